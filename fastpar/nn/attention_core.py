"""The attention core with dropout for selective recomputation on the CPU: the forward keeps one
bit per probability (the dropout mask) and the backward recomputes the probabilities.

    out = dropout_attention(q, k, v, p, causal)    # q (B, H, T, D), k, v (B, Hkv, Tk, D)

On the CPU, attention with dropout runs torch's math kernel, which keeps three (T, Tk) float
matrices per head for backward (the probabilities, the dropout noise, the dropped
probabilities): the largest activations of a block. Recomputing that kernel in backward
(``fastpar.nn.recompute``) draws the dropout mask again, and the draw (``bernoulli_``, ~7 ns a
probability here) costs more than the two matrix products of the core together. This function
draws the mask once, keeps it packed eight to a byte, and keeps q, k, v and the output; its
backward forms the scores again, their softmax (the same kernels on the same values as the
forward, so the same probabilities), and the gradients::

    p_ij = softmax_j(s_ij)   s = q k^T scale (+ causal -inf)   o = c (p * keep) v, c = 1/(1-p)
    dv = c (p * keep)^T do    ds = (p * keep) * (c do v^T) - p * delta    delta_i = do_i . o_i
    dq = ds k scale           dk = ds^T q scale

**The same mask as torch.** The mask is ``bernoulli_(1 - p)`` over a (B, H, T, Tk) tensor
drawn from the current default generator, which is how torch's math kernel draws it (the draw
depends on the element count and the generator, not the dtype), so this and
``F.scaled_dot_product_attention(q, k, v, dropout_p=p)`` drop the same probabilities from the
same generator state and leave it in the same state: a model computes the same function with
and without selective recomputation (to rounding: the kernels differ).

**Memory.** Kept for backward: q, k, v (the caller's tensors), one bit per probability, and the
output in (B, T, H, D) order: the function returns a (B, H, T, D) view of it, so the caller's
``out.transpose(1, 2).reshape(B, T, H * D)`` (the output projection's input, kept by that
projection) is the same storage, counted once. Grouped-query heads share their kv head's rows
without repeating k and v (query head h reads kv head h // (H / Hkv), as ``enable_gqa``).
float32 and float64 compute in their own dtype; bfloat16 and float16 in float32.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

__all__ = ["dropout_attention", "pack_bits", "unpack_bits"]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor as uint8, eight elements a byte (element 8i + j is bit j of byte i; the
    last byte padded with zeros). ``unpack_bits(pack_bits(m), m.shape)`` is ``m``. Eight bytes
    are read as one little-endian int64 (x86, ARM)."""
    if sys.byteorder != "little":
        raise RuntimeError("pack_bits reads eight bools as a little-endian int64")
    flat = mask.reshape(-1).view(torch.uint8)  # each byte 0 or 1
    pad = -flat.numel() % 8
    if pad:
        flat = F.pad(flat, (0, pad))
    elif flat.storage_offset() % 8:  # a view off the int64 grid
        flat = flat.clone()
    x = flat.view(torch.int64)  # eight 0/1 bytes per word: bit 8j -> bit j
    x = x | (x >> 7)
    x = x | (x >> 14)
    x = x | (x >> 28)
    return (x & 0xFF).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, shape) -> torch.Tensor:
    """The bool tensor of ``shape`` that ``pack_bits`` packed into ``packed``."""
    y = packed.to(torch.int64)  # bit j -> byte j of the word
    y = (y | (y << 28)) & 0x0000000F0000000F
    y = (y | (y << 14)) & 0x0003000300030003
    y = (y | (y << 7)) & 0x0101010101010101
    return y.view(torch.uint8)[:shape.numel()].view(torch.bool).view(shape)


