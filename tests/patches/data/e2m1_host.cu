// Host-side check of the patched header: for each float32 on stdin, writes two bytes on stdout:
// vllm::fp32_to_e2m1_software(x), and CUDA's own host conversion __nv_cvt_float_to_fp4(x, E2M1, RN)
// from cuda_fp4.h (NVIDIA's reference for what the satfinite instruction returns).
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
namespace at {
using c10::BFloat16;
using c10::Half;
}  // namespace at
#include <cuda_fp4.h>
#include <cstdio>
#include "nvfp4_utils.cuh"

int main() {
  float x;
  while (fread(&x, sizeof(x), 1, stdin) == 1) {
    const unsigned char out[2] = {vllm::fp32_to_e2m1_software(x),
                                  static_cast<unsigned char>(__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest))};
    fwrite(out, 1, 2, stdout);
  }
  return 0;
}
