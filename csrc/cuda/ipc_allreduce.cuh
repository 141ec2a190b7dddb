// Pure CUDA kernels for an intra-node all-reduce (sum) over CUDA IPC.
//
// This header owns no memory and includes no torch: the caller (ipc_allreduce.cu)
// hands in the peers' mapped pointers, this rank's host-mapped status record and the
// barrier timeout. The kernels are instantiated once, in ipc_kernels.cu.
//
// No kernel argument counts launches: each block reads its launch number from its
// rank's signal block (count[b]) and advances it on exit, so a launch captured in a
// CUDA graph waits for the right barrier values on every replay.
//
// Math (world W, rank r, registered buffers buf_0..buf_{W-1}, each holding rank
// p's input x_p before the launch):
//
//   out[i] = cast_T( (((float(x_0[i]) + float(x_1[i])) + float(x_2[i])) + ... ) )
//
// The peers are always summed in the fixed order 0..W-1 in fp32, so every rank
// gets a bitwise identical result, and one-shot and two-shot agree bitwise too.
//
//   one-shot:  barrier(start) ; out = sum_p buf_p              ; barrier(end)
//   two-shot:  barrier(start) ; buf_r[slice r] = sum_p buf_p[slice r]
//              barrier(mid)   ; out[slice q] = buf_q[slice q] for all q
//              barrier(end)
//
// Barriers are per block: block b of rank r only waits for block b of its peers
// (every rank launches the same grid for the same message size). See README.md.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace fastpar {
namespace ipc {

constexpr int kMaxRanks = 8;
constexpr int kMaxBlocks = 64;  // flag slots per rank; also the launch cap
constexpr int kThreads = 512;
constexpr int kDefaultBlocks = 36;
constexpr int kPackBytes = 16;  // one uint4 load/store

// The signal block of one rank (zeroed once before the first launch).
//   flag[b][p]: written by rank p's block b when it reaches a barrier (every rank,
//               this one included, writes into every rank's block); read by the owner.
//   count[b]:   launches of this context that block b took part in, advanced by the
//               kernel itself after its last barrier. Owner only. Identical on all
//               ranks because every rank makes the same launches with the same grids.
//   abort:      set (owner only) by the first block that timed out; later launches
//               return at once and the host refuses them.
struct Signal {
  alignas(128) uint64_t flag[kMaxBlocks][kMaxRanks];
  alignas(128) uint64_t count[kMaxBlocks];
  alignas(128) uint32_t abort;
};

// Written by the first block of this rank whose wait timed out (a barrier, or the flagged
// kernel's wait for its producer), in host-mapped pinned memory: the host reads it without
// synchronising (ipc_allreduce.cu).
struct Status {
  uint32_t code;  // 0: fine; kTimedOut or kProducerTimedOut
  int32_t peer;   // group rank waited for (kProducerTimedOut: this rank)
  int32_t block;
  int32_t pad;
  uint64_t value;      // barrier value waited for (see start_value); producer: the flag expected
  uint64_t waited_ns;  // how long it waited
};
constexpr uint32_t kTimedOut = 1;          // a peer did not reach a barrier
constexpr uint32_t kProducerTimedOut = 2;  // this rank's producer never published a row block

// What every launch of a context passes besides the pointers.
struct Sync {
  Status* status;       // device pointer of this rank's host-mapped Status
  uint64_t timeout_ns;  // a barrier waiting longer gives up (0: wait for ever)
};

// Everything a launch needs, passed by value (lives in the kernel param space).
struct RankPtrs {
  Signal* signals[kMaxRanks];  // mapped signal block of every rank (own = local)
  void* buffers[kMaxRanks];    // mapped registered buffer of every rank
};

enum class Algo : int { kAuto = 0, kOneShot = 1, kTwoShot = 2 };

// Barrier values of a block's launch number `c` (its count[b] at entry): three
// strictly increasing values per launch, so a flag that is >= the value waited for
// proves the peer reached this barrier (or a later one).
__host__ __device__ constexpr uint64_t start_value(uint64_t c) { return 3 * c + 1; }
__host__ __device__ constexpr uint64_t mid_value(uint64_t c) { return 3 * c + 2; }
__host__ __device__ constexpr uint64_t end_value(uint64_t c) { return 3 * c + 3; }

// ---------------------------------------------------------------- memory ops

__device__ __forceinline__ void store_release_sys(uint64_t* addr, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(addr), "l"(value) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* addr) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(addr) : "memory");
  return value;
}

