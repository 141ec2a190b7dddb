// fastpar shared-memory all-to-all (variable splits). See shm_alltoall.h and README.md.
//
// Each round, rank r writes into its own half one region per peer p (the next piece of its
// slice for p) and signals; rank p then reads region p of every peer's half straight into its
// output. The first round's half also starts with a head: this rank's send rows per peer and
// the rows it expects (or "any"), so every rank knows the whole count matrix after the first
// signal and sizes its output from it. The half reuse argument is the other collectives': one
// signal per round, halves alternating.
#include "shm_alltoall.h"
#include "shm_protocol.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

namespace fastpar {
namespace shm {

using namespace proto;

namespace {

constexpr uint64_t kAny = ~uint64_t(0);  // recv_rows not given: anything is expected

// Single copy from this many bytes between two ranks (the longest such slice of the call).
// Below, the copying rounds' one signal beats the single-copy path's two signals and syscalls.
constexpr uint64_t kSingleCopyMin = 64 << 10;

// Head at the start of the first round's half: send rows then expected rows, world each, then
// what single copy needs: the input's address in its owner, the head's own address there (a
// peer's probe reads it with process_vm_readv and compares it with its mapping of the same
// bytes), and whether the owner can read its peers (Comm::peers_readable).
struct Tail {
  uint64_t in_addr, head_addr, readable;
};
size_t head_bytes(int world) { return (size_t(world) * 16 + sizeof(Tail) + 63) / 64 * 64; }
Tail* tail_of(char* head, int world) { return reinterpret_cast<Tail*>(head + world * 16); }

// Whether this process can read rank p's memory: the first 8 bytes of p's head, read at the
// address p published, equal what this process's mapping of that head holds.
bool can_read(const Comm& c, int p, const char* head) {
  uint64_t got = 0, want;
  std::memcpy(&want, head, sizeof(want));
  iovec local{&got, sizeof(got)};
  iovec remote{reinterpret_cast<void*>(tail_of(const_cast<char*>(head), c.world)->head_addr),
               sizeof(got)};
  return ::process_vm_readv(pid_t(ctrl(c, p)->ident.pid), &local, 1, &remote, 1, 0) ==
             ssize_t(sizeof(got)) && got == want;
}

// Copies `bytes` at address `from` in rank p's process into `to`.
void read_peer(Comm& c, int p, uint64_t from, char* to, uint64_t bytes) {
  const int pid = ctrl(c, p)->ident.pid;
  for (uint64_t done = 0; done < bytes;) {
    iovec local{to + done, size_t(bytes - done)};
    iovec remote{reinterpret_cast<void*>(from + done), size_t(bytes - done)};
    const ssize_t got = ::process_vm_readv(pid_t(pid), &local, 1, &remote, 1, 0);
    if (got <= 0) {
      const int err = got < 0 ? errno : EFAULT;
      fail(c, err == ESRCH ? ErrorKind::PeerDead : ErrorKind::Other,
           "fastpar shm all_to_all: rank " + std::to_string(c.rank) + " could not read " +
               std::to_string(bytes) + " bytes from rank " + std::to_string(p) + " (pid " +
               std::to_string(pid) + "; process_vm_readv: " + std::strerror(err) + ")");
    }
    done += uint64_t(got);
  }
}

// Bytes of each peer's region in a half: what remains after the head, split in world, rounded
// down to cache lines (to 8 bytes in the smallest slots, where a region is under a line).
size_t region_bytes(const Comm& c) {
  const size_t per = (half_bytes(c) - head_bytes(c.world)) / size_t(c.world);
  return per >= 64 ? per / 64 * 64 : per / 8 * 8;
}

// The piece of a slice of `total` bytes that round k carries: [k * cap, +n).
size_t piece(uint64_t total, size_t cap, uint64_t k) {
  const uint64_t b = k * cap;
  return b >= total ? 0 : size_t(std::min<uint64_t>(cap, total - b));
}

}  // namespace

void all_to_all(Comm& c, const void* in, const uint64_t* send_rows, const uint64_t* recv_rows,
                uint64_t row_bytes, uint64_t sig, uint64_t* got_rows,
                const std::function<void*(size_t)>& alloc) {
  const Desc d = begin_call(c, Kind::AllToAll, DType::F32, Op::Sum, row_bytes, 0, sig);
  const int W = c.world, me = c.rank;
  const char* src = static_cast<const char*>(in);
  uint64_t soff[kMaxWorld];  // byte offset of each peer's slice in `in`
  soff[0] = 0;
  for (int p = 1; p < W; ++p) soff[p] = soff[p - 1] + send_rows[p - 1] * row_bytes;
  if (W == 1) {
    if (recv_rows != nullptr && recv_rows[0] != send_rows[0])
      fail(c, ErrorKind::Mismatch,
           "fastpar shm all_to_all: rank 0 expects " + std::to_string(recv_rows[0]) +
               " rows from rank 0 but sends it " + std::to_string(send_rows[0]));
    got_rows[0] = send_rows[0];
    char* out = static_cast<char*>(alloc(send_rows[0] * row_bytes));
    if (send_rows[0] != 0) std::memcpy(out, src, send_rows[0] * row_bytes);
    return;
  }
  const size_t head = head_bytes(W), cap = region_bytes(c);

  // Round 0: the head, then the first piece of every slice for a peer.
  char* mine = half(c, me, c.rounds);
  uint64_t* h = reinterpret_cast<uint64_t*>(mine);
  for (int p = 0; p < W; ++p) {
    h[p] = send_rows[p];
    h[W + p] = recv_rows != nullptr ? recv_rows[p] : kAny;
  }
  *tail_of(mine, W) = Tail{reinterpret_cast<uint64_t>(in), reinterpret_cast<uint64_t>(mine),
                           uint64_t(c.peers_readable)};
  for (int p = 0; p < W; ++p)
    if (p != me)
      std::memcpy(mine + head + p * cap, src + soff[p], piece(send_rows[p] * row_bytes, cap, 0));
  first_round_sync(c, d);  // every descriptor agrees (row bytes, dtype and row shape)

  // The count matrix, read from every head (the half is reused two rounds from now).
  std::vector<uint64_t> sends(size_t(W) * W), expects(size_t(W) * W);  // [r * W + p]
  Tail tails[kMaxWorld];
  bool all_readable = true;
  for (int r = 0; r < W; ++r) {
    char* head = half(c, r, c.rounds);
    const uint64_t* hr = reinterpret_cast<const uint64_t*>(head);
    std::copy(hr, hr + W, &sends[size_t(r) * W]);
    std::copy(hr + W, hr + 2 * W, &expects[size_t(r) * W]);
    tails[r] = *tail_of(head, W);
    all_readable = all_readable && tails[r].readable == 1;
  }
  // Every rank checks the whole matrix in the same order: the same message everywhere.
  for (int p = 0; p < W; ++p)
    for (int r = 0; r < W; ++r) {
      const uint64_t want = expects[size_t(p) * W + r], sent = sends[size_t(r) * W + p];
      if (want != kAny && want != sent)
        fail(c, ErrorKind::Mismatch,
             "fastpar shm all_to_all: rank " + std::to_string(p) + " expects " +
                 std::to_string(want) + " rows from rank " + std::to_string(r) + " but rank " +
                 std::to_string(r) + " sends it " + std::to_string(sent));
    }
  uint64_t roff[kMaxWorld], total = 0, longest = 0;  // output offsets; the longest peer slice
  for (int r = 0; r < W; ++r) {
    got_rows[r] = sends[size_t(r) * W + me];
    roff[r] = total;
    total += got_rows[r] * row_bytes;
    for (int p = 0; p < W; ++p)
      if (p != r) longest = std::max(longest, sends[size_t(r) * W + p] * row_bytes);
  }
  char* out;
  try {
    out = static_cast<char*>(alloc(total));
  } catch (const std::exception& e) {  // peers would wait for our next round: poison instead
    fail(c, ErrorKind::Other, std::string("fastpar shm all_to_all: rank ") +
                                  std::to_string(me) + " could not allocate its output of " +
                                  std::to_string(total) + " bytes: " + e.what());
  }
  if (got_rows[me] != 0) std::memcpy(out + roff[me], src + soff[me], got_rows[me] * row_bytes);

  if (longest >= kSingleCopyMin && all_readable) {
    // Single copy: every rank reads its slices straight out of its peers' inputs (their
    // offsets from the matrix), then an exit signal: nobody reads my input any more.
    ++c.rounds;  // the first round's half stays untouched until the next call's second round
    for (int r = 0; r < W; ++r) {
      if (r == me || got_rows[r] == 0) continue;
      uint64_t at = 0;  // where rank r's slice for me starts in its input
      for (int p = 0; p < me; ++p) at += sends[size_t(r) * W + p] * row_bytes;
      read_peer(c, r, tails[r].in_addr + at, out + roff[r], got_rows[r] * row_bytes);
    }
    signal_and_wait(c, Kind::AllToAll);
    return;
  }
  if (longest >= kSingleCopyMin && c.peers_readable == 0) {
    // The first large call probes every peer once and publishes the verdict in its next
    // heads; single copy starts when every rank's head says yes, so all ranks decide alike.
    bool ok = true;
    for (int r = 0; r < W && ok; ++r)
      ok = r == me || can_read(c, r, half(c, r, c.rounds));
    c.peers_readable = ok ? 1 : 2;
  }

  // Every rank computes the same number of rounds from the same matrix.
  const uint64_t rounds = std::max<uint64_t>(1, (longest + cap - 1) / cap);
  for (uint64_t k = 0; k < rounds; ++k, ++c.rounds) {
    if (k > 0) {
      mine = half(c, me, c.rounds);
      for (int p = 0; p < W; ++p)
        if (p != me)
          if (const size_t n = piece(send_rows[p] * row_bytes, cap, k))
            std::memcpy(mine + head + p * cap, src + soff[p] + k * cap, n);
      signal_and_wait(c, Kind::AllToAll);
    }
    for (int r = 0; r < W; ++r)
      if (r != me)
        if (const size_t n = piece(got_rows[r] * row_bytes, cap, k))
          std::memcpy(out + roff[r] + k * cap, half(c, r, c.rounds) + head + me * cap, n);
  }
}

}  // namespace shm
}  // namespace fastpar
