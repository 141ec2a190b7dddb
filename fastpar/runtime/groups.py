"""The grid's process groups: built once by ``fastpar.init``, asked about by every layer above.

``build_groups`` creates every group of every axis (``torch.distributed.new_group`` is collective
over the world, so all ranks create all groups in the same order) with the job's timeout.
``group_size`` / ``group_rank`` answer for a group a caller holds; without ``fastpar.init`` (no
torch.distributed) or with ``group=None`` they raise instead of pretending to be a group of one,
which would turn a forgotten ``init`` into a silently serial model.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from fastpar.grid import AXES, Grid


def build_groups(grid: Grid, rank: int, timeout: datetime.timedelta,
                 hosts: tuple = ()) -> dict[str, Any]:
    """``{"tp_group": ..., "pp_group": ..., ..., "host_splits": {...}}``: the group of each axis
    that ``rank`` is in, and the host sub-groups of those groups (and of the world) that span
    hosts (``host_splits``: a group's name -> ``HostSplit``; ``hosts``: every rank's host
    identity).

    ``timeout`` bounds every collective on these groups, as it bounds the world's (without it
    torch's 30-minute default would)."""
    mine: dict[str, Any] = {}
    spanning = []  # (group this rank is in or None, its ranks): candidates for a split
    world = list(range(grid.world_size))
    spanning.append((dist.group.WORLD, world))
    for axis in AXES:
        for ranks in grid.groups(axis):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[f"{axis}_group"] = group
            spanning.append((group if rank in ranks else None, ranks))
    splits = {}
    for group, ranks in spanning:  # every rank walks the same list: new_group is collective
        split = _host_split(group, ranks, rank, hosts, timeout)
        if split is not None:
            splits[group.group_name] = split
    mine["host_splits"] = splits
    return mine


class HostSplit:
    """A group that spans hosts with the same number (at least 2) of its ranks on each, cut in
    two: ``intra`` (this rank's host's members) and ``cross`` (the members with this rank's
    local index on every host), with their global ranks in each sub-group's own order (sorted,
    as ``torch.distributed.new_group`` orders its ranks); ``members``: the group's global ranks
    on each host (hosts in order of first appearance, each host's ranks in group order)."""

    def __init__(self, members, intra, intra_ranks, cross, cross_ranks):
        self.members, self.intra, self.intra_ranks = members, intra, intra_ranks
        self.cross, self.cross_ranks = cross, cross_ranks


def by_host(ranks, hosts) -> list[list[int]]:
    """``ranks`` (global, in group order) on each host, hosts in order of first appearance."""
    out: dict = {}
    for r in ranks:
        out.setdefault(hosts[r], []).append(r)
    return list(out.values())


def _host_split(group, ranks, rank, hosts, timeout):
    """The ``HostSplit`` of ``group`` for ``rank`` (None where the group does not span hosts
    evenly with >= 2 ranks on each, or ``rank`` is not in it); collective over the world
    (every rank makes every sub-group, in the same order)."""
    if not hosts:
        return None
    members = by_host(ranks, hosts)
    per_host = {len(m) for m in members}
    if len(members) < 2 or len(per_host) != 1 or per_host == {1}:
        return None
    made = {}
    for m in members:
        made[tuple(m)] = dist.new_group(m, timeout=timeout)
    for i in range(len(members[0])):
        cross = cross_ranks(members, i)
        made[tuple(cross)] = dist.new_group(cross, timeout=timeout)
    if group is None:
        return None
    intra = next(m for m in members if rank in m)
    cross = cross_ranks(members, intra.index(rank))
    return HostSplit(members, made[tuple(intra)], intra, made[tuple(cross)], cross)


def cross_ranks(members, i: int) -> list[int]:
    """The ranks of local index ``i`` on every host, in the cross group's order: sorted, as
    torch orders a group's ranks (hosts a, b, b, a: index 1 is [2, 3], b's rank first)."""
    return sorted(m[i] for m in members)


def _check(group, what: str) -> None:
    if group is None:
        raise ValueError(f"{what}: group is None; pass a process group (e.g. topo.tp_group, "
                         "or torch.distributed.group.WORLD for every rank)")
    if not dist.is_initialized():
        raise RuntimeError(f"{what}: torch.distributed is not initialised; call fastpar.init() "
                           "first")


def _not_member(what: str) -> ValueError:
    return ValueError(f"{what}: this process (global rank {dist.get_rank()}) is not a member of "
                      "the group (torch.distributed.new_group returned NON_GROUP_MEMBER here)")


def group_size(group, what: str = "group_size") -> int:
    """Number of ranks in ``group`` (``ValueError`` if this process is not a member)."""
    _check(group, what)
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise _not_member(what)
    return dist.get_world_size(group)


def group_rank(group, what: str = "group_rank") -> int:
    """This process's index in ``group`` (``ValueError`` if it is not a member)."""
    _check(group, what)
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise _not_member(what)
    return dist.get_rank(group)
