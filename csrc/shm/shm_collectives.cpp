// fastpar shared-memory collectives: implementation. See shm_collectives.h and README.md.
//
// Protocol in one paragraph: each rank owns one control line (a monotonically increasing
// `flag` plus two call descriptors) and one data slot split into two halves. A "round"
// writes this rank's half number (round & 1), bumps `flag` (release), and waits until every
// peer's flag reaches the same value (acquire); then it reads the peers' halves. Round n+1
// reuses the half of round n-1; before writing it, this rank waited (in round n) for every
// peer to publish round n, and a peer publishes round n only after it finished reading
// round n-1. So a half is never overwritten while a peer may still read it, and no
// second "done reading" flag is needed. Flags only grow, so nothing is ever reset.
#include "shm_collectives.h"
#include "shm_protocol.h"
#include "shm_reduce.h"
#include "shm_wait.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

namespace fastpar {
namespace shm {
namespace proto {

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::AllReduce: return "all_reduce";
    case Kind::AllGather: return "all_gather";
    case Kind::ReduceScatter: return "reduce_scatter";
    case Kind::Broadcast: return "broadcast";
    case Kind::AllReduceSymmetric: return "all_reduce (symmetric)";
    case Kind::AllGatherSymmetric: return "all_gather (symmetric)";
    case Kind::ReduceScatterSymmetric: return "reduce_scatter (symmetric)";
    case Kind::QuantAllReduce: return "all_reduce (int8)";
    case Kind::QuantAllGather: return "all_gather (int8)";
    case Kind::QuantReduceScatter: return "reduce_scatter (int8)";
    case Kind::AllToAll: return "all_to_all";
    case Kind::AllToAllSymmetric: return "all_to_all (symmetric)";
    case Kind::AllGatherFromSymmetric: return "all_gather (from symmetric)";
  }
  return "?";
}

// ---- errors and poisoning ---------------------------------------------------------

// Wakes every peer that sleeps in a wait (after a signal, or a poisoning it must see).
void ring_peers(Comm& c) {
  std::atomic_thread_fence(std::memory_order_seq_cst);  // one fence for every bell
  for (int p = 0; p < c.world; ++p)
    if (p != c.rank) detail::ring_fenced(ctrl(c, p)->bell);
}

[[noreturn]] void fail(Comm& c, ErrorKind kind, const std::string& msg) {
  Header* h = header(c);
  detail::poison(h->poison, h->message, sizeof(h->message), &h->cause, kind, msg);
  ring_peers(c);
  throw_error(kind, msg);
}

[[noreturn]] void throw_poisoned(const Comm& c, Kind k) {
  const Header* h = header(c);
  detail::await_poison_message(h->poison);
  throw PoisonedError(std::string("fastpar shm ") + kind_name(k) + ": rank " +
                          std::to_string(c.rank) +
                          " cannot proceed, the segment was poisoned by an earlier error: " +
                          poison_message(c),
                      detail::poison_cause(h->poison, h->cause));
}

// ---- liveness -----------------------------------------------------------------------

// Whether rank p's process has died. Only when that is certain: p attached (pid known), it
// lives in our pid namespace, and /proc says its process is gone, a zombie, or a newer one.
bool peer_dead(const Comm& c, int p) { return detail::ident_dead(ctrl(c, p)->ident); }

// ---- waiting ----------------------------------------------------------------------

// Waits until rank p's flag reaches `target`: a short pause-spin (cheap when the peer is
// running on another core), then sched_yield so oversubscribed cores make progress, then
// (after c.yields_before_sleep yields) a sleep on this rank's bell until p signals, checking
// poison and the deadline at least every 10 ms.
void wait_peer(Comm& c, int p, uint64_t target, Kind k) {
  const std::atomic<uint64_t>& f = ctrl(c, p)->flag;
  detail::wait_until(
      c.spin_now, c.spin_iters, c.yields_before_sleep,
      [&] { return f.load(std::memory_order_acquire) >= target; },
      [&](uint64_t it, detail::WaitClock& clock) {
        if (header(c)->poison.load(std::memory_order_acquire) != 0) throw_poisoned(c, k);
        if ((it & 63) != 0) return;
        const double s = clock.seconds();
        if (c.poll != nullptr && clock.poll_due(s)) {
          if (const char* why = c.poll())
            fail(c, ErrorKind::Interrupted, std::string("fastpar shm ") + kind_name(k) + ": rank " +
                        std::to_string(c.rank) + " " + why + " while waiting for rank " +
                        std::to_string(p) + " (call " + std::to_string(c.calls) + ")");
        }
        if (clock.liveness_due(s) && f.load(std::memory_order_acquire) < target &&
            peer_dead(c, p))
          fail(c, ErrorKind::PeerDead, std::string("fastpar shm ") + kind_name(k) + ": rank " +
                      std::to_string(c.rank) + " found rank " + std::to_string(p) +
                      " dead (pid " + std::to_string(ctrl(c, p)->ident.pid) +
                      " has exited) while waiting for it (call " + std::to_string(c.calls) +
                      ")");
        if (s > c.timeout_s)
          fail(c, ErrorKind::Timeout, std::string("fastpar shm ") + kind_name(k) + ": rank " +
                      std::to_string(c.rank) + " timed out after " + std::to_string(s) +
                      " s waiting for rank " + std::to_string(p) + " (call " +
                      std::to_string(c.calls) + "; rank " + std::to_string(p) +
                      " is at signal " + std::to_string(f.load()) + ", expected " +
                      std::to_string(target) + ")");
      },
      [&] { return &ctrl(c, c.rank)->bell; });
}

// Publish: everything written to this rank's half/descriptor before is visible to a peer
// that acquires the new flag value. Then wait for every peer to publish the same value.
void signal_and_wait(Comm& c, Kind k) {
  ctrl(c, c.rank)->flag.store(++c.flag, std::memory_order_release);
  ring_peers(c);
  for (int p = 0; p < c.world; ++p)
    if (p != c.rank) wait_peer(c, p, c.flag, k);
}

// ---- call descriptors -------------------------------------------------------------

std::string describe(const Desc& d, bool full) {
  Kind k = Kind(d.kind);
  bool elems = k == Kind::AllReduce || k == Kind::ReduceScatter ||
               k == Kind::AllReduceSymmetric || k == Kind::ReduceScatterSymmetric ||
               quantized(k);
  std::string what = std::to_string(d.count) +
                     (elems ? std::string(" ") + dtype_name(DType(d.dtype)) + " elements"
                            : std::string(" bytes"));
  if (quantized(k)) {
    what += " in blocks of " + std::to_string(d.sig);
  } else if (d.sig != 0) {
    char sig[32];
    std::snprintf(sig, sizeof(sig), " [sig 0x%016llx]", static_cast<unsigned long long>(d.sig));
    what += sig;
  }
  if (!full) return what;
  std::string s = std::string(kind_name(k)) + " of " + what;
  if (elems && !quantized(k)) s += d.op == uint32_t(Op::Sum) ? " (sum)" : " (max)";
  if (k == Kind::Broadcast) s += " from root " + std::to_string(d.root);
  return s;
}

Desc begin_call(Comm& c, Kind k, DType dt, Op op, size_t count, int root, uint64_t sig) {
  if (header(c)->poison.load(std::memory_order_acquire) != 0) throw_poisoned(c, k);
  ++c.calls;
  return Desc{uint32_t(k), uint32_t(dt), uint32_t(op), root, count, c.calls, sig};
}

// First round of a call: publish the descriptor with the data, then (after the wait)
// compare every rank's descriptor with rank 0's. All ranks see the same descriptors, so
// all of them throw the same message; none of them has read peer data yet.
void first_round_sync(Comm& c, const Desc& mine) {
  ctrl(c, c.rank)->desc[c.rounds & 1] = mine;
  signal_and_wait(c, Kind(mine.kind));
  const Desc& d0 = ctrl(c, 0)->desc[c.rounds & 1];
  for (int r = 1; r < c.world; ++r) {
    const Desc& d = ctrl(c, r)->desc[c.rounds & 1];
    if (d.kind == d0.kind && d.dtype == d0.dtype && d.op == d0.op && d.root == d0.root &&
        d.count == d0.count && d.sig == d0.sig)
      continue;
    bool full = d.kind != d0.kind || d.op != d0.op || d.root != d0.root;
    fail(c, ErrorKind::Mismatch,
         std::string("fastpar shm ") + kind_name(Kind(mine.kind)) + ": rank " +
                std::to_string(r) + " passed " + describe(d, full) + " but rank 0 passed " +
                describe(d0, full));
  }
}

// Rank r's share [begin, end) of n elements: equal slices rounded to 32 elements.
void slice_of(size_t n, int world, int r, size_t* begin, size_t* end) {
  size_t per = ((n + world - 1) / world + 31) / 32 * 32;
  *begin = std::min(n, per * r);
  *end = std::min(n, *begin + per);
}

}  // namespace proto

