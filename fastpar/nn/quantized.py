"""Tensor-parallel linears with int8 / int4 weights, and ``fastpar.quantize_weights``.

    fastpar.quantize_weights(model, "int8")                  # in place; returns the model
    fastpar.quantize_weights(model, "int4", group_size=128)

Every ``ColumnParallelLinear`` / ``RowParallelLinear`` (the KV heads' ``HeadReplicatedLinear``,
a head that is not tied to the embedding, the Conv1D layout of GPT-2 too) becomes its quantized
twin: the same group, collectives and state-dict prefix; its tp shard kept as
``fastpar.nn.qweight``'s integers and float32 scales (buffers), the bias as it was; ``qmatmul``
where the float layer ran ``F.linear``. Embeddings, norms and a tied head stay in their dtype.
Inference only: the integers take no gradient (an input's gradient still flows). With N out and
K in features, n = tp, per rank::

    column  qweight (N/n, K) int8 | (N/n, K/2) uint8   scales, offsets (groups, N/n)   bias (N/n)
    row     qweight (N, K/n) int8 | (N, K/2n) uint8    scales, offsets (its groups, N) bias (N)

A row shard's groups are its columns' serial groups (``qweight.Grid``): a group cut by a shard
boundary is held in part by the two ranks beside it, with the whole group's scale (computed
once, by a max of the group's statistics over the tp group), so the quantized model is the same
at every tp; a checkpoint stores each group's scales once (``saved_part``: from the shard its
first column lies in) and reshards exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from fastpar.comm.autograd import reduce_from_tp, reduce_scatter_sequence, scatter_to_tp
from fastpar.comm.collectives import all_gather, all_reduce
from fastpar.nn import overlap as ov
from fastpar.nn import qweight
from fastpar.nn.fused import FusedColumnParallelLinear
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fastpar.nn.replicated_heads import HeadReplicatedLinear
from fastpar.nn.sharding import copy_replicated
from fastpar.runtime import group_rank

NO_OVERLAP = ov.Decision(False, 1, "quantized weights: the collective runs whole")
_SCALES = ("scales", "offsets")


class QuantizedLinear:
    """The storage and GEMM shared by the quantized layers (mixed in before the float class):
    ``isinstance(m, QuantizedLinear)`` finds them all."""

    sharded_in = False  # a row layer: this shard's columns start at rank * K / n

    def _quantize(self, layer: nn.Module, fmt: str, group_size) -> None:
        # not the float class's constructor (it would draw a float weight): the float layer's
        # settings (its public attributes: group, tp, sizes, gather_output, heads, ...), then
        # the integers in place of its weight
        nn.Module.__init__(self)
        for name, value in vars(layer).items():
            if not name.startswith("_"):
                setattr(self, name, value)
        self.overlap, self.overlap_pieces, self.overlap_decision = False, None, NO_OVERLAP
        self._decision_key = self._signal_key = self._signal_comm = None
        self.fmt = fmt
        self.bits, group = qweight.check_format(fmt, group_size)
        w = layer.linear_weight.detach()  # (N, K) of this shard
        start = group_rank(self.group) * w.shape[1] if self.sharded_in else 0
        if self.bits == 4 and self.sharded_in and w.shape[1] % 2:
            raise ValueError(f"int4 packs two columns per byte: a row-parallel shard of "
                             f"{w.shape[1]} columns (in_features {self.in_features} / tp "
                             f"{self.tp}) must be even; use int8")
        self.grid = qweight.Grid(group, start, w.shape[1])
        stats = qweight.group_stats(w, self.bits, self.grid)
        if self.sharded_in and self.tp > 1 and not w.is_meta:  # the edge groups' statistics
            # over the whole group (a layer on meta, weighed by a pipeline, has no values)
            every = stats.new_full((self.serial_groups,) + stats.shape[1:], -torch.inf)
            every[self.grid.first:self.grid.first + self.grid.groups] = stats
            stats = all_reduce(every, self.group, op="max")[
                self.grid.first:self.grid.first + self.grid.groups]
        q, scales, offsets = qweight.quantize(w, self.bits, self.grid, stats)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.register_buffer("offsets", offsets)
        bias = layer.bias
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)

    @classmethod
    def from_serial(cls, *args, **kwargs):
        raise TypeError(f"{cls.__name__} is made from a float parallel layer: "
                        f"{cls.__name__}(layer, fmt), or fastpar.quantize_weights(model, fmt)")

    @property
    def serial_groups(self) -> int:
        return -(-self.in_features // self.grid.group)

    @property
    def weight_numel(self) -> int:
        """The weights this shard stands for (out x in of its float form)."""
        return self.qweight.shape[0] * self.grid.columns

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` and the like move the scales but keep their float32 values (the
        format's: a cast to bf16 and back would round them)."""
        kept = {name: getattr(self, name) for name in _SCALES}
        super()._apply(fn, recurse)
        for name, t in kept.items():
            if t is None:
                continue
            now = getattr(self, name)  # fn's device; the scales' own dtype and values
            setattr(self, name, now.float() if t.is_meta or now.is_meta else
                    t.to(device=now.device))
        return self

    def _decide(self, x, op, features):
        return NO_OVERLAP

    def _refuse_training(self) -> None:
        """Nothing to refuse: the integers take no gradient (HeadReplicatedLinear asks)."""

    def qmatmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W_n.T`` of this shard, in x's dtype."""
        return qweight.qmatmul(x, self.qweight, self.scales, self.offsets, self.bits, self.grid)

    @property
    def linear_weight(self) -> torch.Tensor:
        """This shard's weight dequantized, (out, in) in float32 (a new tensor)."""
        return qweight.dequantize(self.qweight, self.scales, self.offsets, self.bits, self.grid)

    def saved_part(self, name: str):
        """``(box, lo, hi)``: the part of this rank's ``name`` that a checkpoint stores, its box
        in the serial tensor and its elements [lo, hi) here: a row shard's scales from its
        first group that starts inside it (the rank before saves the group they share)."""
        t = getattr(self, name)
        (offsets, sizes), skip = self.shard_box(name), 0
        if name in _SCALES and self.sharded_in:
            skip = self.grid.owned_first - self.grid.first
            offsets, sizes = (offsets[0] + skip,) + offsets[1:], (sizes[0] - skip,) + sizes[1:]
        return (offsets, sizes), skip * t[0].numel() if t.dim() else 0, t.numel()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, tp={self.tp}, weights={self.fmt}, "
                f"group_size={self.grid.group}")


