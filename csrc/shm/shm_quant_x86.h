// The AVX2 and AVX-512F paths of the int8 codec (shm_quant.h): the scalar path's five loops
// (shm_quant_scalar.h) over 8 or 16 lanes, the scalar code finishing each span's tail. Lane by
// lane they run the scalar operations: widen, add the residual, |x| as bits (integer max, so a
// NaN is not lost), x * inv, clamp, round to nearest even (explicitly, whatever MXCSR says),
// q * scale, then the add or subtract. Internal to shm_quant.cpp.
#pragma once

#include "shm_quant_scalar.h"
#include "x86_simd.h"

#ifdef FASTPAR_X86

namespace fastpar {
namespace shm {
namespace qcodec {

constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// ---- AVX2: 8 lanes -------------------------------------------------------------------------

FASTPAR_TARGET_AVX2 FASTPAR_INLINE __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
FASTPAR_TARGET_AVX2 FASTPAR_INLINE __m256 load8(const uint16_t* x) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}
FASTPAR_TARGET_AVX2 FASTPAR_INLINE void store8(float* out, __m256 y) { _mm256_storeu_ps(out, y); }
// bf16_round lane by lane: + 0x7fff + the kept lsb, then the top half; a NaN's top half | 0x40.
FASTPAR_TARGET_AVX2 FASTPAR_INLINE void store8(uint16_t* out, __m256 y) {
  const __m256i u = _mm256_castps_si256(y), top = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(top, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q));
  const __m256i r =
      _mm256_blendv_epi8(rounded, _mm256_or_si256(top, _mm256_set1_epi32(0x40)), nan);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
FASTPAR_TARGET_AVX2 FASTPAR_INLINE __m256 dequantize8(const int8_t* q, __m256 scale) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), scale);
}

struct Avx2 {
  template <bool kPlusRes, class S>
  static FASTPAR_TARGET_AVX2 uint32_t amax(const S* x, const float* res, size_t n) {
    const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
    __m256i m = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 v = load8(x + i);
      if constexpr (kPlusRes) v = _mm256_add_ps(v, _mm256_loadu_ps(res + i));
      m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_castps_si256(v), magnitude));
    }
    alignas(32) uint32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
    return amax_tail<kPlusRes>(x, res, i, n, *std::max_element(lanes, lanes + 8));
  }

  template <Feedback F, class S>
  static FASTPAR_TARGET_AVX2 void quantize(const S* x, float* res, size_t n, float scale,
                                           float inv, int8_t* q) {
    const __m256 vinv = _mm256_set1_ps(inv), vscale = _mm256_set1_ps(scale);
    const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      __m256 v = load8(x + i);
      if constexpr (F == Feedback::Replace) v = _mm256_add_ps(v, _mm256_loadu_ps(res + i));
      const __m256 p = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, vinv), lo), hi);
      const __m256i qi = _mm256_cvttps_epi32(_mm256_round_ps(p, kNearest));  // exact: integral
      const __m128i w =
          _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(w, w));
      if constexpr (F != Feedback::None) {
        const __m256 d = _mm256_sub_ps(v, _mm256_mul_ps(_mm256_cvtepi32_ps(qi), vscale));
        _mm256_storeu_ps(
            res + i, F == Feedback::Replace ? d : _mm256_add_ps(_mm256_loadu_ps(res + i), d));
      }
    }
    quantize_tail<F>(x, res, i, n, scale, inv, q);
  }

  template <bool kFirst>
  static FASTPAR_TARGET_AVX2 void accumulate(const int8_t* q, float scale, size_t n, float* acc) {
    const __m256 s = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      const __m256 y = dequantize8(q + i, s);
      _mm256_storeu_ps(acc + i, kFirst ? y : _mm256_add_ps(_mm256_loadu_ps(acc + i), y));
    }
    accumulate_tail<kFirst>(q, scale, i, n, acc);
  }

  template <class S>
  static FASTPAR_TARGET_AVX2 void decode(const int8_t* q, float scale, size_t n, S* out) {
    const __m256 s = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) store8(out + i, dequantize8(q + i, s));
    decode_tail(q, scale, i, n, out);
  }

  template <class S>
  static FASTPAR_TARGET_AVX2 void narrow(const float* acc, size_t n, S* out) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) store8(out + i, _mm256_loadu_ps(acc + i));
    narrow_tail(acc, i, n, out);
  }
};

