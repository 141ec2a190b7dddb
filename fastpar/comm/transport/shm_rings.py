"""Shared-memory point-to-point channels between ranks of one host: pipeline stages' activations
and gradients.

    p2p = ShmP2P(group, ranks, rank, peers=[prev, nxt], timeout=topo.timeout)   # collective
    h = p2p.isend(nxt, TAG_ACTIVATIONS, header, [act])   # returns at once; act stays untouched
    hdr = p2p.recv_header(prev, TAG_ACTIVATIONS)         # 1-D int64 (shape, dtype: the caller's)
    p2p.recv_payload(prev, TAG_ACTIVATIONS, [buf])       # fills buf in place
    n, filled = p2p.recv(prev, TAG_ACTIVATIONS, hbuf, [buf])  # or both at once, if buf fits
    h.wait()                                             # act may be reused now

Sends behave as if buffered without limit: every blocking call (a receive, a wait) keeps pushing
this rank's pending sends while it waits, so a schedule that is deadlock-free with buffered sends
(what ``fastpar.pipeline`` validates) is deadlock-free here. Messages of one (peer, tag) arrive in
the order they were sent. Where single copy works (below), a send that does not fit the ring's
free space goes by address whatever its size, so no bytes stay queued and the peer can take them
while this rank blocks outside these channels (a tensor-parallel all-reduce); without it, queued
bytes move only inside this rank's calls on the channels.

Payloads of at least ``single_copy_min`` bytes (64 KiB), and smaller ones that would not fit the
ring at once, go single-copy where the pair allows it: the receiver reads them straight out of the
sender's memory (``process_vm_readv``), one copy instead of two through the ring. Set-up
probes whether it can (ptrace rules, containers and pid namespaces may forbid it);
``single_copy`` says, per peer, which path this rank's sends take.

Set-up (one segment per pair of ranks, the warm-up, the single-copy probe) is
``shm_rings_setup.py``; kernel protocol and layout: ``csrc/shm/README.md``. The calls that only
benchmarks and tests make (``sendrecv`` and its persistent form, the queue counters) are in
``bench/shm_rings.py``.
"""

from __future__ import annotations

import threading

import torch

from fastpar import _native
from fastpar.comm.engines.native_errors import shm_error
from fastpar.comm.engines.shm import host_oversubscribed, raise_after_kernel
from fastpar.comm.transport import shm_rings_setup as setup
from fastpar.comm.transport.base import SendHandle

TAG_ACTIVATIONS = 0
TAG_GRADIENTS = 1
RING_BYTES = 256 << 10  # per direction and tag: small enough to stay cache-hot; larger
# messages stream through (or go single-copy)
SINGLE_COPY_MIN = 64 << 10  # payload bytes from which a send goes single-copy, where it can
MAX_HEADER_ELEMENTS = 512  # int64: the kernel's 4 KiB


class ShmSend(SendHandle):
    """A send of the shm rings in flight: ``wait()`` until every byte is in the ring, or a
    single-copy payload was read by the receiver (bounded by the timeout), then the header and
    parts may be reused; holds references to them until then. A send that completed in
    ``isend`` has nothing to hold (``refs`` None)."""

    __slots__ = ("_p2p", "_id", "_refs")

    def __init__(self, p2p: ShmP2P, send_id: int, refs: tuple):
        self._p2p, self._id, self._refs = p2p, send_id, refs

    def is_completed(self) -> bool:
        if self._refs is not None and self._p2p._send_finished(self._id):
            self._refs = None
        return self._refs is None

    def wait(self) -> None:
        if self._refs is not None:
            self._p2p._wait_send(self._id)
            self._refs = None


_DONE = ShmSend(None, 0, None)  # every send that completes inside isend (holds nothing)