using namespace proto;

// ---- public API -------------------------------------------------------------------

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::BF16: return 2;
    case DType::F16: return 2;
  }
  throw std::runtime_error("fastpar shm: unknown dtype " + std::to_string(uint32_t(dt)));
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
  }
  return "unknown-dtype";
}

size_t segment_bytes(int world, size_t slot_bytes) {
  if (world < 1 || world > kMaxWorld)
    throw std::runtime_error("fastpar shm: world " + std::to_string(world) +
                             " outside 1.." + std::to_string(kMaxWorld));
  if (slot_bytes < 2 * kPage || slot_bytes % kPage != 0)
    throw std::runtime_error("fastpar shm: slot_bytes " + std::to_string(slot_bytes) +
                             " must be a multiple of 4096 and at least 8192");
  return data_offset(world) + size_t(world) * slot_bytes;
}

void init_segment(void* base, int world, size_t slot_bytes, size_t small_max_bytes,
                  size_t chunk_bytes) {
  segment_bytes(world, slot_bytes);  // validates
  std::memset(base, 0, data_offset(world));
  Header* h = new (base) Header;
  h->version = kVersion;
  h->world = uint32_t(world);
  h->slot_bytes = slot_bytes;
  h->small_max_bytes = std::min(small_max_bytes, slot_bytes / 2);
  h->chunk_bytes = std::max<size_t>(kPage, std::min(chunk_bytes, slot_bytes / 2));
  h->poison.store(0);
  for (int r = 0; r < world; ++r) {
    Ctrl* ct = new (static_cast<char*>(base) + sizeof(Header) + r * sizeof(Ctrl)) Ctrl;
    ct->flag.store(0);
  }
  h->magic.store(kMagic, std::memory_order_release);  // last: attach checks it
}

