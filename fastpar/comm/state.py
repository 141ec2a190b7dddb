"""The communication state of one job: the engine setting, cached routes and every communicator.

Each job has one ``CommState``, a part of the ``Job`` made at the first call that needs it
(``current()``), and ``fastpar.shutdown`` closes it, so a second ``init`` starts clean.
Building it communicates nothing: a group's shm segment, MPI sub-communicator or CUDA IPC
buffers are created at the group's first collective that the policy sends to that engine (a
collective over the group), by the engine's own ``make`` (``comm/engines/``), into one table
of (engine, group) -> communicator.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm import policy
from fastpar.comm.policy import GroupFacts
from fastpar.comm.symmetric_registry import Registry
from fastpar.runtime.bootstrap import job
from fastpar.runtime.groups import by_host

log = logging.getLogger("fastpar.comm")


class CommState:
    def __init__(self, topo):
        self.topo = topo
        # The one reader of FASTPAR_COMM_BACKEND (once per job); comm.use_backend() changes it
        # in code. Collectives and pipeline P2P both take the engine from here.
        self.forced: str | None = os.environ.get("FASTPAR_COMM_BACKEND") or None
        self.forced_by = "FASTPAR_COMM_BACKEND"
        self.routes: dict = {}  # call signature -> Route (comm.routing.route)
        self._groups: dict = {}  # id(group) -> (group, global ranks in group order, GroupFacts)
        # (engine, id(group)) -> (its adapter, its communicator; None where the engine needs
        # none or, for cuda_ipc, could not build one). Each process group owns its
        # communicators (the group stays alive in _groups): two groups with the same members
        # (the world and the dp group at tp = pp = 1) never share one, so threads may drive
        # different groups at once. In the order made: closed in reverse (a communicator made
        # from another, nccl_mpi's from its MPI one, goes first).
        self._comms: dict = {}
        # this rank's slot address -> its SymmetricSegment (fastpar/comm/symmetric.py
        # Registry); an entry goes with the segment's mapping, or at close()
        self.symmetric = Registry()
        # close() of comm's own users of the communicators (symmetric tensors' peers), run
        # before the communicators go; other layers' parts close through the Job
        self.closers: list = []

    def resolve(self, group):
        """``(group, global ranks in group order, GroupFacts)`` for a ``group=`` argument
        (``None``: the world)."""
        if group is None:
            group = dist.group.WORLD
        entry = self._groups.get(id(group))
        if entry is None:
            if group is dist.GroupMember.NON_GROUP_MEMBER:
                raise ValueError(f"global rank {self.topo.rank} is not a member of this group "
                                 "(torch.distributed.new_group returned NON_GROUP_MEMBER here); "
                                 "call collectives only on the ranks of the group")
            try:
                ranks = dist.get_process_group_ranks(group)
            except (ValueError, RuntimeError, KeyError, TypeError) as exc:
                raise ValueError(f"group {group!r} is not a process group of this job, or this "
                                 f"rank ({self.topo.rank}) is not in it ({type(exc).__name__}: "
                                 f"{exc}); pass one of the Topology's *_group or a group from "
                                 "torch.distributed.new_group") from None
            hosts = self.topo.hosts
            per_host = tuple(len(m) for m in by_host(ranks, hosts)) if hosts else ()
            splits = self.topo.host_splits or {}
            # A fastpar backend group's calls that no fastpar engine takes go to its gloo
            # (torch_dist.Torch runs them there even where its kernels could): "gloo" here.
            pg_backend = dist.get_backend(group)
            pg_backend = "gloo" if pg_backend == "fastpar" else pg_backend
            facts = GroupFacts(size=len(ranks), same_host=len(per_host) == 1,
                               native=_native.available(), pg_backend=pg_backend,
                               per_host=per_host, hier_ready=group.group_name in splits,
                               mpi=self.topo.mpi_comm is not None)
            entry = (group, ranks, facts)
            self._groups[id(group)] = entry
        return entry

    def decide(self, op: str, device_type: str, facts, nbytes: int, dtype: torch.dtype,
               reduce_op: str = "sum"):
        """The policy's ``Choice`` for one call on a group of ``facts``, under this job's
        forced engine (if any). ``comm.routing.choose`` adds to the facts what only the engines
        can tell (a CUDA group's IPC communicator, whether nccl_mpi can run)."""
        return policy.choose(op, device_type, facts, nbytes, dtype, reduce_op=reduce_op,
                             forced=self.forced, forced_by=self.forced_by)

    def communicator(self, engine, group, ranks, device):
        """``engine``'s communicator for ``group`` (an adapter of ``comm/engines/``: its
        ``make``, on the group's first call that needs it; None for torch.distributed's)."""
        key = (engine.name, id(group))
        if key not in self._comms:
            self._comms[key] = (engine, engine.make(self, group, ranks, device))
        return self._comms[key][1]

    def close(self):
        """Close every communicator; one that fails does not keep the others open (the first
        error is raised once all were tried)."""
        closers = list(reversed(self.closers))
        self.closers = []
        closers += [lambda e=engine, c=comm: e.close(c)
                    for engine, comm in reversed(list(self._comms.values())) if comm is not None]
        for table in (self._comms, self._groups, self.routes, self.symmetric):
            table.clear()
        first = None
        for close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - raised below, after the others
                first = first or exc
        if first is not None:
            raise first


def current() -> CommState:
    """This job's communication state, made at its first use (``RuntimeError`` before
    ``fastpar.init``); ``fastpar.shutdown`` closes it."""
    the_job = job()
    return the_job.part("comm", lambda: CommState(the_job.topology))
