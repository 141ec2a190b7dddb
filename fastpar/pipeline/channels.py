"""The pipeline's message protocol: self-describing messages between neighbouring stages.

    ch = Channels(topo.pp_group, all_groups=topo.grid.groups("pp"))  # collective: builds
    h = ch.send_forward(y, mb=3, stage=2)       # y: a tensor or a tuple of tensors; -> handle
    x = ch.recv_forward(mb=3, stage=1)          # the previous stage's y, requires_grad as sent
    g = ch.recv_backward(mb=3, stage=1, expect=spec_of(y))
    ch.send_backward(x_grads, mb=3, stage=1)
    ch.finish_step()                             # every send complete; the next step starts

Megatron's verbs (``send_forward``, ``recv_forward``, ``send_backward``, ``recv_backward``,
``send_forward_recv_backward``, ``send_backward_recv_forward``) are methods of ``Channels``, the
state of one rank's channels to its previous and next rank in the group's ring (the ring wraps
around, for interleaved schedules). There are no module-level verbs acting on a hidden
"latest" ``Channels``: the caller holds its own (a ``Pipeline`` builds one).

Every message carries a header (direction, microbatch, destination stage, and each tensor's dtype,
shape and requires_grad) ahead of its payload. The receiver allocates from the header, so it
never reads garbage into a guessed shape, and checks the header against what the schedule
expects: the microbatch and stage of its action, and the shapes that the same channel carried
earlier in the step (and, for gradients, the shapes of the activations they belong to). The
sender applies the same rules to what it sends, so a mismatch raises on both sides, naming the
stage, the microbatch and both shapes.

The transport is ``fastpar.comm.transport``: its engines (``carriers.py``), chosen per
neighbour (``routes.py``): fastpar's shared-memory rings for CPU tensors to the neighbours on
this rank's host, batched ``isend``/``irecv`` on clones of the group to those on other hosts;
all created and warmed up in the constructor. The header's words: ``messages.py``; the
payload's layout on the wire, and Megatron's scatter-gather over tp (``scatter_group``):
``payload.py``.
"""

from __future__ import annotations

import torch

from fastpar.comm.state import current
from fastpar.comm.transport.base import SendHandle
from fastpar.comm.transport.carriers import ShmEngine
from fastpar.comm.transport.routes import choose_routes, open_routes
from fastpar.pipeline.messages import (ACTIVATION, GRADIENT, WHAT, P2PError, P2PTimeout,
                                       abort_reason, decode, describe, encode, encode_abort,
                                       same_shapes, spec_of)
from fastpar.pipeline.payload import Payload
from fastpar.runtime import job

__all__ = ["ACTIVATION", "GRADIENT", "Channels", "P2PError", "P2PTimeout", "SendHandle",
           "describe", "spec_of"]


