"""A GPT language model built from ``fastpar.nn`` layers, as a list of layers a pipeline can cut.

    topo = fastpar.init(tp=2, pp=2)                          # mpirun -np 4 python train.py
    cfg = PRESETS["small"]
    pipe = Pipeline(gpt_layers(cfg, seed=0), loss_fn=gpt_loss, microbatches=4)
    model = GPT(cfg, seed=0)                                 # or: every layer in one module

The layers, batch-first, ``V/tp`` the vocab shard (``T/tp`` with sequence parallelism)::

    embedding   tokens (B, T) int64 -> h (B, T, H)        [SP: (B, T/tp, H), reduce-scattered]
                h = tok[tokens] (+ pos[0..T-1] when positions="learned"), then dropout
    block x L   h = h + attn(norm1(h));  h = h + mlp(norm2(h))                  (pre-norm)
    head        logits_shard = norm(h) @ W_out_shard.T    (B, T, V/tp)   [SP: gathers T first]
    gpt_loss    mean over tokens of cross-entropy(logits, targets), vocab-parallel

Context parallelism (``cfg.context_parallel`` "ring" / "ulysses", ``cp_group``): every layer
takes this rank's slice of each sequence, T/cp tokens in ``fastpar.nn.context``'s layout, in
place of T (tokens (B, T/cp), h (B, T/cp, H), logits (B, T/cp, V/tp)); learned positions are
``pos[context_positions(T)]``, rope turns at those positions, and only attention communicates
(over the cp group). ``gpt_loss`` of a slice is the mean over its tokens.

Serial and parallel are the same code: a group of one rank is the serial model. ``group=None``
means the topology's tp group (``fastpar.nn``'s rule; without ``fastpar.init`` it raises, and a
single process runs the serial model after a plain ``fastpar.init()``).

Initialisation does not depend on tp or on the pipeline cut: layer ``i`` draws the serial (CPU
float32) tensors in parameter order from a generator seeded by ``(seed, i)`` and keeps its shard.
Weights ~ N(0, init_std), residual output projections (the row-parallel ``o_proj``, ``down_proj``
/ ``fc2``) ~ N(0, init_std / sqrt(2 L)) as in GPT-2; biases 0, norm weights 1.

Tied embeddings: the head's output weight is a separate Parameter holding the embedding's values
and vocab rows (a pipeline puts them on different stages); both stay equal when both get the
tied weight's gradient, the sum of the two: after backward call
``sum_tied_grads(modules, topo.embedding_group)`` (it sums the grads of
``tied_parameters(modules)`` here and over the first and last pipeline stage).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.models.config import PRESETS, GPTConfig
from fastpar.nn import (MoE, ColumnParallelLinear, LayerNorm, ParallelMLP, ParallelSelfAttention,
                        RMSNorm, RowParallelLinear, ShardedModule, VocabParallelEmbedding,
                        vocab_parallel_cross_entropy, with_aux_loss)
from fastpar.nn import random as tp_random
from fastpar.nn.context import context_positions
from fastpar.nn.moe import GroupedExperts
from fastpar.nn.recomputation import recompute, recomputing
from fastpar.nn.sharding import copy_into, copy_replicated, resolve_group
from fastpar.pipeline.tied import sum_copies
from fastpar.runtime import group_rank, group_size, is_initialized, topology

# GPTConfig and PRESETS live in config.py; they stay importable from here.
__all__ = ["GPT", "GPTBlock", "GPTConfig", "GPTEmbedding", "GPTHead", "PRESETS", "gpt_layers",
           "gpt_loss", "layer_generator", "sum_tied_grads", "tied_parameters"]


def layer_generator(seed: int, index: int) -> torch.Generator:
    """Layer ``index``'s generator, seeded with a hash of ``(seed, index)``: a stage that builds
    only its own layers draws what the whole model would."""
    digest = hashlib.sha256(f"fastpar.gpt:{seed}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def _normal(shape, std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)


def _materialise(module: nn.Module, cfg: GPTConfig, seed: int, index: int) -> nn.Module:
    """Give ``module`` (built on meta) its values on the current default device; see the module
    docstring. Under ``torch.device("meta")`` (a pipeline weighing layers) it stays on meta."""
    device = torch.empty(0).device  # the default device, as a plain constructor would use
    if device.type == "meta":
        return module
    module.to_empty(device=device)
    gen = layer_generator(seed, index)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.layers)
    for owner in module.modules():
        for name, p in owner.named_parameters(recurse=False):
            if isinstance(owner, (LayerNorm, RMSNorm)):
                value = torch.ones(p.shape) if name == "weight" else torch.zeros(p.shape)
            elif name == "bias":
                value = torch.zeros(p.shape)
            else:  # the serial tensor, then this rank's shard of it
                sharded = isinstance(owner, ShardedModule)
                residual = isinstance(owner, RowParallelLinear) or (
                    isinstance(owner, GroupedExperts) and name in ("fc2", "down_proj"))
                std = residual_std if residual else cfg.init_std
                full = _normal(owner.full_shape(name) if sharded else p.shape, std, gen)
                value = owner.shard_full(name, full) if sharded else full
            copy_into(p, value)
    return module


def _norm(cfg: GPTConfig, group):
    eps = {} if cfg.norm_eps is None else {"eps": cfg.norm_eps}
    if cfg.norm == "layernorm":
        return LayerNorm(cfg.hidden, bias=cfg.bias, sequence_parallel=cfg.sequence_parallel,
                         group=group, device="meta", **eps)
    return RMSNorm(cfg.hidden, sequence_parallel=cfg.sequence_parallel, group=group,
                   device="meta", **eps)


class GPTEmbedding(nn.Module):
    """tokens (B, T) -> (B, T, H), or (B, T/tp, H) under sequence parallelism (Megatron's rule:
    the vocab-parallel lookup is reduce-scattered along the sequence instead of all-reduced).
    Learned positions ``pos`` are replicated; under SP each rank adds its own T/tp rows, and
    their gradient is summed over the tp group (``copy_replicated``: in float32 at least).
    ``cp_group`` (with ``cfg.context_parallel``): tokens (B, T/cp) are this rank's slice and
    take the rows of their true positions."""

    def __init__(self, cfg: GPTConfig, group, cp_group=None):
        super().__init__()
        self.group, self.cfg = group, cfg
        self.cp_group = cp_group if cfg.context_parallel else None
        self.cp = group_size(self.cp_group) if self.cp_group is not None else 1
        self.sequence_parallel, self.dropout = cfg.sequence_parallel, cfg.dropout
        self.tok = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden, sequence_parallel=
                                          cfg.sequence_parallel, group=group, device="meta")
        self.pos = nn.Embedding(cfg.position_rows, cfg.hidden, device="meta") \
            if cfg.positions == "learned" else None

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """The token embedding (V/tp rows) when ``tie_embeddings``, else None."""
        return self.tok.weight if self.cfg.tie_embeddings else None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions`` (B, T): each token's position, for generation (learned positions take
        those rows; no SP or CP); None: 0 .. T - 1."""
        h = self.tok(tokens)  # (B, T, H); SP: (B, T/tp, H)
        if self.pos is not None and positions is not None:
            h = h + self.pos.weight[positions]
        elif self.pos is not None:
            if tokens.shape[1] * self.cp > self.cfg.position_rows:
                raise ValueError(f"sequence of {tokens.shape[1] * self.cp} tokens is longer "
                                 f"than the {self.cfg.position_rows} learned positions")
            t = h.shape[1]
            if self.cp > 1:  # (T/cp,) this rank's tokens' positions in the sequence
                pos = context_positions(t * self.cp, self.cp_group, h.device)
                h = h + self.pos.weight[pos]
            elif self.sequence_parallel:  # rows of this rank's tokens; dW summed over ranks
                start = group_rank(self.group) * t
                h = h + copy_replicated(self.pos.weight, self.group)[start:start + t]
            else:
                h = h + self.pos.weight[:t]
        if self.dropout and self.training:  # under SP each rank holds other tokens: own mask
            with tp_random.fork("tp", self.group) if self.sequence_parallel else nullcontext():
                h = F.dropout(h, self.dropout, training=True)
        return h


