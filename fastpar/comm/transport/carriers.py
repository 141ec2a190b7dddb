"""The engines that carry point-to-point bytes (under ``fastpar.pipeline.channels.Channels``
and the cp ring): batched isend/irecv on clones of the group (NCCL / gloo), and fastpar's
shared-memory rings.

``shm`` (fastpar's native shared-memory rings, ``shm_rings.py``) serves neighbours on this
rank's host with tensors on the CPU; ``torch``: batched ``isend``/``irecv`` (NCCL / gloo) on two
clones of the group, one per direction, so that activation and gradient messages never queue
behind each other (NCCL has no tags), serves the others. Which engine serves which neighbour,
and opening them: ``routes.py``. Both are created and exercised (a warm-up message each way) in
the ``Channels`` constructor, never lazily in a step. ``shift``: a ring's one batch (send to
the next rank, receive from the previous), for ``nn.context_ring``.
"""

from __future__ import annotations

import datetime
import math
import re

import torch
import torch.distributed as dist

from fastpar.comm.transport.base import HEADER_MAX, SendHandle

# torch (2.x) has no timeout type: gloo's recv times out with a plain RuntimeError ("Timed out
# waiting 1000ms for recv operation to complete"), NCCL's watchdog with a DistBackendError
# ("... collective operation timeout ..."), a dead peer with the same types. So, as a fallback
# documented here, a torch error counts as a timeout when its text says so; fastpar's own shm
# engine reports a code instead (fastpar/comm/engines/native_errors.py).
_TORCH_TIMEOUT = re.compile(r"[Tt]imed out|timeout")


class TorchTimeout(RuntimeError, TimeoutError):
    """A wait of the torch engine that ran past the channel's timeout (torch's message)."""


def _wait(work, timeout: float) -> None:
    """``work.wait`` bounded by ``timeout`` (seconds; ``math.inf``: none); a wait that ran out
    raises ``TorchTimeout``: one that returns False (torch's way where it has one), or one
    that raises a RuntimeError (DistError and DistBackendError are ones) saying it timed out."""
    try:
        done = work.wait() if math.isinf(timeout) else work.wait(
            datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        if not isinstance(exc, TimeoutError) and _TORCH_TIMEOUT.search(str(exc)):
            raise TorchTimeout(str(exc)).with_traceback(exc.__traceback__) from None
        raise
    if done is False:
        raise TorchTimeout(f"torch.distributed: a wait ran past {timeout:g} s")


class TorchSend(SendHandle):
    """A send of the torch engine (batched isend works): keeps its tensors alive until
    ``wait()`` (bounded by the channel's timeout) or ``is_completed()`` says it is done."""

    def __init__(self, works=(), keep=(), timeout: float = math.inf):
        self._works, self._keep, self._timeout = list(works), keep, timeout

    def is_completed(self) -> bool:
        if all(w.is_completed() for w in self._works):
            self._works, self._keep = [], ()
        return not self._works

    def wait(self) -> None:
        for w in self._works:
            _wait(w, self._timeout)
        self._works, self._keep = [], ()


def shift(group, t: torch.Tensor, to: int, buf: torch.Tensor, source: int, tag: int,
             timeout: float = math.inf) -> TorchSend:
    """Send ``t`` to global rank ``to`` and receive ``buf`` from ``source`` in one batch of
    torch's isend/irecv on ``group`` (a ring's shift: nn.context_ring's K/V blocks and dK/dV
    sums), matched by ``tag``; the handle keeps both alive until its bounded ``wait()``."""
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, to, group, tag),
                                    dist.P2POp(dist.irecv, buf, source, group, tag)])
    return TorchSend(works, keep=(t, buf), timeout=timeout)


class TorchEngine:
    """Batched isend/irecv on one clone of the group per direction."""

    def __init__(self, clones, timeout: float, device):
        self.clones, self.timeout, self.device = clones, timeout, device

    def isend(self, peer: int, direction: int, header: torch.Tensor, parts):
        padded = torch.zeros(HEADER_MAX, dtype=torch.int64, device=self.device)
        padded[:header.numel()] = header
        ops = [dist.P2POp(dist.isend, t, peer, self.clones[direction])
               for t in (padded, *parts)]
        return TorchSend(dist.batch_isend_irecv(ops), keep=(padded, parts),
                          timeout=self.timeout)

    def recv_header(self, peer: int, direction: int, device) -> torch.Tensor:
        header = torch.empty(HEADER_MAX, dtype=torch.int64, device=device)
        # batched like the sender's ops (NCCL pairs a batch with a batch)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, header, peer,
                                                       self.clones[direction])]):
            _wait(work, self.timeout)
        return header.cpu()

    def recv_payload(self, peer: int, direction: int, parts) -> None:
        if parts:
            ops = [dist.P2POp(dist.irecv, t, peer, self.clones[direction]) for t in parts]
            for work in dist.batch_isend_irecv(ops):
                _wait(work, self.timeout)

    def close(self) -> None:
        pass


class ShmEngine:
    """The shm rings. A receive takes header and payload in one call when the message has the
    layout of the last one from the same peer, direction and stage: it receives into fresh
    buffers of that layout, then falls back to header-then-payload when they do not fit."""

    def __init__(self, rings):
        from fastpar.comm.transport.shm_rings import MAX_HEADER_ELEMENTS

        self.rings = rings
        self.header = torch.empty(MAX_HEADER_ELEMENTS, dtype=torch.int64)  # reused by receives
        self._layout: dict = {}  # (peer, direction, stage) -> ((dtype, numel), ...) seen last

    def isend(self, peer, direction, header, parts):
        return self.rings.isend(peer, direction, header, list(parts))

    def recv_header(self, peer, direction, device):
        return self.rings.recv_header(peer, direction)

    def recv_payload(self, peer, direction, parts):
        self.rings.recv_payload(peer, direction, list(parts))

    def recv(self, peer, direction, stage):
        """``(header, buffers)``: the header (a view of ``self.header``, valid until the next
        receive) and the payload in buffers of the last layout, or ``None`` when it did not fit
        (then ``recv_payload`` takes it)."""
        layout = self._layout.get((peer, direction, stage), ())
        bufs = [torch.empty(n, dtype=d, device="cpu") for d, n in layout]
        n, filled = self.rings.recv(peer, direction, self.header, bufs)
        return self.header[:n], (bufs if filled else None)

    def remember(self, peer, direction, stage, layout) -> None:
        self._layout[(peer, direction, stage)] = layout

    @staticmethod
    def recut(bufs, layout) -> list:
        """``bufs`` (filled by ``recv``) as buffers of ``layout`` (``((dtype, numel), ...)``):
        themselves when they match it, else the same bytes re-cut along it (rare)."""
        if len(bufs) == len(layout) and all((b.dtype, b.numel()) == want
                                            for b, want in zip(bufs, layout)):
            return bufs
        flat = torch.cat([b.view(torch.uint8) for b in bufs] or
                         [torch.empty(0, dtype=torch.uint8)])
        out, at = [], 0
        for dtype, numel in layout:
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            out.append(flat[at:at + nbytes].clone().view(dtype))
            at += nbytes
        return out

    def close(self):
        self.rings.close()
