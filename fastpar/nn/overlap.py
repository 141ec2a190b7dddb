"""Communication overlapped with the GEMMs of the parallel linear layers.

With ``n`` ranks in the TP group, ``k`` pieces (a layer's ``overlap_pieces``), ``W_n`` this
rank's weight shard:

    RowParallelLinear forward   (x_n: (..., in/n))
        for i < k: p_i = x_n[rows i] @ W_n.T; start all_reduce(p_i)     p_i reduces while
        y = [p_0; ...; p_{k-1}]            (after every wait)           p_{i+1} computes
      sequence parallel: the sequence is n segments (rank r keeps segment r); the call's piece i
      is piece i of every segment, and reduce_scatter over the segment axis leaves piece i of
      segment r here
    ColumnParallelLinear forward, sequence parallel (x_r: segment r of the sequence)
        start all_gather(piece i of x_r) for every i; for i: wait, y[piece i of every segment]
        = gathered_i @ W_n.T               (piece i computes while pieces i+1.. are in flight)
    backward
        column: dx_p = sum_j dy_j @ W_j; start all_reduce(dx_p) (reduce_scatter under SP);
                dW_j = dy_j.T @ x; db_j = sum dy_j; wait         (dgrad comm behind the wgrad)
        row, sequence parallel: dy gathered piece by piece as the column forward gathers x;
                dx_n[piece i] = dy_i @ W_n, dW_n += dy_i.T @ x_n[piece i] while later pieces fly

The cut splits rows, never a reduction, so every output element is the same dot product as
without it (the GEMM library may block a shorter matrix differently: float32 rounding only).

Where the collectives run: on CPU, the engine's async handle (gloo runs in its own thread; shm
and mpi complete before returning, so the decomposition runs but nothing overlaps, and the
policy does not choose it there). On CUDA, each collective is issued on a communication stream
that first waits for the compute stream, and the compute stream waits on an event before it
reads the result: no host synchronisation, whatever the engine (NCCL, nccl_mpi, cuda_ipc).

``decide`` is the ``overlap=None`` policy: a plain function of the layout and sizes, tested as a
table; each layer keeps its last ``Decision`` (shown by ``extra_repr``) and logs new ones at
debug level (``logging.getLogger("fastpar.nn")``). The signal-driven row forward on GPUs (GEMM
-> CUDA IPC per finished row block) is in ``overlap_signal.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
import torch.nn.functional as F

from fastpar.comm.collectives import all_gather, all_reduce, reduce_scatter
from fastpar.nn.streams import comm_stream
from fastpar.runtime import group_size

log = logging.getLogger("fastpar.nn")

# overlap=None on CUDA: the smallest collective (bytes per call of the layer, before the cut)
# worth cutting up; below it the collective is latency-bound and k calls cost more than the GEMM
# time they could hide. A starting point until bench/overlap.py measures a GPU per rank.
CUDA_MIN_BYTES = 1 << 20
CUDA_FOUR_PIECES_BYTES = 16 << 20  # from here 4 pieces (the first piece's GEMM is exposed)
SYNC_ENGINES = ("shm", "mpi")  # complete a collective before returning: nothing overlaps
# overlap=None on CPU: off. Measured (bench/overlap.py, 2 ranks on 2 cores, 1024 tokens, hidden
# 1024 / ffn 4096, gloo, 2 and 4 pieces): overlapped / sequential 0.83x-1.14x, most cases at or
# below 1.0x: the ranks' GEMMs and gloo's thread share the same cores, so there is no idle
# resource for the collective to hide in, and the cut's copies cost more than it hides.
CPU_REASON = ("on CPU the GEMMs and the collectives share the cores: measured 0.83x-1.14x on 2 "
              "cores (bench/overlap.py); overlap=True forces it")


@dataclasses.dataclass(frozen=True)
class Decision:
    enabled: bool
    pieces: int
    reason: str
    signal: str = ""  # row layer on CUDA: the signal-driven path taken, or why not

    def __str__(self) -> str:
        said = (f"on, {self.pieces} pieces" if self.enabled else "off") + f" ({self.reason})"
        return f"{said}; {self.signal}" if self.signal else said

    @property
    def chunks(self) -> int:
        """Deprecated name of ``pieces`` (``chunks`` means the pipeline's model chunks)."""
        warnings.warn("Decision.chunks is deprecated: use Decision.pieces", DeprecationWarning,
                      stacklevel=2)
        return self.pieces


def decide(overlap, overlap_pieces, *, tp: int, device: str, engine: str, nbytes: int,
           autocast: bool = False) -> Decision:
    """Whether a layer call overlaps, in how many pieces and why. ``overlap``: the layer's
    setting (True, False, None: this policy); ``overlap_pieces``: the layer's (None: the
    policy's);
    ``engine``: what the comm policy picks for the layer's collective on ``device`` ("cpu",
    "cuda"); ``nbytes``: that collective's size; ``autocast``: whether autocast is on."""
    if tp == 1:
        return Decision(False, 1, "tp 1: no communication")
    if overlap is False:
        return Decision(False, 1, "overlap=False")
    if autocast:
        return Decision(False, 1, "autocast is on: the overlapped Functions do not run under "
                                  "autocast yet" + (" (overlap=True not honoured)" if overlap
                                                    else ""))
    if overlap is True:
        return Decision(True, overlap_pieces or 2, "overlap=True")
    if device == "cpu" and engine in SYNC_ENGINES:
        return Decision(False, 1, f"the {engine} engine completes a collective before it "
                                  "returns: nothing to overlap with")
    if device == "cpu":
        return Decision(False, 1, CPU_REASON)
    if nbytes < CUDA_MIN_BYTES:
        return Decision(False, 1, f"{nbytes} bytes per collective < {CUDA_MIN_BYTES}: "
                                  "latency-bound, pieces would cost more than they hide")
    k = overlap_pieces or (4 if nbytes >= CUDA_FOUR_PIECES_BYTES else 2)
    return Decision(True, k, f"{nbytes} bytes per collective on {engine} ({device})")


def pieces(length: int, count: int) -> list[tuple[int, int]]:
    """``[(start, stop)]`` of ``min(count, length)`` near-equal pieces covering ``length``."""
    k = max(1, min(count, length))
    bounds = [length * i // k for i in range(k + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(k)]


# ------------------------------------------------------------------ collectives in flight

class _Pending:
    """A collective in flight; ``wait()`` returns its result once the compute stream may read
    it (CPU: the engine's handle; CUDA: an event on the communication stream)."""

    __slots__ = ("handle", "event", "result")

    def __init__(self, handle=None, event=None, result=None):
        self.handle, self.event, self.result = handle, event, result

    def wait(self) -> torch.Tensor:
        if self.event is None:
            return self.handle.wait()
        torch.cuda.current_stream(self.result.device).wait_event(self.event)
        return self.result


def _start(collective, t: torch.Tensor, group, **kwargs) -> _Pending:
    if not t.is_cuda:
        return _Pending(handle=collective(t, group, async_op=True, **kwargs))
    compute = torch.cuda.current_stream(t.device)
    stream = comm_stream(t.device)
    stream.wait_stream(compute)  # t is written by the compute stream
    with torch.cuda.stream(stream):
        result = collective(t, group, **kwargs)
        event = torch.cuda.Event()
        event.record(stream)
    t.record_stream(stream)  # t's memory is not reused before the collective is done with it
    result.record_stream(compute)  # allocated on the comm stream, read on the compute stream
    return _Pending(event=event, result=result)


def _seg_view(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``t`` with its ``dim`` (the sequence, n segments) split into ``(n, S/n)``: a view."""
    shape = list(t.shape)
    if shape[dim] % n:
        raise ValueError(f"sequence dim {dim} of size {shape[dim]} is not divisible by the "
                         f"tensor-parallel size {n}")
    return t.view(*shape[:dim], n, shape[dim] // n, *shape[dim + 1:])


def _gather_pieces(x: torch.Tensor, group, dim: int, count: int):
    """Start all-gathers of ``x``'s pieces along ``dim`` (this rank's segment): ``[(start,
    stop, pending)]``, each result ``(..., n * (stop - start), ...)`` in rank order."""
    return [(a, b, _start(all_gather, x.narrow(dim, a, b - a).contiguous(), group, dim=dim))
            for a, b in pieces(x.shape[dim], count)]


# ------------------------------------------------------------------ row-parallel

class RowParallelOverlap(torch.autograd.Function):
    """``y = comm(x_n @ W_n.T)`` in pieces (see the module docstring); the bias is the caller's.
    ``sp``: reduce-scatter along ``dim`` instead of all-reduce. ``signal``: the group's
    CudaIpcCommunicator when ``overlap_signal.signal_path`` chose the signal-driven forward,
    else None."""

    @staticmethod
    def forward(ctx, x, weight, group, sp, dim, n_pieces, signal=None):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sp, ctx.dim, ctx.n_pieces = group, sp, dim, n_pieces
        if signal is not None:
            from fastpar.nn.overlap_signal import signal_row_forward

            y2 = signal_row_forward(x.reshape(-1, x.shape[-1]), weight, signal)
            return y2.view(*x.shape[:-1], weight.shape[0])
        if sp:
            n = group_size(group)
            xv = _seg_view(x, dim, n)  # (..., n, S/n, ..., in/n)
            started = []
            for a, b in pieces(xv.shape[dim + 1], n_pieces):
                partial = F.linear(xv.narrow(dim + 1, a, b - a), weight)  # (.., n, s, .., out)
                # reduce-scatter over the segment axis: this rank keeps piece (a, b) of its own
                # segment; it runs while the next piece's GEMM computes
                started.append(_start(reduce_scatter, partial, group, dim=dim))
            return torch.cat([p.wait().squeeze(dim) for p in started], dim=dim)
        x2 = x.reshape(-1, x.shape[-1])  # (rows, in/n)
        y2 = torch.empty(x2.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
        started = []
        for a, b in pieces(x2.shape[0], n_pieces):
            torch.mm(x2[a:b], weight.t(), out=y2[a:b])
            started.append(_start(all_reduce, y2[a:b], group))  # reduces while a:b+ computes
        for p in started:
            p.wait()
        return y2.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if not ctx.sp:  # dx_n = dy @ W_n, dW_n = dy.T @ x_n: no communication
            dy2 = dy.reshape(-1, dy.shape[-1])
            dw = dy2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
            dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
            return dx, dw, None, None, None, None, None
        n, dim = group_size(ctx.group), ctx.dim
        xv = _seg_view(x, dim, n)  # (.., n, S/n, .., in/n)
        dx = torch.empty_like(x)
        dxv = _seg_view(dx, dim, n)
        dw = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        # every piece of dy's all-gather is in flight while the earlier pieces' GEMMs compute
        for a, b, p in _gather_pieces(dy.contiguous(), ctx.group, dim, ctx.n_pieces):
            g = _seg_view(p.wait(), dim, n)  # (.., n, s, .., out): piece (a, b) of each segment
            dxv.narrow(dim + 1, a, b - a).copy_(g.matmul(weight))
            if dw is not None:
                xp = xv.narrow(dim + 1, a, b - a)
                dw.add_(g.reshape(-1, g.shape[-1]).t().mm(xp.reshape(-1, xp.shape[-1])))
        return dx, dw, None, None, None, None, None


# ------------------------------------------------------------------ column-parallel

class ColumnParallelOverlap(torch.autograd.Function):
    """``y_j = x @ W_j.T + b_j`` for several column layers sharing one input (q, k, v; gate, up)
    with the region's entry communication overlapped: ``sp`` all-gathers x piece by piece under
    the GEMMs; backward all-reduces (reduce-scatters) dx behind the weight gradients.
    ``params``: the weights, then the biases (None where a layer has none)."""

    @staticmethod
    def forward(ctx, x, group, sp, dim, n_pieces, count, *params):
        weights, biases = params[:count], params[count:]
        ctx.group, ctx.sp, ctx.dim, ctx.count = group, sp, dim, count
        ctx.has_bias = [b is not None for b in biases]
        if not sp:  # copy_to_tp: nothing to send forward
            ctx.save_for_backward(x, *weights)
            return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
        n = group_size(group)
        shape = list(x.shape)
        shape[dim] *= n
        full = torch.empty(shape, dtype=x.dtype, device=x.device)  # the gathered input
        fullv = _seg_view(full, dim, n)
        outs = [torch.empty(*shape[:-1], w.shape[0], dtype=x.dtype, device=x.device)
                for w in weights]
        outv = [_seg_view(o, dim, n) for o in outs]
        # all pieces' all-gathers in flight; piece i's GEMMs compute while i+1.. still travel
        for a, b, p in _gather_pieces(x.contiguous(), group, dim, n_pieces):
            g = _seg_view(p.wait(), dim, n)  # (.., n, s, .., in): piece (a, b) of each segment
            fullv.narrow(dim + 1, a, b - a).copy_(g)
            for o, w, bias in zip(outv, weights, biases):
                o.narrow(dim + 1, a, b - a).copy_(F.linear(g, w, bias))
        ctx.save_for_backward(full, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *dys):
        x, *weights = ctx.saved_tensors  # x: the full (gathered) input
        dx_partial = None
        for dy, w in zip(dys, weights):
            part = dy.matmul(w)
            dx_partial = part if dx_partial is None else dx_partial.add_(part)
        # dx's collective runs while the weight gradients compute (Megatron's dgrad/wgrad overlap)
        if ctx.sp:
            pending = _start(reduce_scatter, dx_partial.contiguous(), ctx.group, dim=ctx.dim)
        else:
            pending = _start(all_reduce, dx_partial.contiguous(), ctx.group)
        x2 = x.reshape(-1, x.shape[-1])
        dws, dbs = [], []
        for j, dy in enumerate(dys):
            dy2 = dy.reshape(-1, dy.shape[-1])
            dws.append(dy2.t().mm(x2) if ctx.needs_input_grad[6 + j] else None)
            want_b = ctx.has_bias[j] and ctx.needs_input_grad[6 + ctx.count + j]
            dbs.append(dy2.sum(0) if want_b else None)
        dx = pending.wait()
        return (dx, None, None, None, None, None, *dws, *dbs)
