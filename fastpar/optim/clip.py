"""Gradient clipping by the serial model's global norm when the parameters are sharded.

    loss = model.step(x, y)                           # gradients averaged over dp already
    norm = fastpar.optim.clip_grad_norm_(model, 1.0)  # = clip_grad_norm_ on the serial model

Each rank holds a piece of the serial model: shards of ``fastpar.nn`` layers over tp (their
``shard_dims``), whole layers of its pipeline stage, and copies of tp-replicated parameters
(norm weights, row-parallel biases). The global 2-norm counts every serial element once::

    norm**2 = all_reduce_over(tp x pp)( sum_{p sharded} |g_p|^2 + [tp_rank == 0] sum_{p replicated} |g_p|^2 )

dp replicas hold the same averaged gradients, so dp takes no part. Parameters tied across
pipeline stages (a GPT's embedding and output weight) are separate parameters of the serial
model too, so both count, as they do there. ``DistributedOptimizer.clip_grad_norm_`` does the
same for ZeRO's sharded gradients (it shares ``sharded_params``).
"""

from __future__ import annotations

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


@torch.no_grad()
def clip_grad_norm_(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale this rank's gradients so the serial model's global 2-norm is at most ``max_norm``;
    returns that norm before clipping (float64, the same on every rank). Collective over the
    topology's mp group (tp x pp): call it on every rank."""
    if not max_norm > 0:
        raise ValueError(f"max_norm must be positive, got {max_norm}")
    sharded = sharded_params(model)
    count_replicated = topology().tp_rank == 0
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    counted = [p.grad.detach() for p in model.parameters()
               if p.grad is not None and (id(p) in sharded or count_replicated)]
    local = torch.zeros(1, dtype=torch.float64)
    if counted:  # one fused norm per device and dtype (torch's own), squared in float64
        local += torch.nn.utils.get_total_norm(counted, 2.0).double().cpu() ** 2
    mp = topology().mp_group
    if mp is not None and group_size(mp) > 1:
        comm.all_reduce(local, group=mp)
    total = local[0].sqrt()
    coef = min(1.0, float(max_norm) / (total.item() + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)  # one fused kernel per device and dtype
    return total
