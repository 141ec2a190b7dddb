"""The TP x CP x DP x PP rank grid (with EP inside DP): coordinates, groups and pipeline neighbours.

Rank order follows Megatron-LM: tp varies fastest, then cp, then dp, then pp::

    rank    = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))
    tp_rank = rank % tp
    cp_rank = (rank // tp) % cp
    dp_rank = (rank // (tp * cp)) % dp
    pp_rank = rank // (tp * cp * dp)

Context parallelism (cp) cuts every sequence into cp slices, one per rank of a cp group; the
ranks of a cp group hold the same parameters and see the same batch, so cp sits between tp and
dp: after tp, its groups (whose attention exchanges K/V blocks on every layer) are the most local
ones. ``dp`` is the number of data-parallel replicas at one cp coordinate (``world_size / (tp x
cp x pp)``), and the dp groups keep that meaning: the ranks that read different batches. cp
shards no parameter, so every parameter's gradient is reduced over a ``dpcp`` group (dp x cp:
the ranks sharing tp and pp coordinates); cp 1 is a job without context parallelism: cp groups
of one rank, dpcp groups equal to the dp groups, and every other group as without cp.

Expert parallelism cuts dp, as Megatron-LM does: the experts of an MoE layer are sharded over
``ep`` ranks, and each expert is replicated over ``edp = dp // ep`` of them. ep varies fastest
inside dp, so an ep group (whose all-to-alls carry every token of every MoE layer) is the most
local one, consecutive dp ranks::

    ep_rank  = dp_rank % ep        # which shard of the experts
    edp_rank = dp_rank // ep       # which replica of that shard
    dp_rank  = edp_rank * ep + ep_rank

Dense parameters are reduced over the dp group; expert parameters over the edp group (the ranks
holding the same experts). ep 1 is a job without expert parallelism: ep groups of one rank, and
edp groups equal to the dp groups. ep and edp groups lie inside dp groups, so at one cp
coordinate.

``Grid`` is the pure arithmetic (no torch.distributed), so every layout is unit-tested without
processes. ``Topology`` is the grid seen from one rank, with the process groups that
``fastpar.init`` builds once (``fastpar.runtime.groups.build_groups``) and that are passed down
explicitly (``group=``) to everything else. Nothing here does I/O or communicates.

(The module is ``fastpar.grid``, not ``fastpar.topology``: that name is the function
``fastpar.topology()`` that returns the current ``Topology``.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

# The axes that have groups, in the order fastpar.init builds them (new axes go last, so the
# groups of the older ones are made in the same order as before).
AXES = ("tp", "pp", "dp", "mp", "embedding", "ep", "edp", "cp", "dpcp")


def validate_degrees(world_size: int, tp: int, pp: int, ep: int = 1, cp: int = 1) -> None:
    """Raise ``ValueError`` naming every factor when ``world_size`` cannot hold ``tp x pp``, its
    ``world_size / (tp x pp)`` cannot be cut into cp groups, or its dp (``world_size / (tp x cp
    x pp)``) cannot be cut into ep groups."""
    for name, value in (("tp", tp), ("pp", pp), ("ep", ep), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if world_size % (tp * pp):
        raise ValueError(f"world_size {world_size} is not divisible by tp {tp} x pp {pp}")
    dpcp = world_size // (tp * pp)
    if dpcp % cp:
        raise ValueError(f"cp {cp} does not divide world_size {world_size} / (tp {tp} x pp {pp}) "
                         f"= {dpcp}: the world is tp x cp x dp x pp, so that quotient must be "
                         "dp x cp")
    dp = dpcp // cp
    if dp % ep:
        # (cp 1 words it as before cp existed)
        factors = f"tp {tp} x pp {pp}" if cp == 1 else f"tp {tp} x cp {cp} x pp {pp}"
        raise ValueError(f"ep {ep} does not divide dp {dp} (world_size {world_size} / "
                         f"({factors})): expert parallelism cuts the dp ranks into groups of ep")


@dataclasses.dataclass(frozen=True)
class Grid:
    """The rank grid of a job: ``world_size = tp * cp * dp * pp``, ``dp = ep * edp``."""

    world_size: int
    tp: int
    pp: int
    ep: int = 1
    cp: int = 1

    def __post_init__(self):
        validate_degrees(self.world_size, self.tp, self.pp, self.ep, self.cp)

    @property
    def dp(self) -> int:
        """Data-parallel replicas at one cp coordinate: ``world_size / (tp x cp x pp)``."""
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        """Replicas of each expert shard: ``dp // ep``."""
        return self.dp // self.ep

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world_size {self.world_size}")

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank (``cp_rank`` is asked apart, so this
        triple means what it meant before the cp axis)."""
        self._check(rank)
        tp, cp, dp = self.tp, self.cp, self.dp
        return rank % tp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        """The global rank at these coordinates: ``tp_rank + tp * (cp_rank + cp * (dp_rank + dp
        * pp_rank))``."""
        return tp_rank + self.tp * (cp_rank + self.cp * (dp_rank + self.dp * pp_rank))

    def cp_rank(self, rank: int) -> int:
        """``(rank // tp) % cp``: which slice of each sequence ``rank`` holds."""
        self._check(rank)
        return (rank // self.tp) % self.cp

    def ep_rank(self, rank: int) -> int:
        """``dp_rank % ep``: which shard of the experts ``rank`` holds."""
        return self.coords(rank)[1] % self.ep

    def edp_rank(self, rank: int) -> int:
        """``dp_rank // ep``: which replica of its expert shard ``rank`` is."""
        return self.coords(rank)[1] // self.ep

    def groups(self, axis: str) -> list[list[int]]:
        """Every group of one axis, each a sorted list of global ranks, in a fixed order.

        ``tp``, ``cp``, ``dp``, ``pp``: ranks differing only in that coordinate (so a dp group
        is the data-parallel replicas at one cp coordinate). ``dpcp``: ranks sharing tp and pp
        coordinates (dp x cp of them, where every parameter's gradient is reduced under context
        parallelism; a rank's index in it is ``dp_rank * cp + cp_rank``). ``mp`` (model
        parallel): ranks sharing dp and cp coordinates (tp x pp of them). ``embedding``: the
        first and last pipeline stage of each (tp, cp, dp) column, which hold the tied input and
        output embeddings. ``ep``: ranks sharing tp, cp, pp and edp coordinates (ep consecutive
        dp ranks, which split the experts between them); ``edp``: ranks sharing tp, cp, pp and
        ep coordinates (dp / ep of them, which hold the same experts). Both cut each dp group:
        an ep group and an edp group meet in exactly one rank.

        With cp 1 every axis but cp and dpcp has the groups, in the order, it had before cp.
        """
        tp, cp, dp, pp, ep, edp = self.tp, self.cp, self.dp, self.pp, self.ep, self.edp
        at = self.rank_of
        if axis == "tp":
            return [[at(t, d, p, c) for t in range(tp)]
                    for p in range(pp) for d in range(dp) for c in range(cp)]
        if axis == "cp":
            return [[at(t, d, p, c) for c in range(cp)]
                    for p in range(pp) for d in range(dp) for t in range(tp)]
        if axis == "dp":
            return [[at(t, d, p, c) for d in range(dp)]
                    for p in range(pp) for c in range(cp) for t in range(tp)]
        if axis == "dpcp":  # d-major, c-minor: ascending, as rank_of grows with c + cp * d
            return [[at(t, d, p, c) for d in range(dp) for c in range(cp)]
                    for p in range(pp) for t in range(tp)]
        if axis == "pp":
            return [[at(t, d, p, c) for p in range(pp)]
                    for d in range(dp) for c in range(cp) for t in range(tp)]
        if axis == "mp":
            return [sorted(at(t, d, p, c) for p in range(pp) for t in range(tp))
                    for d in range(dp) for c in range(cp)]
        if axis == "embedding":
            stages = sorted({0, pp - 1})
            return [[at(t, d, p, c) for p in stages]
                    for d in range(dp) for c in range(cp) for t in range(tp)]
        if axis == "ep":
            return [[at(t, e * ep + k, p, c) for k in range(ep)]
                    for p in range(pp) for c in range(cp) for t in range(tp) for e in range(edp)]
        if axis == "edp":
            return [[at(t, e * ep + k, p, c) for e in range(edp)]
                    for p in range(pp) for c in range(cp) for t in range(tp) for k in range(ep)]
        raise ValueError(f"unknown axis {axis!r}; expected one of {', '.join(AXES)}")

    def group_of(self, axis: str, rank: int) -> list[int] | None:
        """The ranks of ``rank``'s group on ``axis`` (``None`` if it is in none: embedding)."""
        for ranks in self.groups(axis):
            if rank in ranks:
                return ranks
        return None


@dataclasses.dataclass(frozen=True)
class Topology:
    """One rank's view of the grid, with its process groups.

    ``*_group`` are ``torch.distributed`` process groups (``None`` for ``embedding_group`` on a rank
    that is in no embedding group); ``ranks(axis)`` gives the global ranks of the same groups.
    ``ep_group`` / ``edp_group``: the expert-parallel group (the MoE all-to-alls) and the
    expert-data-parallel group (expert parameters' gradients are reduced over it, not over
    ``dp_group``); with ep 1 they are a group of this rank alone and a group of the dp ranks.
    ``cp_group`` / ``dpcp_group``: the context-parallel group (the ranks holding the other slices
    of this rank's sequences) and the dp x cp group (every parameter's gradient is reduced over
    it when cp > 1); with cp 1 they are a group of this rank alone and a group of the dp ranks.
    Immutable: per-job state of the layers above (communicators, RNG streams) lives in the
    ``Job`` that ``fastpar.init`` builds beside it (``fastpar.runtime.job()``).
    """

    grid: Grid
    rank: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str
    hosts: tuple = ()  # host identity of every global rank (fastpar.runtime.hostid)
    cpus: str = ""  # the CPUs this rank runs on and who chose them (fastpar.runtime.binding)
    # This host's ranks outnumber the CPUs they may run on: a rank waiting for a peer of this
    # host must soon hand its core over (the shm engines' waits sleep early).
    oversubscribed: bool = False
    timeout: float = 300.0  # seconds: fastpar.init's bound on rendezvous and every collective
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    mp_group: Any = None
    embedding_group: Any = None
    # the host sub-groups of every group of this rank (the world's too) that spans hosts with
    # as many ranks on each: a group's name -> runtime.groups.HostSplit (hierarchical engine)
    host_splits: Any = None
    mpi_comm: Any = None  # the MPI communicator kept as an out-of-band channel (None without MPI)
    store: Any = None  # the torch.distributed store every rank joined through
    # (after the older fields, so a positional construction of a Topology still means the same)
    ep_group: Any = None
    edp_group: Any = None
    cp_group: Any = None
    dpcp_group: Any = None

    world_size = property(lambda self: self.grid.world_size)
    tp_size = property(lambda self: self.grid.tp)
    pp_size = property(lambda self: self.grid.pp)
    dp_size = property(lambda self: self.grid.dp)
    tp_rank = property(lambda self: self.grid.coords(self.rank)[0])
    dp_rank = property(lambda self: self.grid.coords(self.rank)[1])
    pp_rank = property(lambda self: self.grid.coords(self.rank)[2])
    ep_size = property(lambda self: self.grid.ep)
    edp_size = property(lambda self: self.grid.edp)
    ep_rank = property(lambda self: self.grid.ep_rank(self.rank))
    edp_rank = property(lambda self: self.grid.edp_rank(self.rank))
    cp_size = property(lambda self: self.grid.cp)
    cp_rank = property(lambda self: self.grid.cp_rank(self.rank))
    is_first_stage = property(lambda self: self.pp_rank == 0)
    is_last_stage = property(lambda self: self.pp_rank == self.grid.pp - 1)

    def ranks(self, axis: str) -> list[int] | None:
        """Global ranks of this rank's group on ``axis``."""
        return self.grid.group_of(axis, self.rank)

    @property
    def pp_prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage, ``None`` on the first stage."""
        return None if self.is_first_stage else self.ranks("pp")[self.pp_rank - 1]

    @property
    def pp_next_rank(self) -> int | None:
        """Global rank of the next pipeline stage, ``None`` on the last stage."""
        return None if self.is_last_stage else self.ranks("pp")[self.pp_rank + 1]

    def __repr__(self) -> str:
        return (f"Topology(rank={self.rank}/{self.world_size}, tp={self.tp_rank}/{self.tp_size}, "
                f"cp={self.cp_rank}/{self.cp_size}, "
                f"pp={self.pp_rank}/{self.pp_size}, dp={self.dp_rank}/{self.dp_size}, "
                f"ep={self.ep_rank}/{self.ep_size}, edp={self.edp_rank}/{self.edp_size}, "
                f"device={self.device}, backend={self.backend}, launcher={self.launcher})")

