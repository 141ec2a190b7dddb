// fastpar shared-memory collectives: the element-wise layer (dtype conversions and the
// reduction loops), separate from the synchronisation protocol in shm_collectives.cpp.
// Plain loops the compiler vectorises for the baseline ISA, plus AVX2/F16C versions chosen
// at run time (no -march=native in a shipped build).
#include "shm_reduce.h"
#include "shm_convert.h"
#include "x86_simd.h"

#include <algorithm>
#include <cstring>

namespace fastpar {
namespace shm {

// ---- dtype conversions: portable bit manipulation, F16C as a run-time fast path -------

namespace {

inline float f16_widen(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, em = h & 0x7fffu;
  // Normal: rebias the exponent by 127 - 15 = 112. Subnormal: m * 2^-24 (exact, and no
  // float denormals involved, so DAZ/FTZ cannot change it). Inf/NaN: keep the payload.
  const uint32_t normal = (em << 13) + (112u << 23);
  const uint32_t sub = bits_of(float(int32_t(em)) * 0x1p-24f);
  const uint32_t mant = em & 0x3ffu;  // NaNs come out quiet (as F16C does)
  const uint32_t special = 0x7f800000u | (mant << 13) | (mant ? 0x400000u : 0u);
  return float_of(sign | (em >= 0x7c00u ? special : em >= 0x400u ? normal : sub));
}

inline uint16_t f16_round(float f) {
  const uint32_t u = bits_of(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  uint32_t out;
  if (a > 0x7f800000u) {
    out = 0x7e00u | ((a >> 13) & 0x3ffu);  // NaN, quieted, payload kept
  } else if (a >= 0x477ff000u) {
    out = 0x7c00u;  // >= 65520 rounds (ties to even) to infinity
  } else if (a >= 0x38800000u) {
    // Normal half: rebias, then round to nearest even on the 13 dropped bits; a carry
    // out of the mantissa correctly bumps the exponent.
    out = (a - (112u << 23) + 0xfffu + ((a >> 13) & 1u)) >> 13;
  } else {
    // Subnormal half or zero: in [0.5, 1) the float ulp is 2^-24, the half subnormal
    // step, so adding 0.5 lets the FPU's round-to-nearest-even do the rounding.
    out = bits_of(float_of(a) + 0.5f) - 0x3f000000u;
  }
  return uint16_t(sign | out);
}

#ifdef FASTPAR_X86
FASTPAR_TARGET_F16C void f16_widen_f16c(const uint16_t* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(in + i))));
  for (; i < n; ++i) out[i] = f16_widen(in[i]);
}
FASTPAR_TARGET_F16C void f16_round_f16c(const float* in, uint16_t* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128((__m128i*)(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) out[i] = f16_round(in[i]);
}
const bool kHaveF16C = cpu_has_f16c();
#else
const bool kHaveF16C = false;
#endif

// ---- reduction kernels --------------------------------------------------------------
// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], always in that order, so
// every rank (and both protocols) produce bitwise identical results. Blocked so each
// inner loop is a plain, auto-vectorised pass over an L1-resident accumulator. The whole
// kernel is compiled twice: baseline x86-64 and (picked at run time) AVX2.

// A dtype's codec: storage type S, accumulator type A, and the element conversions
// Ld: S -> A and St: A -> S (rounds once). A codec also given block conversions WidenN /
// NarrowN (kBulk) converts a whole block per call instead, so fp16 can use F16C when
// present; its Ld / St are the portable element conversions those must match.
template <class S_, class A_, A_ (*Ld)(S_), S_ (*St)(A_),
          void (*WidenN)(const S_*, A_*, size_t) = nullptr,
          void (*NarrowN)(const A_*, S_*, size_t) = nullptr>
struct Codec {
  using S = S_;
  using A = A_;
  static constexpr bool kBulk = WidenN != nullptr;
  static FASTPAR_INLINE A ld(S x) { return Ld(x); }
  static FASTPAR_INLINE S st(A x) { return St(x); }
  static void widen(const S* s, A* a, size_t m) { WidenN(s, a, m); }
  static void narrow(const A* a, S* s, size_t m) { NarrowN(a, s, m); }
};

template <class T>
FASTPAR_INLINE T same(T x) { return x; }

using F32Codec = Codec<float, float, same<float>, same<float>>;
using F64Codec = Codec<double, double, same<double>, same<double>>;
using BF16Codec = Codec<uint16_t, float, bf16_widen, bf16_round>;
using F16Codec = Codec<uint16_t, float, f16_widen, f16_round, f16_to_f32_n, f32_to_f16_n>;

struct SumOp {
  template <class A>
  static FASTPAR_INLINE A apply(A acc, A x) { return acc + x; }
};
struct MaxOp {  // NaN-propagating, like torch.max
  template <class A>
  static FASTPAR_INLINE A apply(A acc, A x) { return (x > acc || x != x) ? x : acc; }
};

template <class C, class O>
FASTPAR_INLINE void reduce_blocked(void* dst, const void* const* srcs, int nsrc, size_t n) {
  using S = typename C::S;
  using A = typename C::A;
  constexpr size_t B = 1024;
  alignas(64) A acc[B];
  alignas(64) A tmp[B];
  S* d = static_cast<S*>(dst);
  for (size_t b = 0; b < n; b += B) {
    const size_t m = std::min(B, n - b);
    for (int r = 0; r < nsrc; ++r) {
      const S* s = static_cast<const S*>(srcs[r]) + b;
      if constexpr (C::kBulk) {
        C::widen(s, r == 0 ? acc : tmp, m);
        if (r > 0)
          for (size_t i = 0; i < m; ++i) acc[i] = O::apply(acc[i], tmp[i]);
      } else if (r == 0) {
        for (size_t i = 0; i < m; ++i) acc[i] = C::ld(s[i]);
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] = O::apply(acc[i], C::ld(s[i]));
      }
    }
    if constexpr (C::kBulk) {
      C::narrow(acc, d + b, m);
    } else {
      for (size_t i = 0; i < m; ++i) d[b + i] = C::st(acc[i]);
    }
  }
}

template <class O>
FASTPAR_INLINE void reduce_dt(void* dst, const void* const* srcs, int nsrc, size_t n, DType dt) {
  switch (dt) {
    case DType::F32: return reduce_blocked<F32Codec, O>(dst, srcs, nsrc, n);
    case DType::F64: return reduce_blocked<F64Codec, O>(dst, srcs, nsrc, n);
    case DType::BF16: return reduce_blocked<BF16Codec, O>(dst, srcs, nsrc, n);
    case DType::F16: return reduce_blocked<F16Codec, O>(dst, srcs, nsrc, n);
  }
}

void reduce_base(void* dst, const void* const* srcs, int nsrc, size_t n, DType dt, Op op) {
  if (op == Op::Max) return reduce_dt<MaxOp>(dst, srcs, nsrc, n, dt);
  reduce_dt<SumOp>(dst, srcs, nsrc, n, dt);
}

#ifdef FASTPAR_X86
FASTPAR_TARGET_AVX2 void reduce_avx2(void* dst, const void* const* srcs, int nsrc, size_t n,
                                     DType dt, Op op) {
  if (op == Op::Max) return reduce_dt<MaxOp>(dst, srcs, nsrc, n, dt);
  reduce_dt<SumOp>(dst, srcs, nsrc, n, dt);
}
const bool kHaveAVX2 = cpu_has_avx2();
#endif

}  // namespace

void reduce_into(void* dst, const void* const* srcs, int nsrc, size_t n, DType dt, Op op) {
#ifdef FASTPAR_X86
  if (kHaveAVX2) return reduce_avx2(dst, srcs, nsrc, n, dt, op);
#endif
  reduce_base(dst, srcs, nsrc, n, dt, op);
}

uint16_t f32_to_bf16(float f) { return bf16_round(f); }
float bf16_to_f32(uint16_t h) { return bf16_widen(h); }
uint16_t f32_to_f16(float f) { return f16_round(f); }
float f16_to_f32(uint16_t h) { return f16_widen(h); }

void f16_to_f32_n(const uint16_t* in, float* out, size_t n) {
#ifdef FASTPAR_X86
  if (kHaveF16C) return f16_widen_f16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = f16_widen(in[i]);
}

void f32_to_f16_n(const float* in, uint16_t* out, size_t n) {
#ifdef FASTPAR_X86
  if (kHaveF16C) return f16_round_f16c(in, out, n);
#endif
  for (size_t i = 0; i < n; ++i) out[i] = f16_round(in[i]);
}

}  // namespace shm
}  // namespace fastpar
