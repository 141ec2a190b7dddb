// fastpar shared-memory point-to-point channels: the ring protocol (send, receive, waits for
// sends). A pair's segment, its layout and attach: shm_p2p_segment.cpp; the single-copy path:
// shm_p2p_single_copy.cpp. See shm_p2p.h and README.md.
//
// Protocol in one paragraph: each (direction, tag) of a pair is a single-producer
// single-consumer ring of ring_bytes (a power of two) with two monotonic byte counters on
// their own cache lines: `written`, stored only by the sender (release, after the bytes), and
// `read`, stored only by the receiver (release, after copying out). The sender may write while
// written - read < ring_bytes; the receiver may read while read < written. Messages are a byte
// stream of frames [Prefix][header][payload]; the Prefix carries the header and payload lengths
// and a mark that catches a desynchronised stream. A single-copy frame (its own mark) carries,
// instead of the payload, [u64 n][n x (address, bytes)] of the sender's parts: the receiver
// copies them with process_vm_readv, then bumps the ring's third counter, `acked`, which
// completes the sender's oldest single-copy send on that ring.
#include "shm_p2p.h"

#include "shm_p2p_internal.h"
#include "shm_wait.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace fastpar {
namespace shm {
namespace p2p {

using namespace internal;

namespace {

// ---- sending ------------------------------------------------------------------------------

// Copies the next n bytes of s (n <= s.left) into the ring at stream position pos.
void copy_in(PendingSend& s, char* r, size_t size, uint64_t pos, size_t n) {
  while (n > 0) {
    const Part cur = s.part == 0 ? Part{s.frame.data(), s.frame.size()} : s.parts[s.part - 1];
    const size_t k = std::min(cur.bytes - s.offset, n);
    if (k > 0) ring_put(r, size, pos, static_cast<const char*>(cur.data) + s.offset, k);
    pos += k;
    n -= k;
    s.offset += k;
    if (s.offset == cur.bytes) {
      ++s.part;
      s.offset = 0;
    }
  }
}

// Moves s into the ring of `tag` as far as there is room, publishing a chunk at a time.
void advance(Peer& p, int tag, PendingSend& s) {
  TxRing& tx = p.tx[tag];
  Counter& w = written(p, p.side, tag);
  char* r = ring(p, p.side, tag);
  while (s.left > 0) {
    const uint64_t want = std::min<uint64_t>(s.left, kChunkBytes);
    uint64_t room = p.ring_bytes - (tx.written - tx.read_seen);
    if (room < want) {
      tx.read_seen = read(p, p.side, tag).value.load(std::memory_order_acquire);
      room = p.ring_bytes - (tx.written - tx.read_seen);
      if (room == 0) return;
    }
    const size_t n = size_t(std::min(room, want));
    copy_in(s, r, p.ring_bytes, tx.written, n);
    tx.written += n;
    s.left -= n;
    w.value.store(tx.written, std::memory_order_release);
    ring_peer(p);
  }
}

// A send wholly in the ring: complete, or (single copy) waiting for the receiver's ack.
void in_ring(Endpoint& ep, TxRing& tx, const PendingSend& s) {
  if (s.ack == 0) return;
  tx.unacked.push_back({s.id, s.ack, s.payload});
  ++ep.unacked;
}

// Pushes the queue of one channel, oldest send first.
void push(Endpoint& ep, Peer& p, int tag) {
  TxRing& tx = p.tx[tag];
  while (!tx.queue.empty()) {
    advance(p, tag, tx.queue.front());
    if (tx.queue.front().left > 0) return;
    in_ring(ep, tx, tx.queue.front());
    tx.queue.pop_front();
    --ep.pending;
  }
}

// Whether send `id` of this channel is done; ids ascend through unacked, then queue.
bool channel_done(const TxRing& tx, uint64_t id) {
  return (tx.queue.empty() || tx.queue.front().id > id) &&
         (tx.unacked.empty() || tx.unacked.front().id > id);
}

// The channel that holds send `id` (queued or awaiting its ack), or {nullptr, -1} if complete.
std::pair<Peer*, int> find_send(const Endpoint& ep, uint64_t id) {
  if (ep.pending == 0 && ep.unacked == 0) return {nullptr, -1};
  auto holds = [id](const auto& q) {
    if (q.empty() || q.front().id > id || q.back().id < id) return false;
    for (const auto& s : q)
      if (s.id == id) return true;
    return false;
  };
  for (const Peer& p : ep.peers)
    for (int t = 0; t < p.tags; ++t)
      if (holds(p.tx[t].queue) || holds(p.tx[t].unacked)) return {const_cast<Peer*>(&p), t};
  return {nullptr, -1};
}

// Whether n bytes would go into the ring of `tag` at once: nothing queued ahead of them and
// room for all of them (the peer's read counter is loaded only when the last one seen is short).
bool fits_now(Peer& p, int tag, uint64_t n) {
  TxRing& tx = p.tx[tag];
  if (!tx.queue.empty()) return false;
  if (p.ring_bytes - (tx.written - tx.read_seen) >= n) return true;
  tx.read_seen = read(p, p.side, tag).value.load(std::memory_order_acquire);
  return p.ring_bytes - (tx.written - tx.read_seen) >= n;
}

// ---- receiving ----------------------------------------------------------------------------

// Waits until n bytes of the ring of `tag` from p are unread; pushes pending sends meanwhile.
void await_bytes(Endpoint& ep, Peer& p, int tag, uint64_t n, const Await& what) {
  RxRing& rx = p.rx[tag];
  if (rx.written_seen - rx.read >= n) return;
  const Counter& w = written(p, 1 - p.side, tag);
  auto ready = [&] {
    progress(ep);
    rx.written_seen = w.value.load(std::memory_order_acquire);
    return rx.written_seen - rx.read >= n;
  };
  if (!ready()) wait(ep, p, tag, what, ready);
}

// Publishes that the receiver is done with everything before rx.read.
void release(Peer& p, int tag) {
  read(p, 1 - p.side, tag).value.store(p.rx[tag].read, std::memory_order_release);
  ring_peer(p);
}

}  // namespace

// ---- public API (the segment's layout, open and attach: shm_p2p_segment.cpp) ---------------

uint64_t send(Endpoint& ep, int slot, int tag, const void* hdr, size_t hdr_len,
              const Part* parts, size_t n_parts) {
  Peer& p = channel(ep, slot, tag, "send");
  if (hdr_len > kMaxHeaderBytes)
    misuse(me(ep) + " send to rank " + std::to_string(p.rank) + ": header of " +
           std::to_string(hdr_len) + " bytes, at most " + std::to_string(kMaxHeaderBytes));
  check_poison(ep, p);
  TxRing& tx = p.tx[tag];
  PendingSend s;
  s.id = ep.next_id++;
  for (size_t i = 0; i < n_parts; ++i) s.payload += parts[i].bytes;
  // FIFO per channel: older sends go first; this one starts only behind an empty queue.
  push(ep, p, tag);
  // Single copy for a large payload, and for any payload that would not wholly fit the ring
  // now: a descriptor needs no more progress from this rank, queued bytes would (README).
  const bool single = s.payload > 0 && n_parts <= kMaxSingleCopyParts &&
                      ep.single_copy_min != SIZE_MAX && peer_reads_me(p) &&
                      (s.payload >= ep.single_copy_min ||
                       !fits_now(p, tag, sizeof(Prefix) + hdr_len + s.payload));
  const Prefix pre{uint32_t(hdr_len), single ? kSingleCopyMark : kFrameMark, s.payload};
  const size_t desc = single ? sizeof(uint64_t) + n_parts * sizeof(RemotePart) : 0;
  s.frame.resize(sizeof(pre) + hdr_len + desc);
  char* f = s.frame.data();
  std::memcpy(f, &pre, sizeof(pre));
  if (hdr_len > 0) std::memcpy(f + sizeof(pre), hdr, hdr_len);
  if (single) {  // [u64 n][n x (address, bytes)]: the receiver reads the parts from here
    f += sizeof(pre) + hdr_len;
    const uint64_t n = n_parts;
    std::memcpy(f, &n, sizeof(n));
    for (size_t i = 0; i < n_parts; ++i) {
      const RemotePart r{reinterpret_cast<uint64_t>(parts[i].data), parts[i].bytes};
      std::memcpy(f + sizeof(n) + i * sizeof(r), &r, sizeof(r));
    }
    s.ack = ++tx.single_copies;
  } else {
    s.parts.assign(parts, parts + n_parts);
  }
  s.left = s.frame.size() + (single ? 0 : s.payload);
  if (tx.queue.empty()) advance(p, tag, s);
  if (s.left > 0) {
    tx.queue.push_back(std::move(s));
    ++ep.pending;
    return ep.next_id - 1;
  }
  in_ring(ep, tx, s);
  return single ? s.id : 0;
}

void progress(Endpoint& ep) {
  if (ep.pending == 0 && ep.unacked == 0) return;
  for (Peer& p : ep.peers) {
    if (header(p)->poison.load(std::memory_order_relaxed) != 0) continue;  // its waits report
    for (int t = 0; t < p.tags; ++t) {
      if (!p.tx[t].queue.empty()) push(ep, p, t);
      if (!p.tx[t].unacked.empty()) collect_acks(ep, p, t);
    }
  }
}

size_t recv_header(Endpoint& ep, int slot, int tag, void* buf, size_t cap) {
  Peer& p = channel(ep, slot, tag, "recv_header");
  RxRing& rx = p.rx[tag];
  if (rx.payload_left > 0)
    misuse(me(ep) + " recv_header from rank " + std::to_string(p.rank) + " on " +
           tag_name(tag) + ": " + std::to_string(rx.payload_left) + " of the " +
           std::to_string(rx.payload_bytes) +
           " payload bytes of the previous message are not received yet");
  check_poison(ep, p);
  const Await what{Await::Header, 0, 0};
  await_bytes(ep, p, tag, sizeof(Prefix), what);
  const char* r = ring(p, 1 - p.side, tag);
  Prefix pre;
  ring_get(r, p.ring_bytes, rx.read, &pre, sizeof(pre));
  const bool single = pre.mark == kSingleCopyMark;
  auto corrupt = [&](const std::string& why) {
    fail(p, ErrorKind::Other,
         me(ep) + " found a corrupt message frame from rank " + std::to_string(p.rank) +
                " on " + tag_name(tag) + " at stream byte " + std::to_string(rx.read) + " (" +
                why + ")");
  };
  if ((pre.mark != kFrameMark && !single) || pre.header_len > kMaxHeaderBytes)
    corrupt("header length " + std::to_string(pre.header_len));
  if (pre.header_len > cap)
    misuse(me(ep) + " recv_header from rank " + std::to_string(p.rank) + " on " +
           tag_name(tag) + ": the header has " + std::to_string(pre.header_len) +
           " bytes but the buffer holds " + std::to_string(cap));
  uint64_t at = sizeof(Prefix) + pre.header_len;  // frame bytes, from rx.read
  await_bytes(ep, p, tag, at + (single ? sizeof(uint64_t) : 0), what);
  if (pre.header_len > 0)
    ring_get(r, p.ring_bytes, rx.read + sizeof(Prefix), buf, pre.header_len);
  if (single) {  // the descriptor: [u64 n][n x (address, bytes)] in the sender's memory
    uint64_t n = 0;
    ring_get(r, p.ring_bytes, rx.read + at, &n, sizeof(n));
    at += sizeof(n);
    if (n == 0 || n > kMaxSingleCopyParts)
      corrupt("a single-copy descriptor of " + std::to_string(n) + " parts");
    await_bytes(ep, p, tag, at + n * sizeof(RemotePart), what);
    rx.remote.resize(size_t(n));
    uint64_t total = 0;
    for (uint64_t i = 0; i < n; ++i, at += sizeof(RemotePart)) {
      RemotePart part;
      ring_get(r, p.ring_bytes, rx.read + at, &part, sizeof(part));
      rx.remote[i] = {reinterpret_cast<const void*>(part.addr), size_t(part.bytes)};
      total += part.bytes;
    }
    if (total != pre.payload_len)
      corrupt("single-copy parts of " + std::to_string(total) + " bytes for a payload of " +
              std::to_string(pre.payload_len));
  }
  rx.read += at;
  release(p, tag);
  rx.single_copy = single;
  rx.payload_left = rx.payload_bytes = pre.payload_len;
  return pre.header_len;
}

uint64_t payload_left(const Endpoint& ep, int slot, int tag) {
  return ep.peers.at(size_t(slot)).rx.at(size_t(tag)).payload_left;
}

void recv_payload(Endpoint& ep, int slot, int tag, const Span* parts, size_t n_parts) {
  Peer& p = channel(ep, slot, tag, "recv_payload");
  RxRing& rx = p.rx[tag];
  uint64_t total = 0;
  for (size_t i = 0; i < n_parts; ++i) total += parts[i].bytes;
  if (total != rx.payload_left)
    misuse(me(ep) + " recv_payload from rank " + std::to_string(p.rank) + " on " +
           tag_name(tag) + ": the parts hold " + std::to_string(total) +
           " bytes but the message has " + std::to_string(rx.payload_left) +
           " payload bytes left to receive");
  if (total == 0) return;
  check_poison(ep, p);
  if (rx.single_copy) {
    read_remote(ep, p, tag, parts, n_parts);
    return;
  }
  const char* r = ring(p, 1 - p.side, tag);
  size_t part = 0, offset = 0;
  while (rx.payload_left > 0) {
    await_bytes(ep, p, tag, 1,
                Await{Await::Payload, rx.payload_bytes - rx.payload_left, rx.payload_bytes});
    // Copy out a chunk at most, then publish it, so the sender refills while we copy on.
    uint64_t n = std::min<uint64_t>({rx.written_seen - rx.read, rx.payload_left, kChunkBytes});
    rx.payload_left -= n;
    while (n > 0) {
      const size_t k = size_t(std::min<uint64_t>(n, parts[part].bytes - offset));
      char* dst = static_cast<char*>(parts[part].data) + offset;
      if (k > 0) ring_get(r, p.ring_bytes, rx.read, dst, k);
      rx.read += k;
      n -= k;
      offset += k;
      if (offset == parts[part].bytes) {
        ++part;
        offset = 0;
      }
    }
    release(p, tag);
  }
}

size_t recv(Endpoint& ep, int slot, int tag, void* buf, size_t cap, const Span* parts,
            size_t n_parts, bool* taken) {
  const size_t n = recv_header(ep, slot, tag, buf, cap);
  uint64_t total = 0;
  for (size_t i = 0; i < n_parts; ++i) total += parts[i].bytes;
  *taken = total == ep.peers[slot].rx[tag].payload_left;
  if (*taken) recv_payload(ep, slot, tag, parts, n_parts);
  return n;
}

bool send_done(const Endpoint& ep, uint64_t id) { return find_send(ep, id).first == nullptr; }

namespace {

// Waits until send `id` of channel (p, tag) is complete. The peer's flush (it takes no more
// messages) ends the wait: `closing` (this rank's flush too) drops what the peer will never
// take; otherwise that is an error (not a protocol error: no poison).
void await_send(Endpoint& ep, Peer& p, int tag, uint64_t id, bool closing) {
  check_poison(ep, p);
  TxRing& tx = p.tx[tag];
  auto done = [&] { return channel_done(tx, id); };
  const Counter& consumed = read(p, p.side, tag);
  const Counter& acks = acked(p, p.side, tag);
  const std::atomic<uint32_t>& gone = side(p, 1 - p.side)->closing;
  progress(ep);
  auto queued_bytes = [&] {
    uint64_t queued = 0;
    for (const AwaitedAck& a : tx.unacked)
      if (a.id <= id) queued += a.payload;
    for (const PendingSend& s : tx.queue)
      if (s.id <= id) queued += s.left + (s.ack != 0 ? s.payload : 0);
    return queued;
  };
  while (!done()) {
    if (gone.load(std::memory_order_acquire) != 0) {
      progress(ep);  // what the peer took before its flush is visible now
      if (done()) return;
      const uint64_t queued = queued_bytes();
      if (!closing)
        throw std::runtime_error(me(ep) + " waited for rank " + std::to_string(p.rank) +
                                 " to take the messages sent to it on " + tag_name(tag) +
                                 ", but it closed its channels with " + std::to_string(queued) +
                                 " bytes of them not taken");
      ep.pending -= tx.queue.size();
      ep.unacked -= tx.unacked.size();
      tx.queue.clear();
      tx.unacked.clear();
      return;
    }
    // Each wait lasts until the peer takes some bytes out of this ring or reads a single-copy
    // payload (bounded by the timeout).
    const uint64_t seen = consumed.value.load(std::memory_order_acquire);
    const uint64_t seen_acks = acks.value.load(std::memory_order_acquire);
    wait(ep, p, tag, Await{Await::Send, queued_bytes(), 0}, [&] {
      progress(ep);
      return done() || consumed.value.load(std::memory_order_acquire) != seen ||
             acks.value.load(std::memory_order_acquire) != seen_acks ||
             gone.load(std::memory_order_acquire) != 0;
    });
  }
}

}  // namespace

void wait_send(Endpoint& ep, uint64_t id) {
  if (id >= ep.next_id) misuse(me(ep) + " wait_send: no send has id " + std::to_string(id));
  auto [p, tag] = find_send(ep, id);
  if (p != nullptr) await_send(ep, *p, tag, id, false);
}

void flush(Endpoint& ep) {
  for (Peer& p : ep.peers) {
    side(p, p.side)->closing.store(1, std::memory_order_release);
    ring_peer(p);
  }
  for (Peer& p : ep.peers)
    for (int t = 0; t < p.tags; ++t) {
      const TxRing& tx = p.tx[t];
      if (!tx.queue.empty() || !tx.unacked.empty())
        await_send(ep, p, t, ep.next_id - 1, true);  // the channel's newest send, at most
    }
}

}  // namespace p2p
}  // namespace shm
}  // namespace fastpar
