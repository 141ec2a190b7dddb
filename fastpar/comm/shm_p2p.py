"""Shared-memory point-to-point channels between ranks of one host: pipeline stages' activations
and gradients.

    p2p = ShmP2P(group, ranks, rank, peers=[prev, nxt], timeout=topo.timeout)   # collective
    h = p2p.isend(nxt, TAG_ACTIVATIONS, header, [act])   # returns at once; act stays untouched
    hdr = p2p.recv_header(prev, TAG_ACTIVATIONS)         # 1-D int64 (shape, dtype: the caller's)
    p2p.recv_payload(prev, TAG_ACTIVATIONS, [buf])       # fills buf in place
    n, filled = p2p.recv(prev, TAG_ACTIVATIONS, hbuf, [buf])  # or both at once, if buf fits
    h, n, filled = p2p.sendrecv(nxt, TAG_ACTIVATIONS, header, [act],   # isend + recv (+ wait),
                                prev, TAG_ACTIVATIONS, hbuf, [buf])    # one call
    step = p2p.sendrecv_init(nxt, TAG_ACTIVATIONS, header, [act], prev, TAG_ACTIVATIONS, hbuf,
                             [buf])                                    # persistent: bound once,
    h, n, filled = step.start()                                        # started every iteration
    h.wait()                                             # act may be reused now

Sends behave as if buffered without limit: every blocking call (a receive, a wait) keeps pushing
this rank's pending sends while it waits, so a schedule that is deadlock-free with buffered sends
(what ``fastpar.pipeline`` validates) is deadlock-free here. Messages of one (peer, tag) arrive in
the order they were sent. Where single copy works (below), a send that does not fit the ring's
free space goes by address whatever its size, so no bytes stay queued and the peer can take them
while this rank blocks outside these channels (a tensor-parallel all-reduce); without it, queued
bytes move only inside this rank's calls on the channels. ``pending()`` counts queued sends.

One segment per pair of ranks, created by the lower rank in ``/dev/shm`` (mode 0600, a reaper
unlinks it if the creator dies during set-up) and unlinked once both ranks mapped it, so a rank
that dies later leaks nothing. Kernel protocol and layout: ``csrc/shm/README.md``.

Payloads of at least ``single_copy_min`` bytes (64 KiB), and smaller ones that would not fit the
ring at once, go single-copy where the pair allows it: the receiver reads them straight out of the
sender's memory (``process_vm_readv``), one copy instead of two through the ring. Set-up probes whether it can (ptrace rules, containers and pid
namespaces may forbid it); ``single_copy`` says, per peer, which path this rank's sends take.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm.p2p_messages import SendHandle
from fastpar.comm.segments import map_segments
from fastpar.comm.native_errors import shm_error
from fastpar.comm.shm import host_oversubscribed, raise_after_kernel

TAG_ACTIVATIONS = 0
TAG_GRADIENTS = 1
RING_BYTES = 256 << 10  # per direction and tag: small enough to stay cache-hot; larger
# messages stream through (or go single-copy)
SINGLE_COPY_MIN = 64 << 10  # payload bytes from which a send goes single-copy, where it can
MAX_HEADER_ELEMENTS = 512  # int64: the kernel's 4 KiB

log = logging.getLogger(__name__)


class ShmSend(SendHandle):
    """A send of the shm rings in flight: ``wait()`` until every byte is in the ring, or a single-copy payload
    was read by the receiver (bounded by the timeout), then the header and parts may be reused;
    holds references to them until then. A send that completed in ``isend`` has nothing to
    hold (``refs`` None)."""

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


class Sendrecv:
    """A persistent sendrecv (MPI_Send_init + MPI_Recv_init): the tensors are bound once;
    each ``start()`` sends the current bytes of the header and parts and receives into the
    bound buffers, as ``ShmP2P.sendrecv`` does, without converting tensor arguments (the bulk of
    a small message's time). Holds the tensors until ``free()`` or the channels' close."""

    __slots__ = ("_p2p", "_plan", "_refs", "_start")

    def __init__(self, p2p: ShmP2P, plan: int, refs: tuple):
        self._p2p, self._plan, self._refs = p2p, plan, refs
        self._start = p2p._ops.shm_p2p_sendrecv_start.default._op

    def start(self) -> tuple[ShmSend, int, bool]:
        """``(handle, n, filled)`` as ``ShmP2P.sendrecv`` returns them."""
        send_id, n = self._p2p._call("sendrecv", self._start, self._plan)
        handle = ShmSend(self._p2p, send_id, self._refs) if send_id else _DONE
        return (handle, n, True) if n >= 0 else (handle, -1 - n, False)

    def free(self) -> None:
        if self._refs is not None and self._p2p._ep is not None:
            self._p2p._call("free", self._p2p._ops.shm_p2p_sendrecv_free.default, self._plan)
        self._refs = None


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
        if rank not in self.ranks:
            raise ValueError(f"fastpar shm p2p: rank {rank} is not in the group {self.ranks}")
        strangers = [p for p in self.peers if p not in self.ranks or p == rank]
        if strangers:
            raise ValueError(f"fastpar shm p2p: rank {rank} lists peers {strangers}, which are "
                             f"itself or outside the group {self.ranks}")
        if not 1 <= tags <= 64:
            raise ValueError(f"fastpar shm p2p: tags={tags}, expected 1..64")
        if ring_bytes < 8192 or ring_bytes & (ring_bytes - 1):
            raise ValueError(f"fastpar shm p2p: ring_bytes={ring_bytes} must be a power of two, "
                             f"at least 8192")
        if not timeout > 0:
            raise ValueError(f"fastpar shm p2p: timeout={timeout} must be > 0 (math.inf: none)")
        if single_copy_min is not None and single_copy_min < 0:
            raise ValueError(f"fastpar shm p2p: single_copy_min={single_copy_min} must be >= 0 "
                             f"(None: never)")
        self.single_copy: dict[int, bool] = {}
        self._single_copy_min = single_copy_min
        self._ops = torch.ops.fastpar
        self._ep = None
        self._busy = threading.Lock()
        self._maps: list[tuple[mmap.mmap, ctypes.c_char]] = []
        oversubscribed = self._check_symmetric(group) or bool(host_oversubscribed())
        self._slot = {p: i for i, p in enumerate(self.peers)}
        # The hot calls skip OpOverload.__call__ (a Python frame, ~0.3 us a call).
        self._send = self._ops.shm_p2p_send.default._op
        self._recv_header = self._ops.shm_p2p_recv_header.default._op
        self._recv_payload = self._ops.shm_p2p_recv_payload.default._op
        self._recv = self._ops.shm_p2p_recv.default._op
        self._sendrecv = self._ops.shm_p2p_sendrecv.default._op
        bases = self._map_segments(group)
        try:
            self._ep = self._ops.shm_p2p_open(
                rank, oversubscribed, self.peers, bases, tags, ring_bytes, float(timeout),
                -1 if single_copy_min is None else single_copy_min)
            self._warm_up()
        except BaseException:
            if self._ep is not None:
                self._ops.shm_p2p_close(self._ep)
                self._ep = None
            self._unmap()
            raise

    # ---- set-up ---------------------------------------------------------------------------

    def _check_symmetric(self, group) -> bool:
        """Checks that pairing is symmetric; returns whether the group's ranks outnumber the
        CPUs they may run on together (then waits spin little and sleep soon: see the kernel's
        ``open``; the host's other ranks count too, ``host_oversubscribed``). A rank bound to a CPU of its own is not oversubscribed, though its own
        affinity holds fewer CPUs than the group has ranks."""
        table = [None] * len(self.ranks)
        dist.all_gather_object(table, (self.peers, sorted(os.sched_getaffinity(0))), group=group)
        lists = {r: peers for r, (peers, _) in zip(self.ranks, table)}
        cpus = set().union(*(set(c) for _, c in table))
        for a, peers_of_a in lists.items():
            for b in peers_of_a:
                if a not in lists[b]:
                    raise ValueError(f"fastpar shm p2p: pairing is not symmetric: rank {a} lists "
                                     f"rank {b} as a peer but rank {b} lists {lists[b]}")
        return len(self.ranks) > len(cpus)

    def _map_segments(self, group) -> list[int]:
        """One segment per pair of peers, created by the lower rank (which lays it out), mapped
        prefaulted by both (a fresh ring page would otherwise cost a page fault on each side,
        ~2 us per 4 KiB, until the ring has wrapped once); ``segments.map_segments``."""
        nbytes = self._ops.shm_p2p_segment_bytes(self.tags, self.ring_bytes)
        pairs = {(min(self.rank, p), max(self.rank, p)): p for p in self.peers}

        def init(pair, mapping):
            anchor = ctypes.c_char.from_buffer(mapping)
            self._ops.shm_p2p_init_segment(ctypes.addressof(anchor), pair[0], pair[1],
                                           self.tags, self.ring_bytes)
            del anchor

        maps = map_segments(group, self.rank, {pair: (pair[0], pair) for pair in pairs}, nbytes,
                            f"fastpar shm p2p: setting up the channels of global rank "
                            f"{self.rank} to {self.peers}", tag="p2p-", init=init,
                            populate=True)
        base_of = {}
        for pair, m in maps.items():
            anchor = ctypes.c_char.from_buffer(m)  # keeps the address valid
            self._maps.append((m, anchor))
            base_of[pairs[pair]] = ctypes.addressof(anchor)
        return [base_of[p] for p in self.peers]

    def _unmap(self) -> None:
        while self._maps:
            m, anchor = self._maps.pop()
            del anchor  # the buffer export, before the mapping can close
            m.close()

    def _warm_up(self) -> None:
        """One tiny message each way on every pair and tag, twice: both ends attached, every
        control line touched. Between the rounds each rank probes whether it can read its
        peers' memory; a peer's second message comes after its verdict, so ``single_copy`` is
        known on both sides once this returns."""
        for round_ in (0, 1):
            sends = [self.isend(p, t, torch.tensor([self.rank, p, t, round_]), [])
                     for p in self.peers for t in range(self.tags)]
            for p in self.peers:
                for t in range(self.tags):
                    got = self.recv_header(p, t).tolist()
                    if got != [p, self.rank, t, round_]:
                        raise RuntimeError(f"fastpar shm p2p: rank {self.rank}'s warm-up "
                                           f"message from rank {p} on tag {t} reads {got}, "
                                           f"expected {[p, self.rank, t, round_]}")
            for h in sends:
                h.wait()
            if round_ == 0:
                self._ops.shm_p2p_probe(self._ep)
        self.single_copy = {p: self._single_copy_min is not None and
                            self._ops.shm_p2p_single_copy(self._ep, self._slot[p])
                            for p in self.peers}
        slow = [p for p, ok in self.single_copy.items() if not ok]
        if slow and self._single_copy_min is not None:
            log.info("fastpar shm p2p: rank %d sends to ranks %s through the rings only (they "
                     "cannot read its memory: ptrace rules or pid namespaces)", self.rank, slow)

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

    def sendrecv(self, dst: int, send_tag: int, header: torch.Tensor, parts: list[torch.Tensor],
                 src: int, recv_tag: int, recv_header: torch.Tensor,
                 recv_parts: list[torch.Tensor]) -> tuple[ShmSend, int, bool]:
        """``isend(dst, send_tag, header, parts)``, ``recv(src, recv_tag, recv_header,
        recv_parts)`` and, when the payload was filled, the send's wait, in one call (MPI's
        Sendrecv: a ring step where every rank sends on and receives at once). Returns
        ``(handle, n, filled)``; the handle is complete unless ``filled`` is False (waiting for
        the send then could deadlock with a peer waiting for this rank's ``recv_payload``)."""
        send_id, n = self._call("sendrecv", self._sendrecv, self._slot_of(dst, send_tag, "isend"),
                                send_tag, header, parts, self._slot_of(src, recv_tag, "recv"),
                                recv_tag, recv_header, recv_parts)
        handle = ShmSend(self, send_id, (header, parts)) if send_id else _DONE
        return (handle, n, True) if n >= 0 else (handle, -1 - n, False)

    def sendrecv_init(self, dst: int, send_tag: int, header: torch.Tensor,
                      parts: list[torch.Tensor], src: int, recv_tag: int,
                      recv_header: torch.Tensor, recv_parts: list[torch.Tensor]) -> Sendrecv:
        """``sendrecv``'s arguments bound once, for a step repeated on the same tensors."""
        plan = self._call("sendrecv_init", self._ops.shm_p2p_sendrecv_init.default,
                          self._slot_of(dst, send_tag, "isend"), send_tag, header, parts,
                          self._slot_of(src, recv_tag, "recv"), recv_tag, recv_header,
                          recv_parts)
        return Sendrecv(self, plan, (header, parts, recv_header, recv_parts))

    def progress(self) -> None:
        """Pushes pending sends as far as the rings allow; never blocks."""
        self._call("progress", self._ops.shm_p2p_progress.default)

    def pending(self) -> int:
        """Sends of this rank with bytes not yet in their ring, after pushing what fits (never
        blocks). Only this rank's later calls on the channels move them, so a nonzero count
        before a collective that the peer's progress depends on can deadlock until the timeout.
        Stays 0 towards peers with single copy unless a ring is full of descriptors."""
        return self._call("pending", self._ops.shm_p2p_pending.default)[0]

    def unread(self) -> int:
        """Single-copy sends of this rank wholly in their ring whose payload the peer has not
        read yet (they complete without this rank's help)."""
        return self._call("unread", self._ops.shm_p2p_pending.default)[1]

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
            self._unmap()
            return
        with self._busy:  # a call in flight on another thread ends first (or times out)
            try:
                self._ops.shm_p2p_flush(self._ep)
                self._closed_clean = True
            finally:
                self._ops.shm_p2p_close(self._ep)
                self._ep = None
                self._unmap()

    def __repr__(self) -> str:
        return (f"ShmP2P(rank={self.rank}, peers={self.peers}, tags={self.tags}, "
                f"ring_bytes={self.ring_bytes}, single_copy={self.single_copy}, "
                f"open={self._ep is not None})")


__all__ = ["MAX_HEADER_ELEMENTS", "RING_BYTES", "SINGLE_COPY_MIN", "Sendrecv", "ShmSend",
           "ShmP2P", "TAG_ACTIVATIONS", "TAG_GRADIENTS"]
