// Torch glue for the CUDA IPC all-reduce: argument checks, the per-rank
// context, and IPC handle helpers. The kernels live in ipc_allreduce.cuh; the
// op schemas in the bindings file. Compiled only against a CUDA build of torch.
#include "ipc_allreduce.h"

// c10/cuda/CUDAStream.h rather than ATen/cuda/CUDAContext.h: the same
// getCurrentCUDAStream (at::cuda re-exports c10::cuda) without pulling in the
// cuBLAS/cuSPARSE headers, which a bare CUDA toolkit may not ship.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cstring>
#include <memory>

#include "ipc_allreduce.cuh"

namespace fastpar {
namespace ipc {
namespace {

// One rank's view of the group. Owned by the Python policy through an int64.
struct Context {
  RankPtrs ptrs{};
  int rank = 0;
  int world = 0;
  int device = 0;
  int64_t buffer_bytes = 0;
  uint64_t epoch = 0;  // launches so far; identical on all ranks
};

Context* as_context(int64_t handle) {
  TORCH_CHECK(handle != 0, "ipc_all_reduce: null context (disposed or never initialized)");
  return reinterpret_cast<Context*>(handle);
}

bool aligned(int64_t ptr, int64_t alignment) { return ptr % alignment == 0; }

}  // namespace

int64_t ipc_meta_size() { return static_cast<int64_t>(sizeof(Signal)); }

int64_t ipc_max_world() { return kMaxRanks; }

int64_t ipc_one_shot_max_bytes(int64_t world) {
  return one_shot_max_bytes(static_cast<int>(world));
}

int64_t ipc_init(c10::ArrayRef<int64_t> peer_signal_ptrs,
                 c10::ArrayRef<int64_t> peer_buffer_ptrs, int64_t rank, int64_t world,
                 int64_t buffer_bytes) {
  TORCH_CHECK(world >= 2 && world <= kMaxRanks, "ipc_init: world=", world, " must be in [2, ",
              kMaxRanks, "]");
  TORCH_CHECK(rank >= 0 && rank < world, "ipc_init: rank=", rank, " not in [0, ", world, ")");
  TORCH_CHECK(static_cast<int64_t>(peer_signal_ptrs.size()) == world,
              "ipc_init: got ", peer_signal_ptrs.size(), " signal pointers for world=", world);
  TORCH_CHECK(static_cast<int64_t>(peer_buffer_ptrs.size()) == world,
              "ipc_init: got ", peer_buffer_ptrs.size(), " buffer pointers for world=", world);
  TORCH_CHECK(buffer_bytes > 0 && buffer_bytes % kPackBytes == 0, "ipc_init: buffer_bytes=",
              buffer_bytes, " must be a positive multiple of ", kPackBytes);
  auto ctx = std::make_unique<Context>();
  for (int64_t p = 0; p < world; ++p) {
    const int64_t sig = peer_signal_ptrs[p];
    const int64_t buf = peer_buffer_ptrs[p];
    TORCH_CHECK(sig != 0 && aligned(sig, alignof(Signal)), "ipc_init: signal pointer of rank ",
                p, " (", sig, ") is null or not ", alignof(Signal), "-byte aligned");
    TORCH_CHECK(buf != 0 && aligned(buf, kPackBytes), "ipc_init: buffer pointer of rank ", p,
                " (", buf, ") is null or not ", kPackBytes, "-byte aligned");
    ctx->ptrs.signals[p] = reinterpret_cast<Signal*>(sig);
    ctx->ptrs.buffers[p] = reinterpret_cast<void*>(buf);
  }
  ctx->rank = static_cast<int>(rank);
  ctx->world = static_cast<int>(world);
  ctx->device = c10::cuda::current_device();
  ctx->buffer_bytes = buffer_bytes;
  return reinterpret_cast<int64_t>(ctx.release());
}

namespace {

// Checks shared by both entry points; returns the tensor's bytes.
int64_t check_tensor(const Context* ctx, const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda(), what, ": tensor must be on CUDA, got ", t.device());
  TORCH_CHECK(t.get_device() == ctx->device, what, ": tensor is on cuda:", t.get_device(),
              " but the context was built on cuda:", ctx->device);
  TORCH_CHECK(t.is_contiguous(), what, ": tensor must be contiguous");
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, what,
              ": dtype ", dtype, " unsupported (float32, float16, bfloat16)");
  const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
  TORCH_CHECK(bytes % kPackBytes == 0, what, ": numel=", t.numel(), " x ", t.element_size(),
              " bytes = ", bytes, " bytes is not a multiple of ", kPackBytes);
  TORCH_CHECK(aligned(reinterpret_cast<int64_t>(t.data_ptr()), kPackBytes), what, ": data_ptr ",
              t.data_ptr(), " is not ", kPackBytes, "-byte aligned");
  return bytes;
}

// Launches the kernel for t's dtype over `ptrs` on the current stream; one epoch per launch.
void launch(Context* ctx, const RankPtrs& ptrs, at::Tensor& t, int64_t bytes, Algo algo,
            cudaStream_t stream) {
  void* out = t.data_ptr();
  cudaError_t err = cudaErrorInvalidValue;
  switch (t.scalar_type()) {
    case at::kFloat:
      err = launch_all_reduce<float>(ptrs, ctx->rank, ctx->world, out, bytes, algo, ctx->epoch,
                                     kDefaultBlocks, stream);
      break;
    case at::kHalf:
      err = launch_all_reduce<__half>(ptrs, ctx->rank, ctx->world, out, bytes, algo,
                                      ctx->epoch, kDefaultBlocks, stream);
      break;
    case at::kBFloat16:
      err = launch_all_reduce<__nv_bfloat16>(ptrs, ctx->rank, ctx->world, out, bytes, algo,
                                             ctx->epoch, kDefaultBlocks, stream);
      break;
    default:
      break;
  }
  C10_CUDA_CHECK(err);
  ++ctx->epoch;  // only after a successful launch, so all ranks stay in step
}

}  // namespace

