"""What this rank holds of the serial model and optimizer state, as pieces of serial tensors.

    pieces = model_pieces(pipe, opt)                 # the weights of record
    pieces, scalars = optimizer_pieces(pipe, opt)    # "<key>:exp_avg", ... and {"step": 10.0}

A ``Piece`` is the elements ``[lo, hi)`` of the row-major flattening of a box of a serial tensor
(``fastpar.checkpoint.boxes``), with ``data`` the ``(hi - lo,)`` tensor that holds them here:
what a sharded save writes and what a resharding load fills. The same code serves both, so a
layout saves exactly what it loads. Where the weights of record are:

    ZeRO (DistributedOptimizer, any stage)   this rank's range of each parameter in its float32
                                             master shard (fastpar.optim.zero_shards); nothing
                                             gathered
    MasterWeights (bf16 without ZeRO)        the whole float32 master of each tp shard
    otherwise                                the parameters (tp shards) themselves

plus every buffer and frozen parameter, whole. The optimizer state per element (AdamW's
``exp_avg``, ``exp_avg_sq``) has the masters' geometry; scalar state (``step``) is the same for
every parameter stepped together and is returned once per kind.

Keys are the serial model's ``state_dict`` keys: a ``Pipeline``'s stages keep them (each rank
has its stages' keys), a ``ShardedModule`` says where its shard sits (``shard_box``).
"""

from __future__ import annotations

import dataclasses

import torch

from fastpar.checkpoint.boxes import Box
from fastpar.optim import DistributedOptimizer, MasterWeights
from fastpar.state_dict import sharded_keys


@dataclasses.dataclass
class Piece:
    section: str                 # "model" or "optimizer"
    name: str                    # serial key ("<param>:<kind>" for optimizer state)
    shape: tuple[int, ...]       # the serial tensor's
    box: Box                     # where the local tensor sits in the serial one
    lo: int                      # elements [lo, hi) of the box's row-major flattening
    hi: int
    data: torch.Tensor           # (hi - lo,): the values here (save) or where they go (load)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype


def _chunks(model) -> list[torch.nn.Module]:
    while hasattr(model, "module") and not hasattr(model, "shard_dims") \
            and not hasattr(model, "chunks"):
        model = model.module  # fastpar.DataParallel and the like
    if hasattr(model, "chunks"):  # a Pipeline: this rank's stages
        return list(model.chunks)
    return [model]


def keyed_tensors(model) -> list[tuple[str, torch.Tensor, tuple, Box]]:
    """``[(serial key, local tensor, serial shape, its box)]`` of every tensor in the model's
    state dict on this rank (parameters and buffers)."""
    out = []
    for chunk in _chunks(model):
        sharded = sharded_keys(chunk)
        for key, t in chunk.state_dict(keep_vars=True).items():
            if key in sharded:
                layer, leaf = sharded[key]
                out.append((key, t, tuple(layer.full_shape(leaf)), layer.shard_box(leaf)))
            else:
                shape = tuple(t.shape)
                out.append((key, t, shape, ((0,) * len(shape), shape)))
    return out


def _zero_ranges(opt: DistributedOptimizer):
    """``{id(param): [(lo, hi, flat group, start in the master shard)]}``: this rank's part of
    each parameter in its group's master shard (empty when another dp rank holds it all)."""
    out = {}
    for f in opt.flat:
        for i, p in enumerate(f.params):
            mine = f.param_range(i)
            out[id(p)] = [(mine[0], mine[1], f, mine[2])] if mine is not None else []
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    assert t.is_contiguous(), "checkpoint pieces are contiguous tensors"
    return t.reshape(-1)


def _saved_parts(model) -> dict[str, tuple]:
    """``{key: (box, lo, hi)}`` of the tensors a layer saves only part of (``saved_part``: a
    quantized row shard's scales, whose edge groups the rank beside it saves): the part's own
    box and its elements ``[lo, hi)`` in the local tensor."""
    out = {}
    for chunk in _chunks(model):
        for key, (layer, leaf) in sharded_keys(chunk).items():
            if hasattr(layer, "saved_part"):
                out[key] = layer.saved_part(leaf)
    return out


