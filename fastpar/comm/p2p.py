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
import os
import re

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm import collectives

ACTIVATION, GRADIENT = 0, 1
_WHAT = ("activation", "gradient")
_MAGIC = 0x46505032  # "FPP2"
HEADER_MAX = 256  # int64 words; the torch engine sends headers of exactly this size
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
           torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}
_TIMEOUT = re.compile(r"[Tt]imed out|waited .* s\b|timeout", re.S)


class P2PError(RuntimeError):
    """A pipeline message went wrong: a mismatch with the schedule, or a peer that died."""


class P2PTimeout(P2PError, TimeoutError):
    """A pipeline wait ran past the job's timeout."""


def spec_of(values) -> tuple:
    """What a message says of its tensors: ``((dtype, shape, requires_grad) or None, ...)``."""
    values = values if isinstance(values, (tuple, list)) else (values,)
    return tuple(None if v is None else (v.dtype, tuple(v.shape), bool(v.requires_grad))
                 for v in values)


def describe(spec) -> str:
    def one(e):
        return "none" if e is None else f"{str(e[0]).removeprefix('torch.')} {list(e[1])}"
    return ", ".join(one(e) for e in spec) if len(spec) != 1 else one(spec[0])


def _same_shapes(a, b) -> bool:
    """Specs agree on every present tensor's dtype and shape (requires_grad may differ)."""
    return len(a) == len(b) and all(
        x is None or y is None or (x[0] == y[0] and x[1] == y[1]) for x, y in zip(a, b))


def _encode(direction: int, mb: int, stage: int, values, is_tuple: bool,
            scattered: list[bool]) -> torch.Tensor:
    words = [_MAGIC, direction, mb, stage, len(values), int(is_tuple)]
    for v, cut in zip(values, scattered):
        if v is None:
            words += [0, 0, 0, 0]
            continue
        if v.dtype not in _CODE:
            raise P2PError(f"fastpar p2p: cannot send a {v.dtype} tensor between stages")
        words += [_CODE[v.dtype], int(v.requires_grad), int(cut), v.dim(), *v.shape]
    if len(words) > HEADER_MAX:
        raise P2PError(f"fastpar p2p: a message of {len(values)} tensors needs a header of "
                       f"{len(words)} words, more than {HEADER_MAX}; send fewer tensors")
    return torch.tensor(words, dtype=torch.int64)


_ABORT = 2  # word 5 of a header: this message says the sender gave up (no payload)


def _encode_abort(reason: str) -> torch.Tensor:
    data = reason.encode()[:8 * (HEADER_MAX - 8)]
    data += b"\0" * (-len(data) % 8)
    words = torch.frombuffer(bytearray(data), dtype=torch.int64) if data else \
        torch.empty(0, dtype=torch.int64)
    head = torch.tensor([_MAGIC, -1, -1, -1, 0, _ABORT, len(data)], dtype=torch.int64)
    return torch.cat([head, words])


