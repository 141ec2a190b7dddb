"""The flat engines' adapters: torch.distributed (gloo, NCCL) and MPI through mpi4py.

The methods every adapter has (``engines.py``), for the engines that need nothing of
fastpar's own: the hierarchical engine runs its cross-host stage on these too, and the
quantized collectives their all-to-all.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fastpar.comm.views import byte_view, numpy_view as _np

# torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
             "prod": dist.ReduceOp.PRODUCT}


class Torch:
    """gloo and NCCL through torch.distributed: the only engines that run in the background."""

    @staticmethod
    def all_reduce(route, t, op, async_op):
        return dist.all_reduce(t, op=TORCH_OPS[op], group=route.group, async_op=async_op)

    @staticmethod
    def all_gather(route, inp, stacked, async_op):
        return _all_gather_tensor(stacked, inp, group=route.group, async_op=async_op)

    @staticmethod
    def all_gather_into(route, block, out, async_op):
        return _all_gather_tensor(out, block, group=route.group, async_op=async_op)

    @staticmethod
    def reduce_scatter(route, inp, out, op, async_op):
        return _reduce_scatter_tensor(out, inp, op=TORCH_OPS[op], group=route.group,
                                      async_op=async_op)

    @staticmethod
    def broadcast(route, t, src, async_op):
        return dist.broadcast(t, src=src, group=route.group, async_op=async_op)

    @staticmethod
    def all_to_all(route, inp, send, recv, out, async_op):
        if recv is None:  # the counts first: a small all-to-all of its own, waited for
            mine = torch.tensor(send, dtype=torch.int64, device=inp.device)
            theirs = torch.empty_like(mine)
            dist.all_to_all_single(theirs, mine, group=route.group)
            recv = theirs.tolist()
        if out is None:
            out = inp.new_empty((sum(recv), *inp.shape[1:]))
        # As bytes: gloo does not carry every dtype (bool, bfloat16), and bytes are bytes.
        row = _rowbyte_view(inp)
        work = dist.all_to_all_single(byte_view(out), byte_view(inp), [r * row for r in recv],
                                      [s * row for s in send], group=route.group,
                                      async_op=async_op)
        return out, recv, work


def _rowbyte_view(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


class Mpi:
    """The MPI library's own collectives through mpi4py (numpy views of CPU tensors)."""

    @staticmethod
    def _op(op: str):
        from mpi4py import MPI

        return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]

    @staticmethod
    def all_reduce(route, t, op, async_op):
        from mpi4py import MPI

        route.comm.Allreduce(MPI.IN_PLACE, _np(t), op=Mpi._op(op))

    @staticmethod
    def all_gather(route, inp, stacked, async_op):
        route.comm.Allgather(_np(inp), _np(stacked))

    @staticmethod
    def all_gather_into(route, block, out, async_op):
        from mpi4py import MPI

        route.comm.Allgather(MPI.IN_PLACE, _np(out))

    @staticmethod
    def reduce_scatter(route, inp, out, op, async_op):
        route.comm.Reduce_scatter_block(_np(inp), _np(out), op=Mpi._op(op))

    @staticmethod
    def broadcast(route, t, src, async_op):
        route.comm.Bcast(_np(t), root=route.ranks.index(src))

    @staticmethod
    def all_to_all(route, inp, send, recv, out, async_op):
        from mpi4py import MPI

        if recv is None:  # the counts first (MPI's small all-to-all of Python ints)
            recv = route.comm.alltoall(list(send))
        if out is None:
            out = inp.new_empty((sum(recv), *inp.shape[1:]))
        row = _rowbyte_view(inp)
        # Bytes, so that any dtype goes (MPI's counts are C ints: under 2 GiB per peer).
        scounts, rcounts = [s * row for s in send], [r * row for r in recv]
        route.comm.Alltoallv([_np(byte_view(inp)), (scounts, _offsets(scounts)), MPI.BYTE],
                             [_np(byte_view(out)), (rcounts, _offsets(rcounts)), MPI.BYTE])
        return out, recv, None


def _offsets(counts: list[int]) -> list[int]:
    offsets, at = [], 0
    for c in counts:
        offsets.append(at)
        at += c
    return offsets


def flat_adapter(engine: str):
    """The adapter of a flat engine: ``mpi``, or torch's for any torch.distributed backend."""
    return Mpi if engine == "mpi" else Torch
