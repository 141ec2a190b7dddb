"""Autograd collectives: the communication of tensor and sequence parallelism as differentiable ops.

Megatron's paper names the two basic operators of a TP region ``f`` and ``g``::

    copy_to_tp      (f)   forward: y = x                    backward: dx = all_reduce(dy)
    reduce_from_tp  (g)   forward: y = all_reduce(x)        backward: dx = dy

plus the moves along the last dim (a column-parallel output or a row-parallel input), for
sequence parallelism the moves along a sequence dim that replace ``f``/``g`` at the region edges,
and for expert parallelism the all-to-all of rows (``all_to_all_rows``).
Every wrapper takes an explicit ``group`` (``None`` is an error, not the world: these run inside a
TP region, whose group the caller holds) and is the identity, without a copy, on a group of one
rank. Collectives go through ``fastpar.comm`` so the engine policy applies.

A collective that works in place never touches a tensor autograd may hand to someone else: gradients
are cloned before an in-place all-reduce (one ``dy`` can feed several branches, e.g. a residual).
"""

from __future__ import annotations

import torch

from fastpar.comm.alltoall import all_to_all_v, exchange
from fastpar.comm.collectives import all_gather, all_reduce, reduce_scatter
from fastpar.runtime import group_rank, group_size


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """A fresh contiguous copy of this rank's equal chunk of ``x`` along ``dim``.

    Always a copy, never a view: a chunk along dim 0 is already contiguous, so ``.contiguous()``
    would return a view, and autograd forbids in-place ops on views made by a custom Function."""
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} evenly over {n} ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].clone(memory_format=torch.contiguous_format)


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    # Clone first: the in-place all-reduce must not change a gradient shared with another branch.
    return all_reduce(grad.clone(memory_format=torch.contiguous_format), group)


class CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _summed(dy, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward. ``inplace`` reduces ``x`` itself (callers pass it
    only for a fresh tensor nobody saved, e.g. a matmul output)."""

    @staticmethod
    def forward(ctx, x, group, inplace):
        if inplace:
            ctx.mark_dirty(x)
            return all_reduce(x, group)
        return all_reduce(x.clone(memory_format=torch.contiguous_format), group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None


class AllGatherSequence(torch.autograd.Function):
    """All-gather along ``dim`` forward; reduce-scatter along ``dim`` backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, dy):
        return reduce_scatter(dy, ctx.group, dim=ctx.dim), None, None


class ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward; all-gather along ``dim`` backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return reduce_scatter(x, group, dim=dim)

    @staticmethod
    def backward(ctx, dy):
        return all_gather(dy, ctx.group, dim=ctx.dim), None, None


class Scatter(torch.autograd.Function):
    """Keep this rank's chunk along ``dim`` forward; all-gather along ``dim`` backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, dy):
        return all_gather(dy, ctx.group, dim=ctx.dim), None, None


class Gather(torch.autograd.Function):
    """All-gather along ``dim`` forward; keep this rank's chunk along ``dim`` backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim=dim)

    @staticmethod
    def backward(ctx, dy):
        return _split(dy, ctx.group, ctx.dim), None, None


class AllToAllRows(torch.autograd.Function):
    """All-to-all of rows forward; the transposed all-to-all backward (the rows rank i got from
    rank j go back from i to j: send and receive counts swap)."""

    @staticmethod
    def forward(ctx, x, group, send_counts, recv_counts):
        y, send, recv = exchange("all_to_all_rows", x, send_counts, recv_counts, group, False)
        ctx.group, ctx.counts = group, (recv, send)
        return y

    @staticmethod
    def backward(ctx, dy):
        recv, send = ctx.counts
        return all_to_all_v(dy, recv, send, ctx.group), None, None, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Enter a TP region (Megatron's f). forward: ``y = x``; backward: ``dx = all_reduce(dy)``."""
    if group_size(group, "copy_to_tp") == 1:
        return x
    return CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group, *, inplace: bool = False) -> torch.Tensor:
    """Leave a TP region (Megatron's g). forward: ``y = all_reduce(x)``; backward: ``dx = dy``.

    ``inplace=True`` reduces ``x``'s storage (only for a fresh tensor no other op saved)."""
    if group_size(group, "reduce_from_tp") == 1:
        return x
    # traced by torch.compile: out of place (the graph's functional all-reduce is anyway)
    return ReduceFromTP.apply(x, group, inplace and not torch.compiler.is_compiling())


def scatter_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """forward: ``y = x.chunk(n, -1)[rank]``; backward: ``dx = all_gather(dy, dim=-1)``."""
    if group_size(group, "scatter_to_tp") == 1:
        return x
    return Scatter.apply(x, group, -1)


def gather_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """forward: ``y = all_gather(x, dim=-1)``; backward: ``dx = dy.chunk(n, -1)[rank]``."""
    if group_size(group, "gather_from_tp") == 1:
        return x
    return Gather.apply(x, group, -1)


def all_gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Enter a TP region from a sequence-parallel one (replaces f).

    forward: ``y = all_gather(x_shard, dim)``; backward: ``dx_shard = reduce_scatter(dy, dim)``
    (each rank's ``dy`` is a partial sum from its weight shard)."""
    if group_size(group, "all_gather_sequence") == 1:
        return x
    return AllGatherSequence.apply(x, group, dim)


def reduce_scatter_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Leave a TP region into a sequence-parallel one (replaces g).

    forward: ``y_shard = reduce_scatter(x, dim)``; backward: ``dx = all_gather(dy_shard, dim)``."""
    if group_size(group, "reduce_scatter_sequence") == 1:
        return x
    return ReduceScatterSequence.apply(x, group, dim)


def scatter_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Shard a replicated activation along ``dim`` (e.g. after the embedding).

    forward: ``y_shard = x.chunk(n, dim)[rank]``; backward: ``dx = all_gather(dy_shard, dim)``."""
    if group_size(group, "scatter_sequence") == 1:
        return x
    return Scatter.apply(x, group, dim)


def gather_sequence(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Rebuild a replicated activation from sequence shards (e.g. before a replicated head).

    forward: ``y = all_gather(x_shard, dim)``; backward: ``dx_shard = dy.chunk(n, dim)[rank]``."""
    if group_size(group, "gather_sequence") == 1:
        return x
    return Gather.apply(x, group, dim)


def all_to_all_rows(x: torch.Tensor, group, send_counts=None, recv_counts=None) -> torch.Tensor:
    """Expert-parallel dispatch and combine: rows of ``x`` (dim 0) to the ranks of ``group``.

    forward: ``y = all_to_all_v(x, send_counts, recv_counts)`` (``send_counts=None``: equal
    splits, ``all_to_all``); backward: ``dx = all_to_all_v(dy, recv_counts, send_counts)``, the
    transposed exchange (``recv_counts`` as exchanged in the forward when not given)."""
    if group_size(group, "all_to_all_rows") == 1:
        return x
    return AllToAllRows.apply(x, group, send_counts, recv_counts)
