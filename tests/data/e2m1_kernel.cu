// A kernel that uses vLLM's FP4 header: the 8-value conversion every NVFP4 quant kernel calls.
// Built by tests/patches/test_e2m1.py for several targets; VEC8 names the function of that version.
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
// Older headers name at::Half / at::BFloat16; the torch CPU wheel's header-only c10 provides them.
namespace at {
using c10::BFloat16;
using c10::Half;
}  // namespace at
#include "nvfp4_utils.cuh"

__global__ void to_e2m1(const float* in, uint32_t* out, int groups) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= groups) {
    return;
  }
  float v[8];
  for (int k = 0; k < 8; ++k) {
    v[k] = in[8 * i + k];
  }
  out[i] = vllm::VEC8(v);
}

#ifdef WITH_MAIN
#include <cstdio>
#include <vector>
// Reads float32 values (a multiple of 8) on stdin, writes one uint32 per 8 values on stdout.
int main() {
  std::vector<float> in;
  float value;
  while (fread(&value, sizeof(value), 1, stdin) == 1) {
    in.push_back(value);
  }
  const int groups = static_cast<int>(in.size() / 8);
  float* d_in;
  uint32_t* d_out;
  if (cudaMalloc(&d_in, in.size() * sizeof(float)) != cudaSuccess ||
      cudaMalloc(&d_out, groups * sizeof(uint32_t)) != cudaSuccess) {
    fprintf(stderr, "cudaMalloc failed\n");
    return 2;
  }
  cudaMemcpy(d_in, in.data(), in.size() * sizeof(float), cudaMemcpyHostToDevice);
  to_e2m1<<<(groups + 255) / 256, 256>>>(d_in, d_out, groups);
  std::vector<uint32_t> out(groups);
  if (cudaMemcpy(out.data(), d_out, groups * sizeof(uint32_t), cudaMemcpyDeviceToHost) != cudaSuccess) {
    fprintf(stderr, "kernel failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 3;
  }
  fwrite(out.data(), sizeof(uint32_t), out.size(), stdout);
  return 0;
}
#endif