class Channels:
    """This rank's channels to its neighbours in ``group``'s ring of ranks.

    Construction is collective over the world when the torch engine serves a pair of
    neighbours in any group of ``all_groups`` (it clones every group of that partition of the
    world that ``group`` belongs to, e.g. every pp group), and over ``group`` when the shm rings
    serve a pair in it. ``engine_name``: "shm", "torch", "shm+torch" (shm to the neighbours on
    this host, torch to the others) or "local"; ``reason`` says why, per neighbour.
    ``timeout`` (seconds; default: the job's) bounds every wait."""

    def __init__(self, group=None, *, all_groups=None, scatter_group=None, engine: str = "auto",
                 timeout: float | None = None, device=None):
        state = current()
        topo = state.topo
        self.group, self.ranks, _ = state.resolve(group)
        self.rank = topo.rank
        self.index = self.ranks.index(self.rank)
        n = len(self.ranks)
        self.prev = self.ranks[(self.index - 1) % n]
        self.next = self.ranks[(self.index + 1) % n]
        self.timeout = topo.timeout if timeout is None else float(timeout)
        self.device = torch.device(device) if device is not None else topo.device
        self.scatter_group = scatter_group
        self._wire = Payload(scatter_group, self.device)
        self._specs: dict = {}  # (direction, peer, stage) -> spec seen first in this step
        self._pending: list[SendHandle] = []
        self.bytes_sent = 0  # payload bytes this rank has sent to other ranks
        self._broken: BaseException | None = None
        self._aborted = False  # abort messages sent to the neighbours
        self._aborts: list = []  # their sends, held: a torch send dropped in flight stalls gloo
        self._local: dict = {ACTIVATION: [], GRADIENT: []}  # messages to this rank itself
        groups = [list(g) for g in all_groups] if all_groups is not None else [self.ranks]
        if self.ranks not in groups:
            raise ValueError(f"all_groups {groups} does not hold this rank's group {self.ranks}")
        self.closed = False
        self.routes = choose_routes(engine, self.ranks, self.rank, groups, topo.hosts or (),
                                    self.device, state.forced, state.forced_by)
        self.engine_name, self.reason = self.routes.name, self.routes.reason
        self._engine = open_routes(self.routes, group=self.group, ranks=self.ranks,
                                   rank=self.rank, groups=groups, timeout=self.timeout,
                                   device=self.device)
        job().on_close(self.close)  # at shutdown, before the communicators under it go
        self._warm_up()
        self.bytes_sent = 0

    # -- the verbs ------------------------------------------------------------------------
    def send_forward(self, values, *, mb: int, stage: int) -> SendHandle:
        """Send stage ``stage - 1``'s output ``values`` to the next rank, for ``stage``."""
        return self._send(ACTIVATION, self.next, values, mb, stage, None)

    def recv_forward(self, *, mb: int, stage: int):
        """The input of ``stage`` for microbatch ``mb``, from the previous rank."""
        return self._recv(ACTIVATION, self.prev, mb, stage, None)

    def send_backward(self, grads, *, mb: int, stage: int, expect=None) -> SendHandle:
        """Send the gradient of stage ``stage``'s input to the previous rank (for stage - 1)."""
        return self._send(GRADIENT, self.prev, grads, mb, stage, expect)

    def recv_backward(self, *, mb: int, stage: int, expect=None):
        """The gradient of stage ``stage``'s output, from the next rank; ``expect``: the
        output's ``spec_of``, which the gradient must match."""
        return self._recv(GRADIENT, self.next, mb, stage, expect)

    def send_forward_recv_backward(self, values, *, mb: int, stage: int, recv_mb: int,
                                   recv_stage: int, expect=None):
        handle = self.send_forward(values, mb=mb, stage=stage)
        return handle, self.recv_backward(mb=recv_mb, stage=recv_stage, expect=expect)

    def send_backward_recv_forward(self, grads, *, mb: int, stage: int, recv_mb: int,
                                   recv_stage: int, expect=None):
        handle = self.send_backward(grads, mb=mb, stage=stage, expect=expect)
        return handle, self.recv_forward(mb=recv_mb, stage=recv_stage)

    def finish_step(self) -> None:
        """Wait for every send of this step; the next step may carry other shapes."""
        self.wait_sends()
        self._specs.clear()
        self._wire.new_step()

    def wait_sends(self) -> None:
        pending, self._pending = self._pending, []
        for handle in pending:
            self._guard(handle.wait, "a send to complete",
                        None, None, None)

    def release_completed(self) -> None:
        """Drop the references of completed sends (their buffers may be freed)."""
        self._pending = [h for h in self._pending if not h.is_completed()]

    def close(self) -> None:
        """Wait for pending sends (unless a failure broke the channel) and release it."""
        self.closed = True
        try:
            if self._broken is None:
                self.wait_sends()
            self._pending = []
        finally:
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    # -- messages -------------------------------------------------------------------------
    def _check_spec(self, direction, peer, mb, stage, spec, expect, side) -> str | None:
        """The mismatch, in words, of ``spec`` against what this channel expects (``None``:
        none). Sender and receiver apply the same rules to the same header."""
        key = (direction, peer, stage)
        first = self._specs.setdefault(key, spec)
        for want, why in ((expect, "the activation it belongs to"),
                          (first, "earlier microbatches of this step on this channel")):
            if want is not None and not same_shapes(want, spec):
                return (f"fastpar p2p: shape mismatch at stage {stage}, microbatch {mb} "
                        f"({WHAT[direction]}, {side} rank {self.rank}, peer rank {peer}): "
                        f"expected {describe(want)} (from {why}), got {describe(spec)}")
        return None

    def abandon(self, why: BaseException) -> None:
        """The step failed on this rank: tell both neighbours at once (an abort message on each
        channel they may be waiting on), so that they fail now instead of at the timeout; later
        ``close()`` does not wait for this rank's sends."""
        if self._broken is None:
            self._broken = why
        if self._aborted or self._engine is None:
            return
        self._aborted = True
        text = str(why).splitlines()[0] if str(why) else type(why).__name__
        header = encode_abort(f"rank {self.rank}: {type(why).__name__}: {text}"[:1500])
        for direction, dst in ((ACTIVATION, self.next), (GRADIENT, self.prev)):
            if dst != self.rank:
                try:  # best effort: the channel may be what failed
                    self._aborts.append(self._engine.isend(dst, direction, header, []))
                except Exception:  # noqa: BLE001 - the original error is what gets raised
                    pass

    def _fail(self, error: P2PError) -> P2PError:
        """Remember that this channel is broken: close() then drops pending sends instead of
        waiting for a peer that has given up."""
        self._broken = error
        return error

    def _open(self) -> None:
        if self.closed:
            raise P2PError(f"fastpar p2p: rank {self.rank}'s Channels were closed (by close() or "
                           "fastpar.shutdown); a new job builds its own")

    def _send(self, direction, peer, values, mb, stage, expect) -> SendHandle:
        self._open()
        is_tuple = isinstance(values, (tuple, list))
        values = tuple(values) if is_tuple else (values,)
        for v in values:
            if v is not None and not isinstance(v, torch.Tensor):
                raise TypeError(f"fastpar p2p: stages exchange tensors (or tuples of tensors), "
                                f"got {type(v).__name__} at stage {stage}")
        mismatch = self._check_spec(direction, peer, mb, stage, spec_of(values), expect,
                                    "sender")
        if mismatch and peer == self.rank:
            raise self._fail(P2PError(mismatch))
        if peer == self.rank:  # another chunk of this rank: a fresh leaf, as if received
            values = tuple(None if v is None else v.detach().requires_grad_(
                v.requires_grad and direction == ACTIVATION) for v in values)
            self._local[direction].append((mb, stage, values if is_tuple else values[0]))
            return SendHandle()
        cut = self._wire.cuts(values)
        unlike = self._wire.check_replicated(values, cut, direction, mb, stage)
        if unlike:
            raise self._fail(P2PError(unlike))
        header = encode(direction, mb, stage, values, is_tuple, cut)
        parts = self._wire.pack(values, cut)
        self.bytes_sent += sum(p.numel() * p.element_size() for p in parts)
        handle = self._guard(lambda: self._engine.isend(peer, direction, header, parts),
                             "send", peer, mb, stage, direction)
        self._pending.append(handle)
        if mismatch:  # sent all the same: the receiver reads the header and raises too
            raise self._fail(P2PError(mismatch))
        return handle

    def _recv(self, direction, peer, mb, stage, expect):
        self._open()
        if peer == self.rank:
            queue = self._local[direction]
            if not queue or queue[0][:2] != (mb, stage):
                got = f"microbatch {queue[0][0]} for stage {queue[0][1]}" if queue else "nothing"
                raise P2PError(f"fastpar p2p: rank {self.rank} expects its own {WHAT[direction]}"
                               f" of microbatch {mb} for stage {stage}, but {got} is queued")
            return queue.pop(0)[2]
        engine = self._engine.of(peer)
        shm = isinstance(engine, ShmEngine)
        if shm:  # header and, if it has the last layout of this channel, payload in one call
            header, guessed = self._guard(lambda: engine.recv(peer, direction, stage),
                                          "header", peer, mb, stage, direction)
        else:
            header = self._guard(lambda: engine.recv_header(peer, direction, self.device),
                                 "header", peer, mb, stage, direction)
        reason = abort_reason(header.cpu())
        if reason is not None:
            raise self._fail(P2PError(
                f"fastpar p2p: rank {self.rank} expected the {WHAT[direction]} of microbatch "
                f"{mb} for stage {stage} from rank {peer}, which gave up instead: {reason}"))
        got_dir, got_mb, got_stage, is_tuple, entries = decode(header)
        if (got_dir, got_mb, got_stage) != (direction, mb, stage):
            raise self._fail(P2PError(
                f"fastpar p2p: rank {self.rank} expected the {WHAT[direction]} of microbatch "
                f"{mb} for stage {stage} from rank {peer}, but the next message is the "
                f"{WHAT[got_dir]} of microbatch {got_mb} for stage {got_stage}: the two ranks "
                "run different schedules"))
        if self._wire.group is None and any(e is not None and e[3] for e in entries):
            raise self._fail(P2PError(
                f"fastpar p2p: rank {self.rank} received a scattered {WHAT[direction]} "
                f"(microbatch {mb}, stage {stage}) from rank {peer} but has no tp group to "
                "all-gather it: every rank must build its channels with the same scatter_group"))
        spec = tuple(None if e is None else e[:3] for e in entries)
        mismatch = self._check_spec(direction, peer, mb, stage, spec, expect, "receiver")
        if mismatch:
            raise self._fail(P2PError(mismatch))
        layout, bufs = self._wire.layout(entries), None
        if shm:  # the payload came with the header when the guessed layout could hold it
            engine.remember(peer, direction, stage, layout)
            bufs = None if guessed is None else engine.recut(guessed, layout)
        if bufs is None:
            bufs = [torch.empty(n, dtype=d, device=self.device) for d, n in layout]
            self._guard(lambda: engine.recv_payload(peer, direction, bufs),
                        "payload", peer, mb, stage, direction)
        values = self._wire.unpack(entries, bufs, direction)
        return tuple(values) if is_tuple else values[0]

    def _guard(self, call, what, peer, mb, stage, direction=ACTIVATION):
        """Run an engine call; its failure becomes a ``P2PError`` (``P2PTimeout`` for a wait
        that ran out) naming this rank, the peer and the message."""
        try:
            return call()
        except P2PError:
            raise
        except RuntimeError as exc:
            message = (f" the {what} of the {WHAT[direction]} of microbatch {mb} for stage "
                       f"{stage}" if mb is not None else f" {what}")
            peer_text = f" (peer rank {peer})" if peer is not None else ""
            if isinstance(exc, TimeoutError):  # the engines type their timeouts
                raise self._fail(P2PTimeout(
                    f"fastpar p2p: rank {self.rank} waited {self.timeout:g} s for{message}"
                    f"{peer_text} and gave up: {exc}")) from exc
            raise self._fail(P2PError(f"fastpar p2p: rank {self.rank} failed on{message}"
                                      f"{peer_text}: {exc}")) from exc

    def _warm_up(self) -> None:
        """One tiny message each way on both directions: a channel that cannot carry one
        fails here, at construction, not in the middle of a step."""
        probe = torch.zeros(1, device=self.device)
        for direction, dst, src in ((ACTIVATION, self.next, self.prev),
                                    (GRADIENT, self.prev, self.next)):
            if dst == self.rank:
                continue
            self._send(direction, dst, probe, -1, -1, None)
            self._recv(direction, src, -1, -1, None)
        self._wire.warm_up()
        self.finish_step()

