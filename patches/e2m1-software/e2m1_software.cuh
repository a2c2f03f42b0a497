// --- sparkbuild e2m1-software (patches/e2m1-software) ---------------------------------------
// cvt.rn.satfinite.e2m1x2.f32 assembles only for arch- or family-specific Blackwell targets
// (sm_100a, sm_103a, sm_110a, sm_120a, sm_121a, their f variants). Everywhere else (plain sm_120 or
// sm_121, compute_12x PTX for JIT, older GPUs, the host) the same codes are computed in software.
#include <cstdint>
#include <cstring>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000 &&                          \
    (defined(__CUDA_ARCH_SPECIFIC__) || defined(__CUDA_ARCH_FAMILY_SPECIFIC__) || \
     defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM101_ALL) ||  \
     defined(__CUDA_ARCH_FEAT_SM103_ALL) || defined(__CUDA_ARCH_FEAT_SM110_ALL) ||  \
     defined(__CUDA_ARCH_FEAT_SM120_ALL) || defined(__CUDA_ARCH_FEAT_SM121_ALL))
  #define SPARKBUILD_E2M1_HW 1
#else
  #define SPARKBUILD_E2M1_HW 0
#endif

namespace vllm {

// E2M1 code of x in the low 4 bits: bit 3 is the sign, bits 0-2 index the magnitudes
// 0, 0.5, 1, 1.5, 2, 3, 4, 6. Round to nearest with ties to the even code, saturate to 6,
// keep the sign (also of zero and of values that round to zero). NaN becomes +6 (0x7): E2M1 has
// no NaN, and that is what the satfinite hardware conversion returns.
__host__ __device__ inline uint8_t fp32_to_e2m1_software(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  const uint32_t magnitude_bits = bits & 0x7fffffffu;
  if (magnitude_bits > 0x7f800000u) {
    return 0x7;
  }
  const uint8_t sign = static_cast<uint8_t>((bits >> 28) & 0x8u);
  float a;
  memcpy(&a, &magnitude_bits, sizeof(a));
  // Each threshold is the midpoint between two neighbours; at the midpoint itself the even code
  // wins, hence <= where the lower code is even and < where the upper one is.
  uint8_t code;
  if (a <= 0.25f) {
    code = 0;  // 0.25 ties 0 (even) and 0.5
  } else if (a < 0.75f) {
    code = 1;  // 0.75 ties 0.5 and 1.0 (even)
  } else if (a <= 1.25f) {
    code = 2;
  } else if (a < 1.75f) {
    code = 3;
  } else if (a <= 2.5f) {
    code = 4;
  } else if (a < 3.5f) {
    code = 5;
  } else if (a <= 5.0f) {
    code = 6;
  } else {
    code = 7;  // saturate: 6 and everything above it, infinity included
  }
  return static_cast<uint8_t>(sign | code);
}

// One byte as cvt.rn.satfinite.e2m1x2.f32 d, hi, lo packs it: hi in bits 4-7, lo in bits 0-3.
__host__ __device__ inline uint8_t fp32x2_to_e2m1x2_software(float hi, float lo) {
  return static_cast<uint8_t>((fp32_to_e2m1_software(hi) << 4) | fp32_to_e2m1_software(lo));
}

}  // namespace vllm
// --- end sparkbuild e2m1-software -------------------------------------------------------------
