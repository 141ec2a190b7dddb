// fastpar shared-memory collectives: the protocol shared by shm_collectives.cpp (the
// copying collectives, setup, errors) and shm_symmetric.cpp (the in-place ones over symmetric
// buffers). Internal: nothing outside csrc/shm includes it. The protocol itself is described at
// the top of shm_collectives.cpp and in README.md.
#pragma once

#include "shm_collectives.h"
#include "shm_wait.h"

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

namespace fastpar {
namespace shm {
namespace proto {

constexpr uint64_t kMagic = 0x3130304d48535046ULL;  // "FPSHM001"
constexpr uint32_t kVersion = 3;  // 2: process identity in the control lines, signatures;
                                  // 3: a bell in each control line
constexpr int kMaxWorld = 64;
constexpr size_t kPage = 4096;
// Waiting, liveness and poisoning are shared with shm_p2p.cpp (shm_wait.h).
using detail::Ident;

enum class Kind : uint32_t {
  AllReduce = 1, AllGather = 2, ReduceScatter = 3, Broadcast = 4, AllReduceSymmetric = 5,
  AllGatherSymmetric = 6, ReduceScatterSymmetric = 7, QuantAllReduce = 8, QuantAllGather = 9,
  QuantReduceScatter = 10, AllToAll = 11,  // AllToAll: shm_alltoall.cpp
  AllToAllSymmetric = 12, AllGatherFromSymmetric = 13
};

inline bool quantized(Kind k) {
  return k == Kind::QuantAllReduce || k == Kind::QuantAllGather || k == Kind::QuantReduceScatter;
}

// What a rank passed to a call; compared across ranks in the call's first round.
struct Desc {
  uint32_t kind, dtype, op;
  int32_t root;
  uint64_t count;  // elements (reductions, quantized calls) or bytes (all_gather, broadcast)
  uint64_t call;
  uint64_t sig;  // the caller's description of the bytes (dtype, shape); 0: none. Quantized
                 // calls: the block, which is what their bytes are
};

struct alignas(128) Header {
  std::atomic<uint64_t> magic;
  uint32_t version, world;
  uint64_t slot_bytes, small_max_bytes, chunk_bytes;
  std::atomic<uint32_t> poison;  // 0 ok, 1 being poisoned, 2 poisoned + message written
  char message[256];
  uint32_t cause;  // ErrorKind of the first error, written before poison becomes 2
};

// One cache line per rank, written only by its owner: flag and descriptors share the
// line so a peer's acquire of `flag` brings the descriptor along in the same transfer.
struct alignas(128) Ctrl {
  std::atomic<uint64_t> flag;
  Desc desc[2];  // indexed by round parity, like the data halves
  Ident ident;   // written once by its owner at attach, before its first signal (the flag's
                 // release publishes it)
  detail::Bell bell;  // where its owner sleeps in a long wait; every peer rings it on signal
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics");
static_assert(sizeof(Ctrl) == 128, "one control line per rank");

inline size_t data_offset(int world) {
  size_t h = sizeof(Header) + size_t(world) * sizeof(Ctrl);
  return (h + kPage - 1) / kPage * kPage;
}
inline Header* header(const Comm& c) { return static_cast<Header*>(c.base); }
inline Ctrl* ctrl(const Comm& c, int r) {
  return reinterpret_cast<Ctrl*>(static_cast<char*>(c.base) + sizeof(Header)) + r;
}
inline size_t half_bytes(const Comm& c) { return c.slot_bytes / 2; }
// Half (round & 1) of rank r's slot.
inline char* half(const Comm& c, int r, uint64_t round) {
  return static_cast<char*>(c.base) + data_offset(c.world) + size_t(r) * c.slot_bytes +
         (round & 1) * half_bytes(c);
}

const char* kind_name(Kind k);

// Poisons the segment with `msg` (every waiting peer fails with it) and throws it as an error
// of `kind` (shm_errors.h).
[[noreturn]] void fail(Comm& c, ErrorKind kind, const std::string& msg);

// Publish this rank's next flag value (release), then wait for every peer to publish it.
void signal_and_wait(Comm& c, Kind k);

// A call's descriptor (throws if the segment is poisoned); counts the call.
Desc begin_call(Comm& c, Kind k, DType dt, Op op, size_t count, int root, uint64_t sig = 0);

// First round of a call: publish `mine`, wait for every peer, and fail on every rank with
// the same message if any rank's descriptor differs from rank 0's.
void first_round_sync(Comm& c, const Desc& mine);

// Rank r's share [begin, end) of n elements: equal slices rounded to 32 elements.
void slice_of(size_t n, int world, int r, size_t* begin, size_t* end);

}  // namespace proto
}  // namespace shm
}  // namespace fastpar