// Peer data is read through L2 only (.cg): a line of a peer's slice must never
// be served stale from this SM's L1 after the peer rewrote it (two-shot).
__device__ __forceinline__ uint4 load_pack(const void* base, int64_t pack) {
  return __ldcg(reinterpret_cast<const uint4*>(base) + pack);
}

__device__ __forceinline__ void store_pack(void* base, int64_t pack, uint4 value) {
  reinterpret_cast<uint4*>(base)[pack] = value;
}

// The pointers of a launch, copied from the param-space RankPtrs with constant
// indices into registers: taking its address or indexing it at run time would
// copy the whole struct to local memory.
template <int W>
struct RankView {
  void* buffers[W];
  Signal* signals[W];
};

template <int W>
__device__ __forceinline__ RankView<W> make_view(const RankPtrs& ptrs) {
  RankView<W> view;
#pragma unroll
  for (int p = 0; p < W; ++p) {
    view.buffers[p] = ptrs.buffers[p];
    view.signals[p] = ptrs.signals[p];
  }
  return view;
}

// arr[i] for a runtime i < W, by unrolled selects, so arr stays in registers.
// The select is in asm because the compiler turns a plain select chain back
// into an indexed load from a local-memory copy of arr.
template <int W, typename P>
__device__ __forceinline__ P* pick(P* const (&arr)[W], int i) {
  uint64_t out = reinterpret_cast<uint64_t>(arr[0]);
#pragma unroll
  for (int p = 1; p < W; ++p)
    asm("{\n\t.reg .pred eq;\n\tsetp.eq.s32 eq, %2, %3;\n\tselp.b64 %0, %1, %0, eq;\n\t}"
        : "+l"(out)
        : "l"(reinterpret_cast<uint64_t>(arr[p])), "r"(i), "r"(p));
  return reinterpret_cast<P*>(out);
}

__device__ __forceinline__ int load_acquire_sys_s32(const int* addr) {
  int value;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(value) : "l"(addr) : "memory");
  return value;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// Spins until done() holds; false when the context was aborted meanwhile, or when the wait
// passed the context's timeout, in which case the first of this rank's waiters to give up sets
// the abort word and records (code, peer, block, value, waited) in the host-mapped Status. The
// clock and the abort word are read every 1024 spins. One thread per waiter calls it.
template <typename Done>
__device__ __forceinline__ bool wait_for(Done done, Signal* self, const Sync& sync,
                                         uint32_t code, int peer, uint64_t value) {
  uint64_t start = 0;
  for (uint32_t spin = 0; !done(); ++spin) {
    if ((spin & 1023u) != 1023u) continue;
    if (*reinterpret_cast<volatile uint32_t*>(&self->abort) != 0) return false;
    const uint64_t now = global_timer_ns();
    if (start == 0) {
      start = now;
    } else if (sync.timeout_ns != 0 && now - start > sync.timeout_ns) {
      if (atomicCAS(&self->abort, 0u, 1u) == 0u) {  // the first to give up reports
        volatile Status* st = sync.status;
        st->peer = peer;
        st->block = int(blockIdx.x);
        st->value = value;
        st->waited_ns = now - start;
        __threadfence_system();
        st->code = code;
        __threadfence_system();
      }
      return false;
    }
  }
  return true;
}

