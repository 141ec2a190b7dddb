// Torch-facing API of the CUDA IPC all-reduce (implemented in ipc_allreduce.cu,
// compiled only against a CUDA build of torch). The op schemas live in the
// bindings file; every type here maps onto a TORCH_LIBRARY schema type.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <tuple>
#include <c10/util/ArrayRef.h>

namespace fastpar {
namespace ipc {

// Bytes of one rank's signal (flag) block; allocate this much, 128-byte
// aligned, zero it once before ipc_init, and never write it again.
int64_t ipc_meta_size();

// Largest world size the kernels support (8).
int64_t ipc_max_world();

// Build a context for this rank. The vectors hold, per rank 0..world-1, the
// signal-block and registered-buffer device pointers as seen by THIS process
// (own rank: local pointers; peers: ipc_open_handle base + offset). All
// buffers are buffer_bytes long. The current CUDA device is recorded and every
// ipc_all_reduce must use it. Returns an opaque handle (heap pointer).
int64_t ipc_init(c10::ArrayRef<int64_t> peer_signal_ptrs,
                 c10::ArrayRef<int64_t> peer_buffer_ptrs, int64_t rank, int64_t world,
                 int64_t buffer_bytes);

// In-place sum over all ranks of inp_out (float32/float16/bfloat16, contiguous,
// on the context's device, nbytes % 16 == 0, nbytes <= buffer_bytes).
// algo: 0 auto (one-shot below ipc_one_shot_max_bytes(world)), 1 one-shot,
// 2 two-shot. Enqueued on the current CUDA stream; every rank must make the
// same sequence of calls with the same sizes and algo.
void ipc_all_reduce(int64_t ctx, at::Tensor& inp_out, int64_t algo);

// In place over symmetric buffers, no copy in: buffers[p] is rank p's tensor as mapped in this
// process (buffers[rank] == t.data_ptr()); every rank passes its own tensor of the same size.
// Uses the context's signals and epoch (so it orders with ipc_all_reduce) and the two-shot
// kernel (in-place safe); no size limit besides the tensors'. Checks as for ipc_all_reduce.
void ipc_all_reduce_symmetric(int64_t ctx, at::Tensor& t, c10::ArrayRef<int64_t> buffers);

// The size threshold of algo 0: one-shot strictly below it.
int64_t ipc_one_shot_max_bytes(int64_t world);

// Free the context (does not close IPC handles, free buffers or synchronize).
void ipc_dispose(int64_t ctx);

// (handle, offset): the 64 cudaIpcMemHandle_t bytes (uint8 CPU tensor) of the
// allocation holding buf's data, and the byte offset of buf.data_ptr() from
// that allocation's base (the caching allocator sub-allocates).
std::tuple<at::Tensor, int64_t> ipc_get_handle(const at::Tensor& buf);

// Map a peer's allocation into this process on CUDA device `device`; returns
// its base pointer (add the peer's offset). Do not open your own handle.
int64_t ipc_open_handle(const at::Tensor& handle, int64_t device);

// Unmap a base pointer returned by ipc_open_handle.
void ipc_close_handle(int64_t base_ptr);

}  // namespace ipc
}  // namespace fastpar
