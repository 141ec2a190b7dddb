"""Runs one rank's action list: forward and backward of its chunks, and the messages between.

State of one step, per (microbatch, local chunk): the stage input (received, or the data on stage
0), its output until the backward, the gradient received for it, and, under a split backward
(``I`` then ``W``), the weight-gradient work left for ``W``. Everything is dropped the moment the
schedule no longer needs it; a sent output's data is freed once its send completes (the autograd
graph only needs its shape), as Megatron's output deallocation does.

Split backward (zero-bubble schedules): ``I`` computes the gradient of the stage input and
``W`` the parameters' gradients, split exactly on the autograd graph (``split_backward.py``).
"""

from __future__ import annotations

import time

import torch
from torch import nn

from fastpar.comm.p2p import P2PError, spec_of
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
    saves during its forward (parameters excluded: they live anyway), plus its stage input.
    ``peak``: the largest total seen."""

    def __init__(self, params):
        self.alive: dict = {}
        self.total = self.peak = 0
        self.params = {p.untyped_storage().data_ptr() for p in params}

    def hooks(self, key, x):
        seen: set = set(self.params)
        size = [sum(t.untyped_storage().nbytes() for t in _tuple(x)
                    if isinstance(t, torch.Tensor))]

        def pack(t):
            s = t.untyped_storage()
            if s.data_ptr() not in seen:
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


class Executor:
    """One rank's chunks (``chunks[c]`` is model stage ``c * pp + rank``) and how to run an
    action list on them. ``channels``: a ``fastpar.comm.p2p.Channels`` over the pp group."""

    def __init__(self, chunks: list[nn.Module], *, pp: int, rank: int, v: int, channels,
                 loss_fn, board=None):
        self.chunks, self.pp, self.rank, self.v = chunks, pp, rank, v
        self.ch, self.loss_fn, self.board = channels, loss_fn, board
        self.steps = 0

    def stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def run(self, actions, data, targets, *, train: bool):
        """Run ``actions``; ``data``/``targets``: the microbatches (``None`` where this rank
        does not use them). Returns ``(losses, outputs, records, peak_bytes)``: the last stage's
        per-microbatch losses (train) or outputs (inference), and ``(start, end, kind, mb,
        chunk)`` of every action."""
        self.steps += 1
        last = self.pp * self.v - 1
        m = len(data) if data is not None else len(targets) if targets is not None else None
        inputs, outputs, out_specs, in_specs, grads, in_grads, wgrad = ({} for _ in range(7))
        sent = []  # (handle, output) whose data is freed once the send completes
        losses, results, records = [], [], []
        memory = _Memory(p for c in self.chunks for p in c.parameters())
        clock = time.perf_counter
        for pos, a in enumerate(actions):
            key, s = (a.mb, a.chunk), self.stage(a.chunk)
            if self.board is not None:
                self.board.set(self.steps, pos, len(actions), a)
            start = clock()
            try:
                if a.kind == "F":
                    x = data[a.mb] if s == 0 else inputs[key]
                    if s != 0:
                        in_specs[key] = spec_of(x)
                    hooks, done = memory.hooks(key, x) if train else (None, None)
                    with torch.set_grad_enabled(train):
                        if hooks is not None:
                            with hooks:
                                out = self.chunks[a.chunk](x)
                        else:
                            out = self.chunks[a.chunk](x)
                        if s == last and train:
                            loss = self.loss_fn(out, targets[a.mb])
                            losses.append(loss.detach())
                            out = loss / m  # the mean over microbatches is the batch's mean
                        elif s == last:
                            results.append(out)
                    if train:
                        done()
                        outputs[key] = out
                    elif s != last:
                        outputs[key] = out
                    if s != 0 and not train:
                        inputs.pop(key)
                elif a.kind == "SF":
                    out = outputs[key] if train else outputs.pop(key)
                    out_specs[key] = spec_of(out)
                    handle = self.ch.send_forward(out, mb=a.mb, stage=s + 1)
                    if train:
                        sent.append((handle, out))
                elif a.kind == "RF":
                    inputs[key] = self.ch.recv_forward(mb=a.mb, stage=s)
                elif a.kind == "RB":
                    grads[key] = self.ch.recv_backward(mb=a.mb, stage=s, expect=out_specs[key])
                elif a.kind in ("B", "I"):
                    self._backward(a, key, s, last, data, inputs, outputs, grads, in_grads, wgrad,
                                   full=a.kind == "B")
                    if a.kind == "B":
                        memory.release(key)
                elif a.kind == "W":
                    wgrad.pop(key).weight_grads()
                    memory.release(key)
                elif a.kind == "SB":
                    self.ch.send_backward(in_grads.pop(key), mb=a.mb, stage=s - 1,
                                          expect=in_specs.pop(key))
                else:
                    raise ValueError(f"unknown action kind {a.kind!r}")
            except P2PError as exc:
                self.ch.abandon(exc)
                if self.board is not None:
                    self.board.state(3)
                raise type(exc)(self._context(pos, actions, exc)) from exc
            except Exception as exc:
                self.ch.abandon(exc)
                if self.board is not None:
                    self.board.state(3)
                exc.add_note(f"fastpar pipeline: raised in step {self.steps}, action {pos} of "
                             f"{len(actions)} ({a}, model stage {s}) on pipeline rank "
                             f"{self.rank}")
                raise
            records.append((start, clock(), a.kind, a.mb, a.chunk))
            if sent:
                still = []
                for handle, out in sent:
                    if handle.is_completed():
                        _free_data(out)
                    else:
                        still.append((handle, out))
                sent = still
            self.ch.release_completed()
        self.ch.finish_step()
        if self.board is not None and actions:
            self.board.state(2)
        assert not wgrad and not grads and not in_grads, (wgrad, grads, in_grads)
        return losses, results, records, memory.peak

    def _backward(self, a, key, s, last, data, inputs, outputs, grads, in_grads, wgrad, full):
        """B (``full``) or I of one microbatch: input gradients into ``in_grads`` (to be sent
        upstream); under I, the weight-gradient work left for W into ``wgrad``."""
        out = outputs.pop(key)
        if s == last:
            tensors, gs = [out], [None]
        else:
            pairs = [(o, g) for o, g in zip(_tuple(out), _tuple(grads.pop(key)))
                     if o is not None and g is not None and o.requires_grad]
            tensors, gs = [p[0] for p in pairs], [p[1] for p in pairs]
        # stage 0's input: the data's microbatch, a leaf needing grad only if the data does
        x = data[a.mb] if s == 0 else inputs.pop(key, None)
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
            params = [p for p in self.chunks[a.chunk].parameters() if p.requires_grad]
            split = SplitBackward(tensors, gs, want, params)
            got = {id(t): g for t, g in zip(want, split.input_grads())}
            wgrad[key] = split
            if s == 0:  # the data's leaves keep their gradient (joined into the batch later)
                for t in want:
                    g = got[id(t)]
                    if g is not None:
                        t.grad = g if t.grad is None else t.grad + g
        if s != 0:
            grads_x = tuple(got.get(id(t)) if isinstance(t, torch.Tensor) else None for t in xs)
            in_grads[key] = grads_x if isinstance(x, (tuple, list)) else grads_x[0]

    def _context(self, pos, actions, exc) -> str:
        text = (f"pipeline rank {self.rank} (global rank {self.ch.rank}), step {self.steps}, "
                f"action {pos} of {len(actions)} ({actions[pos]}): {exc}")
        if self.board is not None:
            text += "\nevery rank of this host, now:\n" + self.board.describe()
        else:
            text += "\n(launch with mpirun to see every rank's current action here)"
        return text
