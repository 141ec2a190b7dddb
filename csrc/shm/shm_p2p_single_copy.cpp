// fastpar shared-memory point-to-point channels: the single-copy path (README.md, "Single
// copy"). A payload to a peer that can read this process's memory goes as a descriptor,
// [u64 n][n x (address, bytes)] of the sender's parts, after the header; the receiver copies
// the parts straight into its own with process_vm_readv, then bumps the ring's `acked`, which
// completes the sender's oldest single-copy send on that ring. Whether the peer can is probed
// once (probe_single_copy). The ring protocol that carries the descriptors: shm_p2p.cpp.
#include "shm_p2p_internal.h"

#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <string>

namespace fastpar {
namespace shm {
namespace p2p {
namespace internal {

void collect_acks(Endpoint& ep, Peer& p, int tag) {
  std::deque<AwaitedAck>& u = p.tx[tag].unacked;
  const uint64_t acks = acked(p, p.side, tag).value.load(std::memory_order_acquire);
  while (!u.empty() && u.front().ack <= acks) {
    u.pop_front();
    --ep.unacked;
  }
}

bool peer_reads_me(Peer& p) {
  if (!p.single_copy)
    p.single_copy = side(p, 1 - p.side)->reads_peer.load(std::memory_order_acquire) == 1;
  return p.single_copy;
}

void read_remote(Endpoint& ep, Peer& p, int tag, const Span* parts, size_t n_parts) {
  RxRing& rx = p.rx[tag];
  const Side* peer = side(p, 1 - p.side);
  constexpr size_t kIov = 64;  // iovecs per call, each side (the kernel allows IOV_MAX)
  iovec local[kIov], remote[kIov];
  size_t li = 0, lo = 0, ri = 0, ro = 0;  // next byte: parts[li] at lo, rx.remote[ri] at ro
  uint64_t done = 0;
  while (done < rx.payload_bytes) {
    size_t nl = 0, nr = 0;
    for (size_t i = li; i < n_parts && nl < kIov; ++i, ++nl)
      local[nl] = {static_cast<char*>(parts[i].data) + (i == li ? lo : 0),
                   parts[i].bytes - (i == li ? lo : 0)};
    for (size_t i = ri; i < rx.remote.size() && nr < kIov; ++i, ++nr)
      remote[nr] = {const_cast<char*>(static_cast<const char*>(rx.remote[i].data)) +
                        (i == ri ? ro : 0),
                    rx.remote[i].bytes - (i == ri ? ro : 0)};
    const ssize_t got = ::process_vm_readv(pid_t(peer->pid), local, nl, remote, nr, 0);
    if (got <= 0) {
      const int err = got < 0 ? errno : EFAULT;
      const Await what{Await::Payload, done, rx.payload_bytes};
      if (err == ESRCH || detail::ident_dead(peer->ident))
        fail(p, ErrorKind::PeerDead,
             me(ep) + " found rank " + std::to_string(p.rank) + " dead (pid " +
                    std::to_string(peer->pid) + " has exited) while waiting for " +
                    what.describe(p, tag));
      fail(p, ErrorKind::Other,
           me(ep) + " could not copy " + what.describe(p, tag) + " out of rank " +
                  std::to_string(p.rank) + "'s memory (process_vm_readv: " +
                  std::strerror(err) + ")");
    }
    done += uint64_t(got);
    for (uint64_t n = uint64_t(got); n > 0;) {  // advance both cursors by `got` bytes
      const size_t k = size_t(std::min<uint64_t>(n, parts[li].bytes - lo));
      n -= k;
      lo += k;
      if (lo == parts[li].bytes) ++li, lo = 0;
    }
    for (uint64_t n = uint64_t(got); n > 0;) {
      const size_t k = size_t(std::min<uint64_t>(n, rx.remote[ri].bytes - ro));
      n -= k;
      ro += k;
      if (ro == rx.remote[ri].bytes) ++ri, ro = 0;
    }
    while (li < n_parts && parts[li].bytes == 0) ++li;  // empty parts end no transfer
    while (ri < rx.remote.size() && rx.remote[ri].bytes == 0) ++ri;
  }
  rx.payload_left = 0;
  rx.single_copy = false;
  acked(p, 1 - p.side, tag).value.store(++rx.acks, std::memory_order_release);
  ring_peer(p);
}

}  // namespace internal

bool probe_single_copy(Endpoint& ep, int slot) {
  using namespace internal;
  Peer& p = channel(ep, slot, 0, "probe_single_copy");
  const Side* peer = side(p, 1 - p.side);
  bool ok = false;
  if (peer->attached.load(std::memory_order_acquire) != 0 && peer->pid > 0) {
    uint64_t got = 0;
    iovec local{&got, sizeof(got)};
    iovec remote{reinterpret_cast<void*>(peer->probe_addr), sizeof(got)};
    ok = ::process_vm_readv(pid_t(peer->pid), &local, 1, &remote, 1, 0) == ssize_t(sizeof(got)) &&
         got == peer->probe_value;
  }
  side(p, p.side)->reads_peer.store(ok ? 1 : 2, std::memory_order_release);
  return ok;
}

bool single_copy(Endpoint& ep, int slot) {
  return internal::peer_reads_me(internal::channel(ep, slot, 0, "single_copy"));
}

}  // namespace p2p
}  // namespace shm
}  // namespace fastpar
