"""The flat order ZeRO shards: one (dtype, device) group of parameters laid end to end, cut
into runs, each run sharded over dp on its own.

A ``FlatGroup`` is pure arithmetic plus copies in and out of the flat order; it owns no
communication and no storage but the master shard::

    flat   = cat(p.reshape(-1) for p in params)                         # (numel,)
    runs   = contiguous slices flat[lo:hi], cut before the parameters in ``cuts``
    piece  = ceil((hi - lo) / dp)          # a run padded to dp * piece (the padding is zero)
    rank r owns flat[lo + r * piece : lo + (r + 1) * piece] of every run
    shard  = cat over runs of rank r's piece                            # (sum of pieces,)

ZeRO-1 has one run (the whole group: rank r owns one block of the flat order); ZeRO-2 and 3
cut runs by bucket size and at the gather units' boundaries (``run_cuts``: each is
reduce-scattered as soon as backward fills it, ZeRO-3's all-gathered before its module runs). The order is the order the parameters
were given in, so every dp rank that passes the same model derives the same runs, and the
unpadded flat order does not depend on dp or on the runs (what makes a consolidated state
re-shardable at another dp size or stage).
"""

from __future__ import annotations

import dataclasses

import torch


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the shard the inner optimizer updates: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def unit_cuts(flat_params: list, units) -> list[int]:
    """Where runs start in ``flat_params`` so that no run crosses a unit."""
    unit_of = {id(p): u for u, (_, ps, _) in enumerate(units) for p in ps}
    missing = [i for i, p in enumerate(flat_params) if id(p) not in unit_of]
    if missing:
        raise ValueError(f"DistributedOptimizer(stage=3): {len(missing)} of the parameters are "
                         f"not in `module` (positions {missing[:5]}); pass module= the model "
                         "that holds every parameter given")
    return [i for i in range(len(flat_params))
            if i == 0 or unit_of[id(flat_params[i])] != unit_of[id(flat_params[i - 1])]]


def run_cuts(ps: list, stage: int, units, bucket_mb: float, alone: set) -> list[int]:
    """Where the runs of one flat group ``ps`` start: stage 1 one run; stages 2 and 3 one per
    ``bucket_mb`` of master bytes, cut at the ``units`` too (``zero_stage3.module_units``; None:
    no units); a parameter whose id is in ``alone`` a run of its own."""
    if stage == 1:
        return [0]
    forced = set(unit_cuts(ps, units)) if units is not None else {0}
    for i, p in enumerate(ps):
        if id(p) in alone:
            forced |= {i, i + 1}
    cap, used, cuts = int(bucket_mb * 2**20), 0, []
    for i, p in enumerate(ps):
        nbytes = p.numel() * torch.empty((), dtype=master_dtype(p.dtype)).element_size()
        if i in forced or (used and used + nbytes > cap):
            cuts.append(i)
            used = 0
        used += nbytes
    return cuts


@dataclasses.dataclass
class Run:
    """Parameters ``first .. last - 1`` of a group: ``flat[lo:hi]``, rank r's piece at
    ``lo + r * piece``, this rank's piece at ``shard[soff:soff + piece]``, and the run's
    padded ``(dp * piece,)`` block at ``poff`` in the padded flat order."""

    index: int
    first: int
    last: int
    lo: int
    hi: int
    piece: int
    soff: int
    poff: int


