"""The flat layout ZeRO-1 shards: one (dtype, device) group of parameters laid end to end.

A ``FlatGroup`` is pure arithmetic plus the copies in and out of the flat order; it owns no
communication. Parameters keep their own storage; the flat order exists only in the buffers the
optimizer assembles (gradients in, updated shards out)::

    flat   = cat(p.reshape(-1) for p in params) ++ zeros(pad)        # (padded,)
    padded = ceil(numel / dp) * dp,  shard = padded // dp
    rank r owns flat[r * shard : (r + 1) * shard]

The order is the order the parameters were given in, so every dp rank that passes the same
model derives the same layout, and the unpadded flat order does not depend on dp (what makes a
consolidated state re-shardable at another dp size).
"""

from __future__ import annotations

import torch


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the shard the inner optimizer updates: at least float32."""
    return torch.promote_types(dtype, torch.float32)


class FlatGroup:
    """Parameters of one (dtype, device), their offsets in the flat order and this rank's shard.

    ``master``: an ``nn.Parameter`` of shape ``(shard,)`` in ``master_dtype``, this rank's slice
    of the flat parameters (padding zero); it is what the inner optimizer sees.
    """

    def __init__(self, params: list[torch.nn.Parameter], dp_size: int, dp_rank: int,
                 alloc=None):
        self.params = params
        self.dtype, self.device = params[0].dtype, params[0].device
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.shard = -(-self.numel // dp_size)  # ceil
        self.padded = self.shard * dp_size
        self.start = dp_rank * self.shard
        self.master = torch.nn.Parameter(self.local(self.flat_params()))
        # alloc(numel, dtype) -> zeroed tensor, e.g. in symmetric memory (DistributedOptimizer);
        # None: plain tensors. Both buffers are (padded,) in master_dtype, reused every step.
        self._alloc = alloc
        self._grad_buf: torch.Tensor | None = None
        self._gather_buf: torch.Tensor | None = None
        if alloc is not None and self.device.type == "cpu":
            self.buffer("grad"), self.buffer("gather")  # collective: now, in the same order

    def buffer(self, name: str) -> torch.Tensor:
        """The reused ``(padded,)`` buffer ``name`` ("grad" or "gather"), zeroed when made."""
        attr = f"_{name}_buf"
        if getattr(self, attr) is None:
            dt = master_dtype(self.dtype)
            setattr(self, attr, torch.zeros(self.padded, dtype=dt, device=self.device)
                    if self._alloc is None or self.device.type != "cpu"
                    else self._alloc(self.padded, dt))
        return getattr(self, attr)

    @torch.no_grad()
    def flat_params(self) -> torch.Tensor:
        """The parameters in flat order, ``(numel,)`` in ``master_dtype``."""
        return torch.cat([p.detach().reshape(-1) for p in self.params]).to(
            master_dtype(self.dtype))

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard ``(shard,)`` of an unpadded flat tensor ``(numel,)``: a
        fresh tensor."""
        assert full.shape == (self.numel,), (full.shape, self.numel)
        out = torch.zeros(self.shard, dtype=full.dtype, device=full.device)
        end = min(self.start + self.shard, self.numel)
        if end > self.start:
            out[:end - self.start].copy_(full[self.start:end])
        return out

    @torch.no_grad()
    def flat_grad(self) -> torch.Tensor:
        """The gradients in flat order, ``(padded,)`` in ``master_dtype``; a missing gradient
        (a parameter this backward did not reach) counts as zero."""
        buf = self.buffer("grad")
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            if p.grad is None:
                buf[a:b].zero_()
            else:
                buf[a:b].copy_(p.grad.reshape(-1))
        return buf  # the padding was zeroed at allocation and is never written

    @torch.no_grad()
    def write_params(self, full: torch.Tensor) -> None:
        """Copy a gathered flat tensor ``(padded,)`` or ``(numel,)`` into the parameters."""
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            p.copy_(full[a:b].view(p.shape))

    def shard_mask(self, keep) -> torch.Tensor:
        """``(shard,)`` float64 on the group's device: 0 on this rank's elements of every
        parameter ``p`` with ``keep(p)`` false, 1 elsewhere (padding included)."""
        mask = torch.ones(self.shard, dtype=torch.float64, device=self.device)
        for p, a, b in zip(self.params, self.offsets, self.offsets[1:]):
            lo, hi = max(a, self.start), min(b, self.start + self.shard)
            if hi > lo and not keep(p):
                mask[lo - self.start:hi - self.start] = 0
        return mask

    def describe(self) -> str:
        return f"{self.dtype}/{self.device.type}: {self.numel} elements, shard {self.shard}"
