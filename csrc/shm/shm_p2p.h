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
//   probe_single_copy(ep, to2); probe_single_copy(ep, to4);  // once both ends attached
//   uint64_t id = send(ep, to4, /*tag=*/0, hdr, hdr_len, parts, n_parts);  // 0: already done
//   size_t n = recv_header(ep, to2, 0, buf, sizeof(buf));  // then parse the payload size
//   recv_payload(ep, to2, 0, out_parts, n_out);
//   bool taken;                                            // or both at once, when the caller
//   n = recv(ep, to2, 0, buf, sizeof(buf), out_parts, n_out, &taken);  // can guess the sizes
//   wait_send(ep, id);                                     // the caller may reuse its buffers
//
// Every (direction, tag) of a pair is one single-producer single-consumer byte ring carrying
// framed messages. A send copies what fits and leaves the rest pending; every blocking call
// (recv_header, recv_payload, wait_send) keeps pushing every pending send of the endpoint while
// it waits, so sends behave as if buffered without limit: a schedule that cannot deadlock with
// buffered sends cannot deadlock here. Pending sends of one channel complete in FIFO order.
//
// Single copy: a payload of at least Endpoint::single_copy_min bytes to a peer that showed (at
// probe_single_copy) that it can read this process's memory travels as a descriptor (this
// process's addresses of the parts) instead of bytes; the receiver copies the parts straight out
// of the sender with process_vm_readv and acknowledges, which completes the send. Until then the
// sender's parts must stay alive and unchanged, as for any send not yet complete. With such a
// peer (and single_copy_min < SIZE_MAX) a smaller payload goes the same way when its frame would
// not wholly fit the ring's free space now, so a send stays pending only while its descriptor
// does not fit (thousands of unreceived messages): sends then complete with no further call of
// the sender, which may block elsewhere (a collective) while the peer receives. Without single
// copy, pending bytes move only inside this endpoint's calls.
//
// Errors are std::runtime_error naming this rank, the peer and the tag. Protocol errors (a
// timeout, a dead peer, an interrupt, a corrupt frame) poison the pair's segment: every later
// call on any channel of that pair, on either side, throws at once with the first error.
// Misuse (a bad slot or tag, a header too long, a payload of another size than the message's)
// throws without poisoning and without consuming anything.
// An Endpoint is thread-compatible: one thread at a time per Endpoint.
#pragma once

#include "shm_errors.h"

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

namespace fastpar {
namespace shm {
namespace p2p {

constexpr int kDefaultTags = 2;  // tag 0: activations, tag 1: gradients
constexpr int kMaxTags = 64;
constexpr size_t kDefaultRingBytes = size_t(256) << 10;
constexpr size_t kMinRingBytes = 8192;
constexpr size_t kMaxHeaderBytes = 4096;
// A sender publishes at most this many bytes at a time, so that the receiver copies out one
// chunk while the next is copied in.
constexpr size_t kChunkBytes = size_t(64) << 10;
// Payloads of at least this many bytes go single-copy where the pair allows it.
constexpr size_t kDefaultSingleCopyMin = size_t(64) << 10;
// A single-copy descriptor names at most this many parts (more: the payload takes the ring).
constexpr size_t kMaxSingleCopyParts = 64;
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

// A send not yet wholly in its ring: the frame (prefix + header [+ single-copy descriptor]) is
// copied, the payload is read from the caller's parts as the ring frees up.
struct PendingSend {
  uint64_t id;
  std::vector<char> frame;
  std::vector<Part> parts;  // empty for a single-copy send (the frame describes them)
  size_t part = 0;          // next byte: parts[part - 1] at `offset` (part 0: the frame)
  size_t offset = 0;
  uint64_t left = 0;        // bytes not yet in the ring
  uint64_t payload = 0;     // payload bytes
  uint64_t ack = 0;         // single copy: the receiver's acknowledgement that completes it
};

// A single-copy send wholly in the ring, waiting for the receiver to read its parts.
struct AwaitedAck {
  uint64_t id, ack, payload;
};

// This rank's end of one ring it writes (counters are monotonic byte counts).
struct TxRing {
  uint64_t written = 0;    // bytes published; only this rank writes the counter
  uint64_t read_seen = 0;  // the peer's read counter as last loaded
  uint64_t single_copies = 0;      // single-copy sends framed so far on this ring
  std::deque<PendingSend> queue;   // FIFO by id
  std::deque<AwaitedAck> unacked;  // FIFO by id, all older than the queue's
};

// This rank's end of one ring it reads.
struct RxRing {
  uint64_t read = 0;
  uint64_t written_seen = 0;
  uint64_t payload_left = 0;  // of the message whose header was taken last
  uint64_t payload_bytes = 0;
  uint64_t acks = 0;          // single-copy payloads taken so far (published as `acked`)
  bool single_copy = false;   // the last header's payload is in the sender's memory, at:
  std::vector<Part> remote;   // the sender's addresses (capacity kept across messages)
};

struct Peer {
  void* base = nullptr;
  int rank = -1;
  int side = 0;  // 0: this rank is the pair's lower rank
  int tags = 0;
  size_t ring_bytes = 0;
  bool single_copy = false;  // the peer said it reads this process's memory (probe_single_copy)
  std::vector<TxRing> tx;    // by tag
  std::vector<RxRing> rx;    // by tag
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
  // Payloads of at least this many bytes go single-copy to a peer that can read this process,
  // and smaller ones that would not fit the ring at once (SIZE_MAX: never, not even these).
  // Both paths interleave freely on a channel; set it between calls.
  size_t single_copy_min = kDefaultSingleCopyMin;