def _abort_reason(header: torch.Tensor) -> str | None:
    """The reason of an abort message, ``None`` for a normal one."""
    if header.numel() < 7 or int(header[5]) != _ABORT:
        return None
    n = int(header[6])
    return header[7:7 + (n + 7) // 8].numpy().tobytes()[:n].decode(errors="replace").rstrip("\0")


def _decode(header: torch.Tensor):
    """``(direction, mb, stage, is_tuple, [(dtype, shape, requires_grad, scattered) or None])``"""
    w = header.tolist()
    if not w or w[0] != _MAGIC:
        raise P2PError(f"fastpar p2p: a message without fastpar's header arrived (first word "
                       f"{w[0] if w else None!r}); is something else sending on this channel?")
    direction, mb, stage, n, is_tuple = w[1:6]
    entries, i = [], 6
    for _ in range(n):
        code, grad, cut, ndim = w[i:i + 4]
        shape = tuple(w[i + 4:i + 4 + ndim])
        i += 4 + ndim
        entries.append(None if code == 0 else (_DTYPES[code - 1], shape, bool(grad), bool(cut)))
    return direction, mb, stage, bool(is_tuple), entries


class SendHandle:
    """An in-flight send: keeps its tensors alive until ``wait()`` (bounded by the channel's
    timeout) or ``is_completed()`` says it is done."""

    def __init__(self, works=(), keep=(), timeout: float = math.inf):
        self._works, self._keep, self._timeout = list(works), keep, timeout

    def is_completed(self) -> bool:
        if all(w.is_completed() for w in self._works):
            self._works, self._keep = [], ()
        return not self._works

    def wait(self) -> None:
        for w in self._works:
            if math.isinf(self._timeout):
                w.wait()
            else:
                w.wait(datetime.timedelta(seconds=self._timeout))
        self._works, self._keep = [], ()


class _TorchEngine:
    """Batched isend/irecv on one clone of the group per direction."""

    def __init__(self, clones, timeout: float, device):
        self.clones, self.timeout, self.device = clones, timeout, device

    def _wait(self, work) -> None:
        if math.isinf(self.timeout):
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=self.timeout))

    def isend(self, peer: int, direction: int, header: torch.Tensor, parts):
        padded = torch.zeros(HEADER_MAX, dtype=torch.int64, device=self.device)
        padded[:header.numel()] = header
        ops = [dist.P2POp(dist.isend, t, peer, self.clones[direction])
               for t in (padded, *parts)]
        return SendHandle(dist.batch_isend_irecv(ops), keep=(padded, parts),
                          timeout=self.timeout)

    def recv_header(self, peer: int, direction: int, device) -> torch.Tensor:
        header = torch.empty(HEADER_MAX, dtype=torch.int64, device=device)
        # batched like the sender's ops (NCCL pairs a batch with a batch)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, header, peer,
                                                       self.clones[direction])]):
            self._wait(work)
        return header.cpu()

    def recv_payload(self, peer: int, direction: int, parts) -> None:
        if parts:
            ops = [dist.P2POp(dist.irecv, t, peer, self.clones[direction]) for t in parts]
            for work in dist.batch_isend_irecv(ops):
                self._wait(work)

    def close(self) -> None:
        pass


class _ShmEngine:
    """The shm rings. A receive takes header and payload in one call when the message has the
    layout of the last one from the same peer, direction and stage: it receives into fresh
    buffers of that layout, then falls back to header-then-payload when they do not fit."""

    def __init__(self, rings):
        from fastpar.comm.shm_p2p import MAX_HEADER_ELEMENTS

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

    def close(self):
        self.rings.close()


_LAST: list = []  # the most recently built Channels, for the module-level verbs


def _engine_choice(engine: str, same_host: bool, device: torch.device) -> tuple[str, str]:
    forced = os.environ.get("FASTPAR_COMM_BACKEND") or None
    if engine == "auto" and forced in ("shm", "gloo", "nccl"):
        engine = "shm" if forced == "shm" else "torch"
    if engine not in ("auto", "shm", "torch"):
        raise ValueError(f"p2p engine must be 'auto', 'shm' or 'torch', got {engine!r}")
    native = _native.available() and hasattr(torch.ops.fastpar, "shm_p2p_send")
    if engine == "auto":
        if device.type == "cpu" and same_host and native:
            return "shm", "every stage of the group is on this host, tensors on the CPU"
        return "torch", ("not every stage is on this host" if not same_host else
                         f"tensors on {device.type}" if device.type != "cpu" else
                         "the native extension (with its p2p rings) is not built")
    if engine == "shm" and not (device.type == "cpu" and same_host):
        raise ValueError(f"the shm p2p engine needs every stage on one host and CPU tensors "
                         f"(same host: {same_host}, device: {device})")
    return engine, "forced"


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
        if n == 1:
            self.engine_name, self.reason = "local", "a group of one rank"
        else:
            self.engine_name, self.reason = _engine_choice(engine, same_host, self.device)
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
        _LAST[:] = [self]

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
        try:
            if self._broken is None:
                self.wait_sends()
            self._pending = []
        finally:
            if self._engine is not None:
                self._engine.close()
                self._engine = None
            if _LAST and _LAST[0] is self:
                _LAST.clear()

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
        out, parts, gathers = [], [], []
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
            if _TIMEOUT.search(str(exc)):
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
    if not _LAST:
        raise RuntimeError("fastpar p2p: no Channels yet; build one with "
                           "fastpar.comm.p2p.Channels(group) (a Pipeline builds its own)")
    return _LAST[0]


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
