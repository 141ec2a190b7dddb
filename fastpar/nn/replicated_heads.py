"""Key/value projections when tensor parallelism exceeds the KV heads: each head replicated.

    k_proj = HeadReplicatedLinear(hidden, kv_heads * head_dim, bias, heads=kv_heads, group=tp)

A grouped-query model with fewer KV heads than tp ranks (Llama 3 8B: 8 KV heads, tp 16) cannot
give each rank its own KV heads. As vLLM does, each rank holds the one KV head its query heads
use: with ``r = tp / kv_heads`` ranks per head, rank ``i`` holds head ``i // r`` (its query heads
``i * h/tp ..`` map to that KV head under grouped-query attention), so r ranks hold each head
alike. The KV cache per rank is then one head's, ``kv_heads / tp`` of one process's no longer.

Inference only: a replica's weight gradient would hold only its own query heads' share of the
head's gradient (the sum over the r replicas is the gradient), so a forward that would build one
is refused; train at a tp that divides the KV heads. The serial state dict is the model's own
(``gather_full`` takes each head once), and a checkpoint's replicas of a head are replicas.
"""

from __future__ import annotations

import torch
from torch import nn

from fastpar.comm.collectives import all_gather
from fastpar.nn.linear import ColumnParallelLinear
from fastpar.nn.sharding import copy_into, full_linear, generator, resolve_group
from fastpar.runtime import group_rank, group_size


class HeadReplicatedLinear(ColumnParallelLinear):
    """A column-parallel linear of ``heads`` blocks of outputs over more ranks than blocks (the
    group's size a multiple of ``heads``): rank ``i`` holds block ``i // (tp / heads)``. The
    output stays this rank's block (the input of its attention heads)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, heads: int,
                 group=None, device=None, dtype=None, seed=None, **kwargs):
        tp = group_size(resolve_group(group))
        if heads < 1 or tp % heads or out_features % heads:
            raise ValueError(f"HeadReplicatedLinear: {heads} heads of {out_features} outputs "
                             f"cannot be replicated over tp {tp} (tp must be a multiple of the "
                             "heads, the outputs of them)")
        block = out_features // heads
        # the parallel layer's machinery over tp blocks of one head's width (made on meta),
        # then this rank's head as the parameters
        super().__init__(in_features, block * tp, bias, group=group, device="meta",
                         dtype=dtype, **kwargs)
        self.heads, self.block, self.serial_out = heads, block, out_features
        self.replicas = tp // heads
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(block, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(block, **factory)) if bias else None
        if not self.weight.is_meta:
            weight, b = full_linear(out_features, in_features, bias, generator(seed))
            copy_into(self.weight, self.shard_full("weight", weight))
            if bias:
                copy_into(self.bias, self.shard_full("bias", b))

    @classmethod
    def from_serial(cls, linear: nn.Linear, group=None, *, heads: int, **kwargs):
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                    heads=heads, group=group, device="meta", dtype=linear.weight.dtype,
                    **kwargs)
        layer.to_empty(device=linear.weight.device)
        copy_into(layer.weight, layer.shard_full("weight", linear.weight.detach()))
        if linear.bias is not None:
            copy_into(layer.bias, layer.shard_full("bias", linear.bias.detach()))
        return layer

    def _head(self) -> int:
        return group_rank(self.group) // self.replicas

    def full_shape(self, name: str) -> tuple[int, ...]:
        shape = list(getattr(self, name).shape)
        shape[0] = self.serial_out
        return tuple(shape)

    def shard_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.heads, 0)[self._head()]

    def shard_box(self, name: str):
        sizes = tuple(getattr(self, name).shape)
        return (self._head() * self.block,) + (0,) * (len(sizes) - 1), sizes

    def gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        every = all_gather(local.detach().contiguous(), self.group, dim=0)
        blocks = every.chunk(group_size(self.group), 0)
        return torch.cat(blocks[::self.replicas], 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._refuse_training()
        return super().forward(x)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        self._refuse_training()
        return super().local(x)

    def _refuse_training(self) -> None:
        if torch.is_grad_enabled() and (self.weight.requires_grad or (
                self.bias is not None and self.bias.requires_grad)):
            raise ValueError(f"KV heads replicated over tp ({self.heads} heads on "
                             f"{self.heads * self.replicas} ranks) serve inference only: run "
                             "under torch.no_grad() (generation does), or train at a tp that "
                             "divides the KV heads")

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, replicas={self.replicas}, in_features={self.in_features},"
                f" out_features={self.serial_out}, this rank's head={self._head()}")
