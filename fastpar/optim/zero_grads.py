"""ZeRO-2/3 gradients: each run reduce-scattered into this rank's shard as backward fills it.

A cycle per backward (outside ``no_sync()``); the cycles of one step add up in the master
gradients until ``DistributedOptimizer.reduce`` completes them (FSDP's reduction per
microbatch: gradient accumulation keeps only shards):
  - a post-accumulate-grad hook marks its parameter ready; when every parameter of a run is
    ready, the run may be launched: its gradients are copied into one ``(dp * piece,)`` tensor
    in the master dtype, their ``.grad`` dropped (so no full-size gradient outlives its run),
    and ``comm.reduce_scatter(..., async_op=True)`` runs while backward computes the next runs.
  - ordering: runs are launched strictly in launch order (the reverse of the flat order, the
    order backward fills them); a run ready early waits for its predecessors. Every dp rank
    derives the same runs from the same parameters, so all issue the same collectives in the
    same order, whatever order their autograd engines run in.
  - the cycle's first hook queues its end with autograd's engine (``queue_callback``: it runs
    when that backward finishes): the runs this backward touched but did not complete (a
    parameter without a gradient counts as zeros) are launched then, in order; runs it did not
    touch wait for a later backward (an interleaved pipeline's other chunk) or for ``finish``.
  - each run's first reduction of the step goes straight into its slice of the master
    gradient, ``master.grad[soff:soff + piece]`` (allocated at the step's first cycle), later
    ones into a temporary that is added there; each piece is divided by dp once complete. One
    run is in flight at a time: launching run k first completes run k - 1, which had all of run
    k's backward to finish in; so the reduce-scatter keeps one staging tensor alive
    (``peak_staging``: the largest run's ``dp * piece``, in the master dtype, plus its piece
    when it accumulates), not one per run, and no reduced piece waits for the step beside the
    master gradient it belongs in. Where the dp group's reduce-scatter goes to shm the staging
    is one symmetric buffer of ``dp`` rows of at most ``STAGING_ROW_BYTES`` (1 MiB), made once
    and kept: each run is reduce-scattered through it a chunk of columns at a time, the kernel
    reading every rank's rows where they lie (``symmetric``), straight into the master
    gradient (or, accumulating, into one more row, ``acc``); dp + 1 MiB at most instead of a
    whole run.
  - ``finish()`` (the step's reduction) ends the cycle in progress, launches the runs no cycle
    of the step reduced (zeros where no gradient came) and completes the last.
  - inside ``no_sync()`` (every microbatch but the last, or around a whole pipeline step) the
    hooks only let autograd accumulate in ``.grad``: one reduce-scatter per run per step.
  - ``peak_grads``: the most gradient bytes alive at once in the step, the master gradients
    and the ``.grad`` not yet launched, taken at every hook (where ``.grad`` grow).
"""

from __future__ import annotations

import torch

from fastpar import comm
from fastpar.comm import quant as quant_codec
from fastpar.comm import symmetric as symmetric_memory
from fastpar.optim.zero_shards import master_dtype


