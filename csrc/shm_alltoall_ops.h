#pragma once
// Torch glue of the shared-memory all-to-all (csrc/shm/shm_alltoall.h); the communicator is the
// collectives' (shm_ops.h), owned by fastpar/comm/engines/shm.py.
#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

namespace fastpar {

// inp: contiguous CPU rows (dim 0) in group-rank order, send_counts[p] rows for rank p;
// recv_counts: the rows expected from each rank (checked on every rank), or none. Returns the
// rows every rank sent this one, concatenated in rank order, and how many came from each.
// sig: the caller's dtype/row-shape signature, compared across ranks (fastpar/comm/engines/shm.py).
// out: where to write the result (sum(recv_counts) rows; needs recv_counts), else a new tensor.
std::tuple<at::Tensor, std::vector<int64_t>> shm_all_to_all(
    int64_t comm, const at::Tensor& inp, at::IntArrayRef send_counts,
    at::OptionalIntArrayRef recv_counts, int64_t sig, const std::optional<at::Tensor>& out);

}  // namespace fastpar
