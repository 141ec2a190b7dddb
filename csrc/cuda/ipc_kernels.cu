// The instantiations of the CUDA IPC all-reduce kernels (ipc_allreduce.cuh), for each dtype,
// world size 2..8 and algorithm; no torch headers, so tests compile exactly this file for
// every target architecture (tests/test_cuda_compile.py) and the torch glue does not compile
// the kernels a second time.
#define FASTPAR_IPC_INSTANTIATE
#include "ipc_allreduce.cuh"

#include <cstddef>

namespace fastpar {
namespace ipc {

#define FASTPAR_IPC_LAUNCHERS(T)                                                                \
  template cudaError_t launch_all_reduce<T>(const RankPtrs&, int, int, void*, int64_t, Algo,   \
                                            const Sync&, int, cudaStream_t);                   \
  template cudaError_t launch_flagged_all_reduce<T>(const RankPtrs&, int, int, void*, int64_t, \
                                                    int64_t, const int*, int, const Sync&,     \
                                                    cudaStream_t);
FASTPAR_IPC_LAUNCHERS(float)
FASTPAR_IPC_LAUNCHERS(__half)
FASTPAR_IPC_LAUNCHERS(__nv_bfloat16)
#undef FASTPAR_IPC_LAUNCHERS

// The flags, the owner's per-block launch counts and its abort word each on their own 128-byte
// lines; the whole block a multiple of 128 so the buffer after it stays aligned.
static_assert(offsetof(Signal, count) == kMaxBlocks * kMaxRanks * sizeof(uint64_t),
              "signal block layout: flags");
static_assert(offsetof(Signal, abort) % 128 == 0 && sizeof(Signal) % 128 == 0,
              "signal block layout: counts, abort");
// Kernel arguments carry no per-call value (CUDA-graph replay must stay correct): pointers, the
// rank, the size and the timeout only.
static_assert(sizeof(Sync) == 16, "Sync: status pointer and timeout");

}  // namespace ipc
}  // namespace fastpar