def _operands(q, k, v, work):
    """q as (B * Hkv, G * T, D) (each kv head's G query heads stacked by rows), k and v as
    (B * Hkv, Tk, D), in the working dtype."""
    B, H, T, D = q.shape
    hkv, tk = k.shape[1], k.shape[2]
    return (q.to(work).reshape(B * hkv, H // hkv * T, D), k.to(work).reshape(B * hkv, tk, D),
            v.to(work).reshape(B * hkv, tk, D))


def _probabilities(q3, k3, causal: bool, scale: float, t: int) -> torch.Tensor:
    """softmax(q k^T scale (+ causal mask)), (B * Hkv, G * T, Tk): the same kernels on the same
    values in forward and backward, so the same probabilities."""
    s = torch.bmm(q3 * scale, k3.transpose(1, 2))
    if causal:  # -inf above the diagonal of each query head's (T, T) block
        bias = torch.full((t, t), float("-inf"), dtype=s.dtype, device=s.device).triu_(1)
        s.view(s.shape[0], -1, t, t).add_(bias)
    return torch.softmax(s, -1)


class _DropoutAttention(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, p: float, causal: bool, scale: float):
        B, H, T, D = q.shape
        work = torch.promote_types(q.dtype, torch.float32)
        q3, k3, v3 = _operands(q, k, v, work)
        prob = _probabilities(q3, k3, causal, scale, T)
        noise = torch.empty_like(prob).bernoulli_(1.0 - p)  # torch's draw (module docstring)
        keep = pack_bits(noise != 0)
        o = torch.bmm(prob.mul_(noise), v3).mul_(1.0 / (1.0 - p))  # (B, H, T, D) in memory
        del prob, noise
        out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
        out.copy_(o.view(B, H, T, D).transpose(1, 2))
        ctx.save_for_backward(q, k, v, out, keep)
        ctx.args = (p, causal, scale)
        return out.transpose(1, 2)  # (B, H, T, D), a view of the (B, T, H, D) storage kept

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, keep = ctx.saved_tensors
        p, causal, scale = ctx.args
        B, H, T, D = q.shape
        work = torch.promote_types(q.dtype, torch.float32)
        q3, k3, v3 = _operands(q, k, v, work)
        c = 1.0 / (1.0 - p)
        rows = q3.shape[:2]
        dout = dout.to(work)
        delta = (dout * out.transpose(1, 2).to(work)).sum(-1).view(*rows, 1)
        do = (dout * c).reshape(*rows, D)  # c do
        prob = _probabilities(q3, k3, causal, scale, T)  # the forward's probabilities
        dropped = prob.clone().mul_(unpack_bits(keep, prob.shape))
        dv = torch.bmm(dropped.transpose(1, 2), do)  # summed over each kv head's G query heads
        ds = torch.bmm(do, v3.transpose(1, 2)).mul_(dropped).addcmul_(prob, delta, value=-1.0)
        del dropped, prob
        need_q, need_k = ctx.needs_input_grad[:2]
        dq = torch.bmm(ds, k3).mul_(scale).view(q.shape).to(q.dtype) if need_q else None
        dk = torch.bmm(ds.transpose(1, 2), q3).mul_(scale).view(k.shape).to(k.dtype) \
            if need_k else None
        return dq, dk, dv.view(v.shape).to(v.dtype), None, None, None


def dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float,
                      causal: bool, scale: float | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal, enable_gqa=...)``
    keeping one bit per probability for backward (module docstring). q (B, H, T, D), k, v
    (B, Hkv, Tk, D), H a multiple of Hkv; ``causal`` needs Tk == T; 0 < p < 1."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"dropout_attention: p must be in (0, 1), got {p}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[0] != k.shape[0] \
            or q.shape[3] != k.shape[3] or q.shape[1] % k.shape[1]:
        raise ValueError(f"dropout_attention: q (B, H, T, D) and k, v (B, Hkv, Tk, D) with H a "
                         f"multiple of Hkv, got q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}")
    if causal and k.shape[2] != q.shape[2]:
        raise ValueError(f"dropout_attention: causal attention needs as many keys as queries, "
                         f"got {q.shape[2]} queries and {k.shape[2]} keys")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _DropoutAttention.apply(q, k, v, p, causal, scale)
