// The weight-only quantized linear on CPU tensors: y = x @ W.T with W stored as int8 or int4
// integers and per-group float32 scales (fastpar/nn/qweight.py owns the format and the policy
// of when this kernel runs: decode-sized batches, where the GEMM is bound by reading W).
//
// For output n and input column k (0 <= k < K, this shard's columns) in local group
// j = (lead + k) / group - lead / group (groups are `group` columns of the serial weight, this
// shard starting `lead` columns into its first one):
//   bits 8:  W[n, k] = scales[j, n] * q[n, k]                       q int8 (N, K)
//   bits 4:  W[n, k] = scales[j, n] * q[n, k] + offsets[j, n]       q uint8 (N, ceil(K / 2)):
//            column k in byte k / 2, the low nibble for even k, 0..15
// and y[m, n] = sum_j (scales[j, n] * sum_{k in j} x[m, k] q[n, k]
//                      (+ offsets[j, n] * sum_{k in j} x[m, k])), in float32.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace fastpar {

// out (M, N) float32 = x (M, K) float32 @ W.T as above; scales (and offsets) float32
// (groups touched, N); lead in [0, group); group a positive multiple of 16; for bits 4 lead even.
void qlinear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
             const std::optional<at::Tensor>& offsets, int64_t bits, int64_t group, int64_t lead,
             at::Tensor& out);

}  // namespace fastpar
