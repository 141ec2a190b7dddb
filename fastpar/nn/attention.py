"""Causal self-attention with its heads split over the TP group (MHA and grouped-query).

Each rank computes ``num_heads / tp`` query heads and ``num_kv_heads / tp`` key/value heads:
q/k/v projections are column-parallel (a contiguous block of heads per rank, which keeps every
query head with its kv head), the output projection row-parallel. Shapes, batch-first::

    x (B, T, H) -> q (B, nh/tp, T, hd), k, v (B, nkv/tp, T, hd) -> sdpa -> (B, T, nh/tp * hd)
                -> o_proj -> (B, T, H)           (sequence_parallel: x, y are (B, T/tp, H))

Rotary position embedding (``rope_base``, RoFormer / GPT-NeoX "rotate half" layout) turns each
head's q and k, at position p of the full sequence (under sequence parallelism the entry has
already gathered it, so p runs over 0..T-1 on every rank), by angles that grow with p: for
``i < hd/2``, ``theta_i = rope_base ** (-2i / hd)`` and the pair (i, i + hd/2) becomes::

    y_i        = x_i cos(p theta_i) - x_{i+hd/2} sin(p theta_i)
    y_{i+hd/2} = x_{i+hd/2} cos(p theta_i) + x_i sin(p theta_i)

so ``q_p . k_s`` depends on the positions only through ``p - s``. Heads are independent, so the
rotation needs no communication.

``recompute_core=True`` is Megatron's selective recomputation: the attention core
``softmax(q k^T / sqrt(hd) + mask) -> dropout -> @ v`` keeps only q, k, v for backward and runs
again there (``fastpar.nn.recompute``, same dropout mask), dropping the (B, nh/tp, T, T)
probabilities and mask, the largest activations of a block and few of its FLOPs. With attention
dropout on the CPU the core is ``fastpar.nn.attention_core.dropout_attention`` instead: it keeps
the dropout mask as bits and recomputes the probabilities itself, as torch's kernel would have
to draw the mask again, which costs more than the rest of the core.

``context_parallel="ring"`` or ``"ulysses"`` with ``cp_group``: ``x`` holds this rank's slice of
every sequence, (B, T/cp, H) in ``fastpar.nn.context``'s layout (chunks r and 2cp-1-r); the
projections are per token as before, rope turns q and k at their true positions
(``context_positions``: ``cos[pos]``, ``sin[pos]``), and the core is ``ring_attention`` or
``ulysses_attention`` over the cp group (attention dropout by that module's rule, its seed drawn
from the per-tp-rank stream). The output is the slice again, (B, T/cp, H).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.nn import context
from fastpar.nn import random as tp_random
from fastpar.nn.attention_core import dropout_attention
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear, pieces_argument
from fastpar.nn.norm import RMSNorm
from fastpar.nn.recomputation import recompute
from fastpar.nn.replicated_heads import HeadReplicatedLinear
from fastpar.nn.sharding import generator, resolve_group
from fastpar.runtime import group_size


def rope_frequencies(head_dim: int, base: float, scaling: dict | None = None,
                     device=None) -> torch.Tensor:
    """``theta_i`` (hd/2,) in float64. ``scaling`` (Hugging Face's ``rope_scaling``): None;
    ``{"rope_type": "linear", "factor": f}`` (every angle divided by f); or Llama 3's
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``: wavelengths longer than the original context over
    ``low_freq_factor`` divided by ``factor``, shorter than it over ``high_freq_factor`` kept,
    the band between interpolated."""
    half = head_dim // 2
    inv = base ** (-2.0 * torch.arange(half, dtype=torch.float64, device=device) / head_dim)
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (linear, llama3)")
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    context = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > context / low, inv / factor, inv)
    smooth = (context / wavelen - low) / (high - low)
    between = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(between, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rotary_tables(seq_len: int, head_dim: int, base: float, dtype, device,
                  scaling: dict | None = None):
    """``(cos, sin)``, each ``(T, hd/2)``: ``cos(p theta_i)``, ``sin(p theta_i)`` for positions
    ``p < seq_len`` (``theta``: ``rope_frequencies``). The angles are formed in float64 and
    rounded once to ``dtype``."""
    inv_freq = rope_frequencies(head_dim, base, scaling, device)
    angle = torch.arange(seq_len, dtype=torch.float64, device=device)[:, None] * inv_freq
    return angle.cos().to(dtype), angle.sin().to(dtype)  # (T, hd/2) each


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` (B, heads, T, hd) rotated pairwise by ``cos``/``sin`` (T, hd/2); see the module
    docstring."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]  # (B, heads, T, hd/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ParallelSelfAttention(nn.Module):
    """``num_kv_heads=None``: MHA. Projections ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` are
    drawn in that order from ``seed``. ``attn_dropout`` runs on the per-TP-rank stream (heads are
    sharded); ``dropout`` on the output as in ``ParallelMLP``. ``rope_base``: rotate q and k by
    rotary position embedding with that base (e.g. 10000.0; ``None``: no position information
    here); the head dim must be even. ``recompute_core``: recompute the attention core in
    backward (see the module docstring). ``context_parallel`` (None, "ring", "ulysses") and
    ``cp_group``: attention over a sequence split across the cp group (see the module
    docstring); a cp group of one rank is the serial core.

    What Hugging Face architectures add: ``head_dim`` (None: hidden / heads; q and o are
    ``num_heads * head_dim`` wide), ``qkv_bias`` (None: ``bias``; True with ``bias=False``: only
    q, k, v have biases, as Qwen2), ``qk_norm_eps`` (RMSNorm over each head of q and k before
    rope, as Qwen3; its weights are shared by the heads, which tp splits, so their gradients
    are summed over the tp group), ``rope_scaling`` (``rope_frequencies``)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int | None = None,
                 bias: bool = True, *, causal: bool = True, attn_dropout: float = 0.0,
                 dropout: float = 0.0, sequence_parallel: bool = False, sequence_dim: int = 1,
                 overlap=None, overlap_pieces=None, group=None, device=None, dtype=None,
                 seed=None, rope_base: float | None = None, chunks=None,
                 recompute_core: bool = False, context_parallel: str | None = None,
                 cp_group=None, head_dim: int | None = None, qkv_bias: bool | None = None,
                 qk_norm_eps: float | None = None, rope_scaling: dict | None = None):
        super().__init__()
        if context_parallel not in (None, "ring", "ulysses"):
            raise ValueError(f"context_parallel must be None, 'ring' or 'ulysses', got "
                             f"{context_parallel!r}")
        if context_parallel is not None and cp_group is None:
            raise ValueError(f"context_parallel={context_parallel!r} needs cp_group (the ranks "
                             "holding the other slices of each sequence)")
        if context_parallel is not None and sequence_parallel:
            raise ValueError("ParallelSelfAttention: context_parallel with sequence_parallel is "
                             "not supported (both would shard the sequence)")
        self.cp_group = cp_group if context_parallel is not None else None
        self.cp = group_size(cp_group) if self.cp_group is not None else 1
        self.context_parallel = context_parallel if self.cp > 1 else None
        overlap_pieces = pieces_argument(overlap_pieces, chunks, "ParallelSelfAttention")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.group = resolve_group(group)
        tp = group_size(self.group)
        if head_dim is None and hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads "
                             f"{num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads "
                             f"{num_kv_heads}")
        if num_heads % tp or (num_kv_heads % tp and tp % num_kv_heads):
            raise ValueError(f"num_heads {num_heads} and num_kv_heads {num_kv_heads} must both "
                             f"be divisible by the tensor-parallel size {tp} (or tp a multiple "
                             f"of the KV heads: each replicated, for inference)")
        if sequence_parallel and sequence_dim != 1:
            raise ValueError(f"ParallelSelfAttention is batch-first: sequence_dim must be 1, got "
                             f"{sequence_dim}")
        self.head_dim = hidden_size // num_heads if head_dim is None else head_dim
        if rope_base is not None and (rope_base <= 0 or self.head_dim % 2):
            raise ValueError(f"rotary embedding needs rope_base > 0 and an even head dim; got "
                             f"rope_base {rope_base}, head dim {self.head_dim}")
        self.rope_base, self.rope_scaling = rope_base, rope_scaling
        self._rope_cache: tuple | None = None  # (key, cos, sin) of the last forward's tables
        # tp above the KV heads: each rank holds the one its query heads use (replicated_heads)
        self.kv_replicas = tp // num_kv_heads if num_kv_heads % tp else 1
        self.local_heads = num_heads // tp
        self.local_kv_heads = 1 if self.kv_replicas > 1 else num_kv_heads // tp
        self.causal, self.attn_dropout, self.dropout = causal, attn_dropout, dropout
        self.sequence_parallel, self.recompute_core = sequence_parallel, recompute_core
        gen = generator(seed)
        common = dict(sequence_parallel=sequence_parallel, sequence_dim=1, overlap=overlap,
                      overlap_pieces=overlap_pieces, group=self.group, device=device, dtype=dtype,
                      seed=gen)
        q_size, kv_size = num_heads * self.head_dim, num_kv_heads * self.head_dim
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = ColumnParallelLinear(hidden_size, q_size, qkv_bias, **common)
        if self.kv_replicas > 1:
            self.k_proj = HeadReplicatedLinear(hidden_size, kv_size, qkv_bias,
                                               heads=num_kv_heads, **common)
            self.v_proj = HeadReplicatedLinear(hidden_size, kv_size, qkv_bias,
                                               heads=num_kv_heads, **common)
        else:
            self.k_proj = ColumnParallelLinear(hidden_size, kv_size, qkv_bias, **common)
            self.v_proj = ColumnParallelLinear(hidden_size, kv_size, qkv_bias, **common)
        self.o_proj = RowParallelLinear(q_size, hidden_size, bias, **common)
        self.kv_cache = None  # (KVCache, layer index) while generating: fastpar/nn/kv_cache.py
        self.q_norm = self.k_norm = None
        if qk_norm_eps is not None:  # the grads of the shared weights summed over tp's heads
            norm = dict(sequence_parallel=tp > 1, group=self.group, device=device, dtype=dtype)
            self.q_norm = RMSNorm(self.head_dim, qk_norm_eps, **norm)
            self.k_norm = RMSNorm(self.head_dim, qk_norm_eps, **norm)

    def _rotary(self, seq_len: int, dtype, device):
        """``rotary_tables`` for this length, dtype and device, kept from the last call (they
        are constants: recomputing them cost ~5% of a small GPT's step)."""
        key = (seq_len, dtype, device)
        if self._rope_cache is None or self._rope_cache[0] != key:
            with torch.inference_mode(False):  # kept tensors must be usable by a later backward
                self._rope_cache = (key, *rotary_tables(seq_len, self.head_dim, self.rope_base,
                                                        dtype, device, self.rope_scaling))
        return self._rope_cache[1], self._rope_cache[2]

    def _core(self, q, k, v) -> torch.Tensor:
        """The attention core: q (B, nh/tp, T, hd), k, v (B, nkv/tp, T, hd) -> (B, nh/tp, T,
        hd), probabilities dropped on the per-TP-rank stream (heads are sharded)."""
        p = self.attn_dropout if self.training else 0.0
        if self.context_parallel is not None:  # this rank's slice of the sequence
            attend = context.ring_attention if self.context_parallel == "ring" else \
                context.ulysses_attention
            # the dropout seed from the per-tp-rank stream (context's rule; heads are sharded)
            with tp_random.fork("tp", self.group) if p else contextlib.nullcontext():
                return attend(q, k, v, self.cp_group, causal=self.causal, dropout_p=p)
        gqa = self.local_heads != self.local_kv_heads
        if p:
            with tp_random.fork("tp", self.group):
                if self._keeps_mask(q):  # selective: the mask's bits kept, the rest recomputed
                    return dropout_attention(q, k, v, p, self.causal)
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p,
                                                      is_causal=self.causal, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=gqa)

    def _keeps_mask(self, q) -> bool:
        """Whether selective recomputation runs ``dropout_attention`` (its own recompute, the
        dropout mask kept as bits) instead of ``recompute`` around torch's kernel: on the CPU
        with attention dropout, where torch's math kernel would draw the mask again (module
        docstring). GPUs' fused kernels keep no probabilities and draw masks in registers.
        Not under CPU autocast: its backward would recompute in another precision."""
        return (self.recompute_core and self.training and self.attn_dropout > 0
                and self.context_parallel is None and q.device.type == "cpu"
                and torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu"))

    def _heads(self, x: torch.Tensor):
        """q (B, nh/tp, T, hd), k, v (B, nkv/tp, T, hd) of ``x``, before rope."""
        if self.kv_replicas > 1:
            self.k_proj._refuse_training()  # whichever path computes the projections
        # one entry communication for q, k and v (overlapped with their GEMMs by policy)
        q, k, v = ColumnParallelLinear.shared_forward(x, [self.q_proj, self.k_proj, self.v_proj])
        B, T, _ = q.shape  # (B, T, nh/tp * hd): the full sequence (cp: this rank's T/cp)
        q = q.view(B, T, self.local_heads, self.head_dim)
        k = k.view(B, T, self.local_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = v.view(B, T, self.local_kv_heads, self.head_dim).transpose(1, 2)
        return q.transpose(1, 2), k.transpose(1, 2), v

    def _cached(self, x: torch.Tensor) -> torch.Tensor:
        """Generation's forward (``kv_cache`` set): the new tokens' keys and values into the
        cache, attention over every cached slot the mask allows (fastpar/nn/kv_cache.py)."""
        if self.sequence_parallel or self.context_parallel is not None:
            raise ValueError("generation with a KV cache runs without sequence or context "
                             "parallelism (each rank holds whole sequences)")
        cache, index = self.kv_cache
        q, k, v = self._heads(x)
        B, _, T, _ = q.shape
        if self.rope_base is not None:  # each token at its own position (padding skipped)
            cos, sin = self._rotary(cache.max_len, q.dtype, q.device)
            cos, sin = cos[cache.positions][:, None], sin[cache.positions][:, None]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache.static:  # a fixed-shape decode step: every slot, masked
            keys, values = cache.store_static(index, k, v)
            mask = cache.static_mask
        else:
            keys, values = cache.store(index, k, v)
            mask = cache.mask
        h = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                           enable_gqa=self.local_heads != self.local_kv_heads)
        return self.o_proj(h.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kv_cache is not None:
            return self._cached(x)
        q, k, v = self._heads(x)
        B, _, T, _ = q.shape
        # q (B, nh/tp, T, hd); k, v (B, nkv/tp, T, hd)
        if self.rope_base is not None:  # positions 0..T-1 of the full (gathered) sequence
            cos, sin = self._rotary(T * self.cp, q.dtype, q.device)
            if self.context_parallel is not None:  # this rank's tokens' true positions
                pos = context.context_positions(T * self.cp, self.cp_group, q.device)
                cos, sin = cos[pos], sin[pos]  # (T/cp, hd/2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.recompute_core and not self._keeps_mask(q):
            h = recompute(self._core, q, k, v)
        else:
            h = self._core(q, k, v)
        h = h.transpose(1, 2).reshape(B, T, self.local_heads * self.head_dim)  # (B, T, nh/tp*hd)
        y = self.o_proj(h)
        if self.dropout and self.training:
            if self.sequence_parallel:
                with tp_random.fork("tp", self.group):
                    return F.dropout(y, self.dropout, training=True)
            return F.dropout(y, self.dropout, training=True)
        return y