Comm attach(void* base, int rank, int world, size_t slot_bytes) {
  if (base == nullptr) throw std::runtime_error("fastpar shm attach: null segment base");
  const Header* h = static_cast<const Header*>(base);
  uint64_t magic = h->magic.load(std::memory_order_acquire);
  if (magic != kMagic)
    throw std::runtime_error("fastpar shm attach: bad magic " + std::to_string(magic) +
                             " (expected " + std::to_string(kMagic) +
                             "); was init_segment called before attach?");
  if (h->version != kVersion)
    throw std::runtime_error("fastpar shm attach: segment version " +
                             std::to_string(h->version) + " but this build expects " +
                             std::to_string(kVersion));
  if (int(h->world) != world || h->slot_bytes != slot_bytes)
    throw std::runtime_error("fastpar shm attach: segment was created for world " +
                             std::to_string(h->world) + " with slot_bytes " +
                             std::to_string(h->slot_bytes) + " but rank " +
                             std::to_string(rank) + " attaches with world " +
                             std::to_string(world) + " and slot_bytes " +
                             std::to_string(slot_bytes));
  if (rank < 0 || rank >= world)
    throw std::runtime_error("fastpar shm attach: rank " + std::to_string(rank) +
                             " outside 0.." + std::to_string(world - 1));
  Comm c;
  c.base = base;
  c.rank = rank;
  c.world = world;
  c.slot_bytes = slot_bytes;
  c.small_max_bytes = h->small_max_bytes;
  c.chunk_bytes = h->chunk_bytes;
  set_oversubscribed(c, detail::oversubscribed(world));
  detail::record_ident(&ctrl(c, rank)->ident);
  return c;
}

void set_oversubscribed(Comm& c, bool yes) {
  const detail::Tuning t = detail::tuning(yes);
  c.spin_iters = c.spin_now = t.spin_iters;
  c.yields_before_sleep = t.yields_before_sleep;
}

bool is_poisoned(const Comm& c) {
  return header(c)->poison.load(std::memory_order_acquire) != 0;
}

const char* poison_message(const Comm& c) {
  const Header* h = header(c);
  uint32_t p = h->poison.load(std::memory_order_acquire);
  if (p == 0) return "";
  return p == 2 ? h->message : "(error message still being written)";
}