// All threads of the block call this; returns false (in every thread) when the
// wait timed out here or the context was aborted by another block's timeout.
// Thread t < W tells rank t that this block arrived (release, so the block's
// earlier loads/stores are ordered before it via the leading __syncthreads), then
// waits until rank t's same block arrived (acquire); the trailing __syncthreads
// publishes that. A timeout is recorded once in the host-mapped Status; the
// kernel then returns instead of trapping, so the CUDA context survives and the
// host can raise an error naming the ranks.
template <int W>
__device__ __forceinline__ bool block_barrier(const RankView<W>& view, int rank, uint64_t value,
                                              const Sync& sync) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (threadIdx.x < unsigned(W)) {
    const int peer = threadIdx.x;
    store_release_sys(&pick<W>(view.signals, peer)->flag[blockIdx.x][rank], value);
    Signal* self = pick<W>(view.signals, rank);
    const uint64_t* mine = &self->flag[blockIdx.x][peer];
    if (!wait_for([&] { return load_acquire_sys(mine) >= value; }, self, sync, kTimedOut, peer,
                  value))
      failed = 1;
  }
  __syncthreads();
  return failed == 0;
}

// ------------------------------------------------------------ dtype packing

// A 16-byte pack of T widened to fp32: 4 floats or 8 half/bf16.
template <typename T>
struct PackTraits;

template <>
struct PackTraits<float> {
  static constexpr int kElems = 4;
  __device__ static void add(float (&acc)[kElems], uint4 p) {
    acc[0] += __uint_as_float(p.x);
    acc[1] += __uint_as_float(p.y);
    acc[2] += __uint_as_float(p.z);
    acc[3] += __uint_as_float(p.w);
  }
  __device__ static void load(float (&acc)[kElems], uint4 p) {
    acc[0] = __uint_as_float(p.x);
    acc[1] = __uint_as_float(p.y);
    acc[2] = __uint_as_float(p.z);
    acc[3] = __uint_as_float(p.w);
  }
  __device__ static uint4 pack(const float (&acc)[kElems]) {
    return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]),
                      __float_as_uint(acc[3]));
  }
};

// Half and bf16: a pack is four 2-element vectors V2 (__half2 /
// __nv_bfloat162), widened pairwise to float2 and rounded back (RN).
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ void from_float2(float2 f, __half2* v) { *v = __float22half2_rn(f); }
__device__ __forceinline__ void from_float2(float2 f, __nv_bfloat162* v) {
  *v = __float22bfloat162_rn(f);
}

template <typename V2>
struct Pack16x8 {
  static constexpr int kElems = 8;
  __device__ static void add(float (&acc)[kElems], uint4 p) {
    const V2* v = reinterpret_cast<const V2*>(&p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = to_float2(v[k]);
      acc[2 * k] += f.x;
      acc[2 * k + 1] += f.y;
    }
  }
  __device__ static void load(float (&acc)[kElems], uint4 p) {
    const V2* v = reinterpret_cast<const V2*>(&p);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = to_float2(v[k]);
      acc[2 * k] = f.x;
      acc[2 * k + 1] = f.y;
    }
  }
  __device__ static uint4 pack(const float (&acc)[kElems]) {
    uint4 p;
    V2* v = reinterpret_cast<V2*>(&p);
#pragma unroll
    for (int k = 0; k < 4; ++k) from_float2(make_float2(acc[2 * k], acc[2 * k + 1]), &v[k]);
    return p;
  }
};

template <>
struct PackTraits<__half> : Pack16x8<__half2> {};
template <>
struct PackTraits<__nv_bfloat16> : Pack16x8<__nv_bfloat162> {};

// Sum pack `i` of all W buffers in rank order 0..W-1 (loads issued first).
template <typename T, int W>
__device__ __forceinline__ uint4 reduce_pack(const RankView<W>& view, int64_t i) {
  using P = PackTraits<T>;
  uint4 v[W];
#pragma unroll
  for (int p = 0; p < W; ++p) v[p] = load_pack(view.buffers[p], i);
  float acc[P::kElems];
  P::load(acc, v[0]);
#pragma unroll
  for (int p = 1; p < W; ++p) P::add(acc, v[p]);
  return P::pack(acc);
}

// ------------------------------------------------------------------ kernels

