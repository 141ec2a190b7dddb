"""Cross-entropy over logits sharded along the vocabulary, without ever gathering them.

For one token with logits ``z`` over a vocabulary of ``V`` split in TP shards ``z_n``, target ``t``
and label smoothing ``e``::

    m      = all_reduce_max(max(z_n))                    (for exp's range; no gradient)
    [S, zt, Z] = all_reduce_sum([sum(exp(z_n - m)), z_t - m if t in shard else 0, sum(z_n - m)])
    loss   = (1 - e) * (log S - zt) + e * (log S - Z / V)
    dz_n   = softmax(z)_n - (1 - e) * onehot(t)_n - e / V

``V`` is the real vocabulary: columns of a padded one are left out of ``m``, ``S`` and ``Z``.
The sums travel in one all-reduce (``Z`` only with label smoothing). A token whose target is
``ignore_index`` has loss 0 and no gradient. Arithmetic is in float32 whatever the logits' dtype.
"""

from __future__ import annotations

import torch

from fastpar.comm.collectives import all_reduce
from fastpar.nn.sharding import resolve_group
from fastpar.runtime import group_rank, group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, ignore_index, smoothing):
        shard_size = logits.shape[-1]
        out_shape = target.shape  # (...): one loss per token, as the target
        z = logits.reshape(-1, shard_size).float()  # (N, V_n)
        target = target.reshape(-1)
        valid_cols = min(max(vocab_size - vocab_start, 0), shard_size)  # the rest is padding
        if valid_cols < shard_size:
            z = z.clone()
            z[:, valid_cols:] = float("-inf")
        local_max = z.max(dim=-1).values if shard_size else z.new_full((z.shape[0],), -torch.inf)
        m = all_reduce(local_max, group, op="max")
        z = z - m.unsqueeze(-1)
        exp = z.exp()
        local_t = target - vocab_start
        in_shard = (local_t >= 0) & (local_t < valid_cols)
        rows = torch.arange(z.shape[0], device=z.device)
        safe_t = local_t.clamp(0, max(shard_size - 1, 0))
        sums = torch.empty(z.shape[0], 3 if smoothing else 2, device=z.device)
        sums[:, 0] = exp.sum(dim=-1)
        sums[:, 1] = torch.where(in_shard, z[rows, safe_t], 0.0) if shard_size else 0.0
        if smoothing:
            sums[:, 2] = z[:, :valid_cols].sum(dim=-1)
        all_reduce(sums, group)  # the one fused all-reduce
        log_s = sums[:, 0].log()
        loss = log_s - sums[:, 1]
        if smoothing:
            loss = (1 - smoothing) * loss + smoothing * (log_s - sums[:, 2] / vocab_size)
        keep = target != ignore_index
        loss = torch.where(keep, loss, 0.0)
        softmax = exp.div_(sums[:, :1])
        ctx.save_for_backward(softmax, safe_t, in_shard & keep, keep)
        ctx.smoothing, ctx.valid_cols, ctx.vocab_size = smoothing, valid_cols, vocab_size
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss.view(out_shape)

    @staticmethod
    def backward(ctx, dloss):
        softmax, safe_t, hit, keep = ctx.saved_tensors
        e = ctx.smoothing
        grad = softmax.clone()
        if e:
            grad[:, :ctx.valid_cols] -= e / ctx.vocab_size
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe_t] -= (1 - e) * hit.float()
        grad *= (dloss.reshape(-1).float() * keep.float()).unsqueeze(-1)
        return grad.to(ctx.dtype).view(ctx.shape), None, None, None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor,
                                 ignore_index: int = -100, label_smoothing: float = 0.0, *,
                                 reduction: str = "mean", vocab_size: int | None = None,
                                 group=None) -> torch.Tensor:
    """``F.cross_entropy(full_logits, target, ...)`` from this rank's vocab shard of the logits.

    ``logits_shard``: ``(..., V / n)``, rank r holding columns ``[r * V/n, (r + 1) * V/n)``;
    ``target``: ``(...)`` of full-vocab ids in ``[0, vocab_size)`` or ``ignore_index`` (others
    raise ValueError; on a GPU, a device-side assert). ``vocab_size``: the real vocabulary when
    the shards cover a padded one (columns ``>= vocab_size`` are ignored; default: ``n`` shards'
    columns). ``reduction``: "mean" (over non-ignored tokens, as F.cross_entropy), "sum" or
    "none". The loss is float32.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"logits shard of shape {tuple(logits_shard.shape)} does not match "
                         f"target of shape {tuple(target.shape)} (expected (..., V/tp) and (...))")
    group = resolve_group(group)
    n, rank = group_size(group), group_rank(group)
    shard_size = logits_shard.shape[-1]
    padded_vocab = shard_size * n
    vocab_size = padded_vocab if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded_vocab:
        raise ValueError(f"vocab_size {vocab_size} does not fit {n} shards of {shard_size} "
                         f"columns (padded vocabulary {padded_vocab})")
    # Every rank holds the same targets, so all raise together, before any collective. On a GPU
    # the check is a device-side assert (as F.cross_entropy's): no host sync in the hot path.
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if target.is_cuda:
        torch._assert_async(~bad.any(), f"vocab_parallel_cross_entropy: a target is out of "
                            f"bounds [0, vocab_size {vocab_size}) and not ignore_index")
    elif bad.any():
        raise ValueError(f"Target {target[bad][0].item()} is out of bounds: targets must be in "
                         f"[0, vocab_size {vocab_size}) or ignore_index {ignore_index}")
    losses = _VocabParallelCrossEntropy.apply(logits_shard, target, group, rank * shard_size,
                                              vocab_size, ignore_index, float(label_smoothing))
    if reduction == "none":
        return losses
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()
