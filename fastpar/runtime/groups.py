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


def build_groups(grid: Grid, rank: int, timeout: datetime.timedelta) -> dict[str, Any]:
    """``{"tp_group": ..., "pp_group": ..., ...}``: the group of each axis that ``rank`` is in.

    ``timeout`` bounds every collective on these groups, as it bounds the world's (without it
    torch's 30-minute default would)."""
    mine: dict[str, Any] = {}
    for axis in AXES:
        for ranks in grid.groups(axis):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[f"{axis}_group"] = group
    return mine


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