def model_pieces(model, opt, saving: bool = False) -> list[Piece]:
    """The weights of record this rank holds (see the module docstring); ``saving``: only the
    part of each tensor this rank writes (its layer's ``saved_part``), else all it loads."""
    ranges = _zero_ranges(opt) if isinstance(opt, DistributedOptimizer) else {}
    saved = _saved_parts(model) if saving else {}
    pieces = []
    for key, t, shape, box in keyed_tensors(model):
        if id(t) in ranges:
            for lo, hi, f, start in ranges[id(t)]:
                pieces.append(Piece("model", key, shape, box, lo, hi,
                                    f.master.detach()[start:start + hi - lo]))
            continue
        if isinstance(opt, MasterWeights) and t.requires_grad:
            t = opt.master_of(t)
        if key in saved:
            part, lo, hi = saved[key]
            pieces.append(Piece("model", key, shape, part, 0, hi - lo, _flat(t)[lo:hi]))
            continue
        pieces.append(Piece("model", key, shape, box, 0, t.numel(), _flat(t)))
    return pieces


def optimizer_pieces(model, opt, kinds=None, scalars=None) -> tuple[list[Piece], dict]:
    """The optimizer state this rank holds, ``(pieces, {scalar kind: value})``. Loading passes
    the checkpoint's ``kinds`` and ``scalars``: missing state is created (zeros, the scalars)
    so that the pieces are where the values go."""
    state = opt.inner.state if isinstance(opt, DistributedOptimizer) else opt.state
    creating = kinds is not None
    ranges = _zero_ranges(opt) if isinstance(opt, DistributedOptimizer) else {}

    # fused / capturable Adam(W) keep their step on the parameters' device, others on the CPU
    on_device = any(g.get("fused") or g.get("capturable") for g in opt.param_groups)

    def st_for(holder: torch.Tensor, like: torch.Tensor) -> dict:
        st = state.get(holder)
        if creating:
            if not st:
                st = state[holder] = {k: torch.zeros_like(like) for k in kinds}
            have = _tensor_kinds(st, like.shape)
            if have != sorted(kinds):
                raise ValueError(f"the checkpoint's optimizer state is {sorted(kinds)}, this "
                                 f"optimizer ({type(opt).__name__}) keeps {have}")
            for k, v in scalars.items():
                if isinstance(st.get(k), torch.Tensor):
                    st[k].fill_(float(v))  # in place: its dtype and device stay
                else:
                    st[k] = torch.tensor(float(v), dtype=torch.float32,
                                         device=like.device if on_device else "cpu")
        if not st:
            raise ValueError("optimizer state is missing for some parameters (save after the "
                             "first step)")
        return st

    found_kinds, found_scalars, pieces = kinds, {}, []
    for key, t, shape, box in keyed_tensors(model):
        if not t.requires_grad:
            continue
        if isinstance(opt, DistributedOptimizer):
            for lo, hi, f, start in ranges.get(id(t), []):
                st = st_for(f.master, f.master.detach())
                found_kinds = found_kinds or _tensor_kinds(st, f.master.shape)
                found_scalars = found_scalars or _scalars(st, found_kinds)
                for k in found_kinds:
                    pieces.append(Piece("optimizer", f"{key}:{k}", shape, box, lo, hi,
                                        st[k][start:start + hi - lo]))
            continue
        holder = opt.master_of(t) if isinstance(opt, MasterWeights) else t
        st = st_for(holder, holder.detach())
        found_kinds = found_kinds or _tensor_kinds(st, holder.shape)
        found_scalars = found_scalars or _scalars(st, found_kinds)
        for k in found_kinds:
            pieces.append(Piece("optimizer", f"{key}:{k}", shape, box, 0, t.numel(),
                                _flat(st[k])))
    return pieces, found_scalars


def _tensor_kinds(st: dict, shape) -> list[str]:
    return sorted(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0
                  and tuple(v.shape) == tuple(shape))


def _scalars(st: dict, kinds) -> dict:
    return {k: float(v) for k, v in st.items() if k not in kinds}
