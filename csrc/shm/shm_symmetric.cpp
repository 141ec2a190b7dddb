// fastpar shared-memory collectives over symmetric buffers: every rank's tensor lives in a
// segment that all ranks map (fastpar/comm/symmetric.py), so a rank reads its peers' data where
// it lies instead of through the copying path's slots. Each call takes the group's Comm for its
// flags only: an entry signal (every input is in place, and the descriptors agree), the work,
// and an exit signal (every rank has finished reading, so a rank may write its buffer again).
// The reductions use reduce_into in rank order 0..world-1, as the copying path does, so results
// are bitwise the same. See shm_collectives.h for each call's contract.
#include "shm_collectives.h"
#include "shm_protocol.h"
#include "shm_reduce.h"

#include <algorithm>
#include <cstring>

namespace fastpar {
namespace shm {

using namespace proto;

namespace {

constexpr size_t kBlockBytes = 16 << 10;  // a reduced block stays in L1 for its writes

// Reduces rows [b, e) of srcs (in rank order) block by block into L1, then hands each block
// to `emit(offset_elements, block, n)`.
template <class Emit>
void reduce_blocks(const void* const* srcs_base, int world, size_t b, size_t e, DType dt,
                   Op op, Emit emit) {
  const size_t es = dtype_size(dt), per = kBlockBytes / es;
  alignas(64) char block[kBlockBytes];
  const void* srcs[kMaxWorld];
  for (size_t i = b; i < e; i += per) {
    const size_t n = std::min(per, e - i);
    for (int r = 0; r < world; ++r) srcs[r] = static_cast<const char*>(srcs_base[r]) + i * es;
    reduce_into(block, srcs, world, n, dt, op);
    emit(i, block, n);
  }
}

}  // namespace

void all_reduce_symmetric(Comm& c, void* const* slots, size_t count, DType dt, Op op,
                          uint64_t sig) {
  const Desc d = begin_call(c, Kind::AllReduceSymmetric, dt, op, count, 0, sig);
  if (c.world == 1) return;
  const size_t es = dtype_size(dt);
  first_round_sync(c, d);  // entry: every input in place, no rank still reads the last result
  ++c.rounds;  // the descriptor's parity; the halves are not touched
  size_t b, e;
  slice_of(count, c.world, c.rank, &b, &e);
  reduce_blocks(slots, c.world, b, e, dt, op, [&](size_t i, const char* block, size_t n) {
    for (int r = 0; r < c.world; ++r)
      std::memcpy(static_cast<char*>(slots[r]) + i * es, block, n * es);
  });
  signal_and_wait(c, Kind::AllReduceSymmetric);  // exit: every slice is in every slot
}

void all_gather_symmetric(Comm& c, void* const* slots, size_t bytes, uint64_t sig) {
  const Desc d = begin_call(c, Kind::AllGatherSymmetric, DType::F32, Op::Sum, bytes, 0, sig);
  if (c.world == 1) return;
  first_round_sync(c, d);  // entry: every rank's own part is in its buffer
  ++c.rounds;
  char* mine = static_cast<char*>(slots[c.rank]);
  for (int p = 0; p < c.world; ++p)
    if (p != c.rank)
      std::memcpy(mine + size_t(p) * bytes, static_cast<const char*>(slots[p]) + p * bytes,
                  bytes);
  signal_and_wait(c, Kind::AllGatherSymmetric);  // exit: nobody reads my part any more
}

void all_gather_from_symmetric(Comm& c, void* const* srcs, void* out, size_t bytes,
                               uint64_t sig) {
  const Desc d = begin_call(c, Kind::AllGatherFromSymmetric, DType::F32, Op::Sum, bytes, 0, sig);
  char* to = static_cast<char*>(out);
  if (c.world == 1) {
    std::memmove(to, srcs[0], bytes);
    return;
  }
  first_round_sync(c, d);  // entry: every source in place
  ++c.rounds;
  for (int i = 0; i < c.world; ++i) {  // from this rank on: the ranks read different sources
    const int p = (c.rank + i) % c.world;
    std::memcpy(to + size_t(p) * bytes, srcs[p], bytes);
  }
  signal_and_wait(c, Kind::AllGatherFromSymmetric);  // exit: nobody reads my source any more
}

void all_to_all_symmetric(Comm& c, void* const* slots, void* out, size_t bytes, uint64_t sig) {
  const Desc d = begin_call(c, Kind::AllToAllSymmetric, DType::F32, Op::Sum, bytes, 0, sig);
  char* to = static_cast<char*>(out);
  const size_t mine = size_t(c.rank) * bytes;
  if (c.world == 1) {
    std::memmove(to, static_cast<const char*>(slots[0]), bytes);
    return;
  }
  first_round_sync(c, d);  // entry: every input in place
  ++c.rounds;
  for (int i = 0; i < c.world; ++i) {  // from the next rank on: the ranks read different slots
    const int p = (c.rank + i) % c.world;
    std::memcpy(to + size_t(p) * bytes, static_cast<const char*>(slots[p]) + mine, bytes);
  }
  signal_and_wait(c, Kind::AllToAllSymmetric);  // exit: nobody reads my input any more
}

void reduce_scatter_symmetric(Comm& c, void* const* slots, void* out, size_t count, DType dt,
                              Op op, uint64_t sig) {
  const Desc d = begin_call(c, Kind::ReduceScatterSymmetric, dt, op, count, 0, sig);
  const size_t es = dtype_size(dt);
  if (c.world == 1) {
    std::memmove(out, slots[0], count * es);
    return;
  }
  first_round_sync(c, d);  // entry: every input in place
  ++c.rounds;
  // Rank r's block of every input: slots[p] + r * count elements.
  const void* mine[kMaxWorld];
  for (int p = 0; p < c.world; ++p)
    mine[p] = static_cast<const char*>(slots[p]) + size_t(c.rank) * count * es;
  // Through L1 blocks, so `out` may be this rank's own block of its input.
  reduce_blocks(mine, c.world, 0, count, dt, op, [&](size_t i, const char* block, size_t n) {
    std::memcpy(static_cast<char*>(out) + i * es, block, n * es);
  });
  signal_and_wait(c, Kind::ReduceScatterSymmetric);  // exit: nobody reads my input any more
}

}  // namespace shm
}  // namespace fastpar
