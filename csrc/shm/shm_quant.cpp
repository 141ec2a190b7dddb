// Block-scaled int8 loops of the shm kernels: the drivers that walk a piece's blocks on one
// path, and the choice of path. The loops themselves: shm_quant_scalar.h (the definition element
// by element) and shm_quant_x86.h (AVX2, AVX-512F); shm_quant.h says why they agree bitwise.
#include "shm_quant.h"
#include "shm_quant_scalar.h"
#include "shm_quant_x86.h"

#include <algorithm>
#include <atomic>
#include <cstring>

namespace fastpar {
namespace shm {

namespace {

using namespace qcodec;

// ---- drivers: a piece's blocks, on one path ----------------------------------------------

template <class P, Feedback F, class S>
void encode_blocks(const S* x, size_t nx, float* res, size_t nres, size_t n, size_t block,
                   float* scales, int8_t* q) {
  constexpr bool kPlusRes = F == Feedback::Replace;
  for (size_t b = 0; b < n; b += block) {
    const size_t len = std::min(block, n - b);
    const size_t lx = nx > b ? std::min(len, nx - b) : 0;  // from x; zeros after
    const size_t lr = nres > b ? std::min(len, nres - b) : 0;  // with feedback
    const S* xb = lx ? x + b : nullptr;
    float* rb = lr ? res + b : nullptr;
    const BlockScale s = block_scale(P::template amax<kPlusRes>(xb, rb, kPlusRes ? lr : lx));
    scales[b / block] = s.scale;
    if (s.vector) {
      P::template quantize<F>(xb, rb, lr, s.scale, s.inv, q + b);
      P::template quantize<Feedback::None>(xb + lr, nullptr, lx - lr, s.scale, s.inv, q + b + lr);
    } else if (s.finite) {  // 127 / amax overflowed
      quantize_tail<F>(xb, rb, 0, lr, s.scale, s.inv, q + b);
      quantize_tail<Feedback::None>(xb, nullptr, lr, lx, s.scale, s.inv, q + b);
    } else {  // sent as NaN (q 0, scale NaN); the error this block carried is dropped: were it
              // kept (x - NaN), every later call would quantize x + NaN here
      std::memset(q + b, 0, lx);
      if (F != Feedback::None) std::fill(rb, rb + lr, 0.0f);
    }
    std::memset(q + b + lx, 0, len - lx);
  }
}

template <class P, class S>
void encode_as(const void* x, size_t nx, float* res, size_t nres, Feedback fb, size_t n,
               size_t block, float* scales, int8_t* q) {
  const S* xs = static_cast<const S*>(x);
  switch (fb) {
    case Feedback::None:
      return encode_blocks<P, Feedback::None>(xs, nx, nullptr, 0, n, block, scales, q);
    case Feedback::Replace:
      return encode_blocks<P, Feedback::Replace>(xs, nx, res, nres, n, block, scales, q);
    case Feedback::Add:
      return encode_blocks<P, Feedback::Add>(xs, nx, res, nres, n, block, scales, q);
  }
}

template <class P>
void encode_path(const void* x, DType dt, size_t nx, float* res, size_t nres, Feedback fb,
                 size_t n, size_t block, float* scales, int8_t* q) {
  if (dt == DType::BF16) return encode_as<P, uint16_t>(x, nx, res, nres, fb, n, block, scales, q);
  encode_as<P, float>(x, nx, res, nres, fb, n, block, scales, q);
}

template <class P>
void accumulate_path(const float* scales, const int8_t* q, size_t n, size_t block, float* acc,
                     bool first) {
  for (size_t b = 0; b < n; b += block) {
    const size_t len = std::min(block, n - b);
    if (first)
      P::template accumulate<true>(q + b, scales[b / block], len, acc + b);
    else
      P::template accumulate<false>(q + b, scales[b / block], len, acc + b);
  }
}

template <class P, class S>
void decode_as(const float* scales, const int8_t* q, size_t n, size_t block, S* out) {
  for (size_t b = 0; b < n; b += block)
    P::decode(q + b, scales[b / block], std::min(block, n - b), out + b);
}

template <class P>
void decode_path(const float* scales, const int8_t* q, size_t n, size_t block, void* out,
                 DType dt) {
  if (dt == DType::BF16) return decode_as<P>(scales, q, n, block, static_cast<uint16_t*>(out));
  decode_as<P>(scales, q, n, block, static_cast<float*>(out));
}

template <class P>
void narrow_path(const float* acc, size_t n, void* out, DType dt) {
  if (dt == DType::BF16) return P::narrow(acc, n, static_cast<uint16_t*>(out));
  if (out != acc) std::memcpy(out, acc, n * sizeof(float));
}

bool path_runs(QuantPath path) {
  switch (path) {
    case QuantPath::Scalar: return true;
#ifdef FASTPAR_X86
    case QuantPath::Avx2: return cpu_has_avx2();
    case QuantPath::Avx512: return cpu_has_avx512f();
#endif
    default: return false;
  }
}

QuantPath best_path() {
  for (QuantPath p : {QuantPath::Avx512, QuantPath::Avx2})
    if (path_runs(p)) return p;
  return QuantPath::Scalar;
}

std::atomic<int> chosen_path{int(best_path())};

}  // namespace

// ---- public: one switch per loop ---------------------------------------------------------

QuantPath quant_path() { return QuantPath(chosen_path.load(std::memory_order_relaxed)); }

bool set_quant_path(QuantPath path) {
  if (!path_runs(path)) return false;
  chosen_path.store(int(path), std::memory_order_relaxed);
  return true;
}

const char* quant_path_name(QuantPath path) {
  switch (path) {
    case QuantPath::Scalar: return "scalar";
    case QuantPath::Avx2: return "avx2";
    case QuantPath::Avx512: return "avx512";
  }
  return "?";
}

void quant_encode(QuantPath path, const void* x, DType dt, size_t nx, float* res, size_t nres,
                  Feedback fb, size_t n, size_t block, float* scales, int8_t* q) {
  switch (path) {
#ifdef FASTPAR_X86
    case QuantPath::Avx512:
      return encode_path<Avx512>(x, dt, nx, res, nres, fb, n, block, scales, q);
    case QuantPath::Avx2:
      return encode_path<Avx2>(x, dt, nx, res, nres, fb, n, block, scales, q);
#endif
    default: return encode_path<Scalar>(x, dt, nx, res, nres, fb, n, block, scales, q);
  }
}

void quant_accumulate(QuantPath path, const float* scales, const int8_t* q, size_t n,
                      size_t block, float* acc, bool first) {
  switch (path) {
#ifdef FASTPAR_X86
    case QuantPath::Avx512: return accumulate_path<Avx512>(scales, q, n, block, acc, first);
    case QuantPath::Avx2: return accumulate_path<Avx2>(scales, q, n, block, acc, first);
#endif
    default: return accumulate_path<Scalar>(scales, q, n, block, acc, first);
  }
}

void quant_decode(QuantPath path, const float* scales, const int8_t* q, size_t n, size_t block,
                  void* out, DType dt) {
  switch (path) {
#ifdef FASTPAR_X86
    case QuantPath::Avx512: return decode_path<Avx512>(scales, q, n, block, out, dt);
    case QuantPath::Avx2: return decode_path<Avx2>(scales, q, n, block, out, dt);
#endif
    default: return decode_path<Scalar>(scales, q, n, block, out, dt);
  }
}

void quant_narrow(QuantPath path, const float* acc, size_t n, void* out, DType dt) {
  switch (path) {
#ifdef FASTPAR_X86
    case QuantPath::Avx512: return narrow_path<Avx512>(acc, n, out, dt);
    case QuantPath::Avx2: return narrow_path<Avx2>(acc, n, out, dt);
#endif
    default: return narrow_path<Scalar>(acc, n, out, dt);
  }
}

}  // namespace shm
}  // namespace fastpar
