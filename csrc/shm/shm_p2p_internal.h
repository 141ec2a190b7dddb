// Internal to csrc/shm: what the parts of the shm p2p channels share (the segment's set-up,
// shm_p2p_segment.cpp, the ring protocol, shm_p2p.cpp, and the single-copy path,
// shm_p2p_single_copy.cpp): the segment layout, the error and wait helpers, and the single-copy
// calls the ring protocol makes. See README.md.
#pragma once

#include "shm_p2p.h"
#include "shm_wait.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>

namespace fastpar {
namespace shm {
namespace p2p {
namespace internal {

constexpr uint64_t kMagic = 0x3130305032505046ULL;  // "FPP2P001"
constexpr uint32_t kVersion = 3;  // 3: a bell on each side
constexpr uint32_t kFrameMark = 0x4d415246;       // "FRAM"
constexpr uint32_t kSingleCopyMark = 0x59504f43;  // "COPY"
constexpr size_t kPage = 4096;

struct alignas(128) Header {
  std::atomic<uint64_t> magic;
  uint32_t version, tags;
  uint64_t ring_bytes;
  int32_t rank[2];               // the pair, lower rank first
  std::atomic<uint32_t> poison;  // 0 ok, 1 being poisoned, 2 poisoned + message written
  char message[256];
  uint32_t cause;  // ErrorKind of the first error, written before poison becomes 2
};

// One per side of the pair (0: the lower rank), written by that side at attach.
struct alignas(128) Side {
  std::atomic<uint32_t> attached;  // released after the fields below are written
  // Whether this side can read the other's memory (probe_single_copy): 0 not probed, 1 yes, 2 no.
  std::atomic<uint32_t> reads_peer;
  std::atomic<uint32_t> closing;  // set by flush: this side takes no more messages
  detail::Ident ident;
  int64_t pid;                       // getpid(): where the other side's single copies read from
  uint64_t probe_addr, probe_value;  // a word of this process and its value, for the probe
  detail::Bell bell;  // where this side sleeps in a long wait; the other side rings it after
                      // every store this side may wait for (written, read, acked, closing)
};

struct alignas(128) Counter {
  std::atomic<uint64_t> value;
};

// Starts every message in the ring.
struct Prefix {
  uint32_t header_len;
  uint32_t mark;  // kFrameMark, or kSingleCopyMark: a descriptor follows the header
  uint64_t payload_len;
};

// One part of a single-copy payload in the descriptor: an address in the sender's memory.
struct RemotePart {
  uint64_t addr, bytes;
};

// The word a peer's probe reads back (probe_single_copy): nonzero once this process attached.
inline std::atomic<uint64_t> probe_word{0};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics");
static_assert(sizeof(Counter) == 128 && sizeof(Side) == 128, "one cache line pair each");
static_assert(sizeof(Prefix) == 16, "16-byte frame prefix");

// ---- layout -------------------------------------------------------------------------------

constexpr int kCountersPerRing = 3;  // written, read, acked
inline size_t counters_offset() { return sizeof(Header) + 2 * sizeof(Side); }
inline size_t data_offset(int tags) {
  size_t h = counters_offset() + size_t(2 * tags) * kCountersPerRing * sizeof(Counter);
  return (h + kPage - 1) / kPage * kPage;
}
inline Header* header(const Peer& p) { return static_cast<Header*>(p.base); }
inline Side* side(const Peer& p, int s) {
  return reinterpret_cast<Side*>(static_cast<char*>(p.base) + sizeof(Header)) + s;
}
// Ring i = `dir * tags + tag` carries side dir's messages; its counters are 3i (written, by
// the sender), 3i + 1 (read, by the receiver) and 3i + 2 (acked: single-copy payloads taken,
// by the receiver).
inline size_t ring_index(const Peer& p, int dir, int tag) { return size_t(dir) * p.tags + tag; }
inline Counter& counter(const Peer& p, int dir, int tag, int which) {
  return reinterpret_cast<Counter*>(static_cast<char*>(p.base) + counters_offset())
      [kCountersPerRing * ring_index(p, dir, tag) + which];
}
inline Counter& written(const Peer& p, int dir, int tag) { return counter(p, dir, tag, 0); }
inline Counter& read(const Peer& p, int dir, int tag) { return counter(p, dir, tag, 1); }
inline Counter& acked(const Peer& p, int dir, int tag) { return counter(p, dir, tag, 2); }
inline char* ring(const Peer& p, int dir, int tag) {
  return static_cast<char*>(p.base) + data_offset(p.tags) + ring_index(p, dir, tag) * p.ring_bytes;
}

// n bytes at stream position pos of a ring of `size` bytes, wrapping at its end.
inline void ring_put(char* r, size_t size, uint64_t pos, const void* src, size_t n) {
  const size_t at = size_t(pos & (size - 1)), first = std::min(n, size - at);
  std::memcpy(r + at, src, first);
  std::memcpy(r, static_cast<const char*>(src) + first, n - first);
}
inline void ring_get(const char* r, size_t size, uint64_t pos, void* dst, size_t n) {
  const size_t at = size_t(pos & (size - 1)), first = std::min(n, size - at);
  std::memcpy(dst, r + at, first);
  std::memcpy(static_cast<char*>(dst) + first, r, n - first);
}

// ---- errors -------------------------------------------------------------------------------

inline std::string tag_name(int tag) {
  std::string s = "tag " + std::to_string(tag);
  if (tag == 0) s += " (activations)";
  if (tag == 1) s += " (gradients)";
  return s;
}

inline std::string me(const Endpoint& ep) {
  return "fastpar shm p2p: rank " + std::to_string(ep.rank);
}

// What a wait awaits, for its error messages.
struct Await {
  enum Kind { Header, Payload, Send } kind;
  uint64_t done, total;  // Payload: bytes received / payload length; Send: queued / total

