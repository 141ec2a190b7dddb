"""Parallel linears for two layouts Hugging Face models use, kept as they are so that the serial
state dict (``fastpar.full_state_dict``) is the model's own:

    Conv1DColumnParallelLinear, Conv1DRowParallelLinear   # GPT-2's Conv1D: weight (in, out)
    FusedColumnParallelLinear(in, out, parts=(q, k, v))   # projections stacked in one weight
    FusedConv1DColumnParallelLinear(...)                  # both: GPT-2's c_attn

A Conv1D weight is stored (in, out), as the checkpoint has it, and multiplied as its transpose
(``linear_weight``): a column shard cuts dim 1, a row shard dim 0.

A fused projection stacks ``parts`` along its outputs (q, k and v: heads x head size each; gate
and up: two halves). Contiguous column shards would hand rank 0 all of q and part of k; here
every part is cut on its own, and rank r holds the r-th 1/tp of each, side by side: with parts
cut at head boundaries, its q, k and v shards are whole heads, so the model's own forward
(which splits the output into parts of its now 1/tp sizes) runs on its heads. The gathered
tensor puts every part back in place. Such a shard is several boxes of the serial tensor, which
a sharded checkpoint cannot record: ``shard_box`` refuses (save ``full_state_dict`` instead).
"""

from __future__ import annotations

import torch

from fastpar.comm.collectives import all_gather
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fastpar.nn.sharding import resolve_group
from fastpar.runtime import group_rank, group_size


class Conv1DColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` of a Conv1D: the weight (in, out/tp), as the checkpoint's."""

    layout = "conv1d"


class Conv1DRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` of a Conv1D: the weight (in/tp, out), as the checkpoint's."""

    layout = "conv1d"


class FusedColumnParallelLinear(ColumnParallelLinear):
    """A column-parallel fused projection: ``parts`` output sizes (summing to out_features,
    each divisible by tp) cut one by one; the output stays sharded (no gather_output: the
    gathered shards would interleave the parts)."""

    parts: tuple[int, ...] = ()

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, parts,
                 group=None, **kwargs):
        if kwargs.get("gather_output"):
            raise ValueError(f"{type(self).__name__}: gather_output=True would interleave the "
                             f"parts; gather with a plain ColumnParallelLinear instead")
        parts = tuple(int(p) for p in parts)
        tp = group_size(resolve_group(group))
        if sum(parts) != out_features or any(p <= 0 or p % tp for p in parts):
            raise ValueError(f"{type(self).__name__}: parts {parts} must be positive, sum to "
                             f"out_features {out_features} and each divide by tp {tp}")
        object.__setattr__(self, "parts", parts)  # read by shard_full during __init__
        super().__init__(in_features, out_features, bias, group=group, **kwargs)

    def _out_dim(self, name: str) -> int | None:
        return self.shard_dims.get(name)

    def shard_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        dim = self._out_dim(name)
        if dim is None:
            return full
        rank, tp = group_rank(self.group), group_size(self.group)
        return torch.cat([p.chunk(tp, dim)[rank] for p in full.split(self.parts, dim)], dim)

    def gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        dim, tp = self._out_dim(name), group_size(self.group)
        if dim is None or tp == 1:
            return local
        every = all_gather(local.detach().contiguous(), self.group, dim=dim)
        mine = [p // tp for p in self.parts]
        blocks = [block.split(mine, dim) for block in every.chunk(tp, dim)]  # [rank][part]
        return torch.cat([blocks[r][i] for i in range(len(self.parts)) for r in range(tp)], dim)

    def shard_box(self, name: str):
        if name in self.shard_dims and group_size(self.group) > 1:
            raise ValueError(f"{type(self).__name__} (parts {self.parts}): a rank's shard is "
                             f"{len(self.parts)} pieces of the serial {name}, which a sharded "
                             "checkpoint cannot record; save fastpar.full_state_dict(model)")
        return super().shard_box(name)

    def extra_repr(self) -> str:
        return f"parts={self.parts}, " + super().extra_repr()


class FusedConv1DColumnParallelLinear(FusedColumnParallelLinear):
    """GPT-2's ``c_attn``: a fused projection in the Conv1D layout."""

    layout = "conv1d"
