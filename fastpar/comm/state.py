"""The communication state of one job: the engine setting, cached routes and every communicator.

Each job has one ``CommState``, a part of the ``Job`` made at the first call that needs it
(``current()``), and ``fastpar.shutdown`` closes it, so a second ``init`` starts clean. Building it communicates
nothing: a group's shm segment, MPI sub-communicator or CUDA IPC buffers are created at the
group's first collective that the policy sends to that engine (a collective over the group).
"""

from __future__ import annotations

import bisect

import logging
import os
import zlib

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm import policy
from fastpar.comm.policy import GroupFacts
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
        self.routes: dict = {}  # call signature -> Route; see collectives._route
        self._groups: dict = {}  # id(group) -> (group, global ranks in group order, GroupFacts)
        # Each process group owns its communicators, keyed by id(group) (the group stays alive
        # in _groups): two groups with the same members (the world and the dp group at
        # tp = pp = 1) never share one, so threads may drive different groups at once.
        self._shm: dict = {}  # id(group) -> ShmCommunicator
        self._mpi: dict = {}  # id(group) -> MPI communicator
        self._ipc: dict = {}  # id(group) -> CudaIpcCommunicator, or None where IPC is off
        self._nccl_mpi: dict = {}  # id(group) -> NcclMpiCommunicator
        self._hier: dict = {}  # id(group) -> HierCommunicator (its parts live in the tables)
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
            facts = GroupFacts(size=len(ranks), same_host=len(per_host) == 1,
                               native=_native.available(), pg_backend=dist.get_backend(group),
                               per_host=per_host, hier_ready=group.group_name in splits,
                               mpi=self.topo.mpi_comm is not None)
            entry = (group, ranks, facts)
            self._groups[id(group)] = entry
        return entry

    def choose(self, op: str, t: torch.Tensor, group, reduce_op: str = "sum"):
        """``(group, ranks, Choice)`` for one call; builds nothing but the CUDA IPC communicator
        that the decision needs (only when no other engine is forced)."""
        group, ranks, facts = self.resolve(group)
        if (t.is_cuda and op == "all_reduce" and facts.size > 1 and facts.same_host
                and self.forced in (None, "cuda_ipc")):
            comm = self.cuda_ipc(group, ranks, t.device)
            if comm is not None:
                facts = GroupFacts(**{**facts.__dict__, "ipc_ready": True,
                                      "ipc_max_bytes": comm.max_bytes})
        if self.forced == "nccl_mpi":
            facts = self._with_nccl_mpi(facts)
        choice = policy.choose(op, t.device.type, facts, t.numel() * t.element_size(), t.dtype,
                               reduce_op=reduce_op, forced=self.forced,
                               forced_by=self.forced_by)
        return group, ranks, choice

    def _with_nccl_mpi(self, facts):
        from fastpar.comm.nccl_mpi import unavailable

        why = unavailable(mpi_launched=self.topo.mpi_comm is not None) or ""
        return GroupFacts(**{**facts.__dict__, "nccl_mpi": why})

    def communicator(self, engine: str, group, ranks, device):
        """The engine's communicator for the group (``None`` for torch.distributed engines)."""
        if engine == "shm":
            return self.shm(group, ranks)
        if engine == "mpi":
            return self.mpi(group, ranks)
        if engine == "cuda_ipc":
            return self.cuda_ipc(group, ranks, device)
        if engine == "nccl_mpi":
            return self.nccl_mpi(group, ranks, device)
        if engine == "hier":
            return self.hier(group, ranks)
        return None

    def hier(self, group, ranks):
        key = id(group)
        if key not in self._hier:
            from fastpar.comm.hierarchical import HierCommunicator

            _, _, facts = self.resolve(group)
            split = self.topo.host_splits[group.group_name]
            self._hier[key] = HierCommunicator(self, split, ranks, facts)
        return self._hier[key]

    def shm(self, group, ranks):
        key = id(group)
        if key not in self._shm:
            from fastpar.comm.shm import ShmCommunicator

            self._shm[key] = ShmCommunicator(group, ranks, self.topo.rank, self.topo.timeout)
        return self._shm[key]

    def mpi(self, group, ranks):
        key = id(group)
        if key not in self._mpi:
            if self.topo.mpi_comm is None:
                raise ValueError("the mpi engine needs an MPI launch (mpirun), but this job "
                                 f"was started by {self.topo.launcher}")
            world = self.topo.mpi_comm
            # MPI_Comm_create_group is collective over the members only; the tag (alike on
            # every member: torch names groups in creation order) keeps creations of different
            # groups apart when threads make them at once.
            tag = zlib.crc32(group.group_name.encode()) % 32768
            self._mpi[key] = world.Create_group(world.group.Incl(list(ranks)), tag)
        return self._mpi[key]

    def cuda_ipc(self, group, ranks, device):
        key = id(group)
        if key not in self._ipc:
            comm = None
            if os.environ.get("FASTPAR_CUDA_IPC", "1") != "0":
                from fastpar.comm.cuda_ipc import CudaIpcCommunicator, check_not_capturing

                check_not_capturing(ranks, "the CUDA IPC communicator")
                comm, why = CudaIpcCommunicator.create(group, ranks, self.topo.rank, device,
                                                       self.topo.timeout)
                if comm is None:
                    log.info("cuda_ipc off for group %s, falling back to %s: %s", ranks,
                             dist.get_backend(group), why)
            self._ipc[key] = comm
        return self._ipc[key]

    def nccl_mpi(self, group, ranks, device):
        key = id(group)
        if key not in self._nccl_mpi:
            from fastpar.comm.cuda_ipc import check_not_capturing
            from fastpar.comm.nccl_mpi import NcclMpiCommunicator

            check_not_capturing(ranks, "the nccl_mpi communicator")
            self._nccl_mpi[key] = NcclMpiCommunicator(self.mpi(group, ranks), device)
        return self._nccl_mpi[key]

    def engine_table(self, groups: dict, device_type: str, nbytes: int,
                     dtype: torch.dtype = torch.float32) -> list[dict]:
        """What the policy would choose for each op on each of ``groups`` (``{name: group}``),
        without creating any communicator: rows ``{"group", "ranks", "op", "engine",
        "reason"}``. CUDA IPC is reported as undecided: it needs its collective probe."""
        rows = []
        for name, group in groups.items():
            if group is None:
                continue
            _, ranks, facts = self.resolve(group)
            if self.forced == "nccl_mpi":
                facts = self._with_nccl_mpi(facts)
            for op in policy.OPS:
                try:
                    choice = policy.choose(op, device_type, facts, nbytes, dtype,
                                           forced=self.forced, forced_by=self.forced_by)
                    engine, reason = choice.engine, choice.reason
                except ValueError as exc:
                    engine, reason = "error", str(exc)
                if device_type == "cuda" and op == "all_reduce" and engine != "local" \
                        and self.forced in (None, "cuda_ipc"):
                    reason += " (cuda_ipc is probed at the group's first all_reduce)"
                rows.append({"group": name, "ranks": ranks, "op": op, "engine": engine,
                             "reason": reason})
        return rows

    def close(self):
        """Close every communicator; one that fails does not keep the others open (the first
        error is raised once all were tried)."""
        closers = list(reversed(self.closers))
        self.closers = []
        closers += [c.close for c in self._shm.values()]
        closers += [c.close for c in self._ipc.values() if c is not None]
        closers += [c.close for c in self._nccl_mpi.values()]
        closers += [sub.Free for sub in self._mpi.values()]
        for table in (self._shm, self._ipc, self._nccl_mpi, self._mpi, self._hier, self._groups,
                      self.routes, self.symmetric):
            table.clear()
        first = None
        for close in closers:
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - raised below, after the others
                first = first or exc
        if first is not None:
            raise first


