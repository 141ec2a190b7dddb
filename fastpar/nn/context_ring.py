"""Ring attention: K/V blocks travel around the cp group while each rank attends with them.

Rank r of n holds chunks r and 2n-1-r of the sequence (``fastpar.nn.context``'s layout). At
step s it holds the K/V of rank j = (r - s) mod n and attends with the part of it that the
causal mask leaves, each step the same amount of work (c = T / 2n, the chunk length)::

    step 0  (j = r)   both q chunks against both kv chunks, causal      (2c x 2c) / 2
    j < r             both q chunks against kv chunk j (all earlier)     2c x c
    j > r             q chunk 2n-1-r against both kv chunks              c x 2c
    not causal        both against both                                  2c x 2c

and folds the block into its output with the log-sum-exp merge (``context_math``).

**Forward**: before a step's attention, the K/V it holds go to rank r+1 and the next step's
arrive from rank r-1 (``_Ring.shift``: one ``batch_isend_irecv``); the attention runs while they
travel, then the receive is waited for. n-1 transfers of (2, B, Hkv, T/n, D) in the input
dtype. **Backward**: the K/V go around again the same way, and so do their gradients: at step s
rank r adds its share of dK/dV of block j to the partial sum that ranks j..r-1 made, received
during this step's attention, and sends the sum on (working dtype, float32 for bf16/fp16/fp32
inputs); after n steps each block's sum is back at its owner. n-1 K/V transfers and n dK/dV
transfers, each in flight behind one step's attention. Saved for backward: q, k, v, the output
and the log-sum-exp (float32, (B, H, T/n)); no probabilities.

**Engine**: ``torch.distributed`` isend/irecv on the cp group (gloo on CPU, NCCL on GPUs). Both
progress without the calling thread: gloo's transfers run on its own I/O threads, NCCL's on its
stream, so the next block moves while this one computes. fastpar's pipeline ``Channels`` are not
used: their shm rings copy only inside a call on the channel (the sender pushes while it sends
or waits, the receiver pulls with ``process_vm_readv`` inside its receive), so a transfer
started before the attention would make no progress until the receive after it; and their
messages are the pipeline's (microbatch, stage, direction) with per-step shape checks, not a
ring of equal blocks. Every wait is bounded by the job's timeout.

Measured on the 2-core CPU host (2 ranks, one intra-op thread each, a 4 MB block taking 10 ms
alone, 85 ms of matmuls after posting it): the receive has arrived when the compute ends (the
wait takes 0.07 ms), but the step takes ~95 ms, compute plus transfer: the transfer no longer
blocks the rank, yet gloo's loopback copies run on the same two cores as the attention, so
little of its time is hidden there. With a core to spare (or NCCL on a GPU) it would be.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fastpar.comm.p2p_engines import TorchSend
from fastpar.nn.context_math import (block_backward, block_forward, grouped, keep_mask,
                                     merge_into)
from fastpar.runtime import group_rank, is_initialized, topology

TAG_KV, TAG_DKV = 71, 72  # one tag per message kind: gloo matches a receive by (peer, tag)


class _Ring:
    """This rank's neighbours in ``group`` (global ranks) and the shift of a block to the next
    rank, receiving the previous rank's."""

    def __init__(self, group, positions):
        ranks = dist.get_process_group_ranks(group)
        self.n, self.index = len(ranks), group_rank(group)
        self.group = group
        self.next, self.prev = ranks[(self.index + 1) % self.n], ranks[(self.index - 1) % self.n]
        self.timeout = topology().timeout if is_initialized() else math.inf
        self.positions = positions  # positions(index) -> int64 (T/n,) of that rank's tokens

    def shift(self, t: torch.Tensor, tag: int):
        """Send ``t`` to the next rank and receive the previous rank's block of the same shape;
        returns ``(buffer, handle)``: ``buffer`` is valid after ``handle.wait()``, and ``t``
        must stay unchanged until then."""
        buf = torch.empty_like(t)
        works = dist.batch_isend_irecv([
            dist.P2POp(dist.isend, t, self.next, self.group, tag),
            dist.P2POp(dist.irecv, buf, self.prev, self.group, tag)])
        return buf, TorchSend(works, keep=(t, buf), timeout=self.timeout)


def _step_blocks(r: int, j: int, s: int, c: int, causal: bool):
    """``(rows, cols, diagonal)`` of step s on rank r holding rank j's K/V (module docstring):
    the query rows and K/V columns (slices of the 2c local tokens) and whether the causal mask
    lies on the block's diagonal."""
    every = slice(None)
    if not causal:
        return every, every, False
    if s == 0:
        return every, every, True
    if j < r:
        return every, slice(0, c), False
    return slice(c, None), every, False



