"""Context parallelism: attention over a sequence split across the ranks of a cp group.

    from fastpar.nn import context
    q_l = context.context_split(q, cp_group, dim=2)            # (B, H, T/cp, D): chunks r, 2cp-1-r
    k_l, v_l = (context.context_split(t, cp_group, dim=2) for t in (k, v))
    pos = context.context_positions(T, cp_group)               # (T/cp,) true positions, for rope
    y_l = context.ring_attention(q_l, k_l, v_l, cp_group)       # or ulysses_attention(...)
    y = context.context_gather(y_l, cp_group, dim=2)            # (B, H, T, D) in order again

**Layout.** The sequence of length T is cut into 2cp chunks of c = T / (2cp) tokens; rank r of
the group holds chunks r and 2cp-1-r, concatenated (Megatron's and torchtitan's load balance:
under a causal mask an early chunk attends to little and a late one to much, and each rank gets
one of each, so every rank does the same work). At cp 1 this is the sequence itself. Every
function here takes and returns this layout; its tokens' true positions come from
``context_positions`` (rotary embedding must use them: ``cos[pos]``, ``sin[pos]``). A sequence
length that is not divisible by 2cp is refused with a ``ValueError`` naming T, cp and 2cp (a
rank's slice must be two equal chunks); pad the batch to a multiple of 2cp first.

**Attention.** ``ring_attention`` keeps the heads and passes K/V around the group
(``context_ring.py``: torch isend/irecv, the next block in flight while this one computes,
the blocks merged by log-sum-exp in float32, float64 for float64 inputs). ``ulysses_attention``
re-shards: an all-to-all takes q, k, v from (B, H, T/cp, D) to (B, H/cp, T, D) (the full
sequence of H/cp heads), put in position order, ordinary attention runs, and the inverse
all-to-all returns (B, H, T/cp, D).
Both equal serial ``softmax(q k^T * scale + causal mask) v`` (GQA: query head h uses kv head
h // (H / Hkv)), forward and every gradient. Each takes ``group`` explicitly (the cp group,
e.g. ``fastpar.init(cp=N).cp_group``; None is a ``ValueError``) and is autograd-complete.

**Dropout** (``dropout_p > 0``) follows a rule that does not depend on how the work is split:
the probability of query position i, key position j, head h, batch row b is kept when a hash of
(seed, b, h, i, j) says so (``context_math.keep_mask``), so ring, Ulysses, any cp and a serial
reference that applies ``keep_mask`` drop exactly the same entries (torch's generator could not
give this: each rank sees the pairs in another order). ``dropout_seed=None`` draws the seed from
torch's default CPU generator at the call: every rank of the group must be in the same state
there (``fastpar.nn.random.seed`` seeds it alike; under tensor parallelism, call inside
``fastpar.nn.random.fork("tp")`` to draw from the per-tp-rank stream, Megatron's rule for
sharded heads). The seed is kept for backward, and ``fastpar.nn.recompute`` restores the
generator, so a recomputed forward draws the same seed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fastpar.comm.autograd import all_to_all_rows, gather_sequence, scatter_sequence
from fastpar.nn.context_math import LocalAttention
from fastpar.nn.context_ring import RingAttention, make_ring
from fastpar.runtime import group_rank, group_size

__all__ = ["choose_type", "context_gather", "context_positions", "context_split",
           "ring_attention", "ulysses_attention"]


def _chunk(seq_len: int, cp: int, what: str) -> int:
    """The chunk length T / 2cp; ``ValueError`` naming the numbers when it is not whole."""
    if seq_len % (2 * cp):
        raise ValueError(f"{what}: sequence length {seq_len} is not divisible by 2 x cp = "
                         f"{2 * cp} (cp {cp}): each rank holds two equal chunks of the sequence; "
                         "pad it to a multiple of 2 x cp")
    return seq_len // (2 * cp)


def _order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """int64 (T,): the positions of the layout's tokens, rank 0's slice first."""
    c = _chunk(seq_len, cp, "context parallelism")
    chunks = torch.arange(seq_len, device=device).view(2 * cp, c)
    ranks = torch.arange(cp, device=device)
    return torch.stack([chunks[ranks], chunks[2 * cp - 1 - ranks]], 1).reshape(-1)


def context_positions(seq_len: int, group, device=None) -> torch.Tensor:
    """int64 (T/cp,): the positions in the full sequence of this rank's tokens, chunk r then
    chunk 2cp-1-r (for rotary embedding and position-dependent masks)."""
    cp = group_size(group, "context_positions")
    return _order(seq_len, cp, device).view(cp, -1)[group_rank(group)]


def context_split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's slice of a full sequence (``x`` alike on every rank) along ``dim``.

    forward: ``y = x.index_select(dim, context_positions(T))``; backward: ``dx`` = the
    all-gather of every rank's ``dy`` put back in position order (as ``comm.scatter_sequence``,
    for an ``x`` replicated over the group). ``ValueError`` when T is not divisible by 2cp."""
    cp = group_size(group, "context_split")
    order = _order(x.shape[dim], cp, x.device)
    if cp == 1:
        return x
    return scatter_sequence(x.index_select(dim, order), group, dim)


