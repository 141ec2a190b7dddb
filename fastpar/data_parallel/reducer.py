"""The reduction cycle of ``fastpar.DataParallel``: gradient-ready hooks, ordered bucket launches,
completion, unused parameters.

One cycle per backward outside ``no_sync()``:
  - a post-accumulate-grad hook marks its parameter ready; when every parameter of a bucket is
    ready the bucket may be launched (``comm.all_reduce(bucket, async_op=True)``).
  - ordering: buckets are launched strictly in index order (bucket k only after buckets < k); a
    bucket ready early waits for its predecessors. Every rank derives the same buckets from the
    same model (the wrapper checks this at construction), so every rank issues the same
    collectives in the same order, whatever order its autograd engine runs in.
  - completion: the hook that makes the last parameter ready launches what is left, waits for
    every handle and divides each bucket by the dp size once. So ``loss.backward()`` alone
    returns with averaged gradients; no end-of-backward callback of the autograd engine is used.
  - a cycle that never completes (a trainable parameter got no gradient) is found at the next
    forward or by ``finish()``: an error naming the parameters, raised alike on every rank
    because which parameters a model uses is a property of its structure.
    ``find_unused_parameters=True`` instead walks the autograd graph at the end of the forward
    and marks the parameters it does not reach ready (they contribute what their bucket holds).
"""

from __future__ import annotations


import torch

from fastpar import comm
from fastpar.comm import quant as quant_codec
from fastpar.data_parallel.buckets import Bucket, ParamSpec, plan_buckets


