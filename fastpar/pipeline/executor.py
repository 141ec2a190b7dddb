"""Runs one rank's action list: forward and backward of its chunks, and the messages between.

``Executor.run`` hands each action to the handler of its kind: ``F``, ``B``, ``I``, ``W``
compute, ``SF``, ``RF``, ``SB``, ``RB`` move messages (``actions.py`` defines the kinds). What
a step keeps between its actions is a ``_Step``, holding one ``_Pass`` per (microbatch, local
chunk): the stage input (received, or the data on stage 0), its output until the backward, the
gradient received for that output, the input's gradient until it is sent, and, under a split
backward (``I`` then ``W``), the weight-gradient work left for ``W``. Everything is dropped the
moment the schedule no longer needs it; a sent output's data is freed once its send completes
(the autograd graph only needs its shape), as Megatron's output deallocation does.

Split backward (zero-bubble schedules): ``I`` computes the gradient of the stage input and
``W`` the parameters' gradients, split exactly on the autograd graph (``split_backward.py``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from typing import Any

import torch
from torch import nn

from fastpar.pipeline.channels import P2PError, spec_of
from fastpar.pipeline.board import DONE, FAILED
from fastpar.pipeline.split_backward import SplitBackward


def _tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _free_data(values) -> None:
    """Release a sent output's memory, keeping its shape for autograd (Megatron's
    deallocate_output_tensor): a 1-element tensor expanded to the shape."""
    for t in _tuple(values):
        if isinstance(t, torch.Tensor) and t.grad_fn is not None:
            t.data = torch.empty((), dtype=t.dtype, device=t.device).expand(t.shape)


class _Memory:
    """Bytes each in-flight (microbatch, chunk) keeps for its backward: the storages autograd
    saves during its forward (parameters excluded: they live anyway, or, gathered by ZeRO-3
    for this forward, are counted as parameters: a saved ``nn.Parameter`` or view of one is
    never counted), plus its stage input. ``peak``: the largest total seen."""

    def __init__(self, params):
        self.alive: dict = {}
        self.total = self.peak = 0
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def hooks(self, key, x):
        seen: set = set(self.params)
        size = [0]
        # The input's own bytes (stage 0's microbatch is a view of the whole batch), once:
        # not again where autograd saves it (a norm saves its input, an embedding the ids).
        for t in _tuple(x):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                size[0] += t.numel() * t.element_size()

        def pack(t):
            s = t.untyped_storage()
            base = t._base if t._base is not None else t
            if s.data_ptr() not in seen and not isinstance(base, nn.Parameter):
                seen.add(s.data_ptr())
                size[0] += s.nbytes()
            # an alias, not ``t`` itself: freeing a sent output's data (``_free_data``) must
            # not reach a saved copy of it (tanh saves its output)
            return t.detach()

        def done():
            self.alive[key] = size[0]
            self.total += size[0]
            self.peak = max(self.peak, self.total)

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), done

    def release(self, key) -> None:
        self.total -= self.alive.pop(key, 0)


@dataclasses.dataclass
class _Pass:
    """What one (microbatch, local chunk) holds between its actions in a step. ``None`` is
    nothing held; a field is cleared as soon as no later action of the list needs it."""

    input: Any = None  # the activation received (RF), until F (inference) or the backward
    in_spec: Any = None  # spec_of(input): what the gradient SB sends back must match
    output: Any = None  # F's output (loss / m on the last stage), until SF (inference) or backward
    out_spec: Any = None  # spec_of(output) as SF sent it: what RB's gradient must match
    grad: Any = None  # the output's gradient, received by RB, until the backward
    in_grad: Any = None  # the input's gradient, made by B or I, until SB sends it
    wgrad: SplitBackward | None = None  # the weight-gradient work I leaves, until W


@dataclasses.dataclass
class _Step:
    """One ``Executor.run``: its microbatches, what it returns, and its state between actions."""

    data: Any  # the input microbatches; None where this rank does not use them
    targets: Any  # the target microbatches; None where this rank does not use them
    microbatches: int | None  # each loss is divided by it: the losses sum to the batch's mean
    train: bool
    memory: _Memory
    # (mb, chunk) -> its _Pass, made at the first action that touches it
    passes: dict = dataclasses.field(default_factory=lambda: collections.defaultdict(_Pass))
    sent: list = dataclasses.field(default_factory=list)  # (handle, output) of sends in flight
    losses: list = dataclasses.field(default_factory=list)  # last stage, train: detached losses
    results: list = dataclasses.field(default_factory=list)  # last stage, inference: outputs
    records: list = dataclasses.field(default_factory=list)  # (start, end, kind, mb, chunk)

    def free_sent(self) -> None:
        """Free the data of every sent output whose send has completed (``_free_data``)."""
        if self.sent:
            still = []
            for handle, out in self.sent:
                if handle.is_completed():
                    _free_data(out)
                else:
                    still.append((handle, out))
            self.sent = still


class Executor:
    """One rank's chunks (``chunks[c]`` is model stage ``c * pp + rank``) and how to run an
    action list on them. ``channels``: a ``fastpar.pipeline.channels.Channels`` over the pp group;
    ``board``: this host's status ``Board``, or ``None`` (not under mpirun)."""

    def __init__(self, chunks: list[nn.Module], *, pp: int, rank: int, v: int, channels,
                 loss_fn, board=None):
        self.chunks, self.pp, self.rank, self.v = chunks, pp, rank, v
        self.ch, self.loss_fn, self.board = channels, loss_fn, board
        self.last = pp * v - 1  # the last model stage: it computes the loss
        self.steps = 0

    def stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _handlers(self) -> dict:
        """Action kind -> the bound method that runs it on ``(step, action, its _Pass)``; made
        per run, so that the executor holds no reference cycle to itself."""
        return {"F": self._forward, "B": self._full_backward, "SF": self._send_forward,
                "RF": self._recv_forward, "SB": self._send_backward, "RB": self._recv_backward,
                "I": self._input_backward, "W": self._weight_backward}

    def run(self, actions, data, targets, *, train: bool, before_last_backward=None):
        """Run ``actions``; ``data``/``targets``: the microbatches (``None`` where this rank
        does not use them). Returns ``(losses, outputs, records, peak_bytes)``: the last stage's
        per-microbatch losses (train) or outputs (inference), and ``(start, end, kind, mb,
        chunk)`` of every action. ``before_last_backward()`` is called just before this rank's
        last full backward (``B``) action, after which no gradient of its parameters changes
        (``DataParallel`` reduces during it); not at all where there is none (zb's split
        backward writes ``.grad`` in its W passes)."""
        self.steps += 1
        m = len(data) if data is not None else len(targets) if targets is not None else None
        step = _Step(data, targets, m, train,
                     _Memory(p for c in self.chunks for p in c.parameters()))
        handlers = self._handlers()
        clock = time.perf_counter
        last_b = max((pos for pos, a in enumerate(actions) if a.kind == "B"), default=None) \
            if before_last_backward is not None else None
        for pos, a in enumerate(actions):
            if pos == last_b:
                before_last_backward()
            if self.board is not None:
                self.board.set(self.steps, pos, len(actions), a)
            start = clock()
            try:
                handler = handlers.get(a.kind)
                if handler is None:
                    raise ValueError(f"unknown action kind {a.kind!r}")
                handler(step, a, step.passes[a.mb, a.chunk])
            except P2PError as exc:
                self.ch.abandon(exc)
                if self.board is not None:
                    self.board.state(FAILED)
                raise type(exc)(self._context(pos, actions, exc)) from exc
            except Exception as exc:
                self.ch.abandon(exc)
                if self.board is not None:
                    self.board.state(FAILED)
                exc.add_note(f"fastpar pipeline: raised in step {self.steps}, action {pos} of "
                             f"{len(actions)} ({a}, model stage {self.stage(a.chunk)}) on "
                             f"pipeline rank {self.rank}")
                raise
            step.records.append((start, clock(), a.kind, a.mb, a.chunk))
            step.free_sent()
            self.ch.release_completed()
        self.ch.finish_step()
        if self.board is not None and actions:
            self.board.state(DONE)
        held = {key: p for key, p in step.passes.items()
                if p.wgrad is not None or p.grad is not None or p.in_grad is not None}
        assert not held, held
        return step.losses, step.results, step.records, step.memory.peak

    # -- messages -------------------------------------------------------------------------
    def _recv_forward(self, step: _Step, a, p: _Pass) -> None:
        """RF: the stage input, from stage - 1."""
        p.input = self.ch.recv_forward(mb=a.mb, stage=self.stage(a.chunk))

    def _send_forward(self, step: _Step, a, p: _Pass) -> None:
        """SF: the output to stage + 1. Training keeps it for the backward (and frees its data
        once the send completes); inference has no further use for it."""
        out = p.output
        if not step.train:
            p.output = None
        p.out_spec = spec_of(out)
        handle = self.ch.send_forward(out, mb=a.mb, stage=self.stage(a.chunk) + 1)
        if step.train:
            step.sent.append((handle, out))

    def _recv_backward(self, step: _Step, a, p: _Pass) -> None:
        """RB: the output's gradient, from stage + 1, checked against the output sent."""
        p.grad = self.ch.recv_backward(mb=a.mb, stage=self.stage(a.chunk), expect=p.out_spec)

    def _send_backward(self, step: _Step, a, p: _Pass) -> None:
        """SB: the input's gradient, to stage - 1, checked against the input received."""
        grads, spec = p.in_grad, p.in_spec
        p.in_grad = p.in_spec = None
        self.ch.send_backward(grads, mb=a.mb, stage=self.stage(a.chunk) - 1, expect=spec)

    # -- compute --------------------------------------------------------------------------
    def _forward(self, step: _Step, a, p: _Pass) -> None:
        """F: run the chunk on its input (the data on stage 0); the last stage applies the loss
        (train) or keeps the output as a result (inference). Training counts the bytes autograd
        saves (``_Memory``)."""
        s, key = self.stage(a.chunk), (a.mb, a.chunk)
        x = step.data[a.mb] if s == 0 else p.input
        if s != 0:
            p.in_spec = spec_of(x)
        hooks, done = (step.memory.hooks(key, x) if step.train
                       else (contextlib.nullcontext(), None))
        with torch.set_grad_enabled(step.train):
            with hooks:
                out = self.chunks[a.chunk](x)
            if s == self.last and step.train:
                loss = self.loss_fn(out, step.targets[a.mb])
                step.losses.append(loss.detach())
                out = loss / step.microbatches  # the mean over microbatches is the batch's mean
            elif s == self.last:
                step.results.append(out)
        if step.train:
            done()
        if step.train or s != self.last:
            p.output = out  # for SF, and in training for the backward
        if not step.train:
            p.input = None  # inference: nothing needs the input any more

    def _full_backward(self, step: _Step, a, p: _Pass) -> None:
        """B: input and weight gradients in one autograd pass."""
        self._backward(step, a, p, full=True)
        step.memory.release((a.mb, a.chunk))

    def _input_backward(self, step: _Step, a, p: _Pass) -> None:
        """I: the input gradient only; the weight-gradient work is left in ``p.wgrad``."""
        self._backward(step, a, p, full=False)

    def _weight_backward(self, step: _Step, a, p: _Pass) -> None:
        """W: the weight gradients an earlier I left."""
        split, p.wgrad = p.wgrad, None
        split.weight_grads()
        step.memory.release((a.mb, a.chunk))

    def _backward(self, step: _Step, a, p: _Pass, *, full: bool) -> None:
        """B (``full``) or I of one microbatch: the input's gradient into ``p.in_grad`` (to be
        sent upstream); under I, the weight-gradient work left for W into ``p.wgrad``."""
        s = self.stage(a.chunk)
        out, p.output = p.output, None
        if s == self.last:
            tensors, gs = [out], [None]
        else:
            grad, p.grad = p.grad, None
            pairs = [(o, g) for o, g in zip(_tuple(out), _tuple(grad))
                     if o is not None and g is not None and o.requires_grad]
            tensors, gs = [t for t, _ in pairs], [g for _, g in pairs]
        # stage 0's input: the data's microbatch, a leaf needing grad only if the data does
        x = step.data[a.mb] if s == 0 else p.input
        p.input = None
        xs = _tuple(x) if x is not None else ()
        want = [t for t in xs if isinstance(t, torch.Tensor) and t.requires_grad]
        if full:
            if tensors:
                torch.autograd.backward(tensors, gs)
            got = {id(t): t.grad for t in want}
            if s != 0:
                for t in want:
                    t.grad = None
        else:
            params = [q for q in self.chunks[a.chunk].parameters() if q.requires_grad]
            split = SplitBackward(tensors, gs, want, params)
            got = {id(t): g for t, g in zip(want, split.input_grads())}
            p.wgrad = split
            if s == 0:  # the data's leaves keep their gradient (joined into the batch later)
                for t in want:
                    g = got[id(t)]
                    if g is not None:
                        t.grad = g if t.grad is None else t.grad + g
        if s != 0:
            grads_x = tuple(got.get(id(t)) if isinstance(t, torch.Tensor) else None for t in xs)
            p.in_grad = grads_x if isinstance(x, (tuple, list)) else grads_x[0]

    def _context(self, pos, actions, exc) -> str:
        text = (f"pipeline rank {self.rank} (global rank {self.ch.rank}), step {self.steps}, "
                f"action {pos} of {len(actions)} ({actions[pos]}): {exc}")
        if self.board is not None:
            text += "\nevery rank of this host, now:\n" + self.board.describe()
        else:
            text += "\n(launch with mpirun to see every rank's current action here)"
        return text