void all_reduce(Comm& c, void* data, size_t count, DType dt, Op op) {
  const Desc d = begin_call(c, Kind::AllReduce, dt, op, count, 0);
  if (c.world == 1) return;
  const size_t es = dtype_size(dt), bytes = count * es;
  char* buf = static_cast<char*>(data);
  const void* srcs[kMaxWorld];

  if (bytes <= c.small_max_bytes) {
    // Small: one round; every rank reduces all slots in rank order 0..world-1.
    std::memcpy(half(c, c.rank, c.rounds), buf, bytes);
    first_round_sync(c, d);
    for (int r = 0; r < c.world; ++r) srcs[r] = half(c, r, c.rounds);
    reduce_into(buf, srcs, c.world, count, dt, op);
    ++c.rounds;
    return;
  }
  // Large: per chunk, rank r reduces slice r of all slots into its own slot (same rank
  // order, so bitwise identical), signals, then every rank copies out all slices. A rank's
  // own slice is read from its input directly, so only the peers' slices are copied in.
  const size_t chunk = c.chunk_bytes / es;
  for (size_t off = 0; off < count; off += chunk, ++c.rounds) {
    const size_t n = std::min(chunk, count - off);
    char* mine = half(c, c.rank, c.rounds);
    char* in = buf + off * es;
    size_t b, e;
    slice_of(n, c.world, c.rank, &b, &e);
    std::memcpy(mine, in, b * es);
    std::memcpy(mine + e * es, in + e * es, (n - e) * es);
    if (off == 0)
      first_round_sync(c, d);
    else
      signal_and_wait(c, Kind::AllReduce);
    if (e > b) {
      for (int r = 0; r < c.world; ++r) srcs[r] = half(c, r, c.rounds) + b * es;
      srcs[c.rank] = in + b * es;
      reduce_into(mine + b * es, srcs, c.world, e - b, dt, op);
    }
    signal_and_wait(c, Kind::AllReduce);
    for (int r = 0; r < c.world; ++r) {
      slice_of(n, c.world, r, &b, &e);
      std::memcpy(buf + (off + b) * es, half(c, r, c.rounds) + b * es, (e - b) * es);
    }
  }
}

void all_gather(Comm& c, const void* in, void* out, size_t bytes, uint64_t sig) {
  const Desc d = begin_call(c, Kind::AllGather, DType::F32, Op::Sum, bytes, 0, sig);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (c.world == 1) {
    if (src != dst) std::memmove(dst, src, bytes);
    return;
  }
  // One round per chunk; at least one round so that a 0-byte rank still meets the others.
  size_t off = 0;
  do {
    const size_t n = std::min(c.chunk_bytes, bytes - off);
    std::memcpy(half(c, c.rank, c.rounds), src + off, n);
    if (off == 0)
      first_round_sync(c, d);
    else
      signal_and_wait(c, Kind::AllGather);
    // Own part comes from the slot too: `in` may alias out + rank * bytes.
    for (int r = 0; r < c.world; ++r)
      std::memcpy(dst + size_t(r) * bytes + off, half(c, r, c.rounds), n);
    ++c.rounds;
    off += n;
  } while (off < bytes);
}

void reduce_scatter(Comm& c, const void* in, void* out, size_t count, DType dt, Op op) {
  const Desc d = begin_call(c, Kind::ReduceScatter, dt, op, count, 0);
  const size_t es = dtype_size(dt);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (c.world == 1) {
    std::memmove(dst, src, count * es);
    return;
  }
  // Per round, n elements of each of the world destination blocks: piece j of this
  // rank's half holds in[j*count + off : +n]; rank r reduces piece r of every half.
  const size_t per_round = std::max<size_t>(1, half_bytes(c) / (size_t(c.world) * es));
  const void* srcs[kMaxWorld];
  size_t off = 0;
  do {
    const size_t n = std::min(per_round, count - off);
    char* mine = half(c, c.rank, c.rounds);
    for (int j = 0; j < c.world; ++j)
      std::memcpy(mine + j * n * es, src + (j * count + off) * es, n * es);
    if (off == 0)
      first_round_sync(c, d);
    else
      signal_and_wait(c, Kind::ReduceScatter);
    for (int r = 0; r < c.world; ++r) srcs[r] = half(c, r, c.rounds) + c.rank * n * es;
    reduce_into(dst + off * es, srcs, c.world, n, dt, op);
    ++c.rounds;
    off += n;
  } while (off < count);
}

void broadcast(Comm& c, void* data, size_t bytes, int root, uint64_t sig) {
  const Desc d = begin_call(c, Kind::Broadcast, DType::F32, Op::Sum, bytes, root, sig);
  if (root < 0 || root >= c.world)
    fail(c, ErrorKind::Mismatch,
         "fastpar shm broadcast: rank " + std::to_string(c.rank) + " passed root " +
                std::to_string(root) + " outside 0.." + std::to_string(c.world - 1));
  if (c.world == 1) return;
  char* buf = static_cast<char*>(data);
  size_t off = 0;
  do {
    const size_t n = std::min(c.chunk_bytes, bytes - off);
    if (c.rank == root) std::memcpy(half(c, root, c.rounds), buf + off, n);
    if (off == 0)
      first_round_sync(c, d);
    else
      signal_and_wait(c, Kind::Broadcast);
    if (c.rank != root) std::memcpy(buf + off, half(c, root, c.rounds), n);
    ++c.rounds;
    off += n;
  } while (off < bytes);
}

}  // namespace shm
}  // namespace fastpar