def context_gather(y: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The full sequence in position order from every rank's slice along ``dim``.

    forward: the all-gather of the slices, reordered by position; backward: ``dy``'s tokens of
    this rank (as ``comm.gather_sequence``, for a result every rank holds)."""
    cp = group_size(group, "context_gather")
    order = _order(y.shape[dim] * cp, cp, y.device)
    if cp == 1:
        return y
    full = gather_sequence(y, group, dim)  # layout order: rank 0's slice first
    return full.index_select(dim, torch.argsort(order))


def _checked(name: str, q, k, v, group, dropout_p: float, scale):
    """``(cp, scale)`` after checking the arguments (``ValueError`` naming the numbers)."""
    cp = group_size(group, name)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"{name}: q, k, v must be (B, heads, T/cp, head dim), got shapes "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, T, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[2:] != (T, D):
        raise ValueError(f"{name}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be (B, "
                         f"Hkv, T/cp, D) = ({B}, Hkv, {T}, {D}) for q {tuple(q.shape)}")
    if H % k.shape[1]:
        raise ValueError(f"{name}: {H} query heads are not divisible by {k.shape[1]} kv heads")
    if T % 2:
        _chunk(T * cp, cp, name)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"{name}: dropout_p must be in [0, 1), got {dropout_p}")
    return cp, (1.0 / math.sqrt(D) if scale is None else float(scale))


def _seed(dropout_p: float, dropout_seed) -> int:
    if not dropout_p:
        return 0
    if dropout_seed is not None:
        return int(dropout_seed)
    return int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))  # default CPU generator


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                   causal: bool = True, dropout_p: float = 0.0, scale: float | None = None,
                   dropout_seed: int | None = None, engine: str = "p2p") -> torch.Tensor:
    """This rank's slice of ``softmax(q k^T * scale + mask) v`` over the whole sequence.

    q (B, H, T/cp, D), k, v (B, Hkv, T/cp, D) (Hkv divides H: grouped-query attention, K/V
    travel with Hkv heads), this rank's tokens in the layout of ``context_split``; returns
    (B, H, T/cp, D) in q's dtype. ``scale`` defaults to 1/sqrt(D); ``dropout_p`` drops
    probabilities by the module's rule (``dropout_seed``: see the module docstring). ``group``:
    the cp group (required). ``ValueError``: shapes that do not match, an odd T/cp (T not
    divisible by 2cp), ``dropout_p`` outside [0, 1), an unknown ``engine``.

    forward: ring steps, K/V shifted to the next rank while each block computes; backward: the
    K/V go around again with their gradients' partial sums (``context_ring.py``). ``engine``:
    how K/V reach the other ranks: "p2p" (the default: torch isend/irecv, gloo or NCCL) or
    "shared" (CPU, a group on one host: every rank reads the others' K/V in shared memory
    where they lie; not the default: measured no faster on the 2-core host, and it keeps n + 2
    blocks per group and shape); the same result either way, up to the order of the dK/dV
    sums."""
    cp, scale = _checked("ring_attention", q, k, v, group, dropout_p, scale)
    seq_len = q.shape[2] * cp
    slices = _order(seq_len, cp).view(cp, -1)  # (cp, T/cp): each rank's positions
    work = torch.promote_types(q.dtype, torch.float32)
    ring = make_ring(group, lambda j: slices[j], k, work, engine)
    return RingAttention.apply(q, k, v, ring, scale, causal, float(dropout_p),
                               _seed(dropout_p, dropout_seed))


def _kv_repeats(heads: int, kv_heads: int, cp: int) -> int:
    """How many copies of each kv head Ulysses sends: the fewest that make the kv heads
    divisible by cp (1 when cp divides Hkv). cp / gcd(Hkv, cp) copies give Hkv' = Hkv x copies
    heads, a multiple of cp, and each query head block of rank r (H/cp heads) then falls on
    rank r's Hkv'/cp kv heads (the copies divide H / Hkv because cp divides H)."""
    return cp // math.gcd(kv_heads, cp)


def _to_heads(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(B, h, T/cp, D) sequence-sharded -> (B, h/cp, T, D) head-sharded, tokens in position
    order (differentiable: all_to_all_rows and views)."""
    B, h, t, D = x.shape
    blocks = x.reshape(B, cp, h // cp, t, D).transpose(0, 1).contiguous()  # (cp, B, h/cp, t, D)
    got = all_to_all_rows(blocks, group)  # block i: rank i's tokens of this rank's heads
    got = got.view(cp, B, h // cp, 2, t // 2, D)
    # chunk order 0..2cp-1: ranks' first chunks in rank order, then second chunks reversed
    chunks = torch.cat([got[:, :, :, 0], got[:, :, :, 1].flip(0)])  # (2cp, B, h/cp, c, D)
    return chunks.permute(1, 2, 0, 3, 4).reshape(B, h // cp, cp * t, D)


def _to_sequence(y: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse of ``_to_heads``: (B, h/cp, T, D) -> (B, h, T/cp, D)."""
    B, hl, T, D = y.shape
    chunks = y.view(B, hl, 2 * cp, T // (2 * cp), D).permute(2, 0, 1, 3, 4)  # (2cp, B, h/cp,..)
    mine = torch.stack([chunks[:cp], chunks[cp:].flip(0)], 3)  # (cp, B, h/cp, 2, c, D)
    got = all_to_all_rows(mine.reshape(cp, B, hl, T // cp, D), group)  # block i: rank i's heads
    return got.transpose(0, 1).reshape(B, cp * hl, T // cp, D)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *,
                      causal: bool = True, dropout_p: float = 0.0, scale: float | None = None,
                      dropout_seed: int | None = None) -> torch.Tensor:
    """``ring_attention``'s result by DeepSpeed-Ulysses: all-to-all to (B, H/cp, T, D),
    attention over the whole sequence in position order, all-to-all back.

    H must be divisible by cp (``ValueError`` naming both). kv heads: when cp does not divide
    Hkv (e.g. Hkv < cp), each kv head is repeated cp / gcd(Hkv, cp) times before the all-to-all
    (``_kv_repeats``), so every rank receives the kv heads its query heads use; their gradients
    sum back over the copies. Without dropout the core is ``F.scaled_dot_product_attention``
    (is_causal on the reordered sequence); with dropout, the written-out core applying the
    module's rule (``context_math.LocalAttention``, holding (B, H/cp, T, T) scores per call)."""
    cp, scale = _checked("ulysses_attention", q, k, v, group, dropout_p, scale)
    H = q.shape[1]
    if H % cp:
        raise ValueError(f"ulysses_attention: {H} query heads are not divisible by cp {cp}")
    seed = _seed(dropout_p, dropout_seed)
    copies = _kv_repeats(H, k.shape[1], cp)
    if copies > 1:
        k, v = k.repeat_interleave(copies, 1), v.repeat_interleave(copies, 1)
    if cp > 1:
        q, k, v = (_to_heads(x, group, cp) for x in (q, k, v))  # (B, heads/cp, T, D)
    hl, hkv = q.shape[1], k.shape[1]
    if dropout_p:
        first = group_rank(group) * hl
        heads = torch.arange(first, first + hl, device=q.device)
        pos = torch.arange(q.shape[2], device=q.device)
        y = LocalAttention.apply(q, k, v, scale, causal, float(dropout_p), seed, heads, pos)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale,
                                           enable_gqa=hl != hkv)
    return _to_sequence(y, group, cp) if cp > 1 else y


def choose_type(heads: int, kv_heads: int, cp: int, *, tp: int = 1, same_host: bool = True,
                dropout: bool = False) -> tuple[str, str]:
    """``("ring" | "ulysses", why)``: the cp attention that suits a layout (``bench/context.py``
    measured it; docs/design.md, "Context parallelism: which type").

    ``heads``, ``kv_heads``: the model's; ``tp``: tensor parallelism splitting them first;
    ``same_host``: whether the cp group's ranks share a host; ``dropout``: attention dropout on.
    Ulysses runs torch's fused attention on H/cp heads of the whole sequence (one kernel call,
    the faster at long sequences on the CPU host measured) but needs the heads per tp rank
    divisible by cp and does not hide its all-to-alls; the ring takes any head count, sends only
    Hkv heads of K/V and keeps their transfers in flight behind the attention (fused per block
    without dropout: O(T/cp) memory; with dropout its written-out blocks hold (T/cp)^2)."""
    if min(heads, kv_heads, cp, tp) < 1 or heads % kv_heads:
        raise ValueError(f"choose_type: heads {heads}, kv heads {kv_heads}, cp {cp}, tp {tp} "
                         "must be positive, heads a multiple of kv heads")
    local = heads // tp
    if heads % tp or local % cp:
        return "ring", (f"{local} heads per tp rank (heads {heads} / tp {tp}) are not "
                        f"divisible by cp {cp}: Ulysses cannot split them")
    if dropout:
        return "ring", ("attention dropout: Ulysses's written-out core holds (B, H/cp, T, T) "
                        "probabilities; the ring holds (T/cp)^2 blocks a step")
    if not same_host:
        return "ring", ("the cp group spans hosts: the ring's K/V transfers overlap the "
                        "attention, Ulysses's all-to-alls wait on the link")
    repeats = _kv_repeats(local, max(kv_heads // tp, 1), cp)
    note = f" (kv heads repeated {repeats}x for the all-to-all)" if repeats > 1 else ""
    return "ulysses", ("heads divide by cp inside one host: one fused attention on H/cp "
                       f"heads of the whole sequence{note}")
