"""ZeRO stages 1 and 2's flat buffers: the parameters as views of one padded flat buffer (the
runs' blocks side by side, ``FlatGroup.padded_view``), and stage 1's flat gradient buffer with
its reduction, one reduce-scatter of the whole buffer at the step.

Where the dp group's collectives go to shm the buffers are symmetric memory (``symmetric``):
each run's block of the parameters is gathered in place, and stage 1's gradient buffer is
reduce-scattered where it lies. A float32 stage 1's master is this rank's block of the
parameter buffer itself, and its gradients are views of the gradient buffer, so backward
accumulates into it; a bfloat16 model's gradients are copied into the float32 buffer."""

from __future__ import annotations

import torch

from fastpar import comm
from fastpar.comm import quant as quant_codec
from fastpar.comm import symmetric as symmetric_memory
from fastpar.optim.zero_shards import FlatGroup, master_dtype
from fastpar.runtime import group_rank, group_size


def _alloc(numel: int, dtype, device, group, symmetric: bool) -> torch.Tensor:
    if symmetric:  # collective: same order on every rank
        return comm.symmetric_empty(numel, dtype=dtype, group=group).zero_()
    return torch.zeros(numel, dtype=dtype, device=device)


@torch.no_grad()
def build_flat_buffers(f: FlatGroup, stage: int, group, symmetric: bool) -> None:
    """Stages 1 and 2: the parameters of ``f`` become views of one padded flat buffer (their
    values kept); stage 1 also puts the gradients in one (views when the dtype is the
    master's). Collective where ``symmetric``."""
    dp_size, dp_rank = group_size(group), group_rank(group)
    f.param_buf = _alloc(f.padded, f.dtype, f.device, group, symmetric)
    if symmetric:  # each run's block: the same offset on every rank, gathered in place
        symmetric_memory.register_parts(f.param_buf, [(r.poff, r.piece * dp_size)
                                                      for r in f.runs])
    for i, p in enumerate(f.params):
        view = f.padded_view(f.param_buf, i)
        view.copy_(p.detach())
        p.data = view
    f.master_is_view = stage == 1 and f.dtype == master_dtype(f.dtype)
    if f.master_is_view:  # this rank's block of the parameters is the master itself
        f.master = torch.nn.Parameter(f.param_buf[dp_rank * f.shard:(dp_rank + 1) * f.shard])
    f.grad_buf = f.grad_views = None
    if stage == 1:
        f.grad_buf = _alloc(f.padded, master_dtype(f.dtype), f.device, group, symmetric)
        if f.master_is_view:
            f.grad_views = [f.padded_view(f.grad_buf, i) for i in range(len(f.params))]
            for p, v in zip(f.params, f.grad_views):
                if p.grad is not None:
                    v.copy_(p.grad)
                p.grad = v  # autograd accumulates into the flat buffer from now on


@torch.no_grad()
def reduce_flat(flat: list[FlatGroup], group, quant, error_feedback: bool,
                residuals: dict) -> None:
    """Stage 1: each group's gradients into its flat buffer (where they are not accumulated
    there already), reduce-scattered over ``group`` into the master gradient, the dp mean.
    ``quant``: int8 for float32 buffers, with the rounding carried in ``residuals`` (by
    ``id(f)``) under ``error_feedback``."""
    dp_size = group_size(group)
    for f in flat:
        buf = f.grad_buf
        for i, p in enumerate(f.params):
            g, view = p.grad, f.padded_view(buf, i)
            if f.grad_views is not None and g is not None and g.data_ptr() == view.data_ptr():
                continue  # accumulated in place
            view.copy_(g) if g is not None else view.zero_()
            if f.grad_views is not None:
                p.grad = view
        q = quant if buf.dtype in quant_codec.DTYPES else None
        residual = None
        if q is not None and error_feedback and dp_size > 1:
            residual = residuals.get(id(f))
            if residual is None:
                residual = residuals[id(f)] = torch.zeros(buf.shape, dtype=torch.float32,
                                                          device=buf.device)
        g = comm.reduce_scatter(buf, group=group, quant=q, residual=residual)  # the dp sum
        f.master.grad = g.div_(dp_size) if dp_size > 1 else g.clone()