class Reducer:
    """Owns the buckets of ``params`` (trainable, in registration order, named ``names``) and the
    state of the current reduction cycle over ``group`` (``dp_size`` ranks)."""

    def __init__(self, params, names, *, group, dp_size: int, bucket_mb: float, overlap: bool,
                 find_unused_parameters: bool, reduce_dtype, quant=None,
                 error_feedback: bool = False):
        self._params, self._names = list(params), list(names)
        # quant: float32 and bfloat16 buckets are all-reduced as block-scaled int8 (others in
        # full precision); error feedback keeps a float32 residual per such bucket
        self.quant, self.error_feedback = quant, error_feedback
        self.residuals: dict[int, torch.Tensor] = {}
        self.group, self.dp_size, self.overlap = group, dp_size, overlap
        self.find_unused_parameters, self.reduce_dtype = find_unused_parameters, reduce_dtype
        self._build_buckets(bucket_mb)
        self.comm_hook = None  # (state, hook): DDP's communication hook, replacing our reduce
        self.sync = True  # whether the current backward reduces (set by each forward)
        self.cycles = 0  # reduction cycles completed (every bucket reduced and averaged)
        self._reset_cycle()
        self._hooks = []

    @property
    def params(self) -> list:
        return self._params

    def attach(self) -> None:
        """Register the post-accumulate-grad hook of every parameter."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook(i))
                       for i, p in enumerate(self._params)]

    def _build_buckets(self, bucket_mb: float) -> None:
        def bucket_dtype(p):
            return self.reduce_dtype if self.reduce_dtype is not None and \
                p.is_floating_point() else p.dtype

        specs = [ParamSpec(p.numel(), (bucket_dtype(p), p.device),
                           torch.empty((), dtype=bucket_dtype(p)).element_size())
                 for p in self._params]
        plan = plan_buckets(specs, max(1, int(bucket_mb * 2**20)))
        alloc = self._symmetric_alloc()
        self.buckets: tuple[Bucket, ...] = tuple(
            Bucket(k, [self._params[i] for i in idx], [self._names[i] for i in idx],
                   *specs[idx[0]].key, alloc=alloc) for k, idx in enumerate(plan))
        self._where = [None] * len(self._params)  # param index -> (bucket, view)
        for b, idx in zip(self.buckets, plan):
            for i, view in zip(idx, b.views):
                self._where[i] = (b, view)
        with torch.no_grad():
            for p, (b, view) in zip(self._params, self._where):
                if p.grad is not None:  # gradients the module already held are kept
                    view.copy_(p.grad)
                if not b.copy:
                    p.grad = view  # autograd accumulates into the bucket from now on

    def _symmetric_alloc(self):
        """Bucket storage in symmetric memory (``comm.symmetric_empty``: the shm all-reduce then
        reduces it where it lies) when the dp group's CPU all-reduces go to the shm engine;
        ``None`` (plain tensors) otherwise. Every dp rank decides alike: same group, same
        policy."""
        if not comm.symmetric_available(self.group, "all_reduce"):
            return None

        def alloc(numel, dtype, device):
            if device.type != "cpu":
                return torch.zeros(numel, dtype=dtype, device=device)
            return comm.symmetric_empty(numel, dtype=dtype, group=self.group).zero_()
        return alloc

    # ---- the reduction cycle ------------------------------------------------------------------

    def _reset_cycle(self) -> None:
        self._ready = [False] * len(self._params)
        self._n_ready = 0  # params marked ready, by hooks or by the unused-parameter search
        self._hooked = 0  # params marked ready by their hook in this cycle
        self._next = 0  # the next bucket to launch
        self._handles: list[tuple[Bucket, comm.Handle]] = []
        for b in self.buckets:
            b.pending = len(b.params)

    def _hook(self, i: int):
        def on_grad(p: torch.Tensor) -> None:
            self._gradient_ready(i, p)
        return on_grad

    @torch.no_grad()
    def _gradient_ready(self, i: int, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``i``: its gradient for this backward is final."""
        b, view = self._where[i]
        if b.copy:
            view.copy_(p.grad)  # the reduce_dtype slot mirrors p.grad
        elif p.grad.data_ptr() != view.data_ptr():
            # Autograd replaced the view (grad was None, or create_graph=True): the new tensor is
            # the whole gradient; put it back into the bucket and point .grad at the bucket again.
            view.copy_(p.grad)
            p.grad = view
        if not self.sync:
            return  # inside no_sync(): accumulate only
        if self._ready[i]:
            raise RuntimeError(
                f"DataParallel: parameter {self._names[i]!r} received a gradient twice in one "
                "reduction cycle (two backward passes through parts of one forward?); run all "
                "but the last backward of a step under no_sync()")
        self._ready[i] = True
        self._n_ready += 1
        self._hooked += 1
        b.pending -= 1
        if b.pending == 0 and self.overlap:
            self._launch_ready()
        if self._n_ready == len(self._params):
            self._finish()

    def _launch_ready(self) -> None:
        """Launch, in index order, every bucket whose predecessors are all launched and whose
        parameters are all ready. The collectives run while backward computes the next buckets'
        gradients (truly in the background on gloo/NCCL; shm completes inside the call)."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            b = self.buckets[self._next]
            self._handles.append((b, self._all_reduce(b)))
            self._next += 1

    def _all_reduce(self, b):
        if self.comm_hook is not None:
            state, hook = self.comm_hook
            return HookedHandle(hook(state, HookBucket(b, len(self.buckets))), b)
        if self.quant is None or b.data.dtype not in quant_codec.DTYPES:
            return comm.all_reduce(b.data, group=self.group, async_op=True)
        residual = None
        if self.error_feedback and self.dp_size > 1:  # one rank sends nothing: no error
            residual = self.residuals.get(b.index)
            if residual is None:
                residual = self.residuals[b.index] = torch.zeros(
                    b.data.shape, dtype=torch.float32, device=b.data.device)
        # completes before it returns (both of its stages): no overlap with backward
        return comm.all_reduce(b.data, group=self.group, async_op=True, quant=self.quant,
                               residual=residual)

    def _finish(self) -> None:
        """Every parameter is ready: launch the rest, wait for all, average, reset the cycle."""
        self._launch_ready()
        assert self._next == len(self.buckets), (self._next, len(self.buckets))
        for b, handle in self._handles:
            handle.wait()
            if self.dp_size > 1 and self.comm_hook is None:  # a hook averages itself (DDP's)
                b.data.div_(self.dp_size)  # once, in the bucket's dtype (exact for 2^k ranks)
            if b.copy:
                for p, view in zip(b.params, b.views):
                    if p.grad is None:
                        p.grad = view.to(p.dtype)
                    else:
                        p.grad.copy_(view)
        self.cycles += 1
        self._reset_cycle()

    def finish(self) -> None:
        """Complete a cycle that backward left open (see ``DataParallel.
        finish_gradient_synchronization``); a no-op after a normal backward."""
        if self._hooked == 0:  # no backward since the last cycle (maybe a forward alone)
            self._reset_cycle()
            return
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        if self.find_unused_parameters:
            with torch.no_grad():
                for i in missing:  # the last one completes the cycle (collective)
                    self._mark_unused(i)
            return
        # Launched collectives completed on every rank (same buckets launched everywhere): wait
        # for them before the state is dropped, then raise.
        for _, handle in self._handles:
            handle.wait()
        self._reset_cycle()
        names = [self._names[i] for i in missing]
        raise RuntimeError(
            f"DataParallel: {len(names)} of {len(self._params)} trainable parameters received no "
            f"gradient in the last backward: {names}. Their buckets were never reduced, so that "
            "step's gradients are not averaged over the dp group. Every dp rank raises this "
            "error: which parameters a model uses is a property of its structure, alike on all "
            "replicas. Set requires_grad=False on parameters the model never uses, or pass "
            "find_unused_parameters=True if it skips some on purpose.")

    @torch.no_grad()
    def close_cycle(self, finished: bool) -> None:
        """After a pipeline step whose last backward reduced as it went (``DataParallel.step``):
        ``finished``, every parameter's hook fired and the cycle completed; else the parameters
        it did not reach, whose gradients are final too, are marked ready, launching and
        completing the rest. Without any hook in the cycle (no full backward): ``reduce_all``.
        Collective over dp."""
        if finished:
            return
        if self._hooked == 0:
            self.reduce_all()
            return
        for i in [i for i, ready in enumerate(self._ready) if not ready]:
            self._mark_unused(i)

    @torch.no_grad()
    def reduce_all(self) -> None:
        """Reduce every bucket now (after a pipeline step, ``DataParallel.step``): gradients
        the hooks did not see are put back into the buckets first; a parameter without one
        counts as zero. Collective over dp."""
        self.prepare_gradients()
        self._reset_cycle()
        for b in self.buckets:
            b.pending = 0
        self._ready = [True] * len(self._params)
        self._n_ready = len(self._params)
        self._finish()

    def _mark_unused(self, i: int) -> None:
        b, _ = self._where[i]
        self._ready[i] = True
        self._n_ready += 1
        b.pending -= 1
        if self._hooked and b.pending == 0 and self.overlap:
            self._launch_ready()
        if self._hooked and self._n_ready == len(self._params):
            self._finish()

    @torch.no_grad()
    def prepare_gradients(self) -> None:
        """Before a forward: every ``.grad`` points into its bucket again. A gradient set to None
        (``zero_grad(set_to_none=True)``) gets its view back, zeroed; a reduce_dtype slot takes
        the value of ``.grad`` (zero if None)."""
        for p, (b, view) in zip(self._params, self._where):
            g = p.grad
            if b.copy:
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g)
            elif g is None:
                view.zero_()
                p.grad = view
            elif g.data_ptr() != view.data_ptr():
                view.copy_(g)
                p.grad = view

    def mark_unreached(self, output) -> None:
        """find_unused_parameters: walk the autograd graph from the outputs; parameters it does
        not reach get no gradient from this backward and are marked ready now."""
        reached, seen = set(), set()
        stack = [t.grad_fn for t in tensors_in(output) if t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn in seen:
                continue
            seen.add(fn)
            var = getattr(fn, "variable", None)  # AccumulateGrad nodes hold their leaf
            if var is not None:
                reached.add(id(var))
            stack.extend(nxt for nxt, _ in fn.next_functions if nxt is not None)
        for i, p in enumerate(self._params):
            if id(p) not in reached and not self._ready[i]:
                self._mark_unused(i)


def tensors_in(obj):
    """The tensors in a (nested) tuple / list / dict output."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)


