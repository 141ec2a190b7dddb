"""Activation recomputation: keep a region's inputs, recompute its forward in backward.

    y = fastpar.nn.recompute(block, h)              # any module or function, any tensors
    y = fastpar.nn.recompute(core, q, k, v)         # e.g. only attention's softmax + dropout

``recompute(fn, *args, **kwargs)`` runs ``fn`` once with autograd's saved tensors replaced by
small placeholders and keeps only the tensors among ``args`` (the region's inputs; parameters
live anyway). The first time backward needs one of the region's saved tensors, ``fn`` runs again
on those inputs and every saved tensor still wanted is captured, in the order the first forward
saved them (shapes and dtypes checked). Autograd's graph is the first forward's, unchanged: only
where its saved values come from differs.

**Random numbers.** The recompute runs with the generators as the first forward found them: the
default CPU generator, each CUDA device's that an input lives on, the autocast state, and every
stream of the job's ``fastpar.nn.random.tracker()`` (the "tp" stream the sharded regions'
dropout draws from). Each is put back afterwards, so recomputing draws nothing from any stream:
dropout masks in the recompute equal the first forward's, and the runs with and without
recompute consume the same random numbers.

**Recomputed once per forward, whatever the backward.** A recomputed tensor is kept until its
placeholder dies, that is, until autograd releases the node that saved it (a plain backward does
this as each node finishes, so the region's recomputed activations are freed one node at a
time). ``torch.utils.checkpoint`` (non-reentrant) instead recomputes once per *backward call*
(graph task): the zero-bubble split backward (``fastpar.pipeline.split_backward``) runs the input
gradient (I) as one ``autograd.grad`` call with ``retain_graph=True`` and the weight gradients
(W) as one more call per group of parameters, so torch's checkpoint would recompute the region
in I and again in each W group. Here I recomputes it once; the tensors W's nodes need (a
Linear's input for its ``dW``) are the same tensors, still held by the placeholders of the
retained graph, and W only reads them. Between I and W a microbatch therefore holds its
recomputed activations as it would without recompute; between F and I (where a pipeline holds
up to pp microbatches) it holds only the region's inputs.

Collectives inside the region (tensor parallelism, sequence parallelism's gathers) run again in
the recompute, at the same point of every tp rank's backward, so they match across ranks. The
recompute stops right after the last saved tensor (what follows it is not needed again).
"""

from __future__ import annotations

import contextlib
import threading

import torch

from fastpar.runtime import is_initialized

__all__ = ["recompute", "recomputing"]

_LOCAL = threading.local()  # .depth: recomputes running on this thread (backward's)


def recomputing() -> bool:
    """Whether this thread is inside a recompute (a region's forward run again in backward):
    code with side effects beyond its outputs (statistics a layer records) can skip them."""
    return getattr(_LOCAL, "depth", 0) > 0


class _Stop(Exception):
    """Raised inside the recompute once every saved tensor has been captured."""


