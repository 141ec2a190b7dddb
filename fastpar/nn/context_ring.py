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
arrive from rank r-1 (``Ring.shift``: one batch of isend/irecv on the point-to-point
transport); the attention runs while they travel, then the receive is waited for. n-1 transfers of (2, B, Hkv, T/n, D) in the input
dtype. **Backward**: the K/V go around again the same way, and so do their gradients: at step s
rank r adds its share of dK/dV of block j to the partial sum that ranks j..r-1 made, received
during this step's attention, and sends the sum on (working dtype, float32 for bf16/fp16/fp32
inputs); after n steps each block's sum is back at its owner. n-1 K/V transfers and n dK/dV
transfers, each in flight behind one step's attention. Saved for backward: q, k, v, the output
and the log-sum-exp (float32, (B, H, T/n)); no probabilities.

**Engines** (``make_ring``; ``ring_attention(engine=)``). *p2p*: ``torch.distributed``
isend/irecv on the cp group (gloo on CPU, NCCL on GPUs). Both progress without the calling
thread: gloo's transfers run on its own I/O threads, NCCL's on its stream, so the next block
moves while this one computes (the default). *shared* (CPU tensors, a cp group on one host):
every rank's K/V lie in shared memory (``SharedBuffers``, made once per group and block
shape by ``comm.symmetric_slots``), so step s reads rank j's block where it lies: nothing is
sent, nothing copied but each rank's own K/V into its slot, and no core is spent on a transfer.
The backward's dK/dV do not travel either: rank r writes its share of block j to its own slot j,
and after the last step the owner of each block sums its n shares in group order. Synchronised
by barriers (an all_reduce of one element on the shm engine): one after the K/V are written in
the forward and in the backward, one before the shares are summed; two K/V buffers used in turn
let a rank write the next call's K/V while a slower peer still reads this call's. Memory held
per group and shape: 2 K/V blocks (input dtype) and n dK/dV blocks (working dtype) per rank,
beside the activations. Across hosts and on GPUs the ring is p2p. fastpar's pipeline
``Channels`` are not used: their shm rings copy only inside a call on the channel (the sender
pushes while it sends or waits, the receiver pulls with ``process_vm_readv`` inside its
receive), so a transfer started before the attention would make no progress until the receive
after it; and their messages are the pipeline's (microbatch, stage, direction) with per-step
shape checks, not a ring of equal blocks. Every wait is bounded by the job's timeout.

Measured on the 2-core CPU host (2 ranks, one intra-op thread each, a 4 MB block taking 10 ms
alone, 85 ms of matmuls after posting it): the p2p receive has arrived when the compute ends
(the wait takes 0.07 ms), but the step takes ~95 ms, compute plus transfer: the transfer no
longer blocks the rank, yet gloo's loopback copies run on the same two cores as the attention,
so little of its time is hidden there (``bench/context.py`` measures the fraction per step). The
shared engine has no transfer to hide; what it exposes is the barriers' wait.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fastpar.comm.collectives import all_reduce
from fastpar.comm.symmetric import symmetric_slots
from fastpar.comm.transport.carriers import shift
from fastpar.nn import context_math
from fastpar.nn.context_math import (block_backward, block_forward, grouped, keep_mask,
                                     merge_into)
from fastpar.runtime import group_rank, is_initialized, job, topology

TAG_KV, TAG_DKV = 71, 72  # one tag per message kind: gloo matches a receive by (peer, tag)


class _Ready:
    """The handle of a block that is already where it is read."""

    def wait(self):
        pass


