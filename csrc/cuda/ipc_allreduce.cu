// Torch glue for the CUDA IPC all-reduce: argument checks, the per-rank
// context, and IPC handle helpers. The kernels live in ipc_allreduce.cuh; the
// op schemas in the bindings file. Compiled only against a CUDA build of torch.
#include "ipc_allreduce.h"

// c10/cuda/CUDAStream.h rather than ATen/cuda/CUDAContext.h: the same
// getCurrentCUDAStream (at::cuda re-exports c10::cuda) without pulling in the
// cuBLAS/cuSPARSE headers, which a bare CUDA toolkit may not ship.
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

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
  std::vector<int64_t> global_ranks;
  Sync sync{};               // status (device view of status_host) and timeout
  Status* status_host = nullptr;  // cudaHostAlloc'd, mapped; written by a timed-out kernel
  // The previous launch, so that the next one waits for it when it comes on another stream
  // (calls share one staging buffer and one set of flags). Eager launches and launches being
  // captured are tracked apart: a capture may only wait on work of the same capture, and a
  // capture must not make the next eager launch forget the previous eager one.
  struct Last {
    cudaEvent_t event = nullptr;
    cudaStream_t stream = nullptr;
    unsigned long long capture = 0;  // capture id (captured launches only)
    bool valid = false;
  };
  Last eager, captured;
  uint64_t calls = 0;  // launches attempted (for error messages)
};

Context* as_context(int64_t handle) {
  TORCH_CHECK(handle != 0, "ipc_all_reduce: null context (disposed or never initialized)");
  return reinterpret_cast<Context*>(handle);
}

bool aligned(int64_t ptr, int64_t alignment) { return ptr % alignment == 0; }

const char* barrier_name(uint64_t value) {
  switch ((value - 1) % 3) {
    case 0: return "start";
    case 1: return "mid";
    default: return "end";
  }
}

std::string error_of(const Context* ctx) {
  const volatile Status* st = ctx->status_host;
  if (st->code == 0) return {};
  std::atomic_thread_fence(std::memory_order_acquire);  // the fields after the code (aarch64)
  std::ostringstream out;
  out << "fastpar cuda_ipc all_reduce on global ranks [";
  for (size_t i = 0; i < ctx->global_ranks.size(); ++i)
    out << (i ? ", " : "") << ctx->global_ranks[i];
  const int peer = st->peer;
  const uint64_t value = st->value;
  if (st->code == kProducerTimedOut) {
    out << "] timed out: global rank " << ctx->global_ranks[ctx->rank] << " waited "
        << double(st->waited_ns) * 1e-9 << " s for its own GEMM to publish row block "
        << st->block << " (flag value " << value << "); the producer kernel did not run or "
        << "was given other flags. The communicator is unusable: fastpar.shutdown() and init "
        << "again.";
    return out.str();
  }
  out << "] timed out: global rank " << ctx->global_ranks[ctx->rank] << " (block " << st->block
      << ") waited " << double(st->waited_ns) * 1e-9 << " s for global rank "
      << (peer >= 0 && peer < ctx->world ? ctx->global_ranks[peer] : -1) << " at the "
      << barrier_name(value) << " barrier of that block's launch " << (value - 1) / 3
      << " (of " << ctx->calls << " this rank attempted). A peer died, skipped the call, or "
      << "called with another size or dtype. The communicator is unusable and the results of "
      << "that call and later ones are wrong: fastpar.shutdown() and init again.";
  return out.str();
}

void check_usable(const Context* ctx, const char* what) {
  const std::string err = error_of(ctx);
  TORCH_CHECK(err.empty(), what, ": ", err);
}

}  // namespace

int64_t ipc_meta_size() { return static_cast<int64_t>(sizeof(Signal)); }

namespace {

uint64_t timeout_ns_of(double timeout_s) {
  TORCH_CHECK(timeout_s > 0, "ipc: timeout_s=", timeout_s, " must be positive");
  return std::isinf(timeout_s) || timeout_s * 1e9 >= 1.8e19
             ? 0
             : static_cast<uint64_t>(timeout_s * 1e9) + 1;
}

}  // namespace

