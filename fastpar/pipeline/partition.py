"""Cutting a list of layers into ``pp x virtual_stages`` contiguous chunks.

Model stage ``s`` (0 .. pp*v - 1) holds layers ``[bounds[s], bounds[s+1])`` and lives on pipeline
rank ``s % pp`` as its local chunk ``s // pp``. Chunks are balanced by parameter count (a layer
also weighs 1, so parameter-free layers spread out) unless ``balance`` gives the layer counts.

Layers given as zero-argument factories are built on the meta device to be weighed (no memory,
no random numbers drawn), and for real only on the rank that holds them: a large model is never
built whole on one rank.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Callable

import torch
from torch import nn


def named_layers(layers) -> list[tuple[str, object]]:
    """``[(name, module or factory)]`` in order; names are the serial model's state-dict
    prefixes (an ``nn.Sequential``'s child names, a mapping's keys, else ``"0"``, ``"1"``, ...).
    A mapping's names may be dotted paths (``"model.layers.3"``: a Hugging Face model's parts,
    built into a chunk by a ``stage`` builder that places them there)."""
    if isinstance(layers, nn.Sequential):
        items = list(layers.named_children())
    elif isinstance(layers, Mapping):
        items = list(layers.items())
        bad = [n for n, _ in items if not isinstance(n, str) or not n or n.startswith(".")
               or n.endswith(".") or ".." in n]
        if bad:
            raise ValueError(f"layer names must be non-empty dotted paths, got {bad!r}")
    elif isinstance(layers, (list, tuple)):
        items = [(str(i), layer) for i, layer in enumerate(layers)]
    else:
        raise TypeError(f"layers must be an nn.Sequential, a list of modules or zero-argument "
                        f"module factories, or a mapping of names to them, got "
                        f"{type(layers).__name__}")
    for name, layer in items:
        if not isinstance(layer, nn.Module) and not callable(layer):
            raise TypeError(f"layer {name} is a {type(layer).__name__}, neither an nn.Module "
                            "nor a zero-argument factory returning one")
    if not items:
        raise ValueError("layers is empty: a pipeline needs at least one layer per stage")
    first: dict = {}
    for name, layer in items:
        if isinstance(layer, nn.Module) and id(layer) in first:
            raise ValueError(f"layers {first[id(layer)]} and {name} are the same module object: "
                             "a pipeline cuts layers apart, so a module cannot appear twice "
                             "(share weights explicitly, or give each position its own module)")
        first.setdefault(id(layer), name)
    return items


def _build(name: str, factory: Callable) -> nn.Module:
    module = factory()
    if not isinstance(module, nn.Module):
        raise TypeError(f"the factory of layer {name} returned a {type(module).__name__}, not "
                        "an nn.Module")
    return module


def weigh(items) -> tuple[list[int], list[list[str]]]:
    """Parameter count of every layer and its state-dict keys (factories built on meta)."""
    counts, keys = [], []
    for name, layer in items:
        if not isinstance(layer, nn.Module):
            with torch.device("meta"):
                layer = _build(name, layer)
        counts.append(sum(p.numel() for p in layer.parameters()))
        keys.append([f"{name}.{k}" for k in layer.state_dict(keep_vars=True)])
    return counts, keys


def balanced_bounds(weights: list[int], stages: int) -> list[int]:
    """Cut points ``[0, ..., len(weights)]`` of ``stages`` non-empty contiguous chunks whose
    largest total weight is the smallest possible (each layer weighs its count + 1)."""
    n = len(weights)
    w = [x + 1 for x in weights]
    prefix = [0]
    for x in w:
        prefix.append(prefix[-1] + x)
    # best[k][i]: the smallest possible maximum over k chunks of the first i layers
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds, i = [n], n
    for k in range(stages, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    return bounds[::-1]


def bounds_from_balance(balance, n_layers: int, stages: int, pp: int, v: int) -> list[int]:
    balance = list(balance)
    if len(balance) != stages or any(not isinstance(b, int) or b < 1 for b in balance) \
            or sum(balance) != n_layers:
        raise ValueError(f"balance must give a positive layer count for each of the pp x "
                         f"virtual_stages = {pp} x {v} = {stages} stages, summing to the "
                         f"{n_layers} layers; got {balance} (sum {sum(balance)})")
    bounds = [0]
    for b in balance:
        bounds.append(bounds[-1] + b)
    return bounds


def partition(layers, pp: int, v: int, balance=None) -> tuple[list, list[int], list]:
    """``(items, bounds, keys)``: named layers, stage cut points and every layer's keys."""
    items = named_layers(layers)
    stages = pp * v
    if len(items) < stages:
        raise ValueError(f"{len(items)} layers cannot fill pp x virtual_stages = {pp} x {v} = "
                         f"{stages} stages (each stage needs at least one layer)")
    counts, keys = weigh(items)
    if balance is not None:
        bounds = bounds_from_balance(balance, len(items), stages, pp, v)
    else:
        bounds = balanced_bounds(counts, stages)
    return items, bounds, keys


def build_chunk(items, start: int, stop: int, stage=None) -> nn.Module:
    """The layers ``[start, stop)`` as an ``nn.Sequential`` keyed by their serial names, or
    what ``stage([(name, module), ...])`` makes of them (a chunk whose state-dict keys are the
    layers' own under their names, e.g. ``fastpar.pipeline.hf``'s Hugging Face stages)."""
    built = [(name, layer if isinstance(layer, nn.Module) else _build(name, layer))
             for name, layer in items[start:stop]]
    if stage is not None:
        return stage(built)
    dotted = [name for name, _ in built if "." in name]
    if dotted:
        raise ValueError(f"layers {dotted} have dotted names: pass a stage builder that places "
                         "them (Pipeline(stage=...)), or name them without dots")
    return nn.Sequential(OrderedDict(built))
