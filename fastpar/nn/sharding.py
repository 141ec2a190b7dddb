"""How a parallel layer finds its group, cuts a serial tensor into shards and builds its weights.

Initialisation contract: a layer holds exactly its slice of the weight the serial module
(``nn.Linear`` / ``nn.Embedding`` built on the CPU in float32) would hold when drawn from the same
random stream, so a model at TP=1 and at TP=N is the same model. ``seed`` picks the stream:

* ``None``: the global CPU generator, as ``nn.Linear`` uses it (ranks agree when seeded alike);
* an ``int``: a fresh ``torch.Generator`` seeded with it;
* a ``torch.Generator``: used as is, so a block can draw its layers in the serial order.

The full tensor is drawn on every rank and sliced; ``device="meta"`` skips drawing (``parallelize``
fills such layers from an existing module).

Sharded layers describe their parameters with ``shard_dims``: ``{param name: dim}``.
``full_state_dict`` and ``load_full_state_dict`` use it through ``gather_full`` / ``shard_full``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fastpar.runtime import group_rank, group_size, is_initialized, topology


def resolve_group(group):
    """``group`` itself, or the current topology's tp group when ``None``.

    In ``fastpar.nn`` (layers, cross-entropy, RNG streams, ``parallelize``) ``group=None`` means
    the tp group, the group a tensor-parallel layer shards over. (The raw collectives of
    ``fastpar.comm`` take ``None`` to mean the world, as torch.distributed does.)"""
    if group is not None:
        return group
    if not is_initialized():
        raise RuntimeError("a fastpar parallel layer needs group= or fastpar.init() first")
    return topology().tp_group


def generator(seed) -> torch.Generator | None:
    """The CPU generator for ``seed`` (``None``: the global one); see the module docstring."""
    if seed is None or isinstance(seed, torch.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be None, an int or a torch.Generator, got {seed!r}")
    return torch.Generator().manual_seed(seed)


def full_linear(out_features: int, in_features: int, bias: bool, gen):
    """The serial ``nn.Linear`` weight and bias, drawn in its order (weight, then bias)."""
    weight = torch.empty(out_features, in_features)
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=gen)
    b = None
    if bias:
        bound = 1 / math.sqrt(in_features) if in_features > 0 else 0
        b = torch.empty(out_features).uniform_(-bound, bound, generator=gen)
    return weight, b


def full_embedding(num_embeddings: int, embedding_dim: int, padding_idx, gen) -> torch.Tensor:
    """The serial ``nn.Embedding`` weight (normal, padding row zeroed)."""
    weight = torch.empty(num_embeddings, embedding_dim).normal_(generator=gen)
    if padding_idx is not None:
        weight[padding_idx].zero_()
    return weight


def even_shard(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's equal chunk of ``full`` along ``dim``."""
    n = group_size(group)
    assert full.shape[dim] % n == 0, (full.shape, dim, n)
    return full.chunk(n, dim=dim)[group_rank(group)]


def vocab_range(num_embeddings: int, rank: int, size: int) -> tuple[int, int]:
    """``[start, end)`` of the rows rank owns: the vocab is padded to a multiple of ``size``,
    cut in equal parts, and the padding dropped (the last ranks may own fewer rows, even none)."""
    per = -(-num_embeddings // size)
    start = min(rank * per, num_embeddings)
    return start, min(start + per, num_embeddings)


def copy_replicated(param: torch.Tensor, group) -> torch.Tensor:
    """Megatron's f for a parameter replicated over the tp group that meets only this rank's
    tokens (sequence parallelism: norm weights and biases, a row layer's bias, learned
    positions). forward: ``y = param``; backward: ``dparam = all_reduce(dparam_n)`` summed in
    float32 at least: a bf16 / fp16 gradient is widened (exactly), summed, and rounded once to
    the parameter's dtype, rather than rounded after each rank's addition (pytorch#190626 is
    FSDP2 summing such gradients in bf16)."""
    from fastpar.comm.autograd import copy_to_tp

    if group_size(group) == 1:
        return param
    wide = torch.promote_types(param.dtype, torch.float32)
    if wide == param.dtype:
        return copy_to_tp(param, group)
    return copy_to_tp(param.to(wide), group).to(param.dtype)  # forward: exact round trip


def copy_into(param: nn.Parameter, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value.to(device=param.device, dtype=param.dtype))


class ShardedModule(nn.Module):
    """Base of the layers that hold shards: maps a full tensor to the local one and back.

    Subclasses set ``self.group`` and ``self.shard_dims`` (parameter name -> sharded dim); dim 0
    of a vocab-sharded embedding is uneven and handled by overriding the three methods.
    """

    shard_dims: dict[str, int] = {}

    def full_shape(self, name: str) -> tuple[int, ...]:
        """The serial shape of parameter ``name``: the one ``shard_full`` takes."""
        shape = list(getattr(self, name).shape)
        dim = self.shard_dims.get(name)
        if dim is not None:
            shape[dim] *= group_size(self.group)
        return tuple(shape)

    def shard_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        dim = self.shard_dims.get(name)
        return full if dim is None else even_shard(full, dim, self.group)

    def shard_box(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(offsets, sizes)``: where this rank's ``name`` lies in the serial tensor (what
        ``shard_full`` cuts out; sharded checkpoints record it, ``fastpar.checkpoint``)."""
        sizes = tuple(getattr(self, name).shape)
        offsets = [0] * len(sizes)
        dim = self.shard_dims.get(name)
        if dim is not None:
            offsets[dim] = group_rank(self.group) * sizes[dim]
        return tuple(offsets), sizes

    def gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        from fastpar.comm.collectives import all_gather

        dim = self.shard_dims.get(name)
        if dim is None or group_size(self.group) == 1:
            return local
        return all_gather(local.detach().contiguous(), self.group, dim=dim)
