"""Tied weights across pipeline stages: one weight held as copies by the stages that use it (an
embedding on the first stage and the output layer on the last), kept equal by giving every
copy the same gradient, the sum of all of them.

    sum_copies(params, grads, group)     # after backward, before clipping and the step

Each copy starts from the same values and gets the same gradient, so any deterministic
optimizer keeps them equal: what one tied weight would have done, without moving weights.
"""

from __future__ import annotations

import torch

from fastpar.comm.collectives import all_reduce
from fastpar.runtime import group_size


def sum_copies(params, grads, group=None) -> None:
    """Give every copy in ``params`` the sum of ``grads`` (one per copy, ``None`` counting as
    zeros) here and over ``group`` (the other stages' copies; None or one rank: local only).
    The sum is in float32 at least (a bf16 copy is widened, summed and rounded once); grads are
    written in place (a reducer or optimizer may hold views of them), a missing one is set."""
    params, grads = list(params), list(grads)
    if not params:
        return
    like = next((g for g in grads if g is not None), params[0])
    wide = torch.promote_types(like.dtype, torch.float32)
    total = torch.zeros_like(like, dtype=wide)
    for g in grads:
        if g is not None:
            total += g
    if group is not None and group_size(group) > 1:
        all_reduce(total, group)
    for p, g in zip(params, grads):
        if g is None:
            p.grad = total.to(p.dtype, copy=True)
        else:
            g.copy_(total)
