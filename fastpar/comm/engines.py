"""Per-job communicators, one per (engine, group), created on first use and freed at shutdown.

Kept in ``topology.cache`` (not in a module global), so ``fastpar.shutdown()`` frees everything
``init`` led to, and a second ``init`` starts clean.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from fastpar import _native
from fastpar.comm.policy import Layout
from fastpar.runtime import on_shutdown, topology

log = logging.getLogger("fastpar.comm")


class Engines:
    def __init__(self, topo):
        self.topo = topo
        self._groups: dict = {}  # id(group) -> (group, ranks, layout)
        self.routes: dict = {}  # call signature -> Route; see collectives._route
        # FASTPAR_COMM_BACKEND is read once per job; comm.use_backend() changes it in code.
        self.forced = os.environ.get("FASTPAR_COMM_BACKEND") or None
        self._shm: dict = {}
        self._mpi: dict = {}
        self._ipc: dict = {}

    def resolve(self, group):
        """``(group, global ranks in group order, Layout)`` for a ``group=`` argument."""
        if group is None:
            group = dist.group.WORLD
        entry = self._groups.get(id(group))
        if entry is None:
            ranks = dist.get_process_group_ranks(group)
            hosts = {self.topo.hosts[r] for r in ranks} if self.topo.hosts else {None, 0}
            layout = Layout(size=len(ranks), same_host=len(hosts) == 1,
                            native=_native.available(),
                            pg_backend=dist.get_backend(group))
            entry = (group, ranks, layout)
            self._groups[id(group)] = entry
        return entry

    def with_ipc(self, group, ranks, layout, device) -> Layout:
        """The layout completed with what the CUDA IPC communicator of the group offers."""
        comm = self.cuda_ipc(group, ranks, device) if layout.same_host else None
        if comm is None:
            return layout
        return Layout(**{**layout.__dict__, "ipc_ready": True, "ipc_max_bytes": comm.max_bytes})

    def shm(self, group, ranks):
        key = tuple(ranks)
        if key not in self._shm:
            from fastpar.comm.shm import ShmCommunicator

            self._shm[key] = ShmCommunicator(group, ranks, self.topo.rank, self.topo.timeout)
        return self._shm[key]

    def mpi(self, ranks):
        key = tuple(ranks)
        if key not in self._mpi:
            if self.topo.mpi_comm is None:
                raise ValueError("the mpi engine needs an MPI launch (mpirun), but this job "
                                 f"was started by {self.topo.launcher}")
            world = self.topo.mpi_comm
            sub = world.Create_group(world.group.Incl(list(ranks)))
            self._mpi[key] = sub
        return self._mpi[key]

    def cuda_ipc(self, group, ranks, device):
        key = tuple(ranks)
        if key not in self._ipc:
            comm = None
            if os.environ.get("FASTPAR_CUDA_IPC", "1") != "0":
                from fastpar.comm.cuda_ipc import CudaIpcCommunicator

                comm, why = CudaIpcCommunicator.create(group, ranks, self.topo.rank, device)
                if comm is None:
                    log.info("cuda_ipc off for group %s, falling back to %s: %s", ranks,
                             dist.get_backend(group), why)
            self._ipc[key] = comm
        return self._ipc[key]

    def close(self):
        for comm in self._shm.values():
            comm.close()
        for comm in self._ipc.values():
            if comm is not None:
                comm.close()
        for sub in self._mpi.values():
            sub.Free()
        for table in (self._shm, self._ipc, self._mpi, self._groups, self.routes):
            table.clear()


def engines() -> Engines:
    """This job's engines (``RuntimeError`` before ``fastpar.init``)."""
    topo = topology()
    found = topo.cache.get("comm")
    if found is None:
        found = topo.cache["comm"] = Engines(topo)
        on_shutdown(found.close)
    return found