// ---- AVX-512F: 16 lanes ----------------------------------------------------------------------

// GCC 12's AVX-512 intrinsics pass an "undefined" vector that its own -Wuninitialized flags at
// every use once inlined (GCC bug 105593, fixed in 13): nothing here reads it.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

FASTPAR_TARGET_AVX512 FASTPAR_INLINE __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
FASTPAR_TARGET_AVX512 FASTPAR_INLINE __m512 load16(const uint16_t* x) {
  const __m512i h =
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}
FASTPAR_TARGET_AVX512 FASTPAR_INLINE void store16(float* out, __m512 y) {
  _mm512_storeu_ps(out, y);
}
FASTPAR_TARGET_AVX512 FASTPAR_INLINE void store16(uint16_t* out, __m512 y) {  // as store8
  const __m512i u = _mm512_castps_si512(y), top = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
  const __m512i r =
      _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}
FASTPAR_TARGET_AVX512 FASTPAR_INLINE __m512 dequantize16(const int8_t* q, __m512 scale) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), scale);
}

struct Avx512 {
  template <bool kPlusRes, class S>
  static FASTPAR_TARGET_AVX512 uint32_t amax(const S* x, const float* res, size_t n) {
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    __m512i m = _mm512_setzero_si512();
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 v = load16(x + i);
      if constexpr (kPlusRes) v = _mm512_add_ps(v, _mm512_loadu_ps(res + i));
      m = _mm512_max_epu32(m, _mm512_and_si512(_mm512_castps_si512(v), magnitude));
    }
    return amax_tail<kPlusRes>(x, res, i, n, _mm512_reduce_max_epu32(m));
  }

  template <Feedback F, class S>
  static FASTPAR_TARGET_AVX512 void quantize(const S* x, float* res, size_t n, float scale,
                                             float inv, int8_t* q) {
    const __m512 vinv = _mm512_set1_ps(inv), vscale = _mm512_set1_ps(scale);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      __m512 v = load16(x + i);
      if constexpr (F == Feedback::Replace) v = _mm512_add_ps(v, _mm512_loadu_ps(res + i));
      const __m512 p = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, vinv), lo), hi);
      const __m512i qi = _mm512_cvt_roundps_epi32(p, kNearest);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(qi));
      if constexpr (F != Feedback::None) {
        const __m512 d = _mm512_sub_ps(v, _mm512_mul_ps(_mm512_cvtepi32_ps(qi), vscale));
        _mm512_storeu_ps(
            res + i, F == Feedback::Replace ? d : _mm512_add_ps(_mm512_loadu_ps(res + i), d));
      }
    }
    quantize_tail<F>(x, res, i, n, scale, inv, q);
  }

  template <bool kFirst>
  static FASTPAR_TARGET_AVX512 void accumulate(const int8_t* q, float scale, size_t n,
                                               float* acc) {
    const __m512 s = _mm512_set1_ps(scale);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
      const __m512 y = dequantize16(q + i, s);
      _mm512_storeu_ps(acc + i, kFirst ? y : _mm512_add_ps(_mm512_loadu_ps(acc + i), y));
    }
    accumulate_tail<kFirst>(q, scale, i, n, acc);
  }

  template <class S>
  static FASTPAR_TARGET_AVX512 void decode(const int8_t* q, float scale, size_t n, S* out) {
    const __m512 s = _mm512_set1_ps(scale);
    size_t i = 0;
    for (; i + 16 <= n; i += 16) store16(out + i, dequantize16(q + i, s));
    decode_tail(q, scale, i, n, out);
  }

  template <class S>
  static FASTPAR_TARGET_AVX512 void narrow(const float* acc, size_t n, S* out) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) store16(out + i, _mm512_loadu_ps(acc + i));
    narrow_tail(acc, i, n, out);
  }
};

#pragma GCC diagnostic pop

}  // namespace qcodec
}  // namespace shm
}  // namespace fastpar

#endif  // FASTPAR_X86
