"""Gradient clipping by the serial model's global norm when the parameters are sharded.

    loss = model.step(x, y)                           # gradients averaged over dp already
    norm = fastpar.optim.clip_grad_norm_(model, 1.0)  # = clip_grad_norm_ on the serial model

Each rank holds a piece of the serial model: shards of ``fastpar.nn`` layers over tp (their
``shard_dims``), whole layers of its pipeline stage, and copies of tp-replicated parameters
(norm weights, row-parallel biases). The global 2-norm counts every serial element once::

    norm**2 = all_reduce_over(tp x pp)( sum_{p sharded} |g_p|^2 + [tp_rank == 0] sum_{p replicated} |g_p|^2 )
    g *= min(1, max_norm / (norm + 1e-6))                                 # every local grad

dp replicas hold the same averaged gradients, so dp takes no part, except for expert
parameters (``param.expert_parallel``, ``fastpar.nn.MoE``): sharded over the ep group inside dp
(other experts on each of its ranks) and whole on every tp rank, they count on tp rank 0, summed
over the ep group first::

    norm**2 += all_reduce_over(tp x pp)( [tp_rank == 0] all_reduce_over(ep)( sum_{p expert} |g_p|^2 ) )

Tied weights: a Parameter that appears more than once in one module (used by two layers) counts
once, as ``model.parameters()`` yields it once. A GPT's tied embedding and output weight are two
Parameters, one holding a copy of the other (``fastpar.models``: the pipeline may put them on
different stages), both given the tied weight's gradient by ``sum_tied_grads``. The copy is
named by the module holding it (``tied_copies``: ``fastpar.models.GPTHead``'s output weight
when tied) and does not count: the tied weight enters the norm once, at every layout, as in a
model where it is one Parameter (Hugging Face's, torch's ``clip_grad_norm_`` on it).

``DistributedOptimizer.clip_grad_norm_`` (ZeRO) counts the same elements (``counted``), sums over
its dp group as well (there each rank holds a slice of the gradients), and ends in the same
``clip_by_global_norm_``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from fastpar import comm
from fastpar.runtime import group_size, topology


def sharded_params(model: torch.nn.Module) -> set[int]:
    """``id`` of every parameter of ``model`` that a ``fastpar.nn`` layer shards over a tp group
    of more than one rank (the others are whole on every tp rank)."""
    sharded = set()
    for mod in model.modules():
        dims = getattr(mod, "shard_dims", None)  # fastpar.nn.ShardedModule's declaration
        if dims and group_size(mod.group) > 1:
            sharded.update(id(getattr(mod, n)) for n in dims if getattr(mod, n, None) is not None)
    return sharded


def counted(model: torch.nn.Module) -> Callable[[torch.Tensor], bool]:
    """Whether this rank counts a parameter in the serial model's norm: a tp shard of a
    ``fastpar.nn`` layer always, a parameter whole on every tp rank only on tp rank 0; a tied
    weight's copy (a module's ``tied_copies``) never."""
    copies = {id(p) for m in model.modules() for p in getattr(m, "tied_copies", ())}
    if topology().tp_rank == 0:
        return lambda p: id(p) not in copies
    sharded = sharded_params(model)
    return lambda p: id(p) in sharded and id(p) not in copies


def check_max_norm(max_norm: float) -> None:
    if not max_norm > 0:  # 0 would zero every gradient, a negative value flip their signs
        raise ValueError(f"max_norm must be positive, got {max_norm}")


@torch.no_grad()
def clip_by_global_norm_(grads: list[torch.Tensor], local: torch.Tensor, max_norm: float,
                         norm_type: float, groups) -> torch.Tensor:
    """The end both clips share (collective over every group of ``groups`` with more than one
    rank; None entries are skipped). ``local``: ``(1,)`` float64, this rank's sum of
    ``|g| ** norm_type`` over the elements it counts (for ``inf``: their largest ``|g|``)::

        norm = all_reduce(local, sum) ** (1 / norm_type)     # inf: all_reduce(local, max)
        g *= min(1, max_norm / (norm + 1e-6))                # for g in grads, in place

    Returns the norm before clipping (float64, 0-dim, the same on every rank of the groups).
    The callers check ``max_norm`` first (``check_max_norm``), before any collective."""
    inf = math.isinf(norm_type)
    for group in groups:
        if group is not None and group_size(group) > 1:
            comm.all_reduce(local, group=group, op="max" if inf else "sum")
    total = local[0] if inf else local[0] ** (1.0 / norm_type)
    coef = min(1.0, float(max_norm) / (total.item() + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)  # one fused kernel per device and dtype
    return total


@torch.no_grad()
def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale this rank's gradients so the serial model's global 2-norm is at most ``max_norm``;
    returns that norm before clipping (float64, the same on every rank). Collective over the
    topology's mp group (tp x pp): call it on every rank. Tied parameters: see the module
    docstring."""
    check_max_norm(max_norm)
    keep = counted(model)
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    expert = [getattr(p, "expert_parallel", False) for p in params]
    mine = [p.grad.detach() for p, e in zip(params, expert)
            if p.grad is not None and keep(p) and not e]
    local = torch.zeros(1, dtype=torch.float64)
    if mine:  # one fused norm per device and dtype (torch's own), squared in float64
        local += torch.nn.utils.get_total_norm(mine, 2.0).double().cpu() ** 2
    if any(expert):  # every rank of the ep group holds experts of the same stage
        topo = topology()
        experts = torch.zeros(1, dtype=torch.float64)
        theirs = [p.grad.detach() for p, e in zip(params, expert) if e and p.grad is not None]
        if theirs and topo.tp_rank == 0:
            experts += torch.nn.utils.get_total_norm(theirs, 2.0).double().cpu() ** 2
        if group_size(topo.ep_group) > 1:
            comm.all_reduce(experts, group=topo.ep_group)
        local += experts
    return clip_by_global_norm_(grads, local, max_norm, 2.0, [topology().mp_group])


@torch.no_grad()
def clip_shards_(flat, group, max_norm: float, norm_type: float, model) -> torch.Tensor:
    """``DistributedOptimizer.clip_grad_norm_`` over its master shards (``flat``: its
    ``FlatGroup`` list, each a master with its reduced ``.grad`` shard) on the dp ``group``:
    each rank's sum of ``w * |g_shard| ** p`` (w = 1, or with ``model`` the shard of
    ``counted(model)``'s mask) summed over dp, and over mp (tp x pp) with ``model``; every
    shard scaled by ``min(1, max_norm / (norm + 1e-6))``. Returns the norm in the masters'
    dtype."""
    norm_type = float(norm_type)
    grads = [f.master.grad for f in flat]
    weights, groups = [None] * len(grads), [group]
    if model is not None:
        keep = counted(model)
        weights = [f.shard_mask(keep) for f in flat]
        groups.append(topology().mp_group)
    if math.isinf(norm_type):
        local = torch.stack([(g.abs() if w is None else g.abs() * w).max().double()
                             for g, w in zip(grads, weights)]).max().reshape(1)
    else:
        local = sum((g.double().abs().pow(norm_type) * (1.0 if w is None else w)).sum()
                    for g, w in zip(grads, weights)).reshape(1)
    total = clip_by_global_norm_(grads, local, max_norm, norm_type, groups)
    return total.to(grads[0].dtype)