  std::string describe(const Peer& p, int tag) const {
    const std::string from = " rank " + std::to_string(p.rank) + " on " + tag_name(tag);
    switch (kind) {
      case Header: return "the header of the next message from" + from;
      case Payload:
        return "byte " + std::to_string(done) + " of the " + std::to_string(total) +
               "-byte payload of the message from" + from;
      case Send:
        return "rank " + std::to_string(p.rank) + " to take the messages sent to it on " +
               tag_name(tag) + " (" + std::to_string(done) + " bytes still queued)";
    }
    return "?";
  }
};

// Wakes the other side of the pair if it sleeps in a wait (after a store it may wait for).
inline void ring_peer(Peer& p) { detail::ring(side(p, 1 - p.side)->bell); }

[[noreturn]] inline void fail(Peer& p, ErrorKind kind, const std::string& msg) {
  Header* h = header(p);
  detail::poison(h->poison, h->message, sizeof(h->message), &h->cause, kind, msg);
  ring_peer(p);
  throw_error(kind, msg);
}

inline void check_poison(const Endpoint& ep, const Peer& p) {
  if (header(p)->poison.load(std::memory_order_acquire) == 0) return;
  const Header* h = header(p);
  detail::await_poison_message(h->poison);
  throw PoisonedError(me(ep) + " cannot use its channels to rank " + std::to_string(p.rank) +
                          ", their segment was poisoned by an earlier error: " +
                          poison_message(ep, int(&p - ep.peers.data())),
                      detail::poison_cause(h->poison, h->cause));
}

// Misuse: nothing was consumed or published, so the pair stays usable.
[[noreturn]] inline void misuse(const std::string& msg) { throw std::invalid_argument(msg); }

inline Peer& channel(Endpoint& ep, int slot, int tag, const char* call) {
  if (slot < 0 || size_t(slot) >= ep.peers.size())
    misuse(me(ep) + " " + call + ": no peer in slot " + std::to_string(slot) + " (" +
           std::to_string(ep.peers.size()) + " attached)");
  Peer& p = ep.peers[slot];
  if (tag < 0 || tag >= p.tags)
    misuse(me(ep) + " " + call + ": " + tag_name(tag) + " outside the " +
           std::to_string(p.tags) + " tags of the channels to rank " + std::to_string(p.rank));
  return p;
}

// ---- waiting ------------------------------------------------------------------------------

// Sends of the endpoint not wholly in their rings, on channels to peers other than p: while
// there are any, a wait must not sleep on p's bell (their rings free up without ringing it).
inline size_t pending_elsewhere(const Endpoint& ep, const Peer& p) {
  size_t here = 0;
  for (const TxRing& tx : p.tx) here += tx.queue.size();
  return ep.pending - here;
}

// Waits until ready() (which is expected to call progress(ep)) on the channel `tag` of peer p:
// bounded by ep.timeout_s, failing at once if the peer's process dies or the pair is poisoned.
// A long wait sleeps on this side's bell of the pair, unless sends to other peers are pending
// (then it naps, pushing them at each wake).
template <typename Ready>
inline void wait(Endpoint& ep, Peer& p, int tag, const Await& what, Ready&& ready) {
  detail::wait_until(
      ep.spin_now, ep.spin_iters, ep.yields_before_sleep, ready,
      [&](uint64_t it, detail::WaitClock& clock) {
        check_poison(ep, p);
        if ((it & 63) != 0) return;
        const double s = clock.seconds();
        if (ep.poll != nullptr && clock.poll_due(s)) {
          if (const char* why = ep.poll())
            fail(p, ErrorKind::Interrupted,
                 me(ep) + " " + why + " while waiting for " + what.describe(p, tag));
        }
        const Side* peer = side(p, 1 - p.side);
        if (clock.liveness_due(s) && peer->attached.load(std::memory_order_acquire) != 0 &&
            !ready() && detail::ident_dead(peer->ident))
          fail(p, ErrorKind::PeerDead,
               me(ep) + " found rank " + std::to_string(p.rank) + " dead (pid " +
                      std::to_string(peer->ident.pid) + " has exited) while waiting for " +
                      what.describe(p, tag));
        if (s > ep.timeout_s) {
          char waited[32];
          std::snprintf(waited, sizeof(waited), "%.1f", s);
          fail(p, ErrorKind::Timeout,
               me(ep) + " waited " + waited + " s for " + what.describe(p, tag));
        }
      },
      [&]() -> detail::Bell* {
        return pending_elsewhere(ep, p) == 0 ? &side(p, p.side)->bell : nullptr;
      });
}

// ---- single copy (shm_p2p_single_copy.cpp) ------------------------------------------------

// Completes the single-copy sends of one channel that the receiver has read.
void collect_acks(Endpoint& ep, Peer& p, int tag);
// Whether the peer said it can read this process's memory (its verdict only goes 0 -> 1 or 2).
bool peer_reads_me(Peer& p);
// Copies the single-copy payload of the message taken last on `tag` (rx.remote, in the
// sender's memory) into `parts` (their sizes add up to it), then acknowledges it.
void read_remote(Endpoint& ep, Peer& p, int tag, const Span* parts, size_t n_parts);

}  // namespace internal
}  // namespace p2p
}  // namespace shm
}  // namespace fastpar