// Kernel entry: this block's launch number (count[b]) and whether the context is
// still usable, read by one thread and shared so the whole block agrees.
template <int W>
__device__ __forceinline__ bool enter(const RankView<W>& view, int rank, uint64_t& c) {
  __shared__ uint64_t count;
  __shared__ int aborted;
  if (threadIdx.x == 0) {
    Signal* self = pick<W>(view.signals, rank);
    count = self->count[blockIdx.x];
    aborted = *reinterpret_cast<volatile uint32_t*>(&self->abort) != 0;
  }
  __syncthreads();
  c = count;
  return aborted == 0;
}

// Kernel exit after the last barrier: every thread of the block has read count[b]
// (the barrier's trailing __syncthreads), so one thread advances it.
template <int W>
__device__ __forceinline__ void leave(const RankView<W>& view, int rank, uint64_t c) {
  if (threadIdx.x == 0) pick<W>(view.signals, rank)->count[blockIdx.x] = c + 1;
}

// One-shot: every rank reads the whole message from all W buffers.
//   ptrs:    peers' signals and buffers (buffers hold the inputs)
//   sync:    this rank's status record and the barrier timeout
//   rank:    this rank, 0 <= rank < W
//   out:     this rank's result, n_packs * 16 bytes (may be the user tensor)
//   n_packs: message size in 16-byte packs
template <typename T, int W>
__global__ void __launch_bounds__(kThreads, 1)
    one_shot_kernel(RankPtrs ptrs, Sync sync, int rank, void* __restrict__ out, int64_t n_packs) {
  const RankView<W> view = make_view<W>(ptrs);
  uint64_t c;
  if (!enter<W>(view, rank, c)) return;
  if (!block_barrier<W>(view, rank, start_value(c), sync)) return;  // all inputs are in place
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n_packs; i += stride)
    store_pack(out, i, reduce_pack<T, W>(view, i));
  if (!block_barrier<W>(view, rank, end_value(c), sync)) return;  // nobody reads my buffer now
  leave<W>(view, rank, c);
}

// Two-shot: slice q = packs [q * part, min((q + 1) * part, n_packs)).
// Reduce-scatter into the owner's buffer, then all-gather from the owners.
// Arguments as for one_shot_kernel; `out` may be this rank's buffer (symmetric
// tensors: reduced in place), so it is not __restrict__.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads, 1)
    two_shot_kernel(RankPtrs ptrs, Sync sync, int rank, void* out, int64_t n_packs) {
  const RankView<W> view = make_view<W>(ptrs);
  const int64_t part = (n_packs + W - 1) / W;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  uint64_t c;
  if (!enter<W>(view, rank, c)) return;

  if (!block_barrier<W>(view, rank, start_value(c), sync)) return;  // all inputs are in place

  // Reduce-scatter: my slice, summed from every buffer, written over my own
  // buffer's slice (peers only read their own slices of my buffer meanwhile).
  const int64_t lo = rank * part;
  const int64_t hi = lo + part < n_packs ? lo + part : n_packs;
  void* mine = pick<W>(view.buffers, rank);
  for (int64_t i = lo + tid; i < hi; i += stride) store_pack(mine, i, reduce_pack<T, W>(view, i));

  if (!block_barrier<W>(view, rank, mid_value(c), sync)) return;  // every slice is reduced

  // All-gather: slice q from its owner q, in rank order. Pack i is read here by
  // the same tid (so the same block) that reduced it on its owner, which is why
  // per-block barriers suffice.
#pragma unroll
  for (int q = 0; q < W; ++q) {
    const int64_t qlo = q * part;
    const int64_t qhi = qlo + part < n_packs ? qlo + part : n_packs;
    for (int64_t i = qlo + tid; i < qhi; i += stride)
      store_pack(out, i, load_pack(view.buffers[q], i));
  }

  if (!block_barrier<W>(view, rank, end_value(c), sync)) return;  // nobody reads my buffer now
  leave<W>(view, rank, c);
}

