"""Vocab-parallel embedding: each TP rank holds a contiguous range of the vocabulary's rows.

The vocabulary is padded to a multiple of the TP size only to place the cuts (``vocab_range``);
the padding rows are never stored, so they cannot reach outputs, gradients or state dicts. A rank
whose range is empty holds a ``(0, dim)`` weight. With ``E_n`` the rows ``[start, end)``::

    forward: y = all_reduce(E_n[ids - start] masked to ids in [start, end))
             (sequence_parallel: reduce_scatter along sequence_dim instead)
    wgrad:   dE_n[i - start] += dy for ids i in [start, end)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.comm.autograd import reduce_from_tp, reduce_scatter_sequence
from fastpar.comm.collectives import all_gather
from fastpar.nn.sharding import (ShardedModule, copy_into, full_embedding, generator,
                                 resolve_group, vocab_range)
from fastpar.runtime import group_rank, group_size


def unsupported_options(embedding: nn.Embedding) -> list[str]:
    """The options of ``embedding`` a vocab-sharded table cannot reproduce, as ``name=value``:
    max_norm renormalises looked-up rows in place, scale_grad_by_freq counts ids per batch, and
    sparse gradients are not reduced by the collectives."""
    options = []
    if embedding.max_norm is not None:
        options.append(f"max_norm={embedding.max_norm}")
    if embedding.scale_grad_by_freq:
        options.append("scale_grad_by_freq=True")
    if embedding.sparse:
        options.append("sparse=True")
    return options


class VocabParallelEmbedding(ShardedModule):
    """``nn.Embedding`` with its rows split over the TP group; output replicated (or
    sequence-sharded along ``sequence_dim`` when ``sequence_parallel``)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 *, sequence_parallel: bool = False, sequence_dim: int = 1, group=None,
                 device=None, dtype=None, seed=None):
        super().__init__()
        self.group = resolve_group(group)
        self.tp, rank = group_size(self.group), group_rank(self.group)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        if padding_idx is not None and not 0 <= padding_idx < num_embeddings:
            raise ValueError(f"padding_idx {padding_idx} is outside the vocabulary of "
                             f"{num_embeddings}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.vocab_start, self.vocab_end = vocab_range(num_embeddings, rank, self.tp)
        self.per_partition = -(-num_embeddings // self.tp)  # rows per rank of the padded vocab
        self.shard_dims = {"weight": 0}
        rows = self.vocab_end - self.vocab_start
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim, device=device, dtype=dtype))
        if not self.weight.is_meta:
            full = full_embedding(num_embeddings, embedding_dim, padding_idx, generator(seed))
            copy_into(self.weight, self.shard_full("weight", full))

    @classmethod
    def from_serial(cls, embedding: nn.Embedding, group=None, **kwargs):
        """A parallel embedding holding this rank's rows of ``embedding``."""
        options = unsupported_options(embedding)
        if options:
            raise ValueError(f"VocabParallelEmbedding.from_serial: {', '.join(options)} is not "
                             "supported by a vocab-parallel embedding")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                    group=group, device="meta", dtype=embedding.weight.dtype, **kwargs)
        layer.to_empty(device=embedding.weight.device)
        copy_into(layer.weight, layer.shard_full("weight", embedding.weight.detach()))
        layer.weight.requires_grad_(embedding.weight.requires_grad)  # frozen stays frozen
        return layer

    def full_shape(self, name: str) -> tuple[int, ...]:
        return (self.num_embeddings, self.embedding_dim)

    def shard_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return full[self.vocab_start:self.vocab_end]

    def shard_box(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return (self.vocab_start, 0), (self.vocab_end - self.vocab_start, self.embedding_dim)

    def gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return local
        # Equal-sized pieces for the collective: pad to per_partition rows, then drop the padding.
        padded = local.detach().new_zeros(self.per_partition, self.embedding_dim)
        padded[:local.shape[0]] = local.detach()
        return all_gather(padded, self.group, dim=0)[:self.num_embeddings]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp == 1:
            return F.embedding(ids, self.weight, self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        if self.weight.shape[0] == 0:
            # Nothing to look up, but stay in the graph (the empty weight gets an empty grad).
            partial = self.weight.new_zeros(*ids.shape, self.embedding_dim) + self.weight.sum()
        else:
            pad = self.padding_idx
            local_pad = pad - self.vocab_start if pad is not None and not (
                pad < self.vocab_start or pad >= self.vocab_end) else None
            partial = F.embedding(local_ids, self.weight, local_pad)
            partial = partial.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(partial, self.group, self.sequence_dim)
        return reduce_from_tp(partial, self.group, inplace=True)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows=[{self.vocab_start}, "
                f"{self.vocab_end}), tp={self.tp}, sequence_parallel={self.sequence_parallel}")