int64_t ipc_init(c10::ArrayRef<int64_t> peer_signal_ptrs,
                 c10::ArrayRef<int64_t> peer_buffer_ptrs, int64_t rank, int64_t world,
                 int64_t buffer_bytes, c10::ArrayRef<int64_t> global_ranks, double timeout_s,
                 int64_t device) {
  TORCH_CHECK(world >= 2 && world <= kMaxRanks, "ipc_init: world=", world, " must be in [2, ",
              kMaxRanks, "]");
  TORCH_CHECK(rank >= 0 && rank < world, "ipc_init: rank=", rank, " not in [0, ", world, ")");
  TORCH_CHECK(static_cast<int64_t>(peer_signal_ptrs.size()) == world,
              "ipc_init: got ", peer_signal_ptrs.size(), " signal pointers for world=", world);
  TORCH_CHECK(static_cast<int64_t>(peer_buffer_ptrs.size()) == world,
              "ipc_init: got ", peer_buffer_ptrs.size(), " buffer pointers for world=", world);
  TORCH_CHECK(static_cast<int64_t>(global_ranks.size()) == world,
              "ipc_init: got ", global_ranks.size(), " global ranks for world=", world);
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
  ctx->device = static_cast<int>(device);
  ctx->buffer_bytes = buffer_bytes;
  ctx->global_ranks.assign(global_ranks.begin(), global_ranks.end());
  ctx->sync.timeout_ns = timeout_ns_of(timeout_s);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(ctx->device));
  void* host = nullptr;
  C10_CUDA_CHECK(cudaHostAlloc(&host, sizeof(Status), cudaHostAllocMapped));
  std::memset(host, 0, sizeof(Status));
  ctx->status_host = static_cast<Status*>(host);
  void* dev = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&dev, host, 0);
  if (err == cudaSuccess)
    err = cudaEventCreateWithFlags(&ctx->eager.event, cudaEventDisableTiming);
  if (err == cudaSuccess)
    err = cudaEventCreateWithFlags(&ctx->captured.event, cudaEventDisableTiming);
  if (err != cudaSuccess) {
    if (ctx->eager.event != nullptr) cudaEventDestroy(ctx->eager.event);
    cudaFreeHost(host);
    C10_CUDA_CHECK(err);
  }
  ctx->sync.status = static_cast<Status*>(dev);
  return reinterpret_cast<int64_t>(ctx.release());
}

void ipc_set_timeout(int64_t handle, double timeout_s) {
  as_context(handle)->sync.timeout_ns = timeout_ns_of(timeout_s);
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
  check_usable(ctx, what);
  return bytes;
}

// Enqueues one all-reduce of t on the current stream, after the context's previous launch:
// the optional copy of t into this rank's staging buffer, then the kernel for t's dtype over
// `ptrs`. Errors left by unrelated earlier work are cleared first, so that they are not taken
// for this launch's; the kernel advances the per-block counts itself, so a failed launch
// leaves nothing on the host out of step (its peers time out and say so).
template <typename Launch>
void enqueue(Context* ctx, const at::Tensor& t, Launch&& launch_on) {
  const c10::cuda::CUDAGuard guard(t.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  (void)cudaGetLastError();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  unsigned long long capture = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &capturing, &capture));
  const bool in_capture = capturing == cudaStreamCaptureStatusActive;
  Context::Last& last = in_capture ? ctx->captured : ctx->eager;
  if (last.valid && last.stream != stream && (!in_capture || last.capture == capture))
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, last.event, 0));
  ++ctx->calls;
  C10_CUDA_CHECK(launch_on(stream));
  C10_CUDA_CHECK(cudaEventRecord(last.event, stream));
  last.stream = stream;
  last.capture = in_capture ? capture : 0;
  last.valid = true;
}