// One-shot over row blocks that another kernel is still producing (the signal-driven
// GEMM -> all-reduce): the producer writes each rank's rows straight into its registered
// buffer and, once a row block is complete, adds to flags[b] with release semantics
// (fastpar/kernels/flags.py). Block b of this kernel owns row block b (packs
// [b * block_packs, (b + 1) * block_packs)): it waits until flags[b] >= expected (acquire),
// then runs the one-shot protocol on its packs alone, so finished row blocks are reduced while
// later ones are still being computed. Grid = row blocks (<= kMaxBlocks), the same on every
// rank for the same size, so the per-block counts stay in step as for the other kernels.
//   flags:       this rank's per-row-block counters (device memory of this GPU)
//   expected:    value of flags[b] once row block b is complete
//   block_packs: 16-byte packs per row block
// Other arguments as for one_shot_kernel.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads, 1)
    flagged_one_shot_kernel(RankPtrs ptrs, Sync sync, int rank, void* __restrict__ out,
                            int64_t n_packs, const int* flags, int expected, int64_t block_packs) {
  const RankView<W> view = make_view<W>(ptrs);
  uint64_t c;
  if (!enter<W>(view, rank, c)) return;
  __shared__ int produced;
  if (threadIdx.x == 0) {
    const int* flag = flags + blockIdx.x;
    produced = wait_for([&] { return load_acquire_sys_s32(flag) >= expected; },
                        pick<W>(view.signals, rank), sync, kProducerTimedOut, rank,
                        uint64_t(expected));
  }
  __syncthreads();
  if (!produced) return;
  // The producer's rows are in my buffer (acquired above); peers' arrive by the start barrier.
  if (!block_barrier<W>(view, rank, start_value(c), sync)) return;
  const int64_t lo = int64_t(blockIdx.x) * block_packs;
  const int64_t hi = lo + block_packs < n_packs ? lo + block_packs : n_packs;
  for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
    store_pack(out, i, reduce_pack<T, W>(view, i));
  if (!block_barrier<W>(view, rank, end_value(c), sync)) return;  // nobody reads my buffer now
  leave<W>(view, rank, c);
}

// ------------------------------------------------------------- host helpers

// Threshold of Algo::kAuto: one-shot strictly below this many bytes.
inline int64_t one_shot_max_bytes(int world) {
  return world <= 4 ? (int64_t(256) << 10) : (int64_t(128) << 10);
}

inline Algo choose_algo(int64_t bytes, int world, Algo requested) {
  if (requested != Algo::kAuto) return requested;
  return bytes < one_shot_max_bytes(world) ? Algo::kOneShot : Algo::kTwoShot;
}

// Blocks for a launch: enough for one pack per thread of the largest work
// loop, at least 1, at most min(max_blocks, kMaxBlocks). Depends only on the
// size, world and max_blocks, so every rank launches the same grid.
inline int num_blocks(int64_t n_packs, int world, Algo algo, int max_blocks) {
  const int64_t work = algo == Algo::kTwoShot ? (n_packs + world - 1) / world : n_packs;
  int64_t blocks = (work + kThreads - 1) / kThreads;
  const int cap = max_blocks < 1 ? 1 : (max_blocks > kMaxBlocks ? kMaxBlocks : max_blocks);
  if (blocks < 1) blocks = 1;
  return blocks > cap ? cap : int(blocks);
}

template <typename T, int W>
inline void launch_world(Algo algo, int blocks, const RankPtrs& ptrs, const Sync& sync, int rank,
                         void* out, int64_t n_packs, cudaStream_t stream) {
  if (algo == Algo::kOneShot)
    one_shot_kernel<T, W><<<blocks, kThreads, 0, stream>>>(ptrs, sync, rank, out, n_packs);
  else
    two_shot_kernel<T, W><<<blocks, kThreads, 0, stream>>>(ptrs, sync, rank, out, n_packs);
}