class GPTBlock(nn.Module):
    """Pre-norm transformer block: ``h + attn(norm1(h))``, then ``h + mlp(norm2(h))``; shapes
    as the embedding's output, (B, T, H) or (B, T/tp, H). ``cfg.recompute == "full"``: only
    ``h`` (sequence-sharded under SP) is kept for backward, which recomputes the block
    (``fastpar.nn.recompute``); "selective": only the attention core is recomputed.

    Block ``index`` (1 .. layers) with ``cfg.is_moe(index)``: ``mlp`` is a ``fastpar.nn.MoE``
    over ``ep_group`` (replicated over tp: every tp rank routes the same tokens), its router
    losses (balanced per sequence, so that every layout has the same) tied to the output with
    ``with_aux_loss`` at weight ``aux_scale`` (1; a pipeline's trainer sets 1 / microbatches).
    ``moe_stats`` sums what each forward with grad (not a recompute) routed: ``load_balancing``,
    ``z_loss``, ``forwards``, ``load`` (slots per expert, this rank's tokens) and ``dropped``;
    ``None`` until the first such forward (the trainer resets it each step)."""

    def __init__(self, cfg: GPTConfig, group, index: int = 1, ep_group=None, cp_group=None):
        super().__init__()
        sp, p = cfg.sequence_parallel, cfg.dropout
        rope = cfg.rope_base if cfg.positions == "rope" else None
        self.norm1 = _norm(cfg, group)
        self.attn = ParallelSelfAttention(cfg.hidden, cfg.heads, cfg.num_kv_heads, cfg.bias,
                                          attn_dropout=p, dropout=p, sequence_parallel=sp,
                                          overlap=cfg.overlap, group=group, device="meta",
                                          rope_base=rope,
                                          recompute_core=cfg.recompute == "selective",
                                          context_parallel=cfg.context_parallel,
                                          cp_group=cp_group, head_dim=cfg.head_dim,
                                          qkv_bias=cfg.bias or cfg.qkv_bias,
                                          qk_norm_eps=(cfg.norm_eps or 1e-6) if cfg.qk_norm
                                          else None, rope_scaling=cfg.rope_scaling)
        self.norm2 = _norm(cfg, group)
        self.index, self.moe = index, cfg.is_moe(index)
        if self.moe:
            self.mlp = MoE(cfg.hidden, cfg.ffn_size, cfg.moe_experts, cfg.moe_top_k,
                           group=ep_group, capacity_factor=cfg.moe_capacity, activation=cfg.mlp,
                           aux_loss_coef=cfg.moe_aux_coef, z_loss_coef=cfg.moe_z_coef,
                           balance="sequence", device="meta")
            self.dropout, self.aux_scale, self.moe_stats = p, 1.0, None
        else:
            self.mlp = ParallelMLP(cfg.hidden, cfg.ffn_size, cfg.mlp, cfg.bias, p,
                                   sequence_parallel=sp, overlap=cfg.overlap, group=group,
                                   device="meta")

        self.recompute = cfg.recompute == "full"

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return recompute(self._forward, h) if self.recompute else self._forward(h)

    def _forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.norm1(h))
        if not self.moe:
            return h + self.mlp(self.norm2(h))
        y = self.mlp(self.norm2(h))
        if torch.is_grad_enabled() and not recomputing():
            self._record()
        y = with_aux_loss(y, self.mlp.aux_loss, self.aux_scale)
        if self.dropout and self.training:  # replicated over tp: the same mask on every tp rank
            y = F.dropout(y, self.dropout, training=True)
        return h + y

    def _record(self) -> None:
        moe, stats = self.mlp, self.moe_stats
        if stats is None:
            stats = self.moe_stats = {"load_balancing": 0.0, "z_loss": 0.0, "forwards": 0,
                                      "load": torch.zeros_like(moe.expert_load), "dropped": 0}
        stats["load_balancing"] += float(moe.last_aux["load_balancing"])
        stats["z_loss"] += float(moe.last_aux["z_loss"])
        stats["forwards"] += 1
        stats["load"] += moe.expert_load
        stats["dropped"] += moe.last_dropped


