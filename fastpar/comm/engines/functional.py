"""The collectives as torch.compile traces them: torch's functional collectives
(``torch.distributed._functional_collectives``) on the group, which a compiled graph runs
through the group's torch.distributed backend (fastpar's own on fastpar's groups, so the same
kernels as eager). ``fastpar.comm``'s raw collectives take this path while Dynamo traces
(``compiling()``): no routing table, lock or job state is touched on the traced path, so a
compile that fails leaves nothing held.

Out of place, as functional collectives are; the raw collectives copy results into their
in-place arguments (a traced ``copy_``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

OPS = {"sum": "sum", "max": "max", "min": "min", "prod": "product", "avg": "avg"}


def compiling() -> bool:
    return torch.compiler.is_compiling()


def traceable(name: str, async_op: bool, quant=None, residual=None) -> None:
    """What torch.compile cannot trace of a raw collective, refused naming it."""
    if async_op or quant is not None or residual is not None:
        raise ValueError(f"{name} under torch.compile: async_op, quant and residual are eager "
                         "only (compiled code runs the functional collective in the graph)")


def _group(group):
    return dist.group.WORLD if group is None else group


def all_reduce(t: torch.Tensor, group, op: str) -> torch.Tensor:
    return funcol.all_reduce(t, OPS[op], _group(group))


def all_gather(t: torch.Tensor, group, dim: int) -> torch.Tensor:
    return funcol.all_gather_tensor(t.contiguous(), dim, _group(group))


def reduce_scatter(t: torch.Tensor, group, dim: int, op: str) -> torch.Tensor:
    return funcol.reduce_scatter_tensor(t.contiguous(), OPS[op], dim, _group(group))


def broadcast(t: torch.Tensor, src: int, group) -> torch.Tensor:
    return funcol.broadcast(t, src, _group(group))
