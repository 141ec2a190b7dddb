"""One block of attention with its log-sum-exp, its backward, and the attention-dropout rule of
context parallelism: the math under ``fastpar.nn.context``.

A block is the attention of some query rows against some key/value columns, with the softmax
normalised over those columns only. It returns the output and the rows' log-sum-exp, so that
blocks over disjoint column sets merge exactly (flash-attention's rule, in the working dtype
``promote(dtype, float32)``)::

    s = q k^T * scale (+ causal mask)        lse = log sum_j exp(s_j)       o = exp(s - lse) v
    merge (o1, lse1), (o2, lse2):  lse = logaddexp(lse1, lse2)
                                   o = exp(lse1 - lse) o1 + exp(lse2 - lse) o2

Its backward recomputes the probabilities from q, k and the final (merged) lse, so a caller keeps
q, k, v, the output and lse, never a (T, T) matrix::

    p = exp(s - lse)   pd = p * keep / (1 - p_drop)        (o = pd v)
    dv = pd^T do       dpd = do v^T    dp = dpd * keep / (1 - p_drop)
    ds = p * (dp - delta),  delta_i = do_i . o_i   (= sum_j p_ij dp_ij, dropout or not)
    dq = ds k * scale  dk = ds^T q * scale

Shapes, grouped-query attention without repeating k and v: q (B, Hkv, G, Tq, D), k and v
(B, Hkv, 1, Tk, D), G = H / Hkv query heads per kv head (query head h = kv head h // G, as
``repeat_interleave`` pairs them); dk, dv are summed over G.

**Attention dropout** cannot reuse torch's generator: a rank of the ring sees the (query, key)
pairs in another order than one process does, and Ulysses sees other heads. So the mask is a
function of where the probability sits, not of a stream's state::

    keep[b, h, i, j] = mix(row(seed, b, h, i) ^ col(seed, j)) >= p * 2^32

with ``i``, ``j`` the global positions of the query and the key, ``h`` the global query head,
``b`` the batch index, and ``mix`` a 32-bit multiply-xorshift hash (``_mix``). Any
implementation that applies the same rule (serial attention in a test, ring, Ulysses, any cp)
drops the same probabilities. It is written in int64 torch ops (no overflow: every value stays
below 2^49), on any device; a fused kernel could compute the same bits in registers.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in [0, 2^32) and a constant ``c`` < 2^32, without
    int64 overflow: the low and high 16 bits of x are multiplied apart."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds) of int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix_int(value: int) -> int:
    return int(_mix(torch.tensor(value & _M32, dtype=torch.int64)))


def keep_mask(seed: int, p: float, batch: int, heads: torch.Tensor, q_pos: torch.Tensor,
              k_pos: torch.Tensor) -> torch.Tensor:
    """The attention-dropout rule (module docstring): bool (batch, len(heads), len(q_pos),
    len(k_pos)), True where the probability is kept. ``heads``, ``q_pos``, ``k_pos``: int64
    global head indices and token positions (1-D, on the device the mask should be on)."""
    device = q_pos.device
    key = _mix_int(seed ^ _mix_int((seed >> 32) ^ 0x9E3779B9))  # 64-bit seed -> 32-bit key
    col_key = _mix_int(key ^ 0x632BE5AB)
    b = torch.arange(batch, dtype=torch.int64, device=device)
    row = _mix(_mix(b[:, None] ^ key) ^ heads.to(device, torch.int64)[None, :])  # (B, H)
    row = _mix(row[:, :, None] ^ q_pos.to(torch.int64)[None, None, :])  # (B, H, Tq)
    col = _mix(k_pos.to(device, torch.int64) ^ col_key)  # (Tk,)
    threshold = min(round(p * 2.0 ** 32), 2 ** 32)
    return _mix(row[..., None] ^ col) >= threshold  # (B, H, Tq, Tk)


def grouped(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(B, H, T, D) -> (B, Hkv, H / Hkv, T, D): query heads beside their kv head (a view)."""
    B, H, T, D = x.shape
    return x.view(B, kv_heads, H // kv_heads, T, D)


def _scores(q, k, scale: float, causal: bool) -> torch.Tensor:
    """(B, Hkv, G, Tq, Tk) scaled scores; ``causal``: query i sees keys j <= i (Tq == Tk, the
    block's rows and columns at the same positions in the same order)."""
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        tq, tk = s.shape[-2:]
        above = torch.ones(tq, tk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    return s


def fused_kernel(q, keep) -> bool:
    """Whether a block runs in torch's fused CPU attention (flash-style: no (Tq, Tk) scores
    held; it returns the block's log-sum-exp, and its backward takes the whole attention's
    output and log-sum-exp, which is what a block's share of the gradients needs). Without
    dropout only: the fused kernel cannot apply the position-hash mask."""
    return keep is None and q.device.type == "cpu"


def _rows(q, causal: bool) -> tuple:
    """The fused kernel's shape for q-shaped tensors (B, Hkv, G, Tq, D): causal, one head per
    query head, (B*Hkv, G, Tq, D); otherwise each kv head's G query heads stacked by rows as one
    head, (B*Hkv, 1, G*Tq, D) (rows are independent without a mask; ``_heads``)."""
    B, hkv, G, tq, d = q.shape
    return (B * hkv, G, tq, d) if causal else (B * hkv, 1, G * tq, d)


def _heads(q, t, causal: bool):
    """t (B, Hkv, 1, Tk, D) as the fused kernel's k or v beside ``_rows(q)``: causal, each kv
    head repeated for its G query heads (the kernel takes equal head counts and masks by
    position within a head), (B*Hkv, G, Tk, D); otherwise the kv head once, (B*Hkv, 1, Tk, D)."""
    B, hkv, G = q.shape[:3]
    if causal:
        return t.expand(B, hkv, G, *t.shape[3:]).reshape(B * hkv, G, *t.shape[3:])
    return t.reshape(B * hkv, 1, *t.shape[3:])


def block_forward(q, k, v, scale: float, causal: bool, keep, p: float):
    """``(o, lse)`` of one block: q (B, Hkv, G, Tq, D), k, v (B, Hkv, 1, Tk, D) in the working
    dtype; ``keep`` None or bool (B, Hkv, G, Tq, Tk) with drop probability ``p``. Every row
    must see at least one key (true of every block ``fastpar.nn.context`` forms). Without
    dropout on the CPU: torch's fused kernel (``fused_kernel``); else written out."""
    if fused_kernel(q, keep):
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.reshape(_rows(q, causal)), _heads(q, k, causal), _heads(q, v, causal), 0.0,
            causal, attn_mask=None, scale=scale)
        return o.view(q.shape), lse.view(q.shape[:-1])
    s = _scores(q, k, scale, causal)  # (B, Hkv, G, Tq, Tk)
    lse = torch.logsumexp(s, dim=-1)  # (B, Hkv, G, Tq)
    prob = torch.exp(s - lse[..., None])
    if keep is not None:
        prob = prob * keep / (1.0 - p)
    return prob @ v, lse  # (B, Hkv, G, Tq, D), (B, Hkv, G, Tq)


def block_backward(q, k, v, do, o, lse, delta, scale: float, causal: bool, keep, p: float):
    """``(dq, dk, dv)`` of one block's share (module docstring): ``do`` and ``o`` (B, Hkv, G,
    Tq, D), ``lse`` and ``delta`` = rowsum(do * o) (B, Hkv, G, Tq) of the whole attention
    (merged over all blocks); dk, dv (B, Hkv, 1, Tk, D) summed over the G query heads of each
    kv head. Without dropout on the CPU, torch's fused backward given the whole attention's
    ``o`` and ``lse`` (it forms delta itself)."""
    if fused_kernel(q, keep):
        flat = _rows(q, causal)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.reshape(flat), q.reshape(flat), _heads(q, k, causal), _heads(q, v, causal),
            o.reshape(flat), lse.reshape(flat[:-1]).contiguous(), 0.0, causal, attn_mask=None,
            scale=scale)
        if not causal:  # one head per kv head: the G query heads' shares are summed already
            return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
        kv_shape = (*q.shape[:3], *k.shape[3:])
        return (dq.view(q.shape), dk.view(kv_shape).sum(2, keepdim=True),
                dv.view(kv_shape).sum(2, keepdim=True))
    s = _scores(q, k, scale, causal)
    prob = torch.exp(s - lse[..., None])  # (B, Hkv, G, Tq, Tk): 0 where masked
    dprob = do @ v.transpose(-1, -2)  # d(dropped probabilities)
    if keep is not None:
        dropped = prob * keep / (1.0 - p)
        dprob = dprob * keep / (1.0 - p)
    else:
        dropped = prob
    dv = (dropped.transpose(-1, -2) @ do).sum(2, keepdim=True)
    ds = prob * (dprob - delta[..., None])
    dq = (ds @ k) * scale
    dk = (ds.transpose(-1, -2) @ q).sum(2, keepdim=True) * scale
    return dq, dk, dv


