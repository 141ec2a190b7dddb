"""Pipeline point-to-point: self-describing messages between neighbouring stages.

    ch = p2p.Channels(topo.pp_group, all_groups=topo.grid.groups("pp"))  # collective: builds
    h = ch.send_forward(y, mb=3, stage=2)       # y: a tensor or a tuple of tensors; -> handle
    x = ch.recv_forward(mb=3, stage=1)          # the previous stage's y, requires_grad as sent
    g = ch.recv_backward(mb=3, stage=1, expect=spec_of(y))
    ch.send_backward(x_grads, mb=3, stage=1)
    ch.finish_step()                             # every send complete; the next step starts

Megatron's verbs (``send_forward``, ``recv_forward``, ``send_backward``, ``recv_backward``,
``send_forward_recv_backward``, ``send_backward_recv_forward``) are methods of ``Channels``, the
state of one rank's channels to its previous and next rank in the group's ring (the ring wraps
around, for interleaved schedules); the module-level functions call the last ``Channels`` built.

Every message carries a header (direction, microbatch, destination stage, and each tensor's dtype,
shape and requires_grad) ahead of its payload. The receiver allocates from the header, so it
never reads garbage into a guessed shape, and checks the header against what the schedule
expects: the microbatch and stage of its action, and the shapes that the same channel carried
earlier in the step (and, for gradients, the shapes of the activations they belong to). The
sender applies the same rules to what it sends, so a mismatch raises on both sides, naming the
stage, the microbatch and both shapes.

Engines: ``shm`` (fastpar's native shared-memory rings, ``fastpar/comm/shm_p2p.py``) when the
whole group is on one host and the tensors are on the CPU; otherwise ``torch``: batched
``isend``/``irecv`` (NCCL / gloo) on two clones of the group, one per direction, so that
activation and gradient messages never queue behind each other (NCCL has no tags). Both are
created and exercised (a warm-up message each way) in the constructor, never lazily in a step.
``FASTPAR_COMM_BACKEND=shm`` forces the shm rings, ``gloo``/``nccl`` the torch engine.

Scatter-gather (Megatron's): with ``scatter_group`` (the tp group) set, a tensor that every rank
of that group holds alike is sent as this rank's 1/tp of it, and the receiver all-gathers the
pieces over its own tp group: tp times less traffic between stages.
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from fastpar.comm import collectives
from fastpar.comm.p2p_engines import _engine_choice, _ShmEngine, _TorchEngine
from fastpar.comm.p2p_messages import (_WHAT, ACTIVATION, GRADIENT, P2PError, P2PTimeout,
                                       SendHandle,
                                       _abort_reason, _decode, _encode, _encode_abort,
                                       _same_shapes, describe, spec_of)

__all__ = ["ACTIVATION", "GRADIENT", "Channels", "P2PError", "P2PTimeout", "SendHandle",
           "describe", "recv_backward", "recv_forward", "send_backward",
           "send_backward_recv_forward", "send_forward", "send_forward_recv_backward",
           "spec_of"]

class Channels:
    """This rank's channels to its neighbours in ``group``'s ring of ranks.

    Construction is collective over the world when the torch engine is chosen (it clones every
    group of ``all_groups``, the partition of the world that ``group`` belongs to, e.g. every pp
    group) and over ``group`` otherwise. ``timeout`` (seconds; default: the job's) bounds every
    wait."""

    def __init__(self, group=None, *, all_groups=None, scatter_group=None, engine: str = "auto",
                 timeout: float | None = None, device=None):
        from fastpar.comm.state import current

        state = current()
        topo = state.topo
        self.group, self.ranks, layout = state.resolve(group)
        self.rank = topo.rank
        self.index = self.ranks.index(self.rank)
        n = len(self.ranks)
        self.prev = self.ranks[(self.index - 1) % n]
        self.next = self.ranks[(self.index + 1) % n]
        self.timeout = topo.timeout if timeout is None else float(timeout)
        self.device = torch.device(device) if device is not None else topo.device
        self.scatter_group = scatter_group
        self.tp = 1
        if scatter_group is not None:
            self.tp = dist.get_world_size(scatter_group)
            self.tp_rank = dist.get_rank(scatter_group)
        self._specs: dict = {}  # (direction, peer, stage) -> spec seen first in this step
        self._pending: list[SendHandle] = []
        self.bytes_sent = 0  # payload bytes this rank has sent to other ranks
        self._broken: BaseException | None = None
        self._verified: dict = {}  # direction -> scatter-gather's replication checked this step
        self._aborted = False  # abort messages sent to the neighbours
        self._local: dict = {ACTIVATION: [], GRADIENT: []}  # messages to this rank itself
        groups = [list(g) for g in all_groups] if all_groups is not None else [self.ranks]
        if self.ranks not in groups:
            raise ValueError(f"all_groups {groups} does not hold this rank's group {self.ranks}")
        # Every rank must choose alike (the torch engine's clones are made by the whole world):
        # shm only if every group of the partition lies on one host.
        hosts = topo.hosts or ()
        same_host = bool(hosts) and all(len({hosts[r] for r in g}) == 1 for g in groups)
        peers = sorted({self.prev, self.next} - {self.rank})
        self._engine = None
        self.closed = False
        if n == 1:
            self.engine_name, self.reason = "local", "a group of one rank"
        else:
            self.engine_name, self.reason = _engine_choice(engine, same_host, self.device,
                                                           state.forced, state.forced_by)
        if self.engine_name == "shm":
            from fastpar.comm.shm_p2p import ShmP2P

            self._engine = _ShmEngine(ShmP2P(self.group, self.ranks, self.rank, peers,
                                             self.timeout))
        elif self.engine_name == "torch":
            if sum(len(g) for g in groups) != dist.get_world_size():
                raise ValueError(f"all_groups must partition the world's "
                                 f"{dist.get_world_size()} ranks, got {groups}")
            clones = {}
            tdelta = None if math.isinf(self.timeout) else datetime.timedelta(
                seconds=self.timeout)
            for ranks in groups:
                pair = [dist.new_group(list(ranks), timeout=tdelta) for _ in (0, 1)]
                if self.rank in ranks:
                    clones = {ACTIVATION: pair[0], GRADIENT: pair[1]}
            self._engine = _TorchEngine(clones, self.timeout, self.device)
        state.closers.append(self.close)
        self._warm_up()
        self.bytes_sent = 0
        state.channels = self  # the module-level verbs act on the job's latest Channels

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
        self._verified.clear()

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
    def _where(self, direction, peer, mb, stage) -> str:
        what = _WHAT[direction]
        return (f"rank {self.rank}, {'sending' if peer is None else 'with peer rank ' + str(peer)}"
                f" ({what} of microbatch {mb} for stage {stage})" if mb is not None else
                f"rank {self.rank}")

    def _check_spec(self, direction, peer, mb, stage, spec, expect, side) -> str | None:
        """The mismatch, in words, of ``spec`` against what this channel expects (``None``:
        none). Sender and receiver apply the same rules to the same header."""
        key = (direction, peer, stage)
        first = self._specs.setdefault(key, spec)
        for want, why in ((expect, "the activation it belongs to"),
                          (first, "earlier microbatches of this step on this channel")):
            if want is not None and not _same_shapes(want, spec):
                return (f"fastpar p2p: shape mismatch at stage {stage}, microbatch {mb} "
                        f"({_WHAT[direction]}, {side} rank {self.rank}, peer rank {peer}): "
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
        header = _encode_abort(f"rank {self.rank}: {type(why).__name__}: {text}"[:1500])
        for direction, dst in ((ACTIVATION, self.next), (GRADIENT, self.prev)):
            if dst != self.rank:
                try:  # best effort: the channel may be what failed
                    self._engine.isend(dst, direction, header, [])
                except Exception:  # noqa: BLE001 - the original error is what gets raised
                    pass

    def _fail(self, error: P2PError) -> P2PError:
        """Remember that this channel is broken: close() then drops pending sends instead of
        waiting for a peer that has given up."""
        self._broken = error
        return error

    def _check_replicated(self, tensors, direction, mb, stage) -> None:
        """Scatter-gather sends 1/tp of a tensor that every rank of the tp group holds alike;
        on the first scattered message of each step per direction, prove it (a checksum
        all-gathered over the tp group), so that a stage whose output differs across the
        group (a sharded output, per-rank dropout) fails here instead of being spliced."""
        sums = torch.stack([torch.stack([t.detach().double().sum(), t.detach().double().abs()
                                         .sum()]) for t in tensors]).reshape(-1)
        every = collectives.all_gather(sums.to(self.device), group=self.scatter_group, dim=0)
        every = every.reshape(self.tp, -1).cpu()
        if not torch.equal(every, every[:1].expand_as(every)):
            raise self._fail(P2PError(
                f"fastpar p2p: scatter-gather needs the {_WHAT[direction]} that stage "
                f"{stage - 1 if direction == ACTIVATION else stage + 1} sends (microbatch {mb}) "
                f"to be identical on every rank of the tp group, but the tp ranks hold "
                f"different tensors (checksums {every[:, 0].tolist()}): the stage ends in a "
                "sharded or per-rank layer; build the Pipeline with scatter_gather=False"))
        self._verified[direction] = True

    def _scattered(self, t) -> bool:
        return (t is not None and self.tp > 1 and t.numel() % self.tp == 0
                and t.numel() > 0)

    def _send(self, direction, peer, values, mb, stage, expect) -> SendHandle:
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
        cut = [self._scattered(v) for v in values]
        if any(cut) and not self._verified.get(direction):
            self._check_replicated([v for v, c in zip(values, cut) if c], direction, mb, stage)
        header = _encode(direction, mb, stage, values, is_tuple, cut)
        parts = []
        for v, c in zip(values, cut):
            if v is None:
                continue
            v = v.detach()
            if c:  # this rank's 1/tp of the flattened tensor; the receiver all-gathers
                v = v.reshape(-1).chunk(self.tp)[self.tp_rank]
            parts.append(v.contiguous())
        self.bytes_sent += sum(p.numel() * p.element_size() for p in parts)
        handle = self._guard(lambda: self._engine.isend(peer, direction, header, parts),
                             "send", peer, mb, stage, direction)
        self._pending.append(handle)
        if mismatch:  # sent all the same: the receiver reads the header and raises too
            raise self._fail(P2PError(mismatch))
        return handle

    def _recv(self, direction, peer, mb, stage, expect):
        if peer == self.rank:
            queue = self._local[direction]
            if not queue or queue[0][:2] != (mb, stage):
                got = f"microbatch {queue[0][0]} for stage {queue[0][1]}" if queue else "nothing"
                raise P2PError(f"fastpar p2p: rank {self.rank} expects its own {_WHAT[direction]}"
                               f" of microbatch {mb} for stage {stage}, but {got} is queued")
            return queue.pop(0)[2]
        shm = isinstance(self._engine, _ShmEngine)
        if shm:  # header and, if it has the last layout of this channel, payload in one call
            header, guessed = self._guard(lambda: self._engine.recv(peer, direction, stage),
                                          "header", peer, mb, stage, direction)
        else:
            header = self._guard(lambda: self._engine.recv_header(peer, direction, self.device),
                                 "header", peer, mb, stage, direction)
        reason = _abort_reason(header.cpu())
        if reason is not None:
            raise self._fail(P2PError(
                f"fastpar p2p: rank {self.rank} expected the {_WHAT[direction]} of microbatch "
                f"{mb} for stage {stage} from rank {peer}, which gave up instead: {reason}"))
        got_dir, got_mb, got_stage, is_tuple, entries = _decode(header)
        if (got_dir, got_mb, got_stage) != (direction, mb, stage):
            raise self._fail(P2PError(
                f"fastpar p2p: rank {self.rank} expected the {_WHAT[direction]} of microbatch "
                f"{mb} for stage {stage} from rank {peer}, but the next message is the "
                f"{_WHAT[got_dir]} of microbatch {got_mb} for stage {got_stage}: the two ranks "
                "run different schedules"))
        if self.scatter_group is None and any(e is not None and e[3] for e in entries):
            raise self._fail(P2PError(
                f"fastpar p2p: rank {self.rank} received a scattered {_WHAT[direction]} "
                f"(microbatch {mb}, stage {stage}) from rank {peer} but has no tp group to "
                "all-gather it: every rank must build its channels with the same scatter_group"))
        spec = tuple(None if e is None else e[:3] for e in entries)
        mismatch = self._check_spec(direction, peer, mb, stage, spec, expect, "receiver")
        if mismatch:
            raise self._fail(P2PError(mismatch))
        layout = tuple((e[0], math.prod(e[1]) // (self.tp if e[3] else 1))
                       for e in entries if e is not None)
        if shm and guessed is not None and (len(guessed) != len(layout) or any(
                (b.dtype, b.numel()) != want for b, want in zip(guessed, layout))):
            # Same bytes in another split (rare): re-cut them along the header's layout.
            flat = torch.cat([b.view(torch.uint8) for b in guessed] or
                             [torch.empty(0, dtype=torch.uint8)])
            guessed, at = [], 0
            for dtype, numel in layout:
                nbytes = numel * torch.empty((), dtype=dtype).element_size()
                guessed.append(flat[at:at + nbytes].clone().view(dtype))
                at += nbytes
        out, parts = [], []
        received = iter(guessed) if shm and guessed is not None else None
        for e in entries:
            if e is None:
                out.append(None)
                continue
            dtype, shape, grad, cut = e
            numel = math.prod(shape)
            buf = next(received) if received is not None else torch.empty(
                numel // self.tp if cut else numel, dtype=dtype, device=self.device)
            parts.append(buf)
            out.append((buf, shape, grad, cut))
        if shm:
            self._engine.remember(peer, direction, stage, layout)
        if received is None:
            self._guard(lambda: self._engine.recv_payload(peer, direction, parts),
                        "payload", peer, mb, stage, direction)
        values = []
        for item in out:
            if item is None:
                values.append(None)
                continue
            buf, shape, grad, cut = item
            if cut:
                buf = collectives.all_gather(buf, group=self.scatter_group, dim=0)
            t = buf.view(shape)
            if grad and t.is_floating_point() and direction == ACTIVATION:
                t.requires_grad_(True)
            values.append(t)
        return tuple(values) if is_tuple else values[0]

    def _guard(self, call, what, peer, mb, stage, direction=ACTIVATION):
        """Run an engine call; its failure becomes a ``P2PError`` (``P2PTimeout`` for a wait
        that ran out) naming this rank, the peer and the message."""
        try:
            return call()
        except P2PError:
            raise
        except RuntimeError as exc:
            message = (f" the {what} of the {_WHAT[direction]} of microbatch {mb} for stage "
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
        if self.scatter_group is not None:  # the all-gather on arrival, built now too
            collectives.all_gather(torch.zeros(self.tp, device=self.device),
                                   group=self.scatter_group)
        self.finish_step()


def _last() -> Channels:
    from fastpar.comm.state import current

    channels = current().channels
    if channels is None or channels.closed:
        raise RuntimeError("fastpar p2p: no open Channels in this job; build one with "
                           "fastpar.comm.p2p.Channels(group) (a Pipeline builds its own)")
    return channels


def send_forward(values, *, mb: int, stage: int) -> SendHandle:
    return _last().send_forward(values, mb=mb, stage=stage)


def recv_forward(*, mb: int, stage: int):
    return _last().recv_forward(mb=mb, stage=stage)


def send_backward(grads, *, mb: int, stage: int, expect=None) -> SendHandle:
    return _last().send_backward(grads, mb=mb, stage=stage, expect=expect)


def recv_backward(*, mb: int, stage: int, expect=None):
    return _last().recv_backward(mb=mb, stage=stage, expect=expect)


def send_forward_recv_backward(values, **kwargs):
    return _last().send_forward_recv_backward(values, **kwargs)


def send_backward_recv_forward(grads, **kwargs):
    return _last().send_backward_recv_forward(grads, **kwargs)