  std::vector<Peer> peers;  // by slot, in attach order
  uint64_t next_id = 1;     // send ids: 1, 2, ...
  size_t pending = 0;       // sends not yet wholly in their rings
  size_t unacked = 0;       // single-copy sends in their rings, not yet read by the receiver
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

// Tries whether the peer of `slot` can read this process's memory (process_vm_readv of a word
// whose address and value it published at attach; ptrace rules or pid namespaces may forbid
// it) and publishes the verdict, which decides whether the peer's large payloads to this rank
// go single-copy. Call once both ends are attached (e.g. after a message from the peer).
bool probe_single_copy(Endpoint& ep, int slot);

// Whether this rank's large payloads to the peer of `slot` go single-copy (the peer's verdict).
bool single_copy(Endpoint& ep, int slot);

// Queues a message [header][payload = parts concatenated] to the peer of `slot` on `tag`, and
// copies as much of it as fits now (single copy: see above for which payloads go by address). The header (at most kMaxHeaderBytes) is copied at once;
// the parts are read until the send completes. Returns the send's id, or 0 when it completed
// at once (every byte in the ring: the caller may reuse its buffers).
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
// chunk by chunk as the sender streams it (or at once from the sender's memory, single-copy).
void recv_payload(Endpoint& ep, int slot, int tag, const Span* parts, size_t n_parts);

// recv_header, then recv_payload into `parts` if their sizes add up to the payload's length
// (*taken = true; an empty payload always matches). Otherwise *taken = false and the payload
// waits for recv_payload, as after recv_header.
size_t recv(Endpoint& ep, int slot, int tag, void* buf, size_t cap, const Span* parts,
            size_t n_parts, bool* taken);

// Whether send `id` is complete: every byte in the ring, or for a single-copy send read by the
// receiver (the caller may reuse its buffers). Id 0 (completed at once) is always complete.
bool send_done(const Endpoint& ep, uint64_t id);
// Waits for send `id`; fails at once (without poisoning) if the peer has flushed before
// taking it.
void wait_send(Endpoint& ep, uint64_t id);
// The endpoint's last call (before closing): says to every peer that this rank takes no more
// messages, then waits for every pending send of the endpoint until the peer has taken it or
// flushed too (then the peer never will: the send is dropped; two ranks that close with sends
// to each other untaken both return at once).
void flush(Endpoint& ep);

bool is_poisoned(const Endpoint& ep, int slot);
const char* poison_message(const Endpoint& ep, int slot);

}  // namespace p2p
}  // namespace shm
}  // namespace fastpar
