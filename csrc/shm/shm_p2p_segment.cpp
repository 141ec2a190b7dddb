// fastpar shared-memory point-to-point channels: a pair's segment (README.md, "Point-to-point
// channels"): its size and layout (segment_bytes, init_segment, written once by the pair's lower
// rank), an endpoint (open), attaching to a peer's segment (attach: checks the layout, records
// this process for the peer's liveness checks and the single-copy probe), and the segment's
// poison (is_poisoned, poison_message). The ring protocol that runs over it: shm_p2p.cpp.
#include "shm_p2p.h"

#include "shm_p2p_internal.h"
#include "shm_wait.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>

namespace fastpar {
namespace shm {
namespace p2p {

using namespace internal;

size_t segment_bytes(int tags, size_t ring_bytes) {
  if (tags < 1 || tags > kMaxTags)
    throw std::invalid_argument("fastpar shm p2p: tags " + std::to_string(tags) +
                                " outside 1.." + std::to_string(kMaxTags));
  if (ring_bytes < kMinRingBytes || (ring_bytes & (ring_bytes - 1)) != 0 ||
      ring_bytes > (size_t(1) << 40))
    throw std::invalid_argument("fastpar shm p2p: ring_bytes " + std::to_string(ring_bytes) +
                                " must be a power of two from " +
                                std::to_string(kMinRingBytes) + " to 2^40");
  return data_offset(tags) + size_t(2 * tags) * ring_bytes;
}

void init_segment(void* base, int rank_lo, int rank_hi, int tags, size_t ring_bytes) {
  segment_bytes(tags, ring_bytes);  // validates
  if (rank_lo < 0 || rank_lo >= rank_hi)
    throw std::invalid_argument("fastpar shm p2p: a pair needs ranks 0 <= lo < hi, got " +
                                std::to_string(rank_lo) + " and " + std::to_string(rank_hi));
  std::memset(base, 0, data_offset(tags));
  Header* h = new (base) Header;
  h->version = kVersion;
  h->tags = uint32_t(tags);
  h->ring_bytes = ring_bytes;
  h->rank[0] = rank_lo;
  h->rank[1] = rank_hi;
  h->poison.store(0);
  char* c = static_cast<char*>(base) + sizeof(Header);
  for (int s = 0; s < 2; ++s) new (c + s * sizeof(Side)) Side;
  c = static_cast<char*>(base) + counters_offset();
  for (int i = 0; i < 2 * kCountersPerRing * tags; ++i) new (c + i * sizeof(Counter)) Counter{{0}};
  h->magic.store(kMagic, std::memory_order_release);  // last: attach checks it
}

Endpoint open(int rank, bool oversubscribed, double timeout_s) {
  if (rank < 0)
    throw std::invalid_argument("fastpar shm p2p: negative rank " + std::to_string(rank));
  Endpoint ep;
  ep.rank = rank;
  ep.timeout_s = timeout_s;
  const detail::Tuning t = detail::tuning(oversubscribed);
  ep.spin_iters = ep.spin_now = t.spin_iters;
  ep.yields_before_sleep = t.yields_before_sleep;
  return ep;
}

int attach(Endpoint& ep, void* base, int peer, int tags, size_t ring_bytes) {
  const std::string who = me(ep) + " attach to rank " + std::to_string(peer);
  if (base == nullptr) misuse(who + ": null segment base");
  if (peer < 0 || peer == ep.rank) misuse(who + ": a peer must be another rank");
  for (const Peer& q : ep.peers)
    if (q.rank == peer) misuse(who + ": already attached");
  segment_bytes(tags, ring_bytes);  // validates
  const int lo = std::min(ep.rank, peer), hi = std::max(ep.rank, peer);
  const Header* h = static_cast<const Header*>(base);
  const uint64_t magic = h->magic.load(std::memory_order_acquire);
  auto hello = [](uint32_t version, uint32_t tags, uint64_t ring, int a, int b) {
    return "version " + std::to_string(version) + ", " + std::to_string(tags) + " tags, " +
           std::to_string(ring) + "-byte rings, ranks {" + std::to_string(a) + ", " +
           std::to_string(b) + "}";
  };
  if (magic != kMagic)
    throw std::runtime_error(who + ": bad magic " + std::to_string(magic) + " (expected " +
                             std::to_string(kMagic) + "); was init_segment called first?");
  if (h->version != kVersion || h->tags != uint32_t(tags) || h->ring_bytes != ring_bytes ||
      h->rank[0] != lo || h->rank[1] != hi)
    throw std::runtime_error(who + ": expected a segment with " +
                             hello(kVersion, tags, ring_bytes, lo, hi) + " but found " +
                             hello(h->version, h->tags, h->ring_bytes, h->rank[0], h->rank[1]));
  Peer p;
  p.base = base;
  p.rank = peer;
  p.side = ep.rank < peer ? 0 : 1;
  p.tags = tags;
  p.ring_bytes = ring_bytes;
  p.tx.resize(tags);
  p.rx.resize(tags);
  for (int t = 0; t < tags; ++t) {
    p.tx[t].written = written(p, p.side, t).value.load(std::memory_order_acquire);
    p.tx[t].read_seen = read(p, p.side, t).value.load(std::memory_order_acquire);
    p.tx[t].single_copies = acked(p, p.side, t).value.load(std::memory_order_acquire);
    p.rx[t].read = read(p, 1 - p.side, t).value.load(std::memory_order_acquire);
    p.rx[t].written_seen = p.rx[t].read;
    p.rx[t].acks = acked(p, 1 - p.side, t).value.load(std::memory_order_acquire);
  }
  Side* mine = side(p, p.side);
  detail::record_ident(&mine->ident);
  mine->pid = int64_t(::getpid());
  uint64_t word = probe_word.load(std::memory_order_relaxed);
  if (word == 0) {  // any nonzero value a stranger would not guess by chance
    word = (uint64_t(std::chrono::steady_clock::now().time_since_epoch().count()) ^
            uint64_t(::getpid()) << 32) * 0x9e3779b97f4a7c15ULL | 1;
    probe_word.store(word, std::memory_order_relaxed);
  }
  mine->probe_addr = reinterpret_cast<uint64_t>(&probe_word);
  mine->probe_value = word;
  mine->reads_peer.store(0, std::memory_order_relaxed);
  mine->closing.store(0, std::memory_order_relaxed);
  mine->attached.store(1, std::memory_order_release);
  ep.peers.push_back(std::move(p));
  return int(ep.peers.size()) - 1;
}

bool is_poisoned(const Endpoint& ep, int slot) {
  return header(ep.peers.at(slot))->poison.load(std::memory_order_acquire) != 0;
}

const char* poison_message(const Endpoint& ep, int slot) {
  const Header* h = header(ep.peers.at(slot));
  uint32_t s = h->poison.load(std::memory_order_acquire);
  if (s == 0) return "";
  return s == 2 ? h->message : "(error message still being written)";
}

}  // namespace p2p
}  // namespace shm
}  // namespace fastpar