class FlatGroup:
    """Parameters of one (dtype, device), their offsets in the flat order, the runs, and this
    rank's shard.

    ``master``: an ``nn.Parameter`` of shape ``(shard,)`` in ``master_dtype``, what the inner
    optimizer sees; ``DistributedOptimizer`` may make it a view of the parameters' own storage.
    """

    def __init__(self, params: list[torch.nn.Parameter], dp_size: int, dp_rank: int,
                 cuts=(0,)):
        self.params = params
        self.dtype, self.device = params[0].dtype, params[0].device
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = self.offsets[-1]
        self.dp_size, self.dp_rank = dp_size, dp_rank
        starts = sorted({0, *(c for c in cuts if 0 < c < len(params))})
        self.runs: list[Run] = []
        soff = poff = 0
        for k, (a, b) in enumerate(zip(starts, [*starts[1:], len(params)])):
            lo, hi = self.offsets[a], self.offsets[b]
            piece = -(-(hi - lo) // dp_size)  # ceil
            self.runs.append(Run(k, a, b, lo, hi, piece, soff, poff))
            soff += piece
            poff += piece * dp_size
        self.shard, self.padded = soff, poff
        self.run_of = [r for r in self.runs for _ in range(r.first, r.last)]  # param -> run
        self.master = torch.nn.Parameter(self.local(self.flat_params()))
        # storage DistributedOptimizer attaches (stages 1 and 2): the parameters' padded flat
        # buffer, stage 1's gradient buffer and the parameters' views of it
        self.param_buf = self.grad_buf = self.grad_views = None
        self.master_is_view = False
        self.master_symmetric = False  # ZeRO-3: the master in symmetric memory, read in place

    @torch.no_grad()
    def flat_params(self) -> torch.Tensor:
        """The parameters in flat order, ``(numel,)`` in ``master_dtype``."""
        return torch.cat([p.detach().reshape(-1) for p in self.params]).to(
            master_dtype(self.dtype))

    def _mine(self, run: Run) -> tuple[int, int]:
        """This rank's unpadded part of ``run``: flat ``[lo, hi)`` (maybe empty)."""
        lo = min(run.lo + self.dp_rank * run.piece, run.hi)
        return lo, min(lo + run.piece, run.hi)

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's padded shard ``(shard,)`` of an unpadded flat tensor ``(numel,)``: a
        fresh tensor."""
        assert full.shape == (self.numel,), (full.shape, self.numel)
        out = torch.zeros(self.shard, dtype=full.dtype, device=full.device)
        for run in self.runs:
            lo, hi = self._mine(run)
            out[run.soff:run.soff + hi - lo].copy_(full[lo:hi])
        return out

    def unshard(self, stacked: torch.Tensor) -> torch.Tensor:
        """The unpadded flat ``(numel,)`` of every rank's shard, ``stacked`` ``(dp * shard,)``
        in rank order (an all-gather of the shards)."""
        rows = stacked.view(self.dp_size, self.shard)
        return torch.cat([rows[:, r.soff:r.soff + r.piece].reshape(-1)[:r.hi - r.lo]
                          for r in self.runs])

    def padded_view(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s place in a padded flat buffer ``(padded,)``, shaped like it."""
        run = self.run_of[i]
        start = run.poff + self.offsets[i] - run.lo
        return buf[start:start + self.numels[i]].view(self.params[i].shape)

    def run_view(self, block: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s place in its run's own padded block ``(dp * piece,)``."""
        start = self.offsets[i] - self.run_of[i].lo
        return block[start:start + self.numels[i]].view(self.params[i].shape)

    def run_block(self, buf: torch.Tensor, run: Run) -> torch.Tensor:
        """``run``'s padded block ``(dp * piece,)`` of a padded flat buffer."""
        return buf[run.poff:run.poff + run.piece * self.dp_size]

    def param_range(self, i: int) -> tuple[int, int, int] | None:
        """This rank's part of parameter ``i``: ``(lo, hi, start)`` with elements ``[lo, hi)``
        of the parameter's flattening at ``shard[start:start + hi - lo]``; None if another dp
        rank holds all of it."""
        run = self.run_of[i]
        mine_lo, mine_hi = self._mine(run)
        lo, hi = max(self.offsets[i], mine_lo), min(self.offsets[i + 1], mine_hi)
        if hi <= lo:
            return None
        return lo - self.offsets[i], hi - self.offsets[i], run.soff + lo - mine_lo

    def shard_mask(self, keep) -> torch.Tensor:
        """``(shard,)`` float64 on the group's device: 0 on this rank's elements of every
        parameter ``p`` with ``keep(p)`` false, 1 elsewhere (padding included)."""
        mask = torch.ones(self.shard, dtype=torch.float64, device=self.device)
        for i, p in enumerate(self.params):
            mine = self.param_range(i)
            if mine is not None and not keep(p):
                lo, hi, start = mine
                mask[start:start + hi - lo] = 0
        return mask

    def describe(self) -> str:
        return (f"{self.dtype}/{self.device.type}: {self.numel} elements in {len(self.runs)} "
                f"run{'s' if len(self.runs) != 1 else ''}, shard {self.shard}")
