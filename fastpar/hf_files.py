"""A Hugging Face directory's safetensors weights, read by name, one tensor at a time: each
file opened once (memory-mapped), a tensor read only when asked for, so that a rank building a
few layers of a large model reads those layers' tensors and no others.

    reader = SafetensorsReader("llama-dir")     # model.safetensors or its shards' index
    weight = reader.get("model.layers.3.mlp.up_proj.weight")

Below ``fastpar.models`` (which maps these tensors into fastpar's GPT) and ``fastpar.pipeline``
(which builds Hugging Face modules stage by stage from them).
"""

from __future__ import annotations

import json
import os

import torch


class SafetensorsReader:
    """Tensors of a Hugging Face directory by name, from ``model.safetensors`` or the shards that
    ``model.safetensors.index.json`` names; each file opened once, each tensor read alone."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self._open = safe_open
        self.path = path
        index = os.path.join(path, "model.safetensors.index.json")
        single = os.path.join(path, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self.where = dict(json.load(f)["weight_map"])
        elif os.path.exists(single):
            with self._open(single, "pt") as f:
                self.where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise ValueError(f"{path}: no model.safetensors nor model.safetensors.index.json "
                             "(fastpar reads Hugging Face weights as safetensors)")
        self._files: dict[str, object] = {}
        self.read: list[str] = []  # the names read, in order (what a stage cost in reads)

    def has(self, name: str) -> bool:
        """Whether ``get(name)`` finds a tensor (under its name or without its prefix)."""
        return self._stored(name) is not None

    def _stored(self, name: str) -> str | None:
        if name in self.where:
            return name
        bare = name.split(".", 1)[1] if name.startswith(("transformer.", "model.")) else None
        return bare if bare in self.where else None

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name``; a checkpoint of the base model alone (GPT-2's on the hub: ``wte.weight``
        for ``transformer.wte.weight``) is read under the name without its prefix."""
        stored = self._stored(name)
        if stored is None:
            raise ValueError(f"{self.path}: the checkpoint has no tensor {name}")
        self.read.append(name)
        name = stored
        file = self.where[name]
        if file not in self._files:
            self._files[file] = self._open(os.path.join(self.path, file), "pt")
        return self._files[file].get_tensor(name)