# Bytes of one rank's row of the symmetric staging: a run is reduce-scattered (dp, w) columns
# at a time through one symmetric buffer of dp rows, so the staging is dp x 1 MiB at most,
# whatever the runs (the ordinary staging is one whole run). Large enough that each call takes
# the in-place kernel (from SYMMETRIC_SCATTER_MIN, 256 KiB of input) and the calls' signals are
# a small part of their time.
STAGING_ROW_BYTES = 1 << 20


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def staging_bytes(flat, dp_size: int, symmetric: bool) -> int:
    """The reduce-scatter staging's bytes at its largest (what ``peak_staging`` reaches): the
    largest run's ``dp * piece`` in its master dtype, or with the symmetric staging ``dp`` rows
    of at most ``STAGING_ROW_BYTES`` (each a whole number of elements)."""
    sizes = []
    for f in flat:
        es = _esize(master_dtype(f.dtype))
        for run in f.runs:
            row = run.piece * es if not symmetric else \
                min(run.piece, max(1, STAGING_ROW_BYTES // es)) * es
            sizes.append(dp_size * row)
    return max(sizes)


def _fill(row: torch.Tensor, grads, x0: int) -> None:
    """``row`` = the run's flat gradient ``[x0, x0 + len(row))``: each gradient's part that
    falls there, zeros between and after (padding, parameters without a gradient)."""
    x1, pos = x0 + row.numel(), x0
    for a, b, g in grads:
        lo, hi = max(a, x0), min(b, x1)
        if lo >= hi or g is None:  # (no gradient: zeroed with the gap after it)
            continue
        if lo > pos:
            row[pos - x0:lo - x0].zero_()
        row[lo - x0:hi - x0].copy_(g[lo - a:hi - a])
        pos = hi
    if pos < x1:
        row[pos - x0:].zero_()


class GradReducer:
    """The reduce-scatter cycle of a ``DistributedOptimizer``'s flat groups over ``group``."""

    def __init__(self, flat, group, dp_size: int, quant=None, error_feedback: bool = False,
                 symmetric: bool = False):
        self.flat, self.group, self.dp_size = flat, group, dp_size
        self.quant, self.error_feedback = quant, error_feedback
        # symmetric: one staging buffer of dp rows (``staging_bytes``) in symmetric memory, so
        # the reduce-scatter reads every rank's where it lies; every run goes through it a
        # chunk at a time. Collective: every rank derives the same runs.
        self.staging = None
        if symmetric:
            self.staging = comm.symmetric_empty(staging_bytes(flat, dp_size, True),
                                                dtype=torch.uint8, group=group)
            # the rows each chunk takes (prefixes: all but each run's last chunk are full)
            rows = set()
            for f in flat:
                es = _esize(master_dtype(f.dtype))
                width = max(1, self.staging.numel() // (dp_size * es))
                for run in f.runs:
                    last = run.piece - (-(-run.piece // width) - 1) * width
                    rows |= {dp_size * min(width, run.piece) * es, dp_size * last * es}
            symmetric_memory.register_parts(self.staging, [(0, n) for n in sorted(rows)])
        self.symmetric = symmetric
        self.residuals = {}  # (id(f), run.index) -> float32 (dp * piece): error feedback
        # launch order: the last run of the last group first
        self.order = [(f, run) for f in flat for run in f.runs][::-1]
        slot = {(id(f), run.index): k for k, (f, run) in enumerate(self.order)}
        self.sync = True
        self._hooks = []
        self.staged = self.peak_staging = 0  # bytes of staging in flight, and the largest
        self.acc = None  # the symmetric path's accumulation row (made at its first use)
        self.live = self.peak_grads = 0  # gradient bytes alive now / at most (see the top)
        for f in flat:
            for i, p in enumerate(f.params):
                k = slot[(id(f), f.run_of[i].index)]
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(k)))
        self.handles: list = []  # in flight (at most one): (run's slice, accumulate, Handle)
        self.master_nbytes = sum(f.shard * _esize(master_dtype(f.dtype)) for f in flat)
        self._new_step()

    def _new_step(self) -> None:
        """Nothing reduced yet: the next backward (or ``finish``) starts a step."""
        self.written: set[int] = set()  # slots reduced into the master gradients this step
        self.started = False  # the master gradients exist (the step's first cycle began)
        self.live = 0
        self.reset()

    def reset(self) -> None:
        """A new cycle (the one before, if any, launched what it touched)."""
        self.pending = [run.last - run.first for _, run in self.order]
        self.touched = [False] * len(self.order)
        self.fired: set[int] = set()
        self.next = 0
        self.in_cycle = False

    def _grad_bytes(self) -> int:
        """Gradient bytes alive now: the master gradients (once the step began) and the .grad
        that hooks saw and no launch has dropped yet."""
        return (self.master_nbytes if self.started else 0) + self.live

    def _hook(self, k: int):
        def on_grad(p: torch.Tensor) -> None:
            if not self.sync:
                return  # inside no_sync(): autograd accumulates into .grad
            if id(p) in self.fired:
                raise RuntimeError(
                    "DistributedOptimizer: a parameter received a gradient twice in one "
                    "backward; each backward may give a parameter one gradient")
            if not self.in_cycle:
                self._begin_cycle()
            self.fired.add(id(p))
            self.live += p.numel() * p.element_size()
            self.peak_grads = max(self.peak_grads, self._grad_bytes())
            self.touched[k] = True
            self.pending[k] -= 1
            if self.pending[k] == 0:
                self._launch_ready()
        return on_grad

    def _start_step(self) -> None:
        """The master gradients, at the step's first cycle (or its ``finish``): every run
        writes its slice before the step reads it."""
        if not self.started:
            self.started = True
            for g in self.flat:
                if g.master.grad is None:
                    g.master.grad = torch.empty_like(g.master)

    def _begin_cycle(self) -> None:
        self.in_cycle = True
        self._start_step()
        # the end of this backward (autograd's engine calls it when the graph task is done)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_cycle)

    def _end_cycle(self) -> None:
        """This backward is done: launch, in order, the runs it touched but did not complete
        (their missing gradients count as zeros); a new cycle."""
        for k in range(self.next, len(self.order)):
            if self.touched[k]:
                self._launch(k)
        self.reset()

    def _launch_ready(self) -> None:
        while self.next < len(self.order) and self.pending[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    @torch.no_grad()
    def _launch(self, k: int) -> None:
        """Complete the run in flight; reduce-scatter run ``k``'s gradients (dropping them)
        into its master gradient slice, or into a temporary added there when this step has
        reduced into the slice before."""
        self._complete()
        f, run = self.order[k]
        for i in range(run.first, run.last):
            if id(f.params[i]) in self.fired:
                self.live -= f.params[i].numel() * f.params[i].element_size()
        dst = f.master.grad[run.soff:run.soff + run.piece]
        accumulate = k in self.written
        self.written.add(k)
        if self.staging is not None:
            self._reduce_in_chunks(f, run, dst, accumulate)
        else:
            self._launch_whole(f, run, dst, accumulate)

    def _launch_whole(self, f, run, dst, accumulate: bool) -> None:
        buf = torch.zeros(run.piece * self.dp_size, dtype=master_dtype(f.dtype), device=f.device)
        for i in range(run.first, run.last):
            p = f.params[i]
            if p.grad is not None:
                a = f.offsets[i] - run.lo
                buf[a:a + f.numels[i]].copy_(p.grad.reshape(-1))
                p.grad = None
        # the staging, and the piece a reduction that accumulates returns beside it
        self.staged = (run.piece * self.dp_size + run.piece * accumulate) * buf.element_size()
        self.peak_staging = max(self.peak_staging, self.staged)
        # int8 for float32 (and bf16 models' float32) gradients; float64 stays full precision
        quant = self.quant if buf.dtype in quant_codec.DTYPES else None
        residual = None
        if quant is not None and self.error_feedback and self.dp_size > 1:  # one rank: no error
            residual = self.residuals.get((id(f), run.index))
            if residual is None:
                residual = self.residuals[(id(f), run.index)] = torch.zeros_like(buf)
        handle = comm.reduce_scatter(buf, group=self.group, async_op=True,
                                     out=None if accumulate else dst, quant=quant,
                                     residual=residual)
        self.handles.append((dst, accumulate, handle))

    def _reduce_in_chunks(self, f, run, dst, accumulate: bool) -> None:
        """The symmetric staging, ``(dp, w)`` at a time: row r holds columns ``[c, c + w)`` of
        rank r's block of the run (its gradients where they lie in it, zeros elsewhere: padding,
        parameters without a gradient), reduce-scattered into the same columns of this rank's
        piece (accumulating: into ``acc``, then added); synchronous (the staging is written
        again next). Then the piece is averaged."""
        dtype, dp, piece = master_dtype(f.dtype), self.dp_size, run.piece
        grads = []  # (start, end, flat gradient or None) in the run's flat order
        for i in range(run.first, run.last):
            a = f.offsets[i] - run.lo
            g = f.params[i].grad
            grads.append((a, a + f.numels[i], None if g is None else g.reshape(-1)))
        width = max(1, self.staging.numel() // (dp * _esize(dtype)))
        acc = None
        if accumulate:
            if self.acc is None or self.acc.numel() < min(width, piece) or \
                    self.acc.dtype != dtype:
                self.acc = torch.empty(min(width, piece), dtype=dtype, device=f.device)
            acc = self.acc
        for c in range(0, piece, width):
            w = min(width, piece - c)
            rows = self.staging[:dp * w * _esize(dtype)].view(dtype).view(dp, w)
            for r in range(dp):
                _fill(rows[r], grads, r * piece + c)
            self.staged = rows.numel() * rows.element_size() + \
                (0 if acc is None else acc.numel() * acc.element_size())
            self.peak_staging = max(self.peak_staging, self.staged)
            if acc is None:
                comm.reduce_scatter(rows.view(-1), group=self.group, out=dst[c:c + w])
                if dp > 1:
                    dst[c:c + w].div_(dp)
            else:
                comm.reduce_scatter(rows.view(-1), group=self.group, out=acc[:w])
                dst[c:c + w].add_(acc[:w].div_(dp) if dp > 1 else acc[:w])
        for i in range(run.first, run.last):
            f.params[i].grad = None

    @torch.no_grad()
    def _complete(self) -> None:
        """Wait for the runs in flight and average their pieces over dp into the master
        gradient (in place, or added where the reduction accumulates)."""
        for dst, accumulate, handle in self.handles:
            piece = handle.wait()
            if self.dp_size > 1:
                piece.div_(self.dp_size)  # once, after the sum
            if accumulate:
                dst.add_(piece)
        self.handles = []
        self.staged = 0

    @torch.no_grad()
    def finish(self) -> None:
        """The step's reduction: end the cycle in progress (launching every run it has not,
        touched or not: a ``no_sync`` accumulation's gradients, or zeros), launch the runs no
        cycle reduced this step, complete them: the masters' gradients hold the dp average of
        the step's backwards. The next backward starts a new step."""
        self._start_step()
        for k in range(len(self.order)):  # in launch order, as every rank
            if k not in self.written or self._has_grads(k):
                self._launch(k)
        self._complete()
        self._new_step()

    def _has_grads(self, k: int) -> bool:
        """Run ``k`` holds gradients no cycle reduced (a ``no_sync`` backward's)."""
        f, run = self.order[k]
        return any(f.params[i].grad is not None for i in range(run.first, run.last))

    def begin_peaks(self) -> None:
        """Peaks from now (the trainer's memory meter: one step at a time)."""
        self.peak_staging = self.staged
        self.peak_grads = self._grad_bytes()

    def abandon(self) -> None:
        """Complete what is in flight (every rank launched it) without using it; a new step."""
        for _, _, handle in self.handles:
            handle.wait()
        self.handles = []
        self.staged = 0
        self._new_step()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
