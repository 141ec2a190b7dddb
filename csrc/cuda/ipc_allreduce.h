// Torch-facing API of the CUDA IPC all-reduce (implemented in ipc_allreduce.cu,
// compiled only against a CUDA build of torch). The op schemas live in the
// bindings file; every type here maps onto a TORCH_LIBRARY schema type.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <c10/util/ArrayRef.h>

namespace fastpar {
namespace ipc {

// Bytes of one rank's signal block; it sits at the start of the rank's IPC
// allocation (ipc_alloc zeroes it), and nothing but the kernels writes it.
int64_t ipc_meta_size();

// Build a context for this rank. The vectors hold, per rank 0..world-1, the
// signal-block and registered-buffer device pointers as seen by THIS process
// (own rank: local pointers; peers: ipc_open_handle base + offset). All
// buffers are buffer_bytes long. global_ranks names the group's ranks in errors;
// timeout_s bounds every barrier wait (inf: no bound). Every call must use tensors on
// CUDA device `device`. Returns an opaque handle (heap pointer).
int64_t ipc_init(c10::ArrayRef<int64_t> peer_signal_ptrs,
                 c10::ArrayRef<int64_t> peer_buffer_ptrs, int64_t rank, int64_t world,
                 int64_t buffer_bytes, c10::ArrayRef<int64_t> global_ranks, double timeout_s,
                 int64_t device);

// The barrier timeout of later launches (launches already enqueued or captured keep theirs).
void ipc_set_timeout(int64_t ctx, double timeout_s);

// In-place sum over all ranks of inp_out (float32/float16/bfloat16, contiguous,
// on the context's device, nbytes % 16 == 0, nbytes <= buffer_bytes).
// algo: 0 auto (one-shot below one_shot_max_bytes(world) of ipc_allreduce.cuh), 1 one-shot,
// 2 two-shot. Enqueued on the current CUDA stream, after the context's previous
// launch whatever stream that was on (an event wait; eager launches after eager
// ones, captured ones after those of the same capture), so calls from several
// streams never share the staging buffer at once; CUDA-graph capturable (a
// replay must be stream-ordered with eager calls by the caller). Every
// rank must make the same sequence of calls with the same sizes and algo. Raises
// (naming global ranks) if an earlier launch of the context timed out.
void ipc_all_reduce(int64_t ctx, at::Tensor& inp_out, int64_t algo);

// In place over symmetric buffers, no copy in: buffers[p] is rank p's tensor as mapped in this
// process (buffers[rank] == t.data_ptr()); every rank passes its own tensor of the same size.
// Uses the context's signals and launch order (so it orders with ipc_all_reduce) and the
// two-shot kernel (in-place safe); no size limit besides the tensors'. Checks as for
// ipc_all_reduce.
void ipc_all_reduce_symmetric(int64_t ctx, at::Tensor& t, c10::ArrayRef<int64_t> buffers);

// This rank's registered (staging) buffer as a 1-D tensor of `numel` elements of `dtype`
// (a view of memory the context's owner holds; valid until the communicator is closed): a
// producer may write a message into it directly (ipc_all_reduce_flagged).
at::Tensor ipc_staging(int64_t ctx, at::ScalarType dtype, int64_t numel);

// The current stream waits for the context's last launch (after which no peer reads this
// rank's staging buffer): call before a producer writes the staging buffer.
void ipc_wait_idle(int64_t ctx);

// The signal-driven all-reduce: every rank's producer writes its (rows, cols) message into its
// staging buffer and adds to flags[b] (release) as row block b (block_rows rows) completes;
// this one-shot reduces each row block into `out` (rows, cols; contiguous, the staging buffer's
// dtype) as soon as it is complete on every rank. Enqueued on the current stream, ordered with
// the context's other launches; at most 64 row blocks; `expected`: flags[b] of a complete row
// block. Raises, naming the rank, if a producer's flag never came within the timeout.
void ipc_all_reduce_flagged(int64_t ctx, at::Tensor& out, const at::Tensor& flags,
                            int64_t block_rows, int64_t expected);

// "" while the context is fine; else the error a timed-out barrier left (naming
// global ranks). Reads host-mapped memory: no synchronisation.
std::string ipc_error(int64_t ctx);

// Free the context (event and status record; does not close IPC handles, free
// buffers or synchronize).
void ipc_dispose(int64_t ctx);

// cudaMalloc'd memory owned by the caller (not the caching allocator, so that any
// PYTORCH_CUDA_ALLOC_CONF can export it), zeroed and synchronised; ipc_free frees it.
int64_t ipc_alloc(int64_t bytes, int64_t device);
void ipc_free(int64_t ptr, int64_t device);

// The 64 cudaIpcMemHandle_t bytes (uint8 CPU tensor) of an ipc_alloc pointer.
at::Tensor ipc_export(int64_t ptr, int64_t device);

// (handle, offset): the 64 cudaIpcMemHandle_t bytes (uint8 CPU tensor) of the
// caching-allocator segment holding buf's data, and the byte offset of buf.data_ptr() from
// that segment's base (symmetric tensors). Raises for memory that cannot be exported
// (expandable segments, cudaMallocAsync).
std::tuple<at::Tensor, int64_t> ipc_get_handle(const at::Tensor& buf);

// Map a peer's allocation into this process on CUDA device `device`; returns
// its base pointer (add the peer's offset). Do not open your own handle.
int64_t ipc_open_handle(const at::Tensor& handle, int64_t device);

// Unmap a base pointer returned by ipc_open_handle on `device` (the device it was opened on).
void ipc_close_handle(int64_t base_ptr, int64_t device);

// (P2P access supported, native atomics supported) from device a to device b
// (cudaDeviceGetP2PAttribute); native atomics over the link mean NVLink in practice.
std::tuple<bool, bool> ipc_p2p_link(int64_t a, int64_t b);

}  // namespace ipc
}  // namespace fastpar