class HookBucket:
    """What DDP's communication hooks read of a bucket (``torch.distributed.GradBucket``'s
    methods): the flat buffer, its index, whether it is the last, its gradients and
    parameters."""

    def __init__(self, bucket: Bucket, count: int):
        self._bucket, self._count = bucket, count

    def buffer(self) -> torch.Tensor:
        return self._bucket.data

    def set_buffer(self, t: torch.Tensor) -> None:
        self._bucket.data.copy_(t)

    def index(self) -> int:
        return self._bucket.index

    def is_last(self) -> bool:
        return self._bucket.index == self._count - 1

    def gradients(self) -> list:
        return list(self._bucket.views)

    def parameters(self) -> list:
        return list(self._bucket.params)


class HookedHandle:
    """A hook's future as a bucket's handle: ``wait()`` puts the reduced gradients it yields
    into the bucket."""

    def __init__(self, future, bucket: Bucket):
        if not isinstance(future, torch._C.Future):  # torch.futures.Future, or a Work's
            raise TypeError(f"DataParallel: a communication hook must return a "
                            f"torch.futures.Future, got {type(future).__name__}")
        self._future, self._bucket = future, bucket

    def wait(self) -> None:
        value = self._future.wait()
        if isinstance(value, (list, tuple)):
            value = value[0]
        data = self._bucket.data
        if value.data_ptr() != data.data_ptr():
            data.copy_(value.reshape(data.shape))