// The kernel for t's dtype: F(T{}) with T = float, __half or __nv_bfloat16.
template <typename F>
cudaError_t by_dtype(const at::Tensor& t, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(__half{});
    case at::kBFloat16: return f(__nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}

// The copying and symmetric all-reduce: the optional copy of t into this rank's staging buffer,
// then the kernel over `ptrs`, writing t.
void enqueue_all_reduce(Context* ctx, const RankPtrs& ptrs, at::Tensor& t, int64_t bytes,
                        Algo algo, bool copy_in) {
  void* out = t.data_ptr();
  enqueue(ctx, t, [&](cudaStream_t stream) {
    if (copy_in) {
      const cudaError_t err = cudaMemcpyAsync(ptrs.buffers[ctx->rank], out, bytes,
                                              cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) return err;
    }
    return by_dtype(t, [&](auto zero) {
      using T = decltype(zero);
      return launch_all_reduce<T>(ptrs, ctx->rank, ctx->world, out, bytes, algo, ctx->sync,
                                  kDefaultBlocks, stream);
    });
  });
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
  enqueue_all_reduce(ctx, ctx->ptrs, inp_out, bytes, static_cast<Algo>(algo), /*copy_in=*/true);
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
  // Two-shot only: its result lands in each slice's owner first and every rank reads a peer's
  // buffer only for that peer's slice after the mid barrier, so writing the result over the
  // input is safe. One-shot would overwrite a buffer its peers are still summing.
  enqueue_all_reduce(ctx, ptrs, t, bytes, Algo::kTwoShot, /*copy_in=*/false);
}

at::Tensor ipc_staging(int64_t handle, at::ScalarType dtype, int64_t numel) {
  Context* ctx = as_context(handle);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "ipc_staging: dtype ", dtype, " unsupported (float32, float16, bfloat16)");
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(dtype));
  TORCH_CHECK(numel >= 0 && bytes <= ctx->buffer_bytes, "ipc_staging: ", numel, " elements of ",
              dtype, " (", bytes, " bytes) do not fit the registered buffer of ",
              ctx->buffer_bytes, " bytes");
  // A view of memory the communicator owns: valid until it is closed.
  return at::from_blob(ctx->ptrs.buffers[ctx->rank], {numel},
                       at::TensorOptions().dtype(dtype).device(at::kCUDA, ctx->device));
}

void ipc_wait_idle(int64_t handle) {
  Context* ctx = as_context(handle);
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(ctx->device));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  unsigned long long capture = 0;
  C10_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &capturing, &capture));
  const bool in_capture = capturing == cudaStreamCaptureStatusActive;
  const Context::Last& last = in_capture ? ctx->captured : ctx->eager;
  if (last.valid && last.stream != stream && (!in_capture || last.capture == capture))
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream, last.event, 0));
}

void ipc_all_reduce_flagged(int64_t handle, at::Tensor& out, const at::Tensor& flags,
                            int64_t block_rows, int64_t expected) {
  Context* ctx = as_context(handle);
  const char* what = "ipc_all_reduce_flagged";
  const int64_t bytes = check_tensor(ctx, out, what);
  TORCH_CHECK(out.dim() == 2, what, ": out must be 2-D (rows, cols), got ", out.sizes());
  TORCH_CHECK(bytes <= ctx->buffer_bytes, what, ": ", bytes,
              " bytes exceed the registered buffer of ", ctx->buffer_bytes, " bytes");
  const int64_t rows = out.size(0);
  const int64_t row_bytes = out.size(1) * static_cast<int64_t>(out.element_size());
  TORCH_CHECK(block_rows > 0 && (block_rows * row_bytes) % kPackBytes == 0, what,
              ": block_rows=", block_rows, " x ", row_bytes, " bytes per row is not a positive "
              "multiple of ", kPackBytes);
  const int64_t blocks = rows == 0 ? 0 : (rows + block_rows - 1) / block_rows;
  TORCH_CHECK(blocks <= kMaxBlocks, what, ": ", rows, " rows in blocks of ", block_rows, " are ",
              blocks, " row blocks; at most ", kMaxBlocks);
  TORCH_CHECK(flags.is_cuda() && flags.get_device() == ctx->device &&
                  flags.scalar_type() == at::kInt && flags.is_contiguous() &&
                  flags.numel() == blocks,
              what, ": flags must be a contiguous int32 tensor of ", blocks, " elements on cuda:",
              ctx->device, ", got ", flags.scalar_type(), " of ", flags.numel(), " on ",
              flags.device());
  if (bytes == 0) return;
  void* dst = out.data_ptr();
  const int* f = flags.data_ptr<int>();
  enqueue(ctx, out, [&](cudaStream_t stream) {
    return by_dtype(out, [&](auto zero) {
      using T = decltype(zero);
      return launch_flagged_all_reduce<T>(ctx->ptrs, ctx->rank, ctx->world, dst, bytes,
                                          block_rows * row_bytes, f, static_cast<int>(expected),
                                          ctx->sync, stream);
    });
  });
}

