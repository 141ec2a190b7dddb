"""The transformer MLP as one TP region: column-parallel up, activation on shards,
row-parallel down.

    gelu:    y = fc2(gelu(fc1(x)))                               fc1: column, fc2: row
             (gelu_tanh: gelu's tanh approximation, GPT-2's "gelu_new")
    swiglu:  y = down_proj(silu(gate_proj(x)) * up_proj(x))      gate/up: column, down: row

The ffn dim is split over the TP group; the input crosses into the region once (one copy_to_tp or
all-gather for gate and up together) and the output leaves it once (all-reduce or reduce-scatter).
Parameter names match the serial module with the same structure, so state dicts line up.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.nn import random as tp_random
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear, pieces_argument
from fastpar.nn.sharding import generator, resolve_group


class ParallelMLP(nn.Module):
    """``activation``: "gelu" (erf form, as ``F.gelu``), "gelu_tanh" (``F.gelu(approximate=
    "tanh")``) or "swiglu". ``seed`` as for the linear
    layers; the sublayers draw in the serial order (fc1, fc2 / gate, up, down). ``dropout`` is
    applied to the output; under sequence parallelism each rank's tokens get their own stream."""

    def __init__(self, hidden_size: int, ffn_hidden_size: int, activation: str = "gelu",
                 bias: bool = True, dropout: float = 0.0, *, sequence_parallel: bool = False,
                 sequence_dim: int = 1, overlap=None, overlap_pieces=None, group=None,
                 device=None, dtype=None, seed=None, chunks=None):
        super().__init__()
        overlap_pieces = pieces_argument(overlap_pieces, chunks, "ParallelMLP")
        if activation not in ("gelu", "gelu_tanh", "swiglu"):
            raise ValueError(f"activation must be 'gelu', 'gelu_tanh' or 'swiglu', got "
                             f"{activation!r}")
        self.activation, self.dropout = activation, dropout
        self.group = resolve_group(group)
        self.sequence_parallel = sequence_parallel
        gen = generator(seed)
        common = dict(sequence_parallel=sequence_parallel, sequence_dim=sequence_dim,
                      overlap=overlap, overlap_pieces=overlap_pieces, group=self.group,
                      device=device, dtype=dtype, seed=gen)

        def column():
            return ColumnParallelLinear(hidden_size, ffn_hidden_size, bias, **common)

        if activation != "swiglu":
            self.fc1 = column()
            self.fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias, **common)
        else:
            self.gate_proj, self.up_proj = column(), column()
            self.down_proj = RowParallelLinear(ffn_hidden_size, hidden_size, bias, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation != "swiglu":
            approximate = "tanh" if self.activation == "gelu_tanh" else "none"
            h = F.gelu(self.fc1(x), approximate=approximate)  # (..., ffn / tp)
            y = self.fc2(h)
        else:
            # one entry communication for both column layers (overlapped by policy)
            gate, up = ColumnParallelLinear.shared_forward(x, [self.gate_proj, self.up_proj])
            h = F.silu(gate) * up  # (..., ffn / tp)
            y = self.down_proj(h)
        if self.dropout and self.training:
            region = tp_random.fork("tp", self.group) if self.sequence_parallel \
                else contextlib.nullcontext()
            with region:
                y = F.dropout(y, self.dropout, training=True)
        return y
