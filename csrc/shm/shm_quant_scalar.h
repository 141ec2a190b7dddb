// The int8 codec of the shm kernels element by element: the scalar path, and the tails and
// special blocks of the vector paths (shm_quant_x86.h), so that every path runs the same
// operations. Internal to shm_quant.cpp; the definition is in shm_quant.h.
#pragma once

#include "shm_convert.h"
#include "shm_quant.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace fastpar {
namespace shm {
namespace qcodec {

// ---- the definition, element by element ----------------------------------------------------

struct BlockScale {
  float scale, inv;
  bool finite;  // false: every q is 0, the scale NaN, and the residual of the block reset to 0
  bool vector;  // the vector loops may quantize the block: finite, and inv did not overflow
};

// A block's scale and inverse from the bits of its largest |x| (inf and NaN compare above every
// finite value as bits, so a non-finite block shows as amax_bits >= inf's).
FASTPAR_INLINE BlockScale block_scale(uint32_t amax_bits) {
  if (amax_bits >= 0x7f800000u)  // inf or NaN
    return {std::numeric_limits<float>::quiet_NaN(), 0.0f, false, false};
  if (amax_bits == 0) return {0.0f, 0.0f, true, true};  // zeros stay zeros: q = rint(x * 0) = 0
  const float amax = float_of(amax_bits);
  const float inv = 127.0f / amax;
  return {amax / 127.0f, inv, true, inv <= std::numeric_limits<float>::max()};
}

// q = clamp(rint(p), -127, 127) for p = x * inv (clamping first gives the same integer: the
// bounds are integers), ties to even. NaN, 0 * inf in a block whose inv overflowed, gives 0.
FASTPAR_INLINE int8_t quantize_one(float p) {
  if (p != p) return 0;
  return int8_t(std::nearbyint(std::min(127.0f, std::max(-127.0f, p))));
}

FASTPAR_INLINE float widen(float x) { return x; }
FASTPAR_INLINE float widen(uint16_t x) { return bf16_widen(x); }
FASTPAR_INLINE void store_one(float* out, float y) { *out = y; }
FASTPAR_INLINE void store_one(uint16_t* out, float y) { *out = bf16_round(y); }

// The largest |src| of [i, end) as bits, folded into m; src = x, or x + res (kPlusRes).
template <bool kPlusRes, class S>
FASTPAR_INLINE uint32_t amax_tail(const S* x, const float* res, size_t i, size_t end,
                                  uint32_t m) {
  for (; i < end; ++i) {
    const float v = kPlusRes ? widen(x[i]) + res[i] : widen(x[i]);
    m = std::max(m, bits_of(v) & 0x7fffffffu);
  }
  return m;
}

template <Feedback F, class S>
FASTPAR_INLINE void quantize_tail(const S* x, float* res, size_t i, size_t end, float scale,
                                  float inv, int8_t* q) {
  for (; i < end; ++i) {
    const float v = F == Feedback::Replace ? widen(x[i]) + res[i] : widen(x[i]);
    const int8_t qi = quantize_one(v * inv);
    q[i] = qi;
    if (F != Feedback::None) {
      const float d = v - float(qi) * scale;
      res[i] = F == Feedback::Replace ? d : res[i] + d;
    }
  }
}

template <bool kFirst>
FASTPAR_INLINE void accumulate_tail(const int8_t* q, float scale, size_t i, size_t end,
                                    float* acc) {
  for (; i < end; ++i) {
    const float y = float(q[i]) * scale;
    acc[i] = kFirst ? y : acc[i] + y;
  }
}

template <class S>
FASTPAR_INLINE void decode_tail(const int8_t* q, float scale, size_t i, size_t end, S* out) {
  for (; i < end; ++i) store_one(out + i, float(q[i]) * scale);
}

template <class S>
FASTPAR_INLINE void narrow_tail(const float* acc, size_t i, size_t end, S* out) {
  for (; i < end; ++i) store_one(out + i, acc[i]);
}

// ---- the scalar path ----------------------------------------------------------------------
// A path is a struct of these five loops, each over a span of one block (one scale); the
// drivers in shm_quant.cpp walk the blocks and pick the scalar loops for special blocks.

struct Scalar {
  template <bool kPlusRes, class S>
  static uint32_t amax(const S* x, const float* res, size_t n) {
    return amax_tail<kPlusRes>(x, res, 0, n, 0);
  }
  template <Feedback F, class S>
  static void quantize(const S* x, float* res, size_t n, float scale, float inv, int8_t* q) {
    quantize_tail<F>(x, res, 0, n, scale, inv, q);
  }
  template <bool kFirst>
  static void accumulate(const int8_t* q, float scale, size_t n, float* acc) {
    accumulate_tail<kFirst>(q, scale, 0, n, acc);
  }
  template <class S>
  static void decode(const int8_t* q, float scale, size_t n, S* out) {
    decode_tail(q, scale, 0, n, out);
  }
  template <class S>
  static void narrow(const float* acc, size_t n, S* out) { narrow_tail(acc, 0, n, out); }
};

}  // namespace qcodec
}  // namespace shm
}  // namespace fastpar
