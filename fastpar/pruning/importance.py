"""How much each attention head group and each MLP channel of a GPT matters: the scores that
``fastpar.prune`` ranks, one row per block, the same on every rank of the tp group.

    scores = magnitude(cfg, full)                      # full: fastpar.full_state_dict(model)
    scores = activations(model, data, group)           # collective over the tp group
    scores = random_scores(cfg, seed)
    scores.groups    # (L, kv_heads) float64: one score per KV group (MHA: per head)
    scores.channels  # (L, ffn) float64: one score per MLP channel

The units. A KV group g is KV head g with the ``r = heads / kv_heads`` query heads that attend
through it, ``g r .. g r + r - 1`` (the order ``scaled_dot_product_attention(enable_gqa=True)``
and Hugging Face pair them in); under MHA r = 1 and a group is one head. A channel c is row c of
``gate_proj`` and ``up_proj`` (``fc1``) and column c of ``down_proj`` (``fc2``). Removing a unit
removes exactly those weights, and its contribution to the block's output goes with them.

The definitions (``hd`` the head width, ``W[rows of h]`` the ``hd`` rows of head ``h``):

    magnitude    group g:   sqrt( sum_{h in g} (|Wq[rows of h]|^2 + |bq[h]|^2
                                                 + |Wo[:, cols of h]|^2)
                                  + |Wk[rows of g]|^2 + |bk[g]|^2 + |Wv[rows of g]|^2 + |bv[g]|^2 )
                 channel c: sqrt( |Wgate[c]|^2 + |bgate[c]|^2 + |Wup[c]|^2 + |bup[c]|^2
                                  + |Wdown[:, c]|^2 )    (gelu: fc1's row and bias, fc2's column)
                 the 2-norm of every weight the unit takes with it (Frobenius, biases included)
    activations  group g:   sum_{h in g} mean_t |o_t[h]|_2   o_t[h]: head h's attention output at
                                                              token t (hd wide, o_proj's input)
                 channel c: mean_t |a_t[c]|                   a = silu(gate) * up (gelu(fc1)):
                                                              down_proj's (fc2's) input
                 over every token of the calibration batches, the model in eval mode
    random       uniform [0, 1) draws of a generator seeded with ``seed``: the baseline

Magnitude needs no data but sees weights only: a head whose q rows are large and k rows small
attends as softly as the reverse, and RMSNorm weights scale a unit's input unseen.
Activations measure what each unit puts into the residual stream's projection on the
calibration tokens (a head's output before o_proj, a channel's before down_proj), so they rank
by use, at the cost of a forward pass over the batches.

Magnitude reads the serial weights (the same tensors on every rank). Activations are measured
where each rank holds its shard: a rank sums its own heads' and channels' values (tp shards hold
contiguous heads and channels) and an all-gather over the tp group concatenates the shards in
rank order, so every rank holds the same scores. Sums are float64.
"""

from __future__ import annotations

import dataclasses

import torch

from fastpar import comm
from fastpar.models.config import GPTConfig


@dataclasses.dataclass
class Scores:
    """``groups`` (L, kv_heads) and ``channels`` (L, ffn), float64, row i of block i + 1."""

    groups: torch.Tensor
    channels: torch.Tensor


def _rows(t: torch.Tensor, units: int) -> torch.Tensor:
    """Squared 2-norm of each of ``units`` equal blocks of rows of ``t`` (a weight or bias):
    (units,) float64."""
    return t.double().reshape(units, -1).pow(2).sum(1)


