"""Which units a pruning keeps, and the smaller model's config and serial weights.

    kept = keep(cfg, scores, heads=0.5, mlp=0.25, tp=2, by="magnitude")   # a Kept
    kept.cfg                    # the pruned GPTConfig
    small = sliced(full, cfg, kept)    # the serial state dict of the pruned model

Counts. A fraction ``f`` of ``n`` units (KV groups, or MLP channels) removes ``round(f n)``
(halves to even) of them in every block, the same number in each, and keeps the rest; the kept
count must be at least one and a multiple of tp, so every tp rank keeps the same share (the
pruned model is a model of the same tp). Under GQA whole KV groups go, so the query heads keep
their ratio to the KV heads: kept heads = kept groups x heads / kv_heads.

Choice. In each block the units of the highest scores are kept (ties: the lower index), in
their original order, so that kept query heads still attend through their own KV head: new
group j is old group ``kept[j]`` with its query heads. The pruned config names ``head_dim``
(after removing heads, hidden / heads is no longer the head width).
"""

from __future__ import annotations

import dataclasses

import torch

from fastpar.models.config import GPTConfig
from fastpar.pruning.importance import Scores

BY = ("magnitude", "activations", "random")


@dataclasses.dataclass
class Kept:
    """What a pruning kept: ``cfg`` the pruned config; per block (i = 0 .. L - 1 for block i +
    1) the original indices of the kept KV groups (``groups``) and MLP channels
    (``channels``), ascending; ``by``, ``heads``, ``mlp``: how it was asked."""

    cfg: GPTConfig
    groups: list[list[int]]
    channels: list[list[int]]
    by: str
    heads: float
    mlp: float

    def query_heads(self, block: int) -> list[int]:
        """The original indices of the query heads block ``block`` (0-based) keeps."""
        r = self.cfg.heads // self.cfg.num_kv_heads
        return [g * r + j for g in self.groups[block] for j in range(r)]

    def record(self) -> dict:
        """JSON-able: how it was asked, the counts, and the kept KV groups of every block (the
        channels' indices are left out: they are many)."""
        return {"by": self.by, "heads": self.heads, "mlp": self.mlp,
                "heads_kept": self.cfg.heads, "kv_heads_kept": self.cfg.num_kv_heads,
                "ffn_kept": self.cfg.ffn_size, "kv_groups": self.groups}


def count(fraction, total: int, tp: int, what: str, units: str) -> int:
    """The units kept of ``total`` when ``fraction`` of them go (module docstring);
    ValueError naming the numbers when that removes all of them or leaves a count tp does not
    divide."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or \
            not 0 <= fraction <= 1:
        raise ValueError(f"{what} must be a fraction in [0, 1], got {fraction!r}")
    removed = round(fraction * total)
    kept = total - removed
    if kept < 1:
        raise ValueError(f"{what}={fraction:g} removes all {total} {units} of each block; "
                         f"keep at least {tp}")
    if kept % tp:
        raise ValueError(f"{what}={fraction:g} removes {removed} of the {total} {units} of each "
                         f"block and keeps {kept}, which tp {tp} does not divide (every tp rank "
                         f"keeps the same share): remove a multiple of {tp}, a fraction that is "
                         f"a multiple of {tp}/{total} = {tp / total:g}")
    return kept


def pruned_config(cfg: GPTConfig, groups: int, channels: int) -> GPTConfig:
    """``cfg`` with ``groups`` KV groups (their query heads with them) and ``channels`` MLP
    channels per block; the head width named when heads go."""
    changes = {}
    if groups != cfg.num_kv_heads:
        r = cfg.heads // cfg.num_kv_heads
        changes.update(heads=groups * r, head_dim=cfg.head_size,
                       kv_heads=None if cfg.kv_heads is None else groups)
    if channels != cfg.ffn_size:
        changes["ffn_hidden"] = channels
    return dataclasses.replace(cfg, **changes)


def _best(scores: torch.Tensor, k: int) -> list[list[int]]:
    """Per row, the indices of the ``k`` highest scores (ties: the lower index), ascending."""
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return torch.sort(order, dim=1).values.tolist()


def counts(cfg: GPTConfig, heads: float, mlp: float, tp: int) -> tuple[int, int]:
    """``(KV groups, MLP channels)`` each block of ``cfg`` keeps when ``heads`` of its groups
    and ``mlp`` of its channels go, for a model of ``tp`` ranks (``count``'s ValueErrors)."""
    kv = cfg.num_kv_heads
    units = f"KV groups (heads {cfg.heads}, kv_heads {kv})" if kv != cfg.heads else "heads"
    return (count(heads, kv, tp, "heads", units),
            count(mlp, cfg.ffn_size, tp, "mlp", "MLP channels"))


def keep(cfg: GPTConfig, scores: Scores, heads: float, mlp: float, tp: int, by: str) -> Kept:
    """The ``Kept`` of pruning ``heads`` of the KV groups and ``mlp`` of the channels of
    every block of ``cfg`` by ``scores``, for a model of ``tp`` ranks."""
    kept_groups, kept_channels = counts(cfg, heads, mlp, tp)
    small = pruned_config(cfg, kept_groups, kept_channels)
    small.validate(tp)
    return Kept(small, _best(scores.groups, kept_groups), _best(scores.channels, kept_channels),
                by, float(heads), float(mlp))


def _rows(units: list[int], width: int) -> torch.Tensor:
    """The row indices of ``units``, each ``width`` rows: (len(units) width,) int64."""
    u = torch.tensor(units, dtype=torch.long)
    return (u[:, None] * width + torch.arange(width)).reshape(-1)


def sliced(full: dict[str, torch.Tensor], cfg: GPTConfig, kept: Kept) -> dict:
    """The serial state dict of the pruned model: ``full`` (the original's, ``cfg``) with each
    block's removed heads' rows of q/k/v (weights and biases) and columns of o_proj, and its
    removed channels' rows of gate/up (fc1) and columns of down (fc2), cut out."""
    out = dict(full)
    hd = cfg.head_size
    for b in range(cfg.layers):
        a, m = f"{b + 1}.attn.", f"{b + 1}.mlp."
        q_rows = _rows(kept.query_heads(b), hd)
        kv_rows = _rows(kept.groups[b], hd)
        cuts = {a + "q_proj": (q_rows, 0), a + "k_proj": (kv_rows, 0),
                a + "v_proj": (kv_rows, 0), a + "o_proj": (q_rows, 1)}
        c = torch.tensor(kept.channels[b], dtype=torch.long)
        for name in (("gate_proj", "up_proj") if cfg.mlp == "swiglu" else ("fc1",)):
            cuts[m + name] = (c, 0)
        cuts[m + ("down_proj" if cfg.mlp == "swiglu" else "fc2")] = (c, 1)
        for prefix, (index, dim) in cuts.items():
            out[prefix + ".weight"] = full[prefix + ".weight"].index_select(dim, index)
            if dim == 0 and prefix + ".bias" in full:  # a row layer's bias is per output
                out[prefix + ".bias"] = full[prefix + ".bias"].index_select(0, index)
    return out