def merge_into(o: torch.Tensor, lse: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Fold block (o_b, lse_b) into the running (o, lse) in place (views of the rows the block
    covers are fine)."""
    new = torch.logaddexp(lse, lse_b)
    o.mul_(torch.exp(lse - new)[..., None]).add_(o_b * torch.exp(lse_b - new)[..., None])
    lse.copy_(new)


class LocalAttention(torch.autograd.Function):
    """Attention of a whole (local) sequence as one block, with the same dropout rule: what
    Ulysses runs after its all-to-all when dropout is on. q (B, H, T, D), k, v (B, Hkv, T, D);
    ``heads``: q's global head indices; ``pos``: the tokens' positions (increasing)."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, p, seed, heads, pos):
        work = torch.promote_types(q.dtype, torch.float32)
        B, H, T, _ = q.shape
        hkv = k.shape[1]
        keep = None if not p else keep_mask(seed, p, B, heads, pos, pos).view(
            B, hkv, H // hkv, T, T)
        o, lse = block_forward(grouped(q.to(work), hkv), k.to(work)[:, :, None],
                               v.to(work)[:, :, None], scale, causal, keep, p)
        out = o.reshape(q.shape).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, heads, pos)
        ctx.args = (scale, causal, p, seed)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, heads, pos = ctx.saved_tensors
        scale, causal, p, seed = ctx.args
        work = lse.dtype
        B, H, T, _ = q.shape
        hkv = k.shape[1]
        keep = None if not p else keep_mask(seed, p, B, heads, pos, pos).view(
            B, hkv, H // hkv, T, T)
        do, o = grouped(dout.to(work), hkv), grouped(out.to(work), hkv)
        delta = (do * o).sum(-1)
        dq, dk, dv = block_backward(grouped(q.to(work), hkv), k.to(work)[:, :, None],
                                    v.to(work)[:, :, None], do, o, lse, delta, scale, causal,
                                    keep, p)
        return (dq.reshape(q.shape).to(q.dtype), dk[:, :, 0].to(k.dtype),
                dv[:, :, 0].to(v.dtype), None, None, None, None, None, None)