class Ring:
    """The p2p engine: this rank's neighbours in ``group`` (global ranks), the shift of a block
    to the next rank receiving the previous rank's (on the point-to-point transport:
    ``comm.transport.carriers.shift``), and the dK/dV partial sums passed on."""

    def __init__(self, group, positions):
        ranks = dist.get_process_group_ranks(group)
        self.n, self.index = len(ranks), group_rank(group)
        self.group = group
        self.next, self.prev = ranks[(self.index + 1) % self.n], ranks[(self.index - 1) % self.n]
        self.timeout = topology().timeout if is_initialized() else math.inf
        self.positions = positions  # positions(index) -> int64 (T/n,) of that rank's tokens
        self.acc = self.acc_handle = None

    def start(self, kv: torch.Tensor) -> torch.Tensor:
        """The K/V block (2, B, Hkv, T/n, D) this rank attends with at step 0: its own."""
        self.acc = self.acc_handle = None
        return kv

    def shift(self, t: torch.Tensor, tag: int):
        """Send ``t`` to the next rank and receive the previous rank's block of the same shape;
        returns ``(buffer, handle)``: ``buffer`` is valid after ``handle.wait()``, and ``t``
        must stay unchanged until then."""
        buf = torch.empty_like(t)
        return buf, shift(self.group, t, self.next, buf, self.prev, tag, self.timeout)

    def add_share(self, share: torch.Tensor, j: int) -> None:
        """Fold this rank's share of block j's dK/dV (2, B, Hkv, T/n, D) into the partial sum
        of ranks j..r-1 (received during this step's attention) and send it on to rank r+1."""
        if self.acc_handle is not None:
            self.acc_handle.wait()
            share += self.acc
        if self.n == 1:
            self.acc = share
        else:  # rank r-1's sum for block j-1 comes back meanwhile
            self.acc, self.acc_handle = self.shift(share, TAG_DKV)

    def grads(self) -> torch.Tensor:
        """Every rank's share of this rank's own block, summed (after the last step)."""
        if self.acc_handle is not None:
            self.acc_handle.wait()
        return self.acc


class SharedBuffers:
    """The shared-memory slots of one cp group and block shape (``symmetric_slots``): two K/V
    buffers used in turn (input dtype), one of n dK/dV shares per rank (working dtype), and a
    one-element tensor whose all_reduce is the group's barrier. Kept in the job's comm state
    per (group, shape, dtypes); ``None`` where the group is not on one host."""

    def __init__(self, group, shape, dtype, work, n):
        self.group = group
        self.kv = symmetric_slots(2, *shape, dtype=dtype, group=group)  # [rank][buffer]
        self.dkv = symmetric_slots(n, *shape, dtype=work, group=group)
        self.flag = torch.zeros(1)
        self.uses = 0

    @staticmethod
    def of(group, shape, dtype, work, n):
        from fastpar.comm.state import current

        st = current()
        if not st.resolve(group)[2].same_host:
            return None
        # the job's slots per (group, shape): a part of the job, gone with it
        held = job().part("nn.context_ring.buffers", dict)
        key = (id(group), tuple(shape), dtype, work)
        if key not in held:
            held[key] = SharedBuffers(group, shape, dtype, work, n)
        return held[key]

    def barrier(self):
        all_reduce(self.flag, self.group)

    def publish(self, kv: torch.Tensor, rank: int) -> list:
        """Every rank's K/V, ``kv`` being this rank's: written to this rank's slot of the buffer
        not used last, then a barrier. A peer may still read the other buffer (the previous
        call's), never this one: it has passed the previous call's barrier, so every rank has
        finished the call before that, the last to use this buffer."""
        slots = [mine[self.uses % 2] for mine in self.kv]
        self.uses += 1
        slots[rank].copy_(kv)
        self.barrier()
        return slots


class SharedRing(Ring):
    """The shared-memory engine, inside one host: every rank's K/V lies in ``SharedBuffers``,
    so step s reads rank j's block where it lies (no transfer, no copy), and each rank writes
    its dK/dV share of block j to its own slot j; after the last step, a barrier, and the owner
    sums the n shares of its block in group order. One barrier per forward, two per backward."""

    def __init__(self, group, positions, buffers: SharedBuffers):
        super().__init__(group, positions)
        self.buffers = buffers

    def start(self, kv):
        self.blocks = self.buffers.publish(kv, self.index)
        self.step = 0
        return self.blocks[self.index]

    def shift(self, t, tag):
        assert tag == TAG_KV, tag
        self.step += 1
        return self.blocks[(self.index - self.step) % self.n], _Ready()

    def add_share(self, share, j):
        self.buffers.dkv[self.index][j].copy_(share)

    def grads(self):
        self.buffers.barrier()  # every share written
        mine = [slots[self.index] for slots in self.buffers.dkv]
        total = mine[0].clone()
        for part in mine[1:]:
            total += part
        return total