void ipc_all_reduce(int64_t handle, at::Tensor& inp_out, int64_t algo) {
  Context* ctx = as_context(handle);
  const int64_t bytes = check_tensor(ctx, inp_out, "ipc_all_reduce");
  TORCH_CHECK(algo >= 0 && algo <= 2, "ipc_all_reduce: algo=", algo,
              " must be 0 (auto), 1 (one-shot) or 2 (two-shot)");
  TORCH_CHECK(bytes <= ctx->buffer_bytes, "ipc_all_reduce: ", bytes,
              " bytes exceed the registered buffer of ", ctx->buffer_bytes, " bytes");
  if (bytes == 0) return;
  const c10::cuda::CUDAGuard guard(inp_out.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemcpyAsync(ctx->ptrs.buffers[ctx->rank], inp_out.data_ptr(), bytes,
                                 cudaMemcpyDeviceToDevice, stream));
  launch(ctx, ctx->ptrs, inp_out, bytes, static_cast<Algo>(algo), stream);
}

void ipc_all_reduce_symmetric(int64_t handle, at::Tensor& t, c10::ArrayRef<int64_t> buffers) {
  Context* ctx = as_context(handle);
  const int64_t bytes = check_tensor(ctx, t, "ipc_all_reduce (symmetric)");
  TORCH_CHECK(static_cast<int64_t>(buffers.size()) == ctx->world,
              "ipc_all_reduce (symmetric): ", buffers.size(), " buffer pointers for world=",
              ctx->world);
  TORCH_CHECK(buffers[ctx->rank] == reinterpret_cast<int64_t>(t.data_ptr()),
              "ipc_all_reduce (symmetric): the tensor is not this rank's symmetric buffer");
  if (bytes == 0) return;
  RankPtrs ptrs = ctx->ptrs;  // the group's signals; the tensors themselves as the buffers
  for (int p = 0; p < ctx->world; ++p) {
    TORCH_CHECK(buffers[p] != 0 && aligned(buffers[p], kPackBytes),
                "ipc_all_reduce (symmetric): buffer of rank ", p, " is null or misaligned");
    ptrs.buffers[p] = reinterpret_cast<void*>(buffers[p]);
  }
  const c10::cuda::CUDAGuard guard(t.device());
  // Two-shot only: its result lands in each slice's owner first and every rank reads a peer's
  // buffer only for that peer's slice after the mid barrier, so writing the result over the
  // input is safe. One-shot would overwrite a buffer its peers are still summing.
  launch(ctx, ptrs, t, bytes, Algo::kTwoShot, c10::cuda::getCurrentCUDAStream());
}

void ipc_dispose(int64_t handle) { delete reinterpret_cast<Context*>(handle); }

std::tuple<at::Tensor, int64_t> ipc_get_handle(const at::Tensor& buf) {
  TORCH_CHECK(buf.is_cuda(), "ipc_get_handle: tensor must be on CUDA, got ", buf.device());
  const c10::cuda::CUDAGuard guard(buf.device());
  void* ptr = buf.data_ptr();
  size_t base_size = 0;
  // Base of the cudaMalloc'd segment the caching allocator carved buf from
  // (fails for expandable segments, which cudaIpcGetMemHandle can't share).
  void* base = c10::cuda::CUDACachingAllocator::getBaseAllocation(ptr, &base_size);
  TORCH_CHECK(base != nullptr, "ipc_get_handle: no base allocation for ", ptr);
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
  at::Tensor bytes = at::empty({static_cast<int64_t>(sizeof(handle))}, at::kByte);
  std::memcpy(bytes.data_ptr(), &handle, sizeof(handle));
  const int64_t offset = static_cast<const char*>(ptr) - static_cast<const char*>(base);
  return {bytes, offset};
}

int64_t ipc_open_handle(const at::Tensor& handle, int64_t device) {
  TORCH_CHECK(handle.device().is_cpu() && handle.scalar_type() == at::kByte &&
                  handle.is_contiguous() &&
                  handle.numel() == static_cast<int64_t>(sizeof(cudaIpcMemHandle_t)),
              "ipc_open_handle: expected a contiguous uint8 CPU tensor of ",
              sizeof(cudaIpcMemHandle_t), " bytes, got ", handle.scalar_type(), " of ",
              handle.numel(), " on ", handle.device());
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data_ptr(), sizeof(h));
  void* base = nullptr;
  C10_CUDA_CHECK(cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess));
  return reinterpret_cast<int64_t>(base);
}

void ipc_close_handle(int64_t base_ptr) {
  TORCH_CHECK(base_ptr != 0, "ipc_close_handle: null pointer");
  void* base = reinterpret_cast<void*>(base_ptr);
  cudaPointerAttributes attr;
  C10_CUDA_CHECK(cudaPointerGetAttributes(&attr, base));
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(attr.device));
  C10_CUDA_CHECK(cudaIpcCloseMemHandle(base));
}

}  // namespace ipc
}  // namespace fastpar
