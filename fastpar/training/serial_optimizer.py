"""Optimizer state in the serial layout, so a checkpoint reshards to any (tp, pp, dp).

    tensors, scalars = serial_optimizer_state(model, opt)      # collective; same on every rank
    load_serial_optimizer_state(model, opt, tensors, scalars)  # the inverse, at any layout

The model's weights already travel in the serial layout (``fastpar.full_state_dict``); an
optimizer whose state is per element (AdamW: ``exp_avg``, ``exp_avg_sq``) has tensors shaped
like the parameters, sharded the same way. So each state kind is gathered by the same code:
the parameters' ``.data`` are swapped for the state tensors, ``full_state_dict`` gathers them
into serial names (``"<param>:<kind>"``), and loading runs ``load_full_state_dict`` into
swapped-in zero tensors. Scalar state (Adam's ``step``) is the same for every parameter of a
run that steps them together; it is returned once per kind.

Works for ``torch.optim`` optimizers over ``model.parameters()`` in order, for
``fastpar.optim.MasterWeights`` over them (the state is its masters', float32), and for
``fastpar.optim.DistributedOptimizer`` (ZeRO-1: its consolidated flat state is split per
parameter first, and rebuilt the same way on load, at any dp size).
"""

from __future__ import annotations

import contextlib

import torch

from fastpar.optim import DistributedOptimizer, MasterWeights
from fastpar.state_dict import full_state_dict, load_full_state_dict


@contextlib.contextmanager
def swapped(params, tensors):
    """Every ``p.data`` replaced by the matching tensor for the duration."""
    old = [p.data for p in params]
    try:
        for p, t in zip(params, tensors):
            p.data = t
        yield
    finally:
        for p, o in zip(params, old):
            p.data = o


def _state_dtype(opt, p) -> torch.dtype:
    """The dtype ``opt`` keeps ``p``'s state in: its masters' (float32 for a bf16 model)."""
    if isinstance(opt, MasterWeights):
        return opt.master_of(p).dtype
    if isinstance(opt, DistributedOptimizer):
        return next((f.master.dtype for f in opt.flat if any(q is p for q in f.params)),
                    p.dtype)
    return p.dtype


def _per_param(model, opt) -> tuple[list, dict[str, list], dict]:
    """``(params, {kind: [tensor per param]}, {kind: scalar})`` of this rank's optimizer."""
    params = [p for p in model.parameters()]
    if isinstance(opt, DistributedOptimizer):
        full = opt.consolidated_state_dict()  # flat per group; the same on every dp rank
        where = {id(p): (i, a, b) for i, f in enumerate(opt.flat)
                 for p, a, b in zip(f.params, f.offsets, f.offsets[1:])}
        kinds = sorted({k for st in full["state"].values() for k, v in st.items()
                        if isinstance(v, torch.Tensor) and v.dim() == 1})
        scalars = {k: float(v) for st in full["state"].values() for k, v in st.items()
                   if k not in kinds}
        # in the state's own dtype (a bf16 model's ZeRO state is float32, as its masters)
        per = {k: [full["state"][where[id(p)][0]][k][where[id(p)][1]:where[id(p)][2]]
                   .view(p.shape) for p in params] for k in kinds}
        return params, per, scalars
    if isinstance(opt, MasterWeights):  # the state is the float32 masters'
        state = [opt.state.get(opt.master_of(p), {}) for p in params]
    else:
        state = [opt.state.get(p, {}) for p in params]
    if any(not st for st in state):
        raise ValueError("optimizer state is missing for some parameters (save after the "
                         "first step)")
    kinds = sorted(k for k, v in state[0].items() if isinstance(v, torch.Tensor)
                   and v.shape == params[0].shape and v.dim() > 0)
    scalars = {k: float(v) for k, v in state[0].items() if k not in kinds}
    return params, {k: [st[k] for st in state] for k in kinds}, scalars


@torch.no_grad()
def serial_optimizer_state(model, opt) -> tuple[dict[str, torch.Tensor], dict]:
    """``({"<serial param name>:<kind>": tensor}, {kind: scalar})``: collective over every
    group ``full_state_dict`` gathers over; identical on every rank."""
    params, per, scalars = _per_param(model, opt)
    out = {}
    with _unreleased(opt):
        for kind, tensors in per.items():
            with swapped(params, tensors):
                for name, t in full_state_dict(model).items():
                    out[f"{name}:{kind}"] = t
    return out, scalars


def _unreleased(opt):
    """ZeRO-3: the module's state_dict refuses released parameters, even swapped ones."""
    return opt.gathered() if isinstance(opt, DistributedOptimizer) else contextlib.nullcontext()


@torch.no_grad()
def load_serial_optimizer_state(model, opt, tensors: dict[str, torch.Tensor],
                                scalars: dict) -> None:
    """Give ``opt`` the state ``serial_optimizer_state`` saved (under any layout); the model's
    weights must already be loaded. Collective like ``load_full_state_dict``."""
    params = list(model.parameters())
    kinds = sorted({k.rsplit(":", 1)[1] for k in tensors})
    per = {}
    for kind in kinds:
        serial = {k.rsplit(":", 1)[0]: v for k, v in tensors.items() if k.endswith(":" + kind)}
        fresh = [torch.zeros_like(p, dtype=_state_dtype(opt, p)) for p in params]
        with _unreleased(opt), swapped(params, fresh):
            load_full_state_dict(model, serial)
        per[kind] = fresh
    if isinstance(opt, DistributedOptimizer):
        inner = opt.inner.state_dict()
        position = {id(p): j for j, p in enumerate(params)}
        state = {}
        for i, f in enumerate(opt.flat):
            index = [position[id(p)] for p in f.params]  # flat order
            st = {k: torch.cat([per[k][j].reshape(-1) for j in index]).to(f.master.dtype)
                  for k in kinds}
            st.update({k: torch.tensor(v) for k, v in scalars.items()})
            state[i] = st
        masters = [torch.cat([p.detach().reshape(-1) for p in f.params]).to(f.master.dtype)
                   for f in opt.flat]
        opt.load_consolidated_state_dict({"numels": [f.numel for f in opt.flat],
                                          "masters": masters, "state": state,
                                          "param_groups": inner["param_groups"]})
        return
    sd = opt.state_dict()
    order = [id(p) for g in opt.param_groups for p in g["params"]]
    held = [opt.master_of(p) for p in params] if isinstance(opt, MasterWeights) else params
    if order != [id(p) for p in held]:
        raise ValueError("the optimizer must hold model.parameters(), in order")
    state = {}
    for j in range(len(params)):
        st = {k: per[k][j] for k in kinds}
        st.update({k: torch.tensor(v, dtype=torch.float32) for k, v in scalars.items()})
        state[j] = st
    opt.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