class _SaveInputs(torch.autograd.Function):
    """Holds the region's input tensors through autograd's saved tensors, so that the hooks of
    an enclosing region (the pipeline's activation count) see and own them."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.save_for_backward(*tensors)
        return torch.empty(0)

    @staticmethod
    def backward(ctx, grad):
        return (None,) * len(ctx.saved_tensors)


class _Placeholder:
    """Stands in for the ``index``-th tensor the region saved; its death frees the recomputed
    tensor."""

    __slots__ = ("frame", "index", "__weakref__")

    def __init__(self, frame, index):
        self.frame, self.index = frame, index

    def __del__(self):
        self.frame.alive.discard(self.index)
        self.frame.values.pop(self.index, None)


class _Frame:
    """One call of ``recompute``: the function, where its inputs are kept, the random state
    and the shapes of what its first forward saved, and the recomputed tensors still wanted."""

    def __init__(self, fn, args, kwargs):
        self.fn, self.kwargs = fn, kwargs
        self.slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        self.grads = [args[i].requires_grad for i in self.slots]
        inputs = tuple(args[i] for i in self.slots)
        # through autograd when it tracks them; otherwise (no input needs grad) directly
        self.saver = _SaveInputs.apply(*inputs).grad_fn if inputs else None
        self.kept = inputs if self.saver is None else None
        self.rng = _rng_state([args[i] for i in self.slots])
        self.metas: list = []  # (shape, dtype) of each tensor the first forward saved
        self.alive: set = set()  # indices whose placeholder lives
        self.values: dict = {}  # index -> recomputed tensor, while its placeholder lives
        self.recomputed = False

    def pack(self, t):
        index = len(self.metas)
        self.metas.append((t.shape, t.dtype))
        self.alive.add(index)
        return _Placeholder(self, index)

    def unpack(self, holder):
        if not self.recomputed:
            self.recomputed = True
            self._recompute()
        return self.values[holder.index]

    def _inputs(self):
        kept = self.saver.saved_tensors if self.saver is not None else self.kept
        args = list(self.others)
        for i, t, g in zip(self.slots, kept, self.grads):
            args[i] = t.detach().requires_grad_(g)
        return args

    def _recompute(self) -> None:
        args, seen = self._inputs(), [0]

        def capture(t):
            index = seen[0]
            seen[0] += 1
            if index >= len(self.metas) or self.metas[index] != (t.shape, t.dtype):
                got = (t.shape, t.dtype)
                want = self.metas[index] if index < len(self.metas) else "nothing"
                raise RuntimeError(f"fastpar recompute: the recompute saved tensor {index} as "
                                   f"{got}, the first forward {want}: the region must run the "
                                   f"same operations both times")
            if index in self.alive:
                self.values[index] = t.detach()
            if seen[0] == len(self.metas):
                raise _Stop
            return None

        _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
        try:
            with _restored(self.rng), torch.enable_grad(), \
                    torch.autograd.graph.saved_tensors_hooks(capture, lambda _: None):
                self.fn(*args, **self.kwargs)
        except _Stop:
            pass
        finally:
            _LOCAL.depth -= 1
        if seen[0] != len(self.metas):
            raise RuntimeError(f"fastpar recompute: the recompute saved {seen[0]} tensors, the "
                               f"first forward {len(self.metas)}")


def _devices(tensors) -> list:
    return sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})


def _rng_state(tensors) -> dict:
    """Everything dropout may draw from, and the autocast state, as of now."""
    devices = _devices(tensors)
    streams = {}
    if is_initialized():
        from fastpar.nn.random import tracker
        streams = dict(tracker().states)  # values are replaced, never mutated: a copy suffices
    return {"cpu": torch.get_rng_state(), "streams": streams,
            "cuda": {d: torch.cuda.get_rng_state(d) for d in devices},
            "autocast": {dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                         for dev in ("cpu", "cuda")}}


@contextlib.contextmanager
def _restored(state: dict):
    """Run the block with the generators and autocast as ``state`` holds them, then put back
    the ones found on entry."""
    now = _rng_state([])
    now["cuda"] = {d: torch.cuda.get_rng_state(d) for d in state["cuda"]}
    t = None
    if state["streams"] or now["streams"]:
        from fastpar.nn.random import tracker
        t = tracker()
    torch.set_rng_state(state["cpu"])
    for d, s in state["cuda"].items():
        torch.cuda.set_rng_state(s, d)
    if t is not None:  # exactly the streams of then: one made since is made again, alike
        t.states.clear()
        t.states.update(state["streams"])
    try:
        with contextlib.ExitStack() as stack:
            for dev, (enabled, dtype) in state["autocast"].items():
                if enabled or torch.is_autocast_enabled(dev):
                    stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
            yield
    finally:
        torch.set_rng_state(now["cpu"])
        for d, s in now["cuda"].items():
            torch.cuda.set_rng_state(s, d)
        if t is not None:
            t.states.clear()
            t.states.update(now["streams"])


def recompute(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, keeping only the tensors among ``args`` for backward and
    recomputing the rest once, in the first backward that needs it, with the random state of
    this call (see the module docstring). ``kwargs`` are passed as they are (not kept as
    inputs: give tensors positionally). Without grad mode it is a plain call."""
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    frame = _Frame(fn, args, kwargs)
    with torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args, **kwargs)