class ShmP2P:
    """Shared-memory channels between this rank and some peers of one process group.

    Construction is collective over ``group``: every member calls it, with ``ranks`` the group's
    global ranks in group order, ``rank`` this global rank and ``peers`` the global ranks this
    rank talks to. Pairing must be symmetric (b in peers of a iff a in peers of b); a peer listed
    twice (pp=2 ring: previous and next stage are one rank) is one pair. ``timeout`` (seconds,
    may be ``math.inf``) bounds every wait. One thread at a time: a call made while another
    thread is inside one raises at once. ``single_copy_min``: payload bytes from which sends go
    single-copy where the pair allows it (``None``: never); ``single_copy`` maps each peer to
    whether this rank's sends to it do.
    """

    def __init__(self, group, ranks: list[int], rank: int, peers: list[int], timeout: float,
                 ring_bytes: int = RING_BYTES, tags: int = 2,
                 single_copy_min: int | None = SINGLE_COPY_MIN):
        _native.require("the shm p2p channels")
        self.ranks, self.rank = list(ranks), rank
        self.peers = sorted(set(peers))
        self.tags, self.ring_bytes = tags, ring_bytes
        setup.check_arguments(self.ranks, rank, self.peers, tags, ring_bytes, timeout,
                              single_copy_min)
        self.single_copy: dict[int, bool] = {}
        self._ops = torch.ops.fastpar
        self._ep = None
        self._busy = threading.Lock()
        oversubscribed = (setup.check_pairing(group, self.ranks, self.peers)
                          or bool(host_oversubscribed()))
        self._slot = {p: i for i, p in enumerate(self.peers)}
        # The hot calls skip OpOverload.__call__ (a Python frame, ~0.3 us a call).
        self._send = self._ops.shm_p2p_send.default._op
        self._recv_header = self._ops.shm_p2p_recv_header.default._op
        self._recv_payload = self._ops.shm_p2p_recv_payload.default._op
        self._recv = self._ops.shm_p2p_recv.default._op
        self._maps, bases = setup.map_pairs(group, rank, self.peers, tags, ring_bytes)
        try:
            self._ep = self._ops.shm_p2p_open(
                rank, oversubscribed, self.peers, bases, tags, ring_bytes, float(timeout),
                -1 if single_copy_min is None else single_copy_min)
            self.single_copy = setup.warm_up(self, self._ep, single_copy_min)
        except BaseException:
            if self._ep is not None:
                self._ops.shm_p2p_close(self._ep)
                self._ep = None
            setup.unmap(self._maps)
            raise

    # ---- calls ----------------------------------------------------------------------------

    def _call(self, what: str, kernel, *args):
        if self._ep is None:
            raise RuntimeError(f"fastpar shm p2p: {what} on global rank {self.rank}'s channels, "
                               "which are closed")
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(f"fastpar shm p2p: {what} on global rank {self.rank}'s channels "
                               "was called while another thread of this rank is inside a call "
                               "on them; use them from one thread at a time")
        try:
            return kernel(self._ep, *args)
        except RuntimeError as exc:  # typed by the kind the kernel recorded, same message
            error = shm_error(str(exc)).with_traceback(exc.__traceback__)
        finally:
            self._busy.release()
        raise_after_kernel(error)

    def _slot_of(self, peer: int, tag: int, what: str) -> int:
        slot = self._slot.get(peer)
        if slot is None or tag < 0 or tag >= self.tags:
            raise ValueError(f"fastpar shm p2p: {what} with peer {peer} on tag {tag}, but rank "
                             f"{self.rank} has channels to {self.peers} on tags 0..{self.tags - 1}")
        return slot

    def isend(self, peer: int, tag: int, header: torch.Tensor,
              parts: list[torch.Tensor]) -> ShmSend:
        """Queues [header][parts' bytes, concatenated] to ``peer`` on ``tag``; copies what fits
        now. The header is a contiguous 1-D int64 CPU tensor of at most 512 elements (copied at
        once); the parts (contiguous CPU tensors) are read until the returned handle completes.
        The kernel checks both (ValueError)."""
        send_id = self._call("isend", self._send, self._slot_of(peer, tag, "isend"), tag, header,
                             parts)
        return ShmSend(self, send_id, (header, parts)) if send_id else _DONE

    def recv_header(self, peer: int, tag: int) -> torch.Tensor:
        """The header (1-D int64) of the next message from ``peer`` on ``tag``; waits for it."""
        return self._call("recv_header", self._recv_header, self._slot_of(peer, tag,
                                                                          "recv_header"), tag)

    def recv_payload(self, peer: int, tag: int, parts: list[torch.Tensor]) -> None:
        """Fills ``parts`` (contiguous CPU tensors whose bytes add up to the payload of the
        message whose header came last) in place."""
        self._call("recv_payload", self._recv_payload, self._slot_of(peer, tag, "recv_payload"),
                   tag, parts)

    def recv(self, peer: int, tag: int, header: torch.Tensor,
             parts: list[torch.Tensor]) -> tuple[int, bool]:
        """The next message from ``peer`` on ``tag`` in one call: its header into ``header``
        (a contiguous 1-D int64 CPU tensor of up to 512 elements, as long as the header at
        least) and, when the bytes of ``parts`` add up to its payload, the payload into them.
        Returns ``(n, filled)``: the header is ``header[:n]``; ``filled`` False means the parts
        did not fit and the payload waits for ``recv_payload``."""
        n = self._call("recv", self._recv, self._slot_of(peer, tag, "recv"), tag, header, parts)
        return (n, True) if n >= 0 else (-1 - n, False)

    def _send_finished(self, send_id: int) -> bool:
        if self._ep is None:
            return self._closed_clean
        return self._call("is_completed", self._ops.shm_p2p_send_done.default, send_id)

    def _wait_send(self, send_id: int) -> None:
        if self._ep is None and self._closed_clean:
            return
        self._call("wait", self._ops.shm_p2p_wait_send.default, send_id)

    _closed_clean = False

    def close(self) -> None:
        """Waits (bounded by the timeout) for pending sends, then detaches and unmaps.
        Idempotent; detaches and unmaps even when the wait fails, then raises its error."""
        if self._ep is None:
            setup.unmap(self._maps)
            return
        with self._busy:  # a call in flight on another thread ends first (or times out)
            try:
                self._ops.shm_p2p_flush(self._ep)
                self._closed_clean = True
            finally:
                self._ops.shm_p2p_close(self._ep)
                self._ep = None
                setup.unmap(self._maps)

    def __repr__(self) -> str:
        return (f"ShmP2P(rank={self.rank}, peers={self.peers}, tags={self.tags}, "
                f"ring_bytes={self.ring_bytes}, single_copy={self.single_copy}, "
                f"open={self._ep is not None})")


__all__ = ["MAX_HEADER_ELEMENTS", "RING_BYTES", "SINGLE_COPY_MIN", "ShmSend",
           "ShmP2P", "TAG_ACTIVATIONS", "TAG_GRADIENTS"]
