"""The torch.distributed engines, gloo and NCCL: the route's process group is their
communicator (nothing of fastpar's own), and the only engines that run in the background. The
hierarchical engine runs its cross-host stage on them (or on MPI), and the engines without byte
collectives move a quantized call's bytes through them."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm.engines.base import Adapter
from fastpar.comm.views import byte_view

# torch 2.13 renamed the tensor forms (the old names warn); older torch has only the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
             "prod": dist.ReduceOp.PRODUCT}


@contextlib.contextmanager
def gloo_itself():
    """On a fastpar backend group, the calls inside take its gloo, not its kernels: what
    fastpar.comm sends to "gloo" (a forced engine, a call the kernels refuse) is gloo's."""
    if not _native.available():
        yield
        return
    from fastpar import _C

    before = _C.backend_fallback_only(True)
    try:
        yield
    finally:
        _C.backend_fallback_only(before)


class Torch(Adapter):
    """gloo and NCCL through torch.distributed."""

    name = "torch"

    @staticmethod
    def all_reduce(route, t, op, async_op):
        with gloo_itself():
            return dist.all_reduce(t, op=TORCH_OPS[op], group=route.group, async_op=async_op)

    @staticmethod
    def all_gather(route, inp, stacked, async_op):
        with gloo_itself():
            return _all_gather_tensor(stacked, inp, group=route.group, async_op=async_op)

    @staticmethod
    def all_gather_into(route, block, out, async_op):
        with gloo_itself():
            return _all_gather_tensor(out, block, group=route.group, async_op=async_op)

    @staticmethod
    def reduce_scatter(route, inp, out, op, async_op):
        with gloo_itself():
            return _reduce_scatter_tensor(out, inp, op=TORCH_OPS[op], group=route.group,
                                          async_op=async_op)

    @staticmethod
    def broadcast(route, t, src, async_op):
        with gloo_itself():
            return dist.broadcast(t, src=src, group=route.group, async_op=async_op)

    @staticmethod
    def all_to_all(route, inp, send, recv, out, async_op):
        with gloo_itself():
            return _all_to_all(route, inp, send, recv, out, async_op)


def _all_to_all(route, inp, send, recv, out, async_op):
    if recv is None:  # the counts first: a small all-to-all of its own, waited for
        mine = torch.tensor(send, dtype=torch.int64, device=inp.device)
        theirs = torch.empty_like(mine)
        dist.all_to_all_single(theirs, mine, group=route.group)
        recv = theirs.tolist()
    if out is None:
        out = inp.new_empty((sum(recv), *inp.shape[1:]))
    # As bytes: gloo does not carry every dtype (bool, bfloat16), and bytes are bytes.
    row = row_bytes(inp)
    work = dist.all_to_all_single(byte_view(out), byte_view(inp), [r * row for r in recv],
                                  [s * row for s in send], group=route.group,
                                  async_op=async_op)
    return out, recv, work


def row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row (dim 0) of ``t``."""
    return math.prod(t.shape[1:]) * t.element_size()
