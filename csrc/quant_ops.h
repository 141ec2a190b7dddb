// The int8 codec's loops (csrc/shm/shm_quant.h) on CPU tensors in the wire format of
// fastpar/comm/quant.py (per row: float32 scales, int8 values, zeros to 4 bytes), for the
// quantized collectives that move packed bytes through another engine (gloo, MPI, the
// hierarchical path across hosts). Bitwise what quant.pack_rows / unpack_rows and their sums
// compute with torch ops, in one pass each.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fastpar {

// out (rows, packed) uint8 = each row of x (rows, m; float32 or bfloat16) quantized. residual
// (float32, rows * m or fewer elements: the flat rows cut to its length), feedback:
//   "replace": the row quantized is x + residual, then residual = that - what its receivers
//              decode; a row the residual ends inside is quantized from its first elements
//              only, the rest taken as zeros (all_reduce's padding), rows past its end as they are
//   "add":     residual += x - what its receivers decode (an all_reduce owner's second rounding)
// and no residual: none.
void quant_pack_rows(const at::Tensor& x, int64_t block, at::Tensor& out,
                     const std::optional<at::Tensor>& residual, const std::string& feedback);

// out (rows, m; float32 or bfloat16) = the rows of buf (rows, packed) dequantized.
void quant_unpack_rows(const at::Tensor& buf, int64_t m, int64_t block, at::Tensor& out);

// out (m; float32 or bfloat16) = the sum over the rows of buf dequantized, in float32 from row 0
// in row order, rounded once to out's dtype.
void quant_sum_packed_rows(const at::Tensor& buf, int64_t m, int64_t block, at::Tensor& out);

}  // namespace fastpar
