"""Quantized collectives (``quant="int8"``) on the engines that move bytes: torch's backends
(gloo, NCCL) and MPI; the hierarchical engine uses these for its cross-host stage. The shm
engine has them natively (``ShmCommunicator.quantized_*``, csrc/shm/shm_quantized.cpp): its
kernels quantize while copying into their slots and dequantize while copying out, with none of
the passes below. The codec is ``fastpar.comm.quant``'s; every engine computes the same bytes.
CPU tensors are packed, unpacked and summed here by its torch ops, CUDA tensors by the Triton
kernels of ``fastpar.kernels.quant`` (the same bytes, a pass each).

With n ranks, B the block (``Quant.block``), sizes in elements:

    all_gather(x)        each rank packs its x (m elements) once; the packed pieces are
                         all-gathered (n x packed_bytes(m)); every rank dequantizes all n,
                         its own too, so all ranks hold bitwise the same result
    reduce_scatter(x)    x is n chunks of m; each rank packs each chunk (blocks restart at a
                         chunk); an all-to-all sends chunk j to rank j; rank j dequantizes the n
                         pieces it got and sums them in float32 in group-rank order, starting
                         from rank 0's, then rounds once to x's dtype
    all_reduce(t)        reduce_scatter of t cut in n chunks of ceil(N / n) (zeros after the
                         end), each rank's summed chunk quantized again and all-gathered as
                         above: two quantizations, both in float32; all ranks bitwise equal

What crosses per rank: all_gather (n - 1) packed pieces in, reduce_scatter (n - 1) out and in,
all_reduce both: a quarter of float32's bytes, half of bf16's (plus 4 / B for the scales).

Error feedback (``residual``, float32, the input's shape, updated in place): the call quantizes
``x + residual`` and leaves in ``residual`` what the receivers will not see of it, so the next
call sends it (``quant.carried``: zeros in a non-finite block, which is sent as NaN).
all_reduce also adds, on the rank that summed a chunk, the rounding of that sum's second
quantization (counted once over the ranks). Without it a gradient component below a block's
resolution is lost every step; with it, it arrives a few steps late.

Bounds (``tests/test_quantized.py`` checks them per element against float64): all_gather
|y - x| <= b(x), b the codec's (scale / 2 + 4 u amax per block); reduce_scatter sum over ranks of
b(x_r) plus float32 summation (n u sum |y_r|); all_reduce that plus b of the summed chunk;
a bfloat16 output adds its own rounding (2^-8 |y|).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch
import torch.distributed as dist

from fastpar import _native as _native_ext
from fastpar.comm import quant as q

log = logging.getLogger("fastpar.comm")


def me_of(route) -> int:
    """This rank's index in the route's group (its ranks are global ranks)."""
    return route.ranks.index(dist.get_rank())


# ---- byte moves per engine --------------------------------------------------------------------

def _all_gather_bytes(route, send: torch.Tensor, recv: torch.Tensor, async_op: bool):
    """recv (n * len(send), uint8) = every rank's send, in group order, on the route's byte
    mover (``Adapter.byte_mover``: shm's byte kernels carry any dtype; an engine without byte
    collectives hands them to torch's backend of the group)."""
    return route.adapter.byte_mover().all_gather(route, send, recv, async_op)


def _all_to_all_bytes(route, send: torch.Tensor, recv: torch.Tensor, async_op: bool):
    """Equal splits: block j of send (n blocks) goes to rank j; block r of recv comes from
    rank r, on the route's byte mover as ``_all_gather_bytes``."""
    counts = [send.numel() // len(route.ranks)] * len(route.ranks)
    mover = route.adapter.byte_mover()
    return mover.all_to_all(route, send, counts, counts, recv, async_op)[2]


class Pending:
    """A torch work in flight and what turns its bytes into the result."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self):
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._finish is not None:
            self._finish()
            self._finish = None

    def is_completed(self) -> bool:
        """True once the result is filled: when the bytes have arrived, the decode runs here."""
        if self._work is not None and not self._work.is_completed():
            return False
        self.wait()  # the bytes are here: only the decode runs (once)
        return True


def _done_or_pending(work, finish):
    if work is None:
        finish()
        return None
    return Pending(work, finish)


# ---- the codec on the data's device ----------------------------------------------------------
# CPU tensors: the shm kernels' codec loops (csrc/quant_ops.cpp: one pass each, bitwise the torch
# ops of comm.quant, which are the definition and the fallback without the extension). CUDA
# tensors: fastpar.kernels' Triton kernels, the same bytes in one pass each
# (tests/test_quant_kernels.py).

@functools.cache
def _triton_codec():
    """fastpar.kernels, or None (logged once) when Triton is not installed: CUDA tensors then
    take the torch ops, the same bytes in more passes."""
    if importlib.util.find_spec("triton") is None:
        log.debug("quantized collectives: Triton is not installed, so CUDA tensors are "
                  "quantized by torch ops")
        return None
    from fastpar import kernels
    return kernels


def _kernels_for(t: torch.Tensor):
    return _triton_codec() if t.device.type == "cuda" else None


def _native_codec(t: torch.Tensor):
    """torch.ops.fastpar for a CPU tensor when the extension is built (else None: torch ops)."""
    if t.device.type != "cpu" or not _native_ext.available():
        return None
    return torch.ops.fastpar


def _pack_rows(x: torch.Tensor, B: int, out: torch.Tensor, residual=None,
               feedback: str = "replace") -> None:
    """Each row of x (rows, m) packed into out (rows, packed bytes). ``residual`` (float32, at
    most x.numel() elements: the flat rows cut to its length), ``feedback``:
    "replace": the rows quantized are x + residual, then residual = that - what the receivers
    decode (a row the residual ends inside: its first elements only, the rest zeros, as
    all_reduce pads); "add": residual += x - what the receivers decode."""
    native = _native_codec(x)
    if native is not None:
        native.quant_pack_rows(x.contiguous(), B, out, None if residual is None
                               else residual.view(-1), feedback)
        return
    kernels = _kernels_for(x)
    if residual is None:
        (kernels.pack_rows if kernels is not None else q.pack_rows)(x, B, out)
        return
    k = residual.numel()
    if feedback == "replace":
        x = x.to(torch.float32, copy=True)
        x.view(-1)[:k] += residual.view(-1)
        if kernels is not None:  # residual = x - what the receivers decode, in one pass
            kernels.pack_rows(x, B, out, residual=residual)
            return
    (kernels.pack_rows if kernels is not None else q.pack_rows)(x, B, out)
    y = _unpack_rows(out, x.shape[1], B)
    error = q.carried(x, y).view(-1)[:k]  # 0 in a non-finite block
    if feedback == "add":  # (a non-finite block drops what it carried before, too)
        residual.view(-1).add_(error).masked_fill_(y.view(-1)[:k].isnan(), 0.0)
    else:
        residual.view(-1).copy_(error)


def _unpack_rows(buf: torch.Tensor, m: int, B: int, out=None) -> torch.Tensor:
    """float32 (rows, m) of buf's packed rows, or those values in ``out`` (rows, m; float32 or
    bfloat16, rounded once)."""
    native = _native_codec(buf)
    if native is not None:
        if out is None:
            out = torch.empty(buf.shape[0], m, dtype=torch.float32)
        native.quant_unpack_rows(buf, m, B, out)
        return out
    kernels = _kernels_for(buf)
    if kernels is not None:
        return kernels.unpack_rows(buf, m, B, out)
    y = q.unpack_rows(buf, m, B)
    return y if out is None else q.narrow(y, out)


def _sum_packed_rows(buf: torch.Tensor, m: int, B: int, out: torch.Tensor) -> torch.Tensor:
    """out (m,) = the sum of the packed rows' values (as ``_sum_rows``), rounded once to out's
    dtype."""
    native = _native_codec(buf)
    if native is not None:
        native.quant_sum_packed_rows(buf, m, B, out)
        return out
    kernels = _kernels_for(buf)
    if kernels is not None:
        return kernels.sum_packed_rows(buf, m, B, out)
    return q.narrow(_sum_rows(q.unpack_rows(buf, m, B)), out)


def fold_residual(t: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = t + residual`` added in float32 and rounded once to out's dtype (``out`` may be
    ``t``); ``residual`` (float32, t's shape) keeps what that rounding lost, so a bfloat16
    tensor still carries the part of the error it cannot hold (0 where the sum is not finite,
    as the codec drops a non-finite block's). Where a call sends the carried error in full
    precision (the policy skipped int8) or adds it before a full-precision stage (hier)."""
    s = t.float() + residual  # a new tensor: float32 t + residual, one rounding
    out.copy_(s)
    torch.sub(s, out.float(), out=residual)  # 0 for float32 (exact), bf16's rounding else
    residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
    return out


# ---- the collectives -------------------------------------------------------------------------

def all_gather(route, x: torch.Tensor, out: torch.Tensor, spec: q.Quant, async_op: bool):
    """out (n * m elements, x's dtype, contiguous) = every rank's x, dequantized. Returns the
    work still in flight (call ``wait()``), or None when done."""
    if route.adapter.native_quant(route, spec):
        route.comm.quantized_all_gather(x.reshape(-1), out.view(-1), spec)
        return None
    n, m, B = len(route.ranks), x.numel(), spec.block
    per = q.packed_bytes(m, B)
    send = torch.empty(1, per, dtype=torch.uint8, device=x.device)
    _pack_rows(x.reshape(1, m), B, send)
    recv = torch.empty(n * per, dtype=torch.uint8, device=x.device)
    work = _all_gather_bytes(route, send.view(-1), recv, async_op)

    def finish():
        _unpack_rows(recv.view(n, per), m, B, out.view(n, m))
    return _done_or_pending(work, finish)


def reduce_scatter(route, x: torch.Tensor, out: torch.Tensor, spec: q.Quant, residual,
                   async_op: bool):
    """out (m = numel / n elements, x's dtype) = this rank's chunk of the sum over ranks,
    dequantized and summed in float32. ``residual``: error feedback (see the module)."""
    if route.adapter.native_quant(route, spec):
        route.comm.quantized_reduce_scatter(
            x.reshape(-1), out.view(-1), spec,
            None if residual is None else residual.view(-1))
        return None
    n, B = len(route.ranks), spec.block
    m = x.numel() // n
    per = q.packed_bytes(m, B)
    send = torch.empty(n, per, dtype=torch.uint8, device=x.device)
    _pack_rows(x.reshape(n, m), B, send, residual)
    recv = torch.empty(n * per, dtype=torch.uint8, device=x.device)
    work = _all_to_all_bytes(route, send.view(-1), recv, async_op)

    def finish():
        _sum_packed_rows(recv.view(n, per), m, B, out.view(m))
    return _done_or_pending(work, finish)


def _sum_rows(rows: torch.Tensor) -> torch.Tensor:
    """Sum over rows in float32, in row order from row 0's value (the order every engine
    uses: a float32 sum depends on it)."""
    acc = rows[0].clone()
    for r in range(1, rows.shape[0]):
        acc += rows[r]
    return acc


def all_reduce(route, t: torch.Tensor, spec: q.Quant, residual) -> None:
    """t (in place) = the sum over ranks, through two quantizations (see the module)."""
    if route.adapter.native_quant(route, spec):
        route.comm.quantized_all_reduce(t.view(-1), spec,
                                        None if residual is None else residual.view(-1))
        return
    n, B = len(route.ranks), spec.block
    N = t.numel()
    m = -(-N // n)
    src = torch.zeros(n * m, dtype=torch.float32, device=t.device)
    src[:N].copy_(t.reshape(-1))
    per = q.packed_bytes(m, B)
    send = torch.empty(n, per, dtype=torch.uint8, device=t.device)
    _pack_rows(src.view(n, m), B, send, residual)
    recv = torch.empty(n * per, dtype=torch.uint8, device=t.device)
    _all_to_all_bytes(route, send.view(-1), recv, False)
    mine = _sum_packed_rows(recv.view(n, per), m, B,
                            torch.empty(m, dtype=torch.float32, device=t.device))
    piece = torch.empty(1, per, dtype=torch.uint8, device=t.device)
    me = me_of(route)
    lo, hi = min(me * m, N), min((me + 1) * m, N)
    # the owner carries its sum's rounding (once over the ranks) on top of its first one
    _pack_rows(mine.view(1, m), B, piece, None if residual is None or hi == lo
               else residual.view(-1)[lo:hi], "add")
    gathered = torch.empty(n * per, dtype=torch.uint8, device=t.device)
    _all_gather_bytes(route, piece.view(-1), gathered, False)
    # decoded straight into t's dtype (one rounding, the codec's NaN), t itself when it holds
    # all n chunks
    full = t.view(-1) if N == n * m else torch.empty(n * m, dtype=t.dtype, device=t.device)
    _unpack_rows(gathered.view(n, per), m, B, full.view(n, m))
    if full.data_ptr() != t.data_ptr():
        t.view(-1).copy_(full[:N])
