// Torch glue of the shared-memory all-to-all; see shm_alltoall_ops.h.
#include "shm_alltoall_ops.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <stdexcept>

#include "shm/shm_alltoall.h"
#include "shm_ops.h"

namespace fastpar {

std::tuple<at::Tensor, std::vector<int64_t>> shm_all_to_all(
    int64_t handle, const at::Tensor& inp, at::IntArrayRef send_counts,
    at::OptionalIntArrayRef recv_counts, int64_t sig, const std::optional<at::Tensor>& out_opt) {
  TORCH_CHECK(inp.device().is_cpu() && inp.is_contiguous(),
              "fastpar shm all_to_all: the input must be a contiguous CPU tensor");
  TORCH_CHECK(inp.dim() >= 1, "fastpar shm all_to_all: the input needs a dim 0 to split");
  shm::Comm& c = shm_comm(handle);
  const int world = c.world;
  // The Python layer checks these with the user's words; here they guard the kernel's memory.
  TORCH_CHECK(int64_t(send_counts.size()) == world, "fastpar shm all_to_all: ",
              send_counts.size(), " send counts for a group of ", world);
  TORCH_CHECK(!recv_counts.has_value() || int64_t(recv_counts->size()) == world,
              "fastpar shm all_to_all: ", recv_counts->size(), " recv counts for a group of ",
              world);
  uint64_t send[64], recv[64], got[64];
  int64_t sum = 0;
  for (int p = 0; p < world; ++p) {
    TORCH_CHECK(send_counts[p] >= 0, "fastpar shm all_to_all: send count ", send_counts[p],
                " for rank ", p, " is negative");
    send[p] = uint64_t(send_counts[p]);
    sum += send_counts[p];
    if (recv_counts.has_value()) {
      TORCH_CHECK((*recv_counts)[p] >= 0, "fastpar shm all_to_all: recv count ",
                  (*recv_counts)[p], " for rank ", p, " is negative");
      recv[p] = uint64_t((*recv_counts)[p]);
    }
  }
  TORCH_CHECK(sum == inp.size(0), "fastpar shm all_to_all: send counts add up to ", sum,
              " rows but the input has ", inp.size(0));
  std::vector<int64_t> shape = inp.sizes().vec();
  const uint64_t row_bytes = uint64_t(inp.element_size()) *
                             uint64_t(shape.size() > 1 ? c10::multiply_integers(
                                                             shape.begin() + 1, shape.end())
                                                       : 1);
  at::Tensor out;
  if (out_opt.has_value()) {  // the caller's output: sized by its recv_counts
    out = *out_opt;
    TORCH_CHECK(recv_counts.has_value(), "fastpar shm all_to_all: an output needs recv_counts");
    int64_t rows = 0;
    for (int p = 0; p < world; ++p) rows += (*recv_counts)[p];
    shape[0] = rows;
    TORCH_CHECK(out.device().is_cpu() && out.is_contiguous() &&
                    out.scalar_type() == inp.scalar_type() && out.sizes().vec() == shape,
                "fastpar shm all_to_all: the output must be a contiguous CPU ", inp.scalar_type(),
                " tensor of shape ", at::IntArrayRef(shape), ", got ", out.scalar_type(), " ",
                out.sizes());
  }
  // Otherwise the output is made once the kernel knows what arrives (after its first round).
  auto alloc = [&](size_t) -> void* {
    if (out.defined()) return out.data_ptr();  // the kernel checked every rank's recv_counts
    int64_t rows = 0;
    for (int r = 0; r < world; ++r) rows += int64_t(got[r]);
    shape[0] = rows;
    out = at::empty(shape, inp.options());
    return out.data_ptr();
  };
  shm_record_error(nullptr);
  try {
    shm::all_to_all(c, inp.data_ptr(), send, recv_counts.has_value() ? recv : nullptr,
                    row_bytes, uint64_t(sig), got, alloc);
  } catch (const std::runtime_error& e) {  // as shm_ops.cpp's run(): RuntimeError, kind kept
    shm_record_error(&e);
    TORCH_CHECK(false, e.what());
  }
  return {out, std::vector<int64_t>(got, got + world)};
}

}  // namespace fastpar