class Registry:
    """This job's symmetric segments by this rank's slot address (``CommState.symmetric``):
    ``get`` the entry of a whole tensor, ``find`` the one whose slot holds an address."""

    def __init__(self):
        self._by_start: dict = {}
        self._starts: list[int] = []  # sorted

    def __len__(self) -> int:
        return len(self._by_start)

    def __contains__(self, start: int) -> bool:
        return start in self._by_start

    def get(self, start: int, default=None):
        return self._by_start.get(start, default)

    def __setitem__(self, start: int, seg) -> None:
        if start not in self._by_start:
            bisect.insort(self._starts, start)
        self._by_start[start] = seg

    def pop(self, start: int, default=None):
        seg = self._by_start.pop(start, None)
        if seg is None:
            return default
        self._starts.pop(bisect.bisect_left(self._starts, start))
        return seg

    def clear(self) -> None:
        self._by_start.clear()
        self._starts.clear()

    def values(self):
        return self._by_start.values()

    def find(self, address: int):
        """The segment whose slot (this rank's) starts at or before ``address`` nearest; the
        caller checks the end (``SymmetricSegment.place``)."""
        i = bisect.bisect_right(self._starts, address) - 1
        return self._by_start[self._starts[i]] if i >= 0 else None


def current() -> CommState:
    """This job's communication state, made at its first use (``RuntimeError`` before
    ``fastpar.init``); ``fastpar.shutdown`` closes it."""
    the_job = job()
    return the_job.part("comm", lambda: CommState(the_job.topology))