def _step_keep(ring, j, rows, cols, my_pos, heads, hkv, B, seed, p):
    """The dropout keep mask of one ring step (None without dropout): this rank's query rows
    against rank j's key columns, at their true positions, as (B, Hkv, G, rows, cols)."""
    if not p:
        return None
    k_pos = ring.positions(j).to(my_pos.device)[cols]
    return keep_mask(seed, p, B, heads, my_pos[rows], k_pos).view(
        B, hkv, heads.numel() // hkv, -1, k_pos.numel())

class RingAttention(torch.autograd.Function):
    """q (B, H, T/n, D), k, v (B, Hkv, T/n, D), this rank's tokens in the load-balanced layout
    -> this rank's output (B, H, T/n, D). Non-tensor arguments: the ``_Ring``, scale, causal,
    dropout p and seed."""

    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, scale: float, causal: bool, p: float, seed: int):
        work = torch.promote_types(q.dtype, torch.float32)
        B, H, T, D = q.shape
        hkv, c, r, n = k.shape[1], q.shape[2] // 2, ring.index, ring.n
        q5 = grouped(q.to(work), hkv)  # (B, Hkv, G, T/n, D)
        heads = torch.arange(H, device=q.device)
        my_pos = ring.positions(r).to(q.device)
        kv = torch.stack([k, v])  # (2, B, Hkv, T/n, D): one message per step
        o = lse = None
        for s in range(n):
            if s < n - 1:  # the next step's K/V travel while this step attends
                nxt, handle = ring.shift(kv, TAG_KV)
            j = (r - s) % n
            rows, cols, diag = _step_blocks(r, j, s, c, causal)
            keep = _step_keep(ring, j, rows, cols, my_pos, heads, hkv, B, seed, p)
            k_j = kv[0, :, :, None, cols].to(work)  # (B, Hkv, 1, cols, D)
            v_j = kv[1, :, :, None, cols].to(work)
            o_b, lse_b = block_forward(q5[..., rows, :], k_j, v_j, scale, diag, keep, p)
            if o is None:  # step 0 covers every row
                o, lse = o_b, lse_b
            else:
                merge_into(o[..., rows, :], lse[..., rows], o_b, lse_b)
            if s < n - 1:
                handle.wait()
                kv = nxt
        out = o.reshape(B, H, T, D).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (ring, scale, causal, p, seed)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, causal, p, seed = ctx.args
        work = lse.dtype
        B, H = q.shape[:2]
        hkv, c, r, n = k.shape[1], q.shape[2] // 2, ring.index, ring.n
        q5 = grouped(q.to(work), hkv)
        do = grouped(dout.to(work), hkv)  # (B, Hkv, G, T/n, D)
        delta = (do * grouped(out.to(work), hkv)).sum(-1)  # (B, Hkv, G, T/n)
        dq = torch.zeros_like(q5)
        heads = torch.arange(H, device=q.device)
        my_pos = ring.positions(r).to(q.device)
        kv = torch.stack([k, v])
        acc = acc_handle = None  # the partial dK/dV arriving from the previous rank
        for s in range(n):
            if s < n - 1:
                nxt, handle = ring.shift(kv, TAG_KV)
            j = (r - s) % n
            rows, cols, diag = _step_blocks(r, j, s, c, causal)
            keep = _step_keep(ring, j, rows, cols, my_pos, heads, hkv, B, seed, p)
            dq_b, dk_b, dv_b = block_backward(
                q5[..., rows, :], kv[0, :, :, None, cols].to(work),
                kv[1, :, :, None, cols].to(work), do[..., rows, :], lse[..., rows],
                delta[..., rows], scale, diag, keep, p)
            dq[..., rows, :] += dq_b
            dkv = torch.zeros((2, *k.shape), dtype=work, device=k.device)  # block j's share
            dkv[0, :, :, cols] = dk_b[:, :, 0]
            dkv[1, :, :, cols] = dv_b[:, :, 0]
            if acc_handle is not None:  # ranks j..r-1's sum, sent during this step
                acc_handle.wait()
                dkv += acc
            if n > 1:  # on to rank r+1; rank r-1's sum for block j-1 comes back meanwhile
                acc, acc_handle = ring.shift(dkv, TAG_DKV)
            if s < n - 1:
                handle.wait()
                kv = nxt
        if acc_handle is not None:  # every rank's share of this rank's own block
            acc_handle.wait()
            dkv = acc
        return (dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)
