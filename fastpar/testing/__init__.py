"""What tests and benchmarks of parallel layers share: serial reference blocks and a tolerance
derived from the serial model's own rounding error.

    from fastpar.testing import Checks, SerialMLP, assert_close
    assert_close("mlp.out", parallel_out, ref64_out, serial_out)
    c = Checks(); c.close("mlp.out", parallel_out, ref64_out, serial_out)   # + c.worst, c.checked

**The tolerance.** A parallel result differs from the serial one only by rounding: the same sums
taken in another order, split over ranks and joined by a collective. So it is compared with a
float64 evaluation of the same serial model on the same (already rounded) weights and inputs,
and its error is bounded by a small multiple of the error the serial model makes in the working
dtype::

    |par - ref64| <= FACTOR * (|serial - ref64| + eps * |ref64|) + eps * scale * sqrt(numel)

(2-norms over the tensor; ``eps`` of the working dtype). The bound moves with the machine: a CPU
whose kernels round differently (AVX2, AVX-512, another BLAS blocking or thread count) changes
the serial error the same way. ``eps * |ref64|`` is the error of rounding the exact result once,
for results the serial model happens to compute exactly; ``scale`` (the magnitude of the terms
that cancel) is a floor for results that are zero in exact arithmetic, whose relative error
means nothing. A wrong group, a missing reduction or a shard taken from the wrong rank is off by
O(|ref|), orders of magnitude above the bound.

The serial blocks are what ``fastpar.nn.ParallelMLP`` and ``ParallelSelfAttention`` shard, with
the same parameter names and draw order, written with plain ``nn.Linear``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

FACTOR = 8.0  # parallel rounding error allowed, in units of the serial model's own


def rounding_bound(ref: torch.Tensor, serial: torch.Tensor, dtype: torch.dtype, *,
                   factor: float = FACTOR, scale: float = 0.0) -> tuple[float, float]:
    """``(bound, serial error)`` for a result of dtype ``dtype``; see the module docstring."""
    eps = torch.finfo(dtype).eps
    ref64 = ref.detach().double()
    serial_err = (serial.detach().double() - ref64).norm().item()
    bound = factor * (serial_err + eps * ref64.norm().item()) \
        + eps * scale * math.sqrt(ref64.numel())
    return bound, serial_err


def assert_close(name: str, got: torch.Tensor, ref: torch.Tensor, serial: torch.Tensor, *,
                 dtype: torch.dtype | None = None, factor: float = FACTOR,
                 scale: float = 0.0) -> float:
    """Assert ``got`` (a parallel result) is within the rounding bound of ``ref`` (float64);
    ``serial``: the serial model's result in the working dtype (``dtype``, default
    ``serial.dtype``). Returns the error as a fraction of the bound."""
    assert got is not None, f"{name}: missing (no gradient?)"
    assert tuple(got.shape) == tuple(ref.shape) == tuple(serial.shape), \
        f"{name}: shapes {tuple(got.shape)} (parallel), {tuple(ref.shape)} (float64 " \
        f"reference), {tuple(serial.shape)} (serial)"
    if ref.numel() == 0:
        return 0.0
    dtype = serial.dtype if dtype is None else dtype
    bound, serial_err = rounding_bound(ref, serial, dtype, factor=factor, scale=scale)
    err = (got.detach().double() - ref.detach().double()).norm().item()
    assert err <= bound, (
        f"{name}: error {err:.3g} against the float64 reference exceeds the bound {bound:.3g} "
        f"= {factor:g} x (serial {dtype} error {serial_err:.3g} + eps x |ref| "
        f"{torch.finfo(dtype).eps * ref.double().norm().item():.3g}); |ref| = "
        f"{ref.double().norm().item():.3g}")
    return err / bound if bound else 0.0


class Checks:
    """Many ``assert_close`` checks in one multi-rank body: ``checked`` lists their names (so a
    test can compare ranks and count them), ``worst`` is ``(error / bound, name)`` of the
    closest call."""

    def __init__(self):
        self.checked, self.worst = [], (0.0, "")

    def close(self, name, got, ref, serial, **kw):
        ratio = assert_close(name, got, ref, serial, **kw)
        self.worst = max(self.worst, (ratio, name))
        self.checked.append(name)


class SerialMLP(nn.Module):
    """The serial block ``ParallelMLP`` shards: "gelu" ``fc2(gelu(fc1(x)))`` or "swiglu"
    ``down_proj(silu(gate_proj(x)) * up_proj(x))``, then dropout on the output."""

    def __init__(self, hidden: int, ffn: int, activation: str = "gelu", bias: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        self.activation, self.dropout = activation, dropout
        if activation == "gelu":
            self.fc1, self.fc2 = nn.Linear(hidden, ffn, bias), nn.Linear(ffn, hidden, bias)
        else:
            self.gate_proj = nn.Linear(hidden, ffn, bias)
            self.up_proj = nn.Linear(hidden, ffn, bias)
            self.down_proj = nn.Linear(ffn, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu":
            y = self.fc2(F.gelu(self.fc1(x)))
        else:
            y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return F.dropout(y, self.dropout, self.training) if self.dropout else y


class SerialAttention(nn.Module):
    """Causal MHA/GQA, batch-first: the serial block ``ParallelSelfAttention`` shards.

    ``sdpa=False`` writes attention out (kv heads repeated, explicit mask): the independent
    float64 reference. ``sdpa=True`` runs ``F.scaled_dot_product_attention`` on the repeated
    heads, the kernel the parallel layer runs, so that its error in a working dtype measures the
    rounding that kernel makes (a fused kernel rounds gradients that cancel exactly, such as the
    key bias's, differently from the written-out form)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, bias: bool = True, *,
                 sdpa: bool = False):
        super().__init__()
        self.sdpa = sdpa
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias)
        self.o_proj = nn.Linear(hidden, hidden, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(b, t, self.heads, hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(b, t, self.kv_heads, hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(b, t, self.kv_heads, hd).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, nh, T, hd)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, h))
        # Scores in at least float32 (as SDPA's CPU kernels), float64 stays float64.
        score_dtype = torch.promote_types(q.dtype, torch.float32)
        att = (q @ k.transpose(-1, -2)).to(score_dtype) / hd ** 0.5  # (B, nh, T, T)
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(),
                              float("-inf"))
        y = att.softmax(-1).to(v.dtype) @ v  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h))