class GPTHead(nn.Module):
    """(B, T, H) [SP: (B, T/tp, H)] -> logits shard (B, T, V/tp): the final norm, then a
    column-parallel projection without gather (under SP its entry all-gathers the sequence)."""

    def __init__(self, cfg: GPTConfig, group):
        super().__init__()
        self.cfg = cfg
        self.norm = _norm(cfg, group)
        self.out = ColumnParallelLinear(cfg.hidden, cfg.vocab_size, bias=False,
                                        sequence_parallel=cfg.sequence_parallel,
                                        overlap=cfg.overlap, group=group, device="meta")

    @property
    def tied_weight(self) -> nn.Parameter | None:
        """The output weight (V/tp rows, the embedding's) when ``tie_embeddings``, else None."""
        return self.out.weight if self.cfg.tie_embeddings else None

    @property
    def tied_copies(self) -> list[nn.Parameter]:
        """The parameters here that copy another's (the tied output weight): the global
        gradient norm counts the tied weight once (``fastpar.optim.clip``)."""
        return [self.out.weight] if self.cfg.tie_embeddings else []

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(h))


def gpt_layers(cfg: GPTConfig, *, group=None, seed: int = 0, ep_group=None,
               cp_group=None, replicated_kv: bool = False) -> list:
    """Zero-argument factories of the layers in order: embedding, ``cfg.layers`` blocks, head.

    ``group``: the tp group (None: the topology's). ``ep_group``: the expert-parallel group of
    the MoE blocks (None: the topology's after ``fastpar.init``, else none: every expert here).
    ``cp_group``: with ``cfg.context_parallel``, the context-parallel group (None: the
    topology's). ``replicated_kv``: allow tp above the KV heads (each replicated: inference
    only, ``fastpar.nn.replicated_heads``).
    Each factory builds on the default device (meta under ``torch.device("meta")``) with the
    values of the serial model for ``seed``."""
    group = resolve_group(group)
    if ep_group is None and cfg.moe_experts and is_initialized():
        ep_group = topology().ep_group
    if cfg.context_parallel and cp_group is None:
        cp_group = topology().cp_group
    cp = group_size(cp_group) if cfg.context_parallel else 1
    cfg.validate(group_size(group), 1 if ep_group is None else group_size(ep_group), cp,
                 replicated_kv=replicated_kv)
    last = cfg.layers + 1

    def embedding():
        return _materialise(GPTEmbedding(cfg, group, cp_group), cfg, seed, 0)

    def block(i):
        return lambda: _materialise(GPTBlock(cfg, group, i, ep_group, cp_group), cfg, seed, i)

    def head():
        module = _materialise(GPTHead(cfg, group), cfg, seed, last)
        if cfg.tie_embeddings and not module.out.weight.is_meta:
            # The embedding's first draw of layer 0, sharded the same way (V/tp rows).
            full = _normal((cfg.vocab_size, cfg.hidden), cfg.init_std, layer_generator(seed, 0))
            copy_into(module.out.weight, module.out.shard_full("weight", full))
        return module

    return [embedding, *(block(i) for i in range(1, cfg.layers + 1)), head]