def make_ring(group, positions, k: torch.Tensor, work: torch.dtype, engine: str) -> Ring:
    """The ring of ``group`` for K/V blocks (2, *k.shape) of k's dtype: ``engine`` "p2p"
    (torch isend/irecv), "shared" (``SharedBuffers``; ``ValueError`` where the group is not on
    one host or the tensors are not on the CPU)."""
    if engine not in ("p2p", "shared"):
        raise ValueError(f"ring_attention: engine must be 'p2p' or 'shared', got {engine!r}")
    ring = Ring(group, positions)
    if engine == "p2p" or ring.n == 1:
        return ring
    buffers = None
    if k.device.type == "cpu" and is_initialized():
        buffers = SharedBuffers.of(group, (2, *k.shape), k.dtype, work, ring.n)
    if buffers is None:
        raise ValueError("ring_attention: engine 'shared' needs CPU tensors and a cp group on "
                         f"one host (fastpar.init'ed); got {k.device} tensors")
    return SharedRing(group, positions, buffers)


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
    -> this rank's output (B, H, T/n, D). Non-tensor arguments: the ``Ring``, scale, causal,
    dropout p and seed."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, scale: float, causal: bool, p: float, seed: int):
        work = torch.promote_types(q.dtype, torch.float32)
        B, H, T, D = q.shape
        hkv, c, r, n = k.shape[1], q.shape[2] // 2, ring.index, ring.n
        q5 = grouped(q.to(work), hkv)  # (B, Hkv, G, T/n, D)
        heads = torch.arange(H, device=q.device)
        my_pos = ring.positions(r).to(q.device)
        kv = ring.start(torch.stack([k, v]))  # (2, B, Hkv, T/n, D): one message per step
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
        do, o5 = grouped(dout.to(work), hkv), grouped(out.to(work), hkv)  # (B, Hkv, G, T/n, D)
        # rowsum(do * o) for the written-out blocks (B, Hkv, G, T/n); the fused kernel forms it
        fused = not p and context_math.fused_kernel(q5, None)  # every block: no mask to apply
        delta = None if fused else (do * o5).sum(-1)
        dq = torch.zeros_like(q5)
        heads = torch.arange(H, device=q.device)
        my_pos = ring.positions(r).to(q.device)
        kv = ring.start(torch.stack([k, v]))
        for s in range(n):
            if s < n - 1:
                nxt, handle = ring.shift(kv, TAG_KV)
            j = (r - s) % n
            rows, cols, diag = _step_blocks(r, j, s, c, causal)
            keep = _step_keep(ring, j, rows, cols, my_pos, heads, hkv, B, seed, p)
            dq_b, dk_b, dv_b = block_backward(
                q5[..., rows, :], kv[0, :, :, None, cols].to(work),
                kv[1, :, :, None, cols].to(work), do[..., rows, :], o5[..., rows, :],
                lse[..., rows], None if fused else delta[..., rows], scale, diag, keep, p)
            dq[..., rows, :] += dq_b
            share = torch.zeros((2, *k.shape), dtype=work, device=k.device)  # block j's
            share[0, :, :, cols] = dk_b[:, :, 0]
            share[1, :, :, cols] = dv_b[:, :, 0]
            ring.add_share(share, j)
            if s < n - 1:
                handle.wait()
                kv = nxt
        dkv = ring.grads()
        return (dq.reshape(q.shape).to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype),
                None, None, None, None, None)
