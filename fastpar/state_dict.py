"""Serial-shaped state dicts of models holding fastpar's sharded layers.

    sd = fastpar.full_state_dict(model)      # the serial model's keys and shapes, on every rank
    fastpar.load_full_state_dict(model, sd)  # each rank copies its shard of every tensor

Sharded layers (``fastpar.nn.ShardedModule``) say how each of their parameters is cut
(``shard_dims``); every other tensor is replicated and taken as it is. ``full_state_dict``
gathers every sharded tensor over its layer's tp group, so it is collective: call it on every
rank. ``load_full_state_dict`` communicates nothing: each rank slices its own shards out of the
serial tensors.

An object with its own ``_full_state_dict`` / ``_load_full_state_dict`` answers for itself: a
``fastpar.pipeline.Pipeline`` (its stages are on other ranks, so its ``full_state_dict`` is
collective over the world and returns CPU tensors) and a ``fastpar.DataParallel`` (its
module's).
"""

from __future__ import annotations

import torch
from torch import nn

from fastpar.nn.sharding import ShardedModule


def _module(obj) -> nn.Module:
    if not isinstance(obj, nn.Module):
        raise TypeError(f"expected an nn.Module holding fastpar layers, got {type(obj).__name__}")
    return obj


def sharded_keys(model: nn.Module) -> dict[str, tuple[ShardedModule, str]]:
    """State-dict key -> (layer, parameter name) for every sharded parameter."""
    keys = {}
    for prefix, module in model.named_modules():
        if isinstance(module, ShardedModule):
            for name in module.shard_dims:
                if getattr(module, name, None) is not None:
                    keys[f"{prefix}.{name}" if prefix else name] = (module, name)
    return keys


def full_state_dict(obj) -> dict[str, torch.Tensor]:
    """The state dict the serial model would have (detached tensors on the model's devices)."""
    if hasattr(obj, "_full_state_dict"):  # a Pipeline: its stages live on other ranks too
        return obj._full_state_dict()
    model = _module(obj)
    sharded = sharded_keys(model)
    out = {}
    for key, value in model.state_dict(keep_vars=False).items():
        if key in sharded:
            layer, name = sharded[key]
            value = layer.gather_full(name, value)
        out[key] = value.detach().clone()
    return out


def load_full_state_dict(obj, state_dict: dict[str, torch.Tensor], strict: bool = True):
    """Load a serial-shaped ``state_dict`` into ``obj``: each rank copies its shard of every
    sharded tensor and the whole of every replicated one. Returns ``load_state_dict``'s result."""
    if hasattr(obj, "_load_full_state_dict"):  # a Pipeline: each rank loads its stages' keys
        return obj._load_full_state_dict(state_dict, strict=strict)
    model = _module(obj)
    sharded = sharded_keys(model)
    # Every sharded tensor is checked against its serial shape before anything is sliced or
    # copied: a slice of a too-large tensor would otherwise load silently.
    mismatches = []
    for key, value in state_dict.items():
        if key in sharded:
            layer, name = sharded[key]
            want = layer.full_shape(name)
            if tuple(value.shape) != want:
                mismatches.append(f"size mismatch for {key}: copying a param with shape "
                                  f"{tuple(value.shape)} from checkpoint, the shape in current "
                                  f"model is {want}")
    if mismatches:
        raise ValueError(f"load_full_state_dict({type(model).__name__}): " + "; ".join(mismatches))
    local = {}
    for key, value in state_dict.items():
        if key in sharded:
            layer, name = sharded[key]
            value = layer.shard_full(name, value)
            assert value.shape == getattr(layer, name).shape, (key, value.shape)
        local[key] = value
    return model.load_state_dict(local, strict=strict)