std::string ipc_error(int64_t handle) { return error_of(as_context(handle)); }

void ipc_dispose(int64_t handle) {
  Context* ctx = reinterpret_cast<Context*>(handle);
  if (ctx == nullptr) return;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(ctx->device));
  if (ctx->eager.event != nullptr) cudaEventDestroy(ctx->eager.event);
  if (ctx->captured.event != nullptr) cudaEventDestroy(ctx->captured.event);
  if (ctx->status_host != nullptr) cudaFreeHost(ctx->status_host);
  delete ctx;
}

int64_t ipc_alloc(int64_t bytes, int64_t device) {
  TORCH_CHECK(bytes > 0, "ipc_alloc: bytes=", bytes, " must be positive");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaMalloc(&ptr, static_cast<size_t>(bytes)));
  cudaError_t err = cudaMemset(ptr, 0, static_cast<size_t>(bytes));
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaFree(ptr);
    C10_CUDA_CHECK(err);
  }
  return reinterpret_cast<int64_t>(ptr);
}

void ipc_free(int64_t ptr, int64_t device) {
  TORCH_CHECK(ptr != 0, "ipc_free: null pointer");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  C10_CUDA_CHECK(cudaFree(reinterpret_cast<void*>(ptr)));
}

namespace {

at::Tensor handle_bytes(const cudaIpcMemHandle_t& handle) {
  at::Tensor bytes = at::empty({static_cast<int64_t>(sizeof(handle))}, at::kByte);
  std::memcpy(bytes.data_ptr(), &handle, sizeof(handle));
  return bytes;
}

}  // namespace

at::Tensor ipc_export(int64_t ptr, int64_t device) {
  TORCH_CHECK(ptr != 0, "ipc_export: null pointer");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(ptr)));
  return handle_bytes(handle);
}

std::tuple<at::Tensor, int64_t> ipc_get_handle(const at::Tensor& buf) {
  TORCH_CHECK(buf.is_cuda(), "ipc_get_handle: tensor must be on CUDA, got ", buf.device());
  const c10::cuda::CUDAGuard guard(buf.device());
  void* ptr = buf.data_ptr();
  size_t base_size = 0;
  // Base of the cudaMalloc'd segment the caching allocator carved buf from
  // (raises for expandable segments, which cudaIpcGetMemHandle can't share).
  void* base = c10::cuda::CUDACachingAllocator::getBaseAllocation(ptr, &base_size);
  TORCH_CHECK(base != nullptr, "ipc_get_handle: no base allocation for ", ptr);
  cudaIpcMemHandle_t handle;
  C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, base));
  const int64_t offset = static_cast<const char*>(ptr) - static_cast<const char*>(base);
  return {handle_bytes(handle), offset};
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

void ipc_close_handle(int64_t base_ptr, int64_t device) {
  TORCH_CHECK(base_ptr != 0, "ipc_close_handle: null pointer");
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  C10_CUDA_CHECK(cudaIpcCloseMemHandle(reinterpret_cast<void*>(base_ptr)));
}

std::tuple<bool, bool> ipc_p2p_link(int64_t a, int64_t b) {
  int access = 0, atomics = 0;
  C10_CUDA_CHECK(cudaDeviceGetP2PAttribute(&access, cudaDevP2PAttrAccessSupported,
                                           static_cast<int>(a), static_cast<int>(b)));
  C10_CUDA_CHECK(cudaDeviceGetP2PAttribute(&atomics, cudaDevP2PAttrNativeAtomicSupported,
                                           static_cast<int>(a), static_cast<int>(b)));
  return {access != 0, atomics != 0};
}

}  // namespace ipc
}  // namespace fastpar