def magnitude(cfg: GPTConfig, full: dict[str, torch.Tensor]) -> Scores:
    """The magnitude scores (module docstring) of the serial state dict ``full`` (keys of
    ``fastpar.models.GPT``: block i's under ``"{i}."``)."""
    heads, kv = cfg.heads, cfg.num_kv_heads
    groups, channels = [], []
    for i in range(1, cfg.layers + 1):
        a, m = f"{i}.attn.", f"{i}.mlp."
        per_head = _rows(full[a + "q_proj.weight"], heads)  # (heads,)
        o = full[a + "o_proj.weight"]  # (H, heads hd): head h's columns h hd .. (h+1) hd - 1
        per_head += _rows(o.t(), heads)
        if a + "q_proj.bias" in full:
            per_head += _rows(full[a + "q_proj.bias"], heads)
        per_group = per_head.view(kv, heads // kv).sum(1)  # (kv,)
        for name in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            if a + name in full:
                per_group += _rows(full[a + name], kv)
        groups.append(per_group.sqrt())
        ffn = cfg.ffn_size
        ins, out = (("gate_proj", "up_proj"), "down_proj") if cfg.mlp == "swiglu" else \
            (("fc1",), "fc2")
        per_channel = _rows(full[f"{m}{out}.weight"].t(), ffn)  # (ffn,): down's columns
        for name in ins:
            per_channel += _rows(full[f"{m}{name}.weight"], ffn)
            if f"{m}{name}.bias" in full:
                per_channel += _rows(full[f"{m}{name}.bias"], ffn)
        channels.append(per_channel.sqrt())
    return Scores(torch.stack(groups), torch.stack(channels))


def random_scores(cfg: GPTConfig, seed: int) -> Scores:
    """Uniform draws of ``torch.Generator().manual_seed(seed)``: groups first, then channels."""
    gen = torch.Generator().manual_seed(int(seed))
    groups = torch.rand(cfg.layers, cfg.num_kv_heads, generator=gen, dtype=torch.float64)
    channels = torch.rand(cfg.layers, cfg.ffn_size, generator=gen, dtype=torch.float64)
    return Scores(groups, channels)


class _Sums:
    """Forward pre-hooks on each block's ``o_proj`` and ``down_proj`` (``fc2``) summing this
    rank's per-head output norms and per-channel absolute values over tokens, in float64."""

    def __init__(self, blocks, head_dim: int):
        self.head_dim, self.tokens, self.handles = head_dim, 0, []
        self.heads = [None] * len(blocks)
        self.channels = [None] * len(blocks)
        for i, block in enumerate(blocks):
            down = block.mlp.down_proj if hasattr(block.mlp, "down_proj") else block.mlp.fc2
            self.handles.append(block.attn.o_proj.register_forward_pre_hook(self._head(i)))
            self.handles.append(down.register_forward_pre_hook(self._channel(i)))

    def _head(self, i: int):
        def hook(module, args):
            o = args[0]  # (B, T, heads/tp * hd): each local head's output, side by side
            B, T, width = o.shape
            norms = o.detach().double().view(B, T, width // self.head_dim, self.head_dim)
            per_head = norms.norm(dim=-1).sum((0, 1))  # (heads/tp,)
            self.heads[i] = per_head if self.heads[i] is None else self.heads[i] + per_head
            if i == 0:
                self.tokens += B * T
        return hook

    def _channel(self, i: int):
        def hook(module, args):
            a = args[0].detach().double()  # (B, T, ffn/tp)
            per_channel = a.abs().sum((0, 1))  # (ffn/tp,)
            self.channels[i] = per_channel if self.channels[i] is None else \
                self.channels[i] + per_channel
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@torch.no_grad()
def activations(model, data, group) -> Scores:
    """The activation scores (module docstring) of ``model`` (a ``fastpar.models.GPT``) over
    ``data``, an iterable of token tensors (B, T): collective over ``group``, the model's tp
    group (every rank of it must run the same batches). ValueError when ``data`` holds no
    batch."""
    cfg = model.cfg
    blocks = list(model)[1:-1]
    device = next(model.parameters()).device
    sums = _Sums(blocks, cfg.head_size)
    was_training = model.training
    model.eval()
    try:
        for tokens in data:
            model(torch.as_tensor(tokens, device=device))
    finally:
        sums.remove()
        model.train(was_training)
    if sums.tokens == 0:
        raise ValueError("by='activations' needs calibration data: data= holds no batch of "
                         "tokens (B, T)")
    # on the model's device (an NCCL group gathers CUDA tensors), then the scores on the host
    heads = comm.all_gather(torch.stack(sums.heads), group=group, dim=1).cpu()  # (L, heads)
    channels = comm.all_gather(torch.stack(sums.channels), group=group, dim=1).cpu()  # (L, ffn)
    r = cfg.heads // cfg.num_kv_heads
    groups = (heads / sums.tokens).view(cfg.layers, cfg.num_kv_heads, r).sum(2)
    return Scores(groups, channels / sums.tokens)
