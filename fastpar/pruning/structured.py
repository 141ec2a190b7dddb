"""``fastpar.prune``: a smaller GPT of the same architecture, whole attention heads (whole KV
groups under GQA) and MLP channels removed by an importance score.

    small = fastpar.prune(model, heads=0.5, mlp=0.25, by="magnitude")
    small = fastpar.prune(model, heads=0.25, by="activations", data=[tokens, ...])
    small.cfg, small.kept          # the pruned config; which units of the original it kept

The steps, on every rank of the model's tp group: score every unit (``importance``: the same
scores on every rank), choose the kept ones per block (``selection``: the same count in each
block, a multiple of tp), cut the serial state dict (``fastpar.full_state_dict``, gathered over
tp) down to them, and load it into a new GPT of the pruned config at the same tp, each rank
taking its shards (``fastpar.load_full_state_dict``). The original model is left as it was.

Exact by construction: removing head h removes its query rows, its columns of o_proj and (with
its whole group) the group's K/V rows; attention never mixes heads, so the kept heads compute
what they computed, and the block's output is the original's with the removed heads' o_proj
input columns zeroed; likewise a removed channel's down_proj (fc2) column. The pruned model's
logits are the original's with those zeroed, up to float32 rounding (tests/test_prune.py).
"""

from __future__ import annotations

import torch

from fastpar.models.config import GPTConfig
from fastpar.models.gpt import GPT
from fastpar.pruning import importance
from fastpar.pruning.selection import BY, Kept, counts, keep, sliced
from fastpar.runtime import group_size
from fastpar.state_dict import full_state_dict, load_full_state_dict


def empty_gpt(cfg: GPTConfig, group, *, device, dtype=torch.float32, cp_group=None) -> GPT:
    """A ``GPT`` of ``cfg`` over tp ``group`` on ``device`` whose values are not drawn
    (uninitialised memory): for a caller that loads every tensor next."""
    with torch.device("meta"):
        model = GPT(cfg, group=group, cp_group=cp_group)
    return model.to_empty(device=device).to(dtype)


def _check(model, by: str, data) -> None:
    if not isinstance(model, GPT):
        raise TypeError(f"fastpar.prune takes a fastpar GPT (fastpar.models.GPT), got "
                        f"{type(model).__name__}")
    cfg = model.cfg
    if cfg.moe_experts:
        raise ValueError(f"fastpar.prune removes attention heads and MLP channels of dense "
                         f"blocks; blocks {cfg.moe_blocks} are Mixture-of-Experts blocks "
                         f"(moe_experts {cfg.moe_experts})")
    if model[0].cp > 1:
        raise ValueError(f"fastpar.prune runs on whole sequences: the model is context-parallel "
                         f"over {model[0].cp} ranks ({cfg.context_parallel})")
    if by not in BY:
        raise ValueError(f"by must be one of {BY}, got {by!r}")
    if by == "activations" and data is None:
        raise ValueError("by='activations' needs data=: an iterable of token tensors (B, T), "
                         "the calibration batches")


def kept_units(model: GPT, heads: float = 0.0, mlp: float = 0.0, by: str = "magnitude",
               data=None, *, seed: int = 0, full: dict | None = None) -> Kept:
    """What ``prune`` keeps of ``model`` (same arguments); ``full``: the model's
    ``full_state_dict`` when the caller holds it (else gathered here for magnitude)."""
    _check(model, by, data)
    cfg, group = model.cfg, model[0].group
    counts(cfg, heads, mlp, group_size(group))  # errors before any work
    if by == "magnitude":
        scores = importance.magnitude(cfg, full if full is not None else full_state_dict(model))
    elif by == "activations":
        scores = importance.activations(model, data, group)
    else:
        scores = importance.random_scores(cfg, seed)
    return keep(cfg, scores, heads, mlp, group_size(group), by)


def pruned_model(model: GPT, kept: Kept, full: dict | None = None) -> GPT:
    """A new GPT of ``kept.cfg`` over ``model``'s tp group, on its device and in its dtype,
    holding ``model``'s kept weights; ``full``: ``model``'s ``full_state_dict`` if at hand."""
    full = full_state_dict(model) if full is None else full
    first = next(model.parameters())
    small = empty_gpt(kept.cfg, model[0].group, device=first.device, dtype=first.dtype,
                      cp_group=model[0].cp_group)
    load_full_state_dict(small, sliced(full, model.cfg, kept))
    small.train(model.training)
    small.kept = kept
    return small


def prune(model: GPT, heads: float = 0.0, mlp: float = 0.0, by: str = "magnitude", data=None,
          *, seed: int = 0) -> GPT:
    """A new, smaller ``fastpar.models.GPT``: ``model`` with the fraction ``heads`` of its KV
    groups (MHA: its heads) and ``mlp`` of its MLP channels removed from every block, those of
    the lowest importance (``by``: "magnitude", "activations" over ``data``, an iterable of
    token tensors (B, T), or "random" seeded by ``seed``; definitions in
    ``fastpar.pruning.importance``). Collective over the model's tp group (every rank of it
    passes the same arguments and data). Returns a GPT of the pruned config (``.cfg``) at the
    same tp, on the model's device and in its dtype, in its mode, with ``.kept`` (a
    ``selection.Kept``: which KV groups and channels of the original each block kept).

    ValueError naming the values: a fraction that removes every unit or keeps a count tp does
    not divide, an unknown ``by``, "activations" without data, a MoE or context-parallel model;
    TypeError for anything but a fastpar GPT."""
    _check(model, by, data)
    counts(model.cfg, heads, mlp, group_size(model[0].group))  # errors before any work
    full = full_state_dict(model)
    return pruned_model(model, kept_units(model, heads, mlp, by, data, seed=seed, full=full),
                        full)
