"""What one rank runs of a model while generating: the whole GPT, or its pipeline stage.

    stage = Stages(gpt_layers(cfg), cfg)       # under fastpar.init(pp=2): this rank's layers only
    out = fastpar.generate(stage, input_ids, 64)

``Stages`` cuts a GPT's layers (embedding, blocks, head: ``gpt_layers``' factories, or
``hf_layers``' that read a Hugging Face checkpoint as they build) into the pp group's stages,
balanced by parameter count as the trainer's pipeline cuts them (``fastpar.pipeline.partition``),
and builds only this rank's; ``module()`` holds them under the trainer's names ("0" .. "L+1"), so
a trainer checkpoint loads into it. Between stages it keeps ``fastpar.pipeline``'s channels: the
shared-memory rings on a host, batched isend/irecv across hosts.

``Stage`` is the view ``generate`` runs: this rank's embedding (first stage), blocks, head (last
stage), the config, the channels (None at pp 1) and the pp group.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import torch.distributed as dist
from torch import nn

from fastpar.models.config import GPTConfig
from fastpar.models.gpt import GPTBlock, GPTEmbedding, GPTHead
from fastpar.pipeline import partition as part
from fastpar.pipeline.channels import Channels
from fastpar.runtime import topology


@dataclasses.dataclass
class Stage:
    embedding: GPTEmbedding | None
    blocks: list
    head: GPTHead | None
    cfg: GPTConfig
    channels: Channels | None = None
    index: int = 0
    count: int = 1
    group: object = None
    leader: int = 0  # the global rank of the first stage (its results are every rank's)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


class Stages:
    """This rank's stage of a GPT over the topology's pp group (see the module docstring).
    ``factories``: the model's layers as zero-argument factories, in order; ``cfg`` its config;
    ``balance``: layers per stage (default: balanced by parameter count). Collective over the
    world."""

    def __init__(self, factories, cfg: GPTConfig, *, balance=None):
        topo = topology()
        self.cfg, self.pp, self.index = cfg, topo.pp_size, topo.pp_rank
        items, bounds, _ = part.partition(list(factories), self.pp, 1, balance)
        decided = [bounds]
        dist.broadcast_object_list(decided, src=0)  # one cut for the world: rank 0's
        self.bounds = decided[0]
        lo, hi = self.bounds[self.index], self.bounds[self.index + 1]
        self.names = [name for name, _ in items[lo:hi]]
        self.layers = list(part.build_chunk(items, lo, hi).to(topo.device))
        self.ranks = topo.ranks("pp")
        self.group = topo.pp_group
        self.channels = None
        if self.pp > 1:
            self.channels = Channels(topo.pp_group, all_groups=topo.grid.groups("pp"),
                                     device=topo.device)

    def module(self) -> nn.Sequential:
        """This rank's layers under the whole model's names (a checkpoint's keys)."""
        return nn.Sequential(OrderedDict(zip(self.names, self.layers)))

    def stage(self) -> Stage:
        first = self.layers[0] if isinstance(self.layers[0], GPTEmbedding) else None
        head = self.layers[-1] if isinstance(self.layers[-1], GPTHead) else None
        blocks = [layer for layer in self.layers if isinstance(layer, GPTBlock)]
        return Stage(first, blocks, head, self.cfg, self.channels, self.index, self.pp,
                     self.group, self.ranks[0])

    def close(self) -> None:
        if self.channels is not None:
            self.channels.close()


def stage_of(model) -> Stage:
    """The ``Stage`` of a ``Stages``, a ``fastpar.models.GPT`` or a list of its layers."""
    if isinstance(model, Stages):
        return model.stage()
    layers = list(model) if isinstance(model, (nn.Sequential, list, tuple)) else None
    if (not layers or not isinstance(layers[0], GPTEmbedding)
            or not isinstance(layers[-1], GPTHead)
            or not all(isinstance(b, GPTBlock) for b in layers[1:-1])):
        raise TypeError(f"fastpar.generate takes a fastpar GPT (fastpar.models.GPT, the list of "
                        f"gpt_layers' modules: embedding, blocks, head, or a "
                        f"fastpar.generation.Stages), got {type(model).__name__}")
    return Stage(layers[0], layers[1:-1], layers[-1], layers[0].cfg)
