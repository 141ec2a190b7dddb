// Bit-level float helpers shared by the element-wise loops of csrc/shm (shm_reduce.cpp,
// shm_quant.cpp): float <-> bits and the bfloat16 conversions, plain code that inlines into any
// target (baseline or an AVX function). Internal: nothing outside csrc/shm includes it.
#pragma once

#include <cstdint>
#include <cstring>

#define FASTPAR_INLINE inline __attribute__((always_inline))

namespace fastpar {
namespace shm {

FASTPAR_INLINE uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
FASTPAR_INLINE float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

FASTPAR_INLINE uint16_t bf16_round(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return uint16_t(u >> 16);
}
FASTPAR_INLINE float bf16_widen(uint16_t h) { return float_of(uint32_t(h) << 16); }

}  // namespace shm
}  // namespace fastpar