// Launch one all-reduce of `bytes` (multiple of 16) of T on `stream`. The input
// must already be in ptrs.buffers[rank] (stream-ordered before this launch).
// Returns cudaErrorInvalidValue for an unsupported world/size, else the launch
// status. Every rank must pass the same bytes, world, algo and max_blocks, in the
// same order of launches (the per-block counts must stay in step).
template <typename T>
inline cudaError_t launch_all_reduce(const RankPtrs& ptrs, int rank, int world, void* out,
                                     int64_t bytes, Algo algo, const Sync& sync, int max_blocks,
                                     cudaStream_t stream) {
  if (bytes % kPackBytes != 0 || world < 2 || world > kMaxRanks || rank < 0 || rank >= world)
    return cudaErrorInvalidValue;
  const int64_t n_packs = bytes / kPackBytes;
  const Algo chosen = choose_algo(bytes, world, algo);
  const int blocks = num_blocks(n_packs, world, chosen, max_blocks);
  switch (world) {
    case 2: launch_world<T, 2>(chosen, blocks, ptrs, sync, rank, out, n_packs, stream); break;
    case 3: launch_world<T, 3>(chosen, blocks, ptrs, sync, rank, out, n_packs, stream); break;
    case 4: launch_world<T, 4>(chosen, blocks, ptrs, sync, rank, out, n_packs, stream); break;
    case 5: launch_world<T, 5>(chosen, blocks, ptrs, sync, rank, out, n_packs, stream); break;
    case 6: launch_world<T, 6>(chosen, blocks, ptrs, sync, rank, out, n_packs, stream); break;
    case 7: launch_world<T, 7>(chosen, blocks, ptrs, sync, rank, out, n_packs, stream); break;
    case 8: launch_world<T, 8>(chosen, blocks, ptrs, sync, rank, out, n_packs, stream); break;
  }
  return cudaGetLastError();
}

// Launch the flagged one-shot (see flagged_one_shot_kernel) of `bytes` in row blocks of
// `block_bytes` (both multiples of 16; at most kMaxBlocks row blocks) on `stream`.
// Returns cudaErrorInvalidValue for an unsupported world/size, else the launch status.
template <typename T>
inline cudaError_t launch_flagged_all_reduce(const RankPtrs& ptrs, int rank, int world, void* out,
                                             int64_t bytes, int64_t block_bytes,
                                             const int* flags, int expected, const Sync& sync,
                                             cudaStream_t stream) {
  if (bytes % kPackBytes != 0 || block_bytes <= 0 || block_bytes % kPackBytes != 0 ||
      world < 2 || world > kMaxRanks || rank < 0 || rank >= world)
    return cudaErrorInvalidValue;
  const int64_t n_packs = bytes / kPackBytes, block_packs = block_bytes / kPackBytes;
  const int64_t blocks = (n_packs + block_packs - 1) / block_packs;
  if (blocks < 1 || blocks > kMaxBlocks) return cudaErrorInvalidValue;
  switch (world) {
#define FASTPAR_FLAGGED(W)                                                                   \
  case W:                                                                                     \
    flagged_one_shot_kernel<T, W><<<int(blocks), kThreads, 0, stream>>>(                      \
        ptrs, sync, rank, out, n_packs, flags, expected, block_packs);                        \
    break;
    FASTPAR_FLAGGED(2)
    FASTPAR_FLAGGED(3)
    FASTPAR_FLAGGED(4)
    FASTPAR_FLAGGED(5)
    FASTPAR_FLAGGED(6)
    FASTPAR_FLAGGED(7)
    FASTPAR_FLAGGED(8)
#undef FASTPAR_FLAGGED
  }
  return cudaGetLastError();
}

// Every launcher is instantiated once, in ipc_kernels.cu (no torch headers there); other
// translation units (the torch glue) only call them, so they do not compile the kernels again.
#ifndef FASTPAR_IPC_INSTANTIATE
#define FASTPAR_IPC_LAUNCHERS(T)                                                                \
  extern template cudaError_t launch_all_reduce<T>(const RankPtrs&, int, int, void*, int64_t,  \
                                                   Algo, const Sync&, int, cudaStream_t);      \
  extern template cudaError_t launch_flagged_all_reduce<T>(                                    \
      const RankPtrs&, int, int, void*, int64_t, int64_t, const int*, int, const Sync&,        \
      cudaStream_t);
FASTPAR_IPC_LAUNCHERS(float)
FASTPAR_IPC_LAUNCHERS(__half)
FASTPAR_IPC_LAUNCHERS(__nv_bfloat16)
#undef FASTPAR_IPC_LAUNCHERS
#endif

}  // namespace ipc
}  // namespace fastpar
