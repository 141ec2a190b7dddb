"""fastpar's shm P2P rings with the calls that only the benchmarks and tests make (the library's
pipeline uses ``isend``/``recv`` of ``fastpar.comm.transport.shm_rings.ShmP2P``); a helper of
``bench/collectives.py`` (``--ops sendrecv`` on ``shm``), imported by tests too.

    rings = ShmRings(group, ranks, rank, peers, timeout)    # collective, as ShmP2P
    h, n, filled = rings.sendrecv(nxt, 0, header, [x],      # isend + recv (+ the send's wait),
                                  prev, 0, hbuf, [out])     # one call (MPI_Sendrecv)
    step = rings.sendrecv_init(nxt, 0, header, [x], prev, 0, hbuf, [out])  # bound once,
    h, n, filled = step.start()                                             # started each time
    step.free()
    rings.pending(), rings.unread()   # sends with bytes queued; single-copy sends not read yet

    call = ring_step(rings, x, out, dst, src)  # the bench's shm sendrecv row: call() per step
"""

from __future__ import annotations

import weakref

import torch

from fastpar.comm.transport.shm_rings import _DONE, MAX_HEADER_ELEMENTS, ShmP2P, ShmSend


class Sendrecv:
    """A persistent sendrecv (MPI_Send_init + MPI_Recv_init): the tensors are bound once;
    each ``start()`` sends the current bytes of the header and parts and receives into the
    bound buffers, as ``ShmRings.sendrecv`` does, without converting tensor arguments (the bulk
    of a small message's time). Holds the tensors until ``free()`` or the channels' close."""

    __slots__ = ("_p2p", "_plan", "_refs", "_start")

    def __init__(self, p2p: ShmRings, plan: int, refs: tuple):
        self._p2p, self._plan, self._refs = p2p, plan, refs
        self._start = p2p._ops.shm_p2p_sendrecv_start.default._op

    def start(self) -> tuple[ShmSend, int, bool]:
        """``(handle, n, filled)`` as ``ShmRings.sendrecv`` returns them."""
        send_id, n = self._p2p._call("sendrecv", self._start, self._plan)
        handle = ShmSend(self._p2p, send_id, self._refs) if send_id else _DONE
        return (handle, n, True) if n >= 0 else (handle, -1 - n, False)

    def free(self) -> None:
        if self._refs is not None and self._p2p._ep is not None:
            self._p2p._call("free", self._p2p._ops.shm_p2p_sendrecv_free.default, self._plan)
        self._refs = None


class ShmRings(ShmP2P):
    """``ShmP2P`` (same construction, collective over the group) plus ``sendrecv``, its
    persistent form and the queue counters."""

    def sendrecv(self, dst: int, send_tag: int, header: torch.Tensor, parts: list[torch.Tensor],
                 src: int, recv_tag: int, recv_header: torch.Tensor,
                 recv_parts: list[torch.Tensor]) -> tuple[ShmSend, int, bool]:
        """``isend(dst, send_tag, header, parts)``, ``recv(src, recv_tag, recv_header,
        recv_parts)`` and, when the payload was filled, the send's wait, in one call (MPI's
        Sendrecv: a ring step where every rank sends on and receives at once). Returns
        ``(handle, n, filled)``; the handle is complete unless ``filled`` is False (waiting for
        the send then could deadlock with a peer waiting for this rank's ``recv_payload``)."""
        send_id, n = self._call("sendrecv", self._ops.shm_p2p_sendrecv.default._op,
                                self._slot_of(dst, send_tag, "isend"), send_tag, header, parts,
                                self._slot_of(src, recv_tag, "recv"), recv_tag, recv_header,
                                recv_parts)
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


def ring_step(rings: ShmRings, x: torch.Tensor, out: torch.Tensor, dst: int, src: int):
    """The pipeline's rings in nccl-tests' sendrecv: a call that sends ``x`` to ``dst`` with a
    header (as a pipeline message has) and receives ``out`` from ``src``. A persistent
    sendrecv, bound to x and out once as the mpi row binds its numpy views: each call sends on
    and takes header and payload, and returns once its own send is complete (as
    MPI_Sendrecv). Without the binding, a call that passes the tensors (``sendrecv``) pays
    ~2 us more of torch op dispatch."""
    header = torch.zeros(16, dtype=torch.int64)
    got = torch.empty(MAX_HEADER_ELEMENTS, dtype=torch.int64)
    step = rings.sendrecv_init(dst, 0, header, [x], src, 0, got, [out])

    def call():
        step.start()  # out fits the payload: filled, and this rank's send is complete
        return out
    weakref.finalize(call, step.free)  # the plan holds x and out until then
    return call
