// fastpar shared-memory point-to-point channels: the pure kernel layer.
//
// No torch, no Python, maps no memory: the caller maps one segment per pair of ranks
// (shm_open + mmap) and hands in its base pointer. Layout and protocol: csrc/shm/README.md.
//
// Usage (rank 3 talking to ranks 2 and 4):
//   lower rank of each pair: init_segment(base, lo, hi, tags, ring_bytes);  // before attach
//   (out-of-band barrier)
//   Endpoint ep = open(/*rank=*/3, /*oversubscribed=*/false, /*timeout_s=*/300.0);
//   int to2 = attach(ep, base_23, 2, tags, ring_bytes);   // slot 0
//   int to4 = attach(ep, base_34, 4, tags, ring_bytes);   // slot 1
//   uint64_t id = send(ep, to4, /*tag=*/0, hdr, hdr_len, parts, n_parts);
//   size_t n = recv_header(ep, to2, 0, buf, sizeof(buf));  // then parse the payload size
//   recv_payload(ep, to2, 0, out_parts, n_out);
//   wait_send(ep, id);                                     // the caller may reuse its buffers
//
// Every (direction, tag) of a pair is one single-producer single-consumer byte ring carrying
// framed messages. A send copies what fits and leaves the rest pending; every blocking call
// (recv_header, recv_payload, wait_send) keeps pushing every pending send of the endpoint while
// it waits, so sends behave as if buffered without limit: a schedule that cannot deadlock with
// buffered sends cannot deadlock here. Pending sends of one channel complete in FIFO order.
//
// Errors are std::runtime_error naming this rank, the peer and the tag. Protocol errors (a
// timeout, a dead peer, an interrupt, a corrupt frame) poison the pair's segment: every later
// call on any channel of that pair, on either side, throws at once with the first error.
// Misuse (a bad slot or tag, a header too long, a payload of another size than the message's)
// throws without poisoning and without consuming anything.
// An Endpoint is thread-compatible: one thread at a time per Endpoint.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace fastpar {
namespace shm {
namespace p2p {

constexpr int kDefaultTags = 2;  // tag 0: activations, tag 1: gradients
constexpr int kMaxTags = 64;
constexpr size_t kDefaultRingBytes = size_t(4) << 20;
constexpr size_t kMinRingBytes = 8192;
constexpr size_t kMaxHeaderBytes = 4096;
// A sender publishes at most this many bytes at a time, so that the receiver copies out one
// chunk while the next is copied in.
constexpr size_t kChunkBytes = size_t(256) << 10;
constexpr double kDefaultTimeoutS = 300.0;

// Bytes the caller maps for one pair (ring_bytes: a power of two, at least kMinRingBytes).
size_t segment_bytes(int tags, size_t ring_bytes);

// Writes the header and zeroes the control lines (not the rings). Called once, by one process
// of the pair, before either attaches. rank_lo < rank_hi are the pair's ranks.
void init_segment(void* base, int rank_lo, int rank_hi, int tags, size_t ring_bytes);

// A caller-owned byte range to send from (Part) or receive into (Span).
struct Part {
  const void* data;
  size_t bytes;
};
struct Span {
  void* data;
  size_t bytes;
};

// ---- endpoint state (read-only for callers, except the tunables at the top) ---------------

// A send not yet wholly in its ring: the frame (prefix + header) is copied, the payload is
// read from the caller's parts as the ring frees up.
struct PendingSend {
  uint64_t id;
  std::vector<char> frame;
  std::vector<Part> parts;
  size_t part = 0;    // next byte: parts[part - 1] at `offset` (part 0: the frame)
  size_t offset = 0;
  uint64_t left = 0;  // bytes not yet in the ring
};

// This rank's end of one ring it writes (counters are monotonic byte counts).
struct TxRing {
  uint64_t written = 0;    // bytes published; only this rank writes the counter
  uint64_t read_seen = 0;  // the peer's read counter as last loaded
  std::deque<PendingSend> queue;
};

// This rank's end of one ring it reads.
struct RxRing {
  uint64_t read = 0;
  uint64_t written_seen = 0;
  uint64_t payload_left = 0;  // of the message whose header was taken last
  uint64_t payload_bytes = 0;
};

struct Peer {
  void* base = nullptr;
  int rank = -1;
  int side = 0;  // 0: this rank is the pair's lower rank
  int tags = 0;
  size_t ring_bytes = 0;
  std::vector<TxRing> tx;  // by tag
  std::vector<RxRing> rx;  // by tag
};

struct Endpoint {
  int rank = 0;
  double timeout_s = kDefaultTimeoutS;  // per wait; may be inf; set freely between calls
  // Called from inside long waits, at most every 10 ms: a non-null message ends the wait with
  // that message (and poisons the pair). The torch glue lets Ctrl-C through with it.
  const char* (*poll)() = nullptr;
  int spin_iters = 2000;  // as shm::Comm (shm_collectives.h); open lowers it when oversubscribed
  int spin_now = 2000;
  uint64_t yields_before_sleep = 16384;

  std::vector<Peer> peers;  // by slot, in attach order
  uint64_t next_id = 1;     // send ids: 1, 2, ...
  size_t pending = 0;       // sends not yet wholly in their rings
};

// An endpoint with no peers yet. `oversubscribed`: the ranks of this host outnumber the CPUs
// they may run on, so a wait spins little and soon naps to hand its core to the peer. The
// caller decides (it can see every rank's CPUs; a rank bound to one CPU of its own cannot).
Endpoint open(int rank, bool oversubscribed, double timeout_s = kDefaultTimeoutS);

// Maps the channels to `peer` over the pair's segment at `base` and returns their slot.
// Checks the segment's hello (magic, version, tag count, ring size, the pair's ranks) and
// throws naming expected and found on a mismatch. Records this process's identity for the
// peer's liveness checks.
int attach(Endpoint& ep, void* base, int peer, int tags, size_t ring_bytes);

// Queues a message [header][payload = parts concatenated] to the peer of `slot` on `tag`, and
// copies as much of it as fits now. The header (at most kMaxHeaderBytes) is copied at once;
// the parts are read until the send completes. Returns the send's id.
uint64_t send(Endpoint& ep, int slot, int tag, const void* hdr, size_t hdr_len,
              const Part* parts, size_t n_parts);

// Pushes pending sends of every channel as far as their rings allow; never blocks.
void progress(Endpoint& ep);

// Waits for the next message from the peer of `slot` on `tag`, copies its header into buf
// (cap bytes) and returns its length. The payload must be taken (recv_payload) before the
// next header, unless it is empty.
size_t recv_header(Endpoint& ep, int slot, int tag, void* buf, size_t cap);

// Payload bytes of the message whose header recv_header returned last, still to be received.
uint64_t payload_left(const Endpoint& ep, int slot, int tag);

// Copies the payload of that message into `parts`, whose sizes must add up to its length,
// chunk by chunk as the sender streams it.
void recv_payload(Endpoint& ep, int slot, int tag, const Span* parts, size_t n_parts);

// Whether send `id` is complete: every byte in the ring (the caller may reuse its buffers).
bool send_done(const Endpoint& ep, uint64_t id);
void wait_send(Endpoint& ep, uint64_t id);
// Waits for every pending send of the endpoint.
void flush(Endpoint& ep);

bool is_poisoned(const Endpoint& ep, int slot);
const char* poison_message(const Endpoint& ep, int slot);

}  // namespace p2p
}  // namespace shm
}  // namespace fastpar