def gpt_loss(logits_shard: torch.Tensor, targets: torch.Tensor, *, group=None) -> torch.Tensor:
    """Mean cross-entropy over all tokens: logits shard (B, T, V/tp), targets (B, T) int64 ->
    float32 scalar, as ``F.cross_entropy`` of the full logits. ``group``: the tp group of the
    head (None: the topology's)."""
    return vocab_parallel_cross_entropy(logits_shard, targets, group=group)


class GPT(nn.Sequential):
    """Every layer of ``gpt_layers(cfg, group=group, seed=seed)`` in one module (children "0" ..
    str(L + 1): the same state-dict keys as the pipeline). tokens (B, T) -> logits (B, T, V/tp)."""

    def __init__(self, cfg: GPTConfig, group=None, seed: int = 0, ep_group=None,
                 cp_group=None):
        super().__init__(*(factory() for factory in gpt_layers(cfg, group=group, seed=seed,
                                                               ep_group=ep_group,
                                                               cp_group=cp_group)))
        self.cfg = cfg

    def __getitem__(self, idx):
        if isinstance(idx, slice):  # some of the layers: a plain nn.Sequential, same names
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)


def tied_parameters(modules) -> list[nn.Parameter]:
    """The tied Parameters held by ``modules`` (a module or an iterable of them, e.g. a
    pipeline's chunks): the embedding's then the head's, 0, 1 or 2 of them."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    found = {}
    for kind in (GPTEmbedding, GPTHead):
        for module in modules:
            for sub in module.modules():
                if isinstance(sub, kind) and sub.tied_weight is not None:
                    found.setdefault(id(sub.tied_weight), sub.tied_weight)
    return list(found.values())


def sum_tied_grads(modules, group=None, grad_of=None) -> None:
    """Give every tied Parameter the gradient of the tied weight: the sum of all copies' grads,
    here and over ``group`` (the topology's ``embedding_group``: first and last pipeline stage;
    None or one rank: local only). Call after backward, before clipping and the optimizer step;
    a missing grad counts as zeros. The sum is in float32 at least (a bf16 model's copies are
    widened, summed here and over the group, and rounded once). ``grad_of(p)``: the tensor to
    sum in place for copy ``p`` instead of ``p.grad`` (ZeRO-2/3: this rank's reduced gradient
    shard, the same elements of every copy, ``DistributedOptimizer.grad_shard``)."""
    params = tied_parameters(modules)
    if not params:  # untied (then no rank has any), or a middle stage (in no embedding group)
        return
    grads = [grad_of(p) for p in params] if grad_of is not None else [p.grad for p in params]
    sum_copies(params, grads, group)
