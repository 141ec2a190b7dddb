"""ZeRO-2/3 gradients: each run reduce-scattered into this rank's shard as backward fills it.

One cycle per optimizer step (``DistributedOptimizer.reduce`` ends it):
  - a post-accumulate-grad hook marks its parameter ready; when every parameter of a run is
    ready, the run may be launched: its gradients are copied into one ``(dp * piece,)`` tensor
    in the master dtype, their ``.grad`` dropped (so no full-size gradient outlives its run),
    and ``comm.reduce_scatter(..., async_op=True)`` runs while backward computes the next runs.
  - ordering: runs are launched strictly in launch order (the reverse of the flat order, the
    order backward fills them); a run ready early waits for its predecessors. Every dp rank
    derives the same runs from the same parameters, so all issue the same collectives in the
    same order, whatever order their autograd engines run in.
  - each run is reduced straight into its slice of the master gradient,
    ``master.grad[soff:soff + piece]`` (allocated at the cycle's first launch), and divided by
    dp there once it is complete. One run is in flight at a time: launching run k first
    completes run k - 1, which had all of run k's backward to finish in; so the reduce-scatter
    keeps one staging tensor alive (``peak_staging``: the largest run's ``dp * piece``, in the
    master dtype), not one per run, and no reduced piece waits for the step beside the master
    gradient it belongs in. Where the dp group's reduce-scatter goes to shm the staging is one
    symmetric buffer of ``dp`` rows of at most ``STAGING_ROW_BYTES`` (1 MiB), made once and
    kept: each run is reduce-scattered through it a chunk of columns at a time, the kernel
    reading every rank's rows where they lie (``symmetric``), straight into the master
    gradient; dp MiB at most instead of a whole run.
  - ``reduce()`` launches what is left (runs whose parameters got no gradient count as zero)
    and completes the last.
  - inside ``no_sync()`` (every microbatch but the last, or around a whole pipeline step) the
    hooks only let autograd accumulate in ``.grad``: one reduce-scatter per run per step.
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
        self.on_launch = []  # callbacks(f, run): ZeRO-3 frees what backward no longer needs
        self._hooks = []
        self.staged = self.peak_staging = 0  # bytes of staging in flight, and the largest
        for f in flat:
            for i, p in enumerate(f.params):
                k = slot[(id(f), f.run_of[i].index)]
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(k)))
        self.reset()

    def reset(self) -> None:
        self.pending = [run.last - run.first for _, run in self.order]
        self.fired: set[int] = set()
        self.next = 0
        self.handles: list = []  # in flight (at most one): (f, run, Handle)
        self.started = False  # a run of this cycle was launched (the master grads exist)
        self.staged = 0  # bytes of the in-flight run's staging tensor

    def _hook(self, k: int):
        def on_grad(p: torch.Tensor) -> None:
            if not self.sync:
                return  # inside no_sync(): autograd accumulates into .grad
            if id(p) in self.fired:
                raise RuntimeError(
                    "DistributedOptimizer: a parameter received a gradient twice in one step "
                    "outside no_sync(); run all but the last backward of a step under "
                    "opt.no_sync()")
            self.fired.add(id(p))
            self.pending[k] -= 1
            if self.pending[k] == 0:
                self._launch_ready()
        return on_grad

    def _launch_ready(self) -> None:
        while self.next < len(self.order) and self.pending[self.next] == 0:
            self._launch(*self.order[self.next])
            self.next += 1

    @torch.no_grad()
    def _launch(self, f, run) -> None:
        """Complete the run in flight; copy ``run``'s gradients into one padded flat tensor,
        drop them, reduce-scatter it into the master gradient (async: the collective overlaps
        the backward of the runs before it)."""
        self._complete()
        if not self.started:  # every run writes its slice: no need to zero
            self.started = True
            for g in self.flat:
                if g.master.grad is None:
                    g.master.grad = torch.empty_like(g.master)
        if self.staging is not None:
            self._reduce_in_chunks(f, run)
        else:
            self._launch_whole(f, run)
        for callback in self.on_launch:
            callback(f, run)

    def _launch_whole(self, f, run) -> None:
        buf = torch.zeros(run.piece * self.dp_size, dtype=master_dtype(f.dtype), device=f.device)
        for i in range(run.first, run.last):
            p = f.params[i]
            if p.grad is not None:
                a = f.offsets[i] - run.lo
                buf[a:a + f.numels[i]].copy_(p.grad.reshape(-1))
                p.grad = None
        self.staged = buf.numel() * buf.element_size()
        self.peak_staging = max(self.peak_staging, self.staged)
        dst = f.master.grad[run.soff:run.soff + run.piece]
        # int8 for float32 (and bf16 models' float32) gradients; float64 stays full precision
        quant = self.quant if buf.dtype in quant_codec.DTYPES else None
        residual = None
        if quant is not None and self.error_feedback and self.dp_size > 1:  # one rank: no error
            residual = self.residuals.get((id(f), run.index))
            if residual is None:
                residual = self.residuals[(id(f), run.index)] = torch.zeros_like(buf)
        self.handles.append((f, run, comm.reduce_scatter(
            buf, group=self.group, async_op=True, out=dst, quant=quant, residual=residual)))

    def _reduce_in_chunks(self, f, run) -> None:
        """The symmetric staging, ``(dp, w)`` at a time: row r holds columns ``[c, c + w)`` of
        rank r's block of the run (its gradients where they lie in it, zeros elsewhere: padding,
        parameters without a gradient), reduce-scattered into the same columns of this rank's
        piece; synchronous (the staging is written again next). Then the piece is averaged."""
        dtype, dp, piece = master_dtype(f.dtype), self.dp_size, run.piece
        grads = []  # (start, end, flat gradient or None) in the run's flat order
        for i in range(run.first, run.last):
            a = f.offsets[i] - run.lo
            g = f.params[i].grad
            grads.append((a, a + f.numels[i], None if g is None else g.reshape(-1)))
        dst = f.master.grad[run.soff:run.soff + piece]
        width = max(1, self.staging.numel() // (dp * _esize(dtype)))
        for c in range(0, piece, width):
            w = min(width, piece - c)
            rows = self.staging[:dp * w * _esize(dtype)].view(dtype).view(dp, w)
            for r in range(dp):
                _fill(rows[r], grads, r * piece + c)
            self.staged = rows.numel() * rows.element_size()
            self.peak_staging = max(self.peak_staging, self.staged)
            comm.reduce_scatter(rows.view(-1), group=self.group, out=dst[c:c + w])
        if dp > 1:
            dst.div_(dp)
        for i in range(run.first, run.last):
            f.params[i].grad = None

    @torch.no_grad()
    def _complete(self) -> None:
        """Wait for the runs in flight and average their pieces over dp, in place."""
        for f, run, handle in self.handles:
            piece = handle.wait()
            if self.dp_size > 1:
                piece.div_(self.dp_size)  # once, after the sum
        self.handles = []
        self.staged = 0

    @torch.no_grad()
    def finish(self) -> None:
        """Launch every run not launched yet and complete them: the masters' gradients hold the
        dp average; a new cycle starts."""
        for k in range(self.next, len(self.order)):
            self._launch(*self.order[k])
        self._complete()
        self.reset()

    def abandon(self) -> None:
        """Complete what is in flight (every rank launched it) without using it; a new cycle."""
        for _, _, handle in self.handles:
            handle.wait()
        self.reset()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