class QuantizedColumnParallelLinear(QuantizedLinear, ColumnParallelLinear):
    """``ColumnParallelLinear`` with a quantized shard (the module docstring)."""

    def __init__(self, layer: ColumnParallelLinear, fmt: str, group_size=None):
        self._quantize(layer, fmt, group_size)
        self.shard_dims = {"qweight": 0, "scales": 1, "offsets": 1}
        if self.bias is not None:
            self.shard_dims["bias"] = 0

    def local(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qmatmul(x)
        return y if self.bias is None else y + self.bias


class QuantizedRowParallelLinear(QuantizedLinear, RowParallelLinear):
    """``RowParallelLinear`` with a quantized shard (the module docstring)."""

    sharded_in = True

    def __init__(self, layer: RowParallelLinear, fmt: str, group_size=None):
        self._quantize(layer, fmt, group_size)
        # the scales' dim 0 is their groups: cut at the shard's columns, its edge groups
        # shared with the ranks beside it (the methods below)
        self.shard_dims = {"qweight": 1, "scales": 0, "offsets": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp > 1 and not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = self.qmatmul(x)
        if self.tp > 1 and self.sequence_parallel:
            y = reduce_scatter_sequence(y, self.group, self.sequence_dim)
        elif self.tp > 1:
            y = reduce_from_tp(y, self.group, inplace=True)  # fresh, saved by nobody
        bias = self.bias
        if bias is not None and self.sequence_parallel:
            bias = copy_replicated(bias, self.group)
        return y if bias is None else y + bias

    # the scales' rows are groups: a shard's are rows first .. first + groups of the serial
    # tensor, its edge rows shared with the ranks beside it
    def full_shape(self, name: str) -> tuple[int, ...]:
        if name in _SCALES:
            return self.serial_groups, getattr(self, name).shape[1]
        return super().full_shape(name)

    def shard_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name in _SCALES:
            return full[self.grid.first:self.grid.first + self.grid.groups]
        return super().shard_full(name, full)

    def shard_box(self, name: str):
        if name in _SCALES:
            return (self.grid.first, 0), tuple(getattr(self, name).shape)
        return super().shard_box(name)

    def gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if name not in _SCALES or self.tp == 1:
            return super().gather_full(name, local)
        grids = [qweight.Grid(self.grid.group, r * self.grid.columns, self.grid.columns)
                 for r in range(self.tp)]
        most = max(g.groups for g in grids)
        padded = local.new_zeros((most,) + tuple(local.shape[1:]))
        padded[:local.shape[0]] = local.detach()
        every = all_gather(padded, self.group, dim=0).split(most)
        full = local.new_empty(self.full_shape(name))
        for g, part in zip(grids, every):
            full[g.first:g.first + g.groups] = part[:g.groups]
        return full


class QuantizedHeadReplicatedLinear(QuantizedLinear, HeadReplicatedLinear):
    """``HeadReplicatedLinear`` (a KV head per rank, replicated) with a quantized head; its
    scales' head blocks lie along dim 1."""

    def __init__(self, layer: HeadReplicatedLinear, fmt: str, group_size=None):
        self._quantize(layer, fmt, group_size)
        self.shard_dims = {"qweight": 0, "scales": 1, "offsets": 1}
        if self.bias is not None:
            self.shard_dims["bias"] = 0

    def full_shape(self, name: str) -> tuple[int, ...]:
        if name in _SCALES:
            return getattr(self, name).shape[0], self.serial_out
        return super().full_shape(name)

    def shard_full(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if name in _SCALES:
            return full.chunk(self.heads, 1)[self._head()]
        return super().shard_full(name, full)

    def shard_box(self, name: str):
        if name in _SCALES:
            return (0, self._head() * self.block), tuple(getattr(self, name).shape)
        return super().shard_box(name)

    def gather_full(self, name: str, local: torch.Tensor) -> torch.Tensor:
        if name in _SCALES:
            return super().gather_full(name, local.t().contiguous()).t().contiguous()
        return super().gather_full(name, local)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        y = self.qmatmul(x)
        return y if self.bias is None else y + self.bias


def _twin(layer: nn.Module):
    for float_cls, cls in ((HeadReplicatedLinear, QuantizedHeadReplicatedLinear),
                           (ColumnParallelLinear, QuantizedColumnParallelLinear),
                           (RowParallelLinear, QuantizedRowParallelLinear)):
        if isinstance(layer, float_cls):
            return cls
    return None


def quantize_weights(model: nn.Module, weights: str, group_size: int | None = None) -> nn.Module:
    """Quantize ``model``'s parallel linears in place to ``weights`` ("int8" or "int4") with
    groups of ``group_size`` input columns (None: 128 for int8, 64 for int4); see the module
    docstring. Collective over each layer's tp group (a row layer's edge groups). Returns the
    model (a new layer when ``model`` is a parallel linear itself)."""
    qweight.check_format(weights, group_size)
    tied = {id(p) for m in model.modules() for p in getattr(m, "tied_copies", ())}
    todo = [(name, module) for name, module in model.named_modules()
            if _twin(module) is not None and not isinstance(module, QuantizedLinear)
            and id(module.weight) not in tied]
    for name, module in todo:  # every refusal before any change
        if isinstance(module, FusedColumnParallelLinear):
            raise ValueError(f"{name}: a fused projection ({type(module).__name__}) is not "
                             "quantized: its shards hold parts of several weights")
        if qweight.FORMATS[weights] == 4 and isinstance(module, RowParallelLinear) and \
                module.in_features // module.tp % 2:
            raise ValueError(f"{name}: int4 packs two columns per byte, and a row-parallel "
                             f"shard of {module.in_features} in_features / tp {module.tp} = "
                             f"{module.in_features // module.tp} columns is odd; use int8")
    for name, module in todo:
        cls = _twin(module)
        if not name:
            return cls(module, weights, group_size)
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf,
                cls(module, weights, group_size))
    return model


def quantized_meta(model: nn.Module) -> dict | None:
    """``{"format", "group_size"}`` of ``model``'s quantized layers (what a checkpoint of it
    records), None when it has none."""
    kinds = {(m.fmt, m.grid.group) for m in model.modules() if isinstance(m, QuantizedLinear)}
    if len(kinds) > 1:
        raise ValueError(f"the model's layers are quantized in several ways: {sorted(kinds)}")
    if not kinds:
        return None
    fmt, group = kinds.pop()
    return {"format": fmt, "group_size": group}
