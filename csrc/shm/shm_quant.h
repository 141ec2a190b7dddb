// Block-scaled int8 in the loops of the shm kernels: fastpar/comm/quant.py's codec, bit for bit.
// The quantized collectives (shm_quantized.cpp) quantize while they copy a rank's input into its
// slot and dequantize while they copy out of it; these are those loops. Internal to csrc/shm
// (and its selftest).
//
// A piece of n elements is cut, from its first element, into blocks of `block` (a multiple of
// 16; the last one may be shorter). Per block, in float32 (a bfloat16 input widened exactly):
//
//   amax = max |x_i|
//   amax finite and > 0:  scale = amax / 127, inv = 127 / amax       (IEEE divisions)
//                         q_i = clamp(rint(x_i * inv), -127, 127)     (ties to even)
//   amax == 0:            scale = 0, q_i = 0
//   amax inf or NaN:      scale = NaN, q_i = 0 (y is NaN throughout); with a residual, res_i = 0
//   dequantized:          y_i = float(q_i) * scale
//
// (When 127 / amax overflows, amax below 127 / FLT_MAX, x_i * inv is +-inf or, for x_i = 0,
// NaN: q_i = +-127, and 0 for the NaN, which is what torch's conversion of NaN to int8 gives.)
//
// Each loop has three paths, portable scalar, AVX2 and AVX-512F, that compute bitwise the same
// bytes: the same IEEE operations in the same order, the scalar code doing the vector loops'
// tails and the blocks they leave alone (non-finite ones, an overflowed inv). A multiply and an
// add are never fused: the build passes -ffp-contract=off (AVX-512F brings FMA, and GCC fuses
// even intrinsics), so y = q * scale is rounded before it is added or subtracted, as torch does.
#pragma once

#include <cstddef>
#include <cstdint>

#include "shm_collectives.h"

namespace fastpar {
namespace shm {

enum class QuantPath : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

// What quant_encode does with `res`, float32 beside its input (error feedback):
enum class Feedback : int {
  None = 0,
  Replace = 1,  // quantizes src = x + res, then res = src - y: what the receivers will not see
  Add = 2,      // quantizes src = x, then res = res + (src - y): an all_reduce owner's second
                // rounding, carried on top of its first
};
// Either way a block that is not finite (src holds inf or NaN; y is NaN) leaves res = 0 there:
// the error it carried is dropped with the overflow, so the next call quantizes x alone and
// recovers, where res = src - y would be NaN and poison every later call's block.

// The path the collectives use: the fastest this CPU runs, unless set_quant_path chose another.
QuantPath quant_path();
// For tests: make this process's collectives use `path`. False (and no change) if this CPU
// cannot run it.
bool set_quant_path(QuantPath path);
const char* quant_path_name(QuantPath path);

inline size_t quant_blocks(size_t n, size_t block) { return (n + block - 1) / block; }

// Quantizes a piece of n elements into scales[0:ceil(n / block)] and q[0:n]. x is float32 or
// bfloat16 (dt) and is read below nx only: the elements from nx to n are zeros (the padding of
// an all_reduce's last chunk). res (float32; null when fb is None) is read and written below
// nres only; Replace needs nres == nx.
void quant_encode(QuantPath path, const void* x, DType dt, size_t nx, float* res, size_t nres,
                  Feedback fb, size_t n, size_t block, float* scales, int8_t* q);

// acc[0:n] = y (first) or acc[0:n] + y, y the dequantized piece (scales, q) of n elements.
void quant_accumulate(QuantPath path, const float* scales, const int8_t* q, size_t n,
                      size_t block, float* acc, bool first);

// out[0:n] = y in dt (float32, or bfloat16 rounded to nearest even), y as above.
void quant_decode(QuantPath path, const float* scales, const int8_t* q, size_t n, size_t block,
                  void* out, DType dt);

// out[0:n] = acc rounded once to dt (float32: a copy).
void quant_narrow(QuantPath path, const float* acc, size_t n, void* out, DType dt);

}  // namespace shm
}  // namespace fastpar
