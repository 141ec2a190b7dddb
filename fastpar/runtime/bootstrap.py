"""``fastpar.init`` / ``fastpar.shutdown``: from any launcher to a ready ``Topology``.

Steps, identical under every launcher:

1. ``launcher.detect`` reads the launcher, rank and world size from the environment; under an MPI
   launcher mpi4py (``MPI_Init``) then gives rank, world size and local ranks.
2. The tp/pp/ep/cp degrees are validated on every rank before the rendezvous, so a bad layout fails
   everywhere at once with the same ``ValueError`` (said by rank 0 alone: ``runtime.failures``).
3. Rendezvous on a TCP store. Under MPI, rank 0 starts the store on a free port and broadcasts its
   address over MPI; under torchrun the store comes from ``MASTER_ADDR``/``MASTER_PORT``.
4. A join barrier on the store with a deadline: a rank that cannot reach the store (its error
   names the address), or a peer that never arrives, ends in an error naming the missing ranks on
   every rank that is alive, instead of a wait that lasts until the collective timeout.
5. ``torch.distributed.init_process_group`` on that store, then every group of the grid.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from fastpar import _native
from fastpar.grid import Grid, Topology, validate_degrees
from fastpar.runtime import abort, failures, mpich_shm, rendezvous
from fastpar.runtime import launcher as _launcher
from fastpar.runtime.binding import affinity, bind_cpus
from fastpar.runtime.groups import build_groups
from fastpar.runtime.hostid import host_id, machine_id
from fastpar.runtime.job import Job
from fastpar.runtime.rendezvous import as_timedelta, check_timeout

# The one current Job (None outside init/shutdown). "generation" counts inits in this process
# (ranks init in lockstep), so a store that outlives one init (torchrun's agent store) never mixes
# keys of two inits.
_STATE: dict[str, Any] = {"job": None, "generation": 0}


def _choose_device(local_rank: int, local_world_size: int) -> torch.device:
    """``cuda:<local_rank>`` when CUDA is available, else CPU.

    ``FASTPAR_SHARED_GPU=1`` lets several ranks share each GPU (``local_rank % gpus``): for
    testing CUDA IPC on a one-GPU machine. NCCL refuses that, so such a job defaults to gloo.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if local_world_size > visible:
        if os.environ.get("FASTPAR_SHARED_GPU") != "1":
            raise ValueError(
                f"{local_world_size} ranks on this host but only {visible} visible GPUs (local "
                f"rank {local_rank}); launch at most {visible} ranks per host, or set "
                "FASTPAR_SHARED_GPU=1 to share GPUs between ranks (testing only)")
        local_rank %= visible
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _this_process(info: _launcher.LaunchInfo, timeout: float):
    """``(mpi_comm, rank, world_size, local_rank, local_world_size)``; MPI is the truth under an
    MPI launcher (local ranks from ``MPI_Comm_split_type(COMM_TYPE_SHARED)``, not host names).
    MPICH's segment loses its name here, so that no ending of the job leaves it behind
    (``runtime.mpich_shm``)."""
    if info.uses_mpi:
        MPI = rendezvous.mpi_world(info, timeout)
        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local = (node.Get_rank(), node.Get_size())
        mpich_shm.release(node)  # every local rank maps MPICH's segment: its name may go
        node.Free()
        return comm, rank, comm.Get_size(), *local
    # torchrun always sets LOCAL_WORLD_SIZE; a hand-made RANK/WORLD_SIZE environment that does
    # not is taken as one host.
    local_world_size = info.local_world_size if info.local_world_size > 0 else info.world_size
    return None, info.rank, info.world_size, max(info.local_rank, 0), local_world_size


def default_backend(device: torch.device, shared_gpu: bool) -> str:
    """The default group's backend when ``init`` is not told: NCCL for a GPU of its own, else
    fastpar's torch.distributed backend (so ``dist.*`` calls on the grid's groups and compiled
    graphs take fastpar's engines), gloo where the extension that holds it did not load."""
    import torch.distributed as dist

    if device.type == "cuda" and not shared_gpu:
        return "nccl"
    plugins = getattr(dist.Backend, "_plugins", {})
    return "fastpar" if "FASTPAR" in plugins and _native.available() else "gloo"


def init(tp: int = 1, pp: int = 1, *, ep: int = 1, cp: int = 1, backend: str | None = None,
         timeout: float = 300.0) -> Topology:
    """Join the job started by any launcher and return this rank's ``Topology``.

    ``ep``: expert-parallel degree, cutting dp (``world_size / (tp x pp)``, which it must divide)
    into ep groups of consecutive dp ranks and edp groups across them (``fastpar.grid``).
    ``cp``: context-parallel degree, dividing ``world_size / (tp x pp)``: the world is tp x cp x
    dp x pp (tp fastest, then cp), with cp groups (the ranks sharing each sequence) and dpcp
    groups (dp x cp, where gradients are reduced under context parallelism).
    Idempotent for the same arguments; calling it again with different ones is an error (call
    ``shutdown()`` first). ``timeout`` (seconds; ``math.inf``: no limit) bounds the rendezvous and
    every later collective on every group of the grid.
    """
    import torch.distributed as dist

    timeout = check_timeout(timeout)
    args = (tp, pp, ep, cp, backend, timeout)
    current = _STATE["job"]
    if current is not None:
        if current.args == args:
            return current.topology
        names = ("tp", "pp", "ep", "cp", "backend", "timeout")
        old, new = dict(zip(names, current.args)), dict(zip(names, args))
        raise RuntimeError(f"fastpar.init was already called with {old}; called again with "
                           f"{new}. Call fastpar.shutdown() first to change the layout.")

    info = _launcher.detect(os.environ)
    mpi_comm, rank, world_size, local_rank, local_world_size = _this_process(info, timeout)
    if mpi_comm is not None:
        abort.install(mpi_comm, rank)
    try:
        validate_degrees(world_size, tp, pp, ep, cp)
    except ValueError as exc:  # the same numbers on every rank: rank 0 says it
        failures.everywhere(exc, rank)
        raise
    grid = Grid(world_size, tp, pp, ep, cp)
    device = _choose_device(local_rank, local_world_size)
    shared_gpu = device.type == "cuda" and local_world_size > torch.cuda.device_count()
    backend = backend or default_backend(device, shared_gpu)

    owns_pg = not dist.is_initialized()
    if owns_pg:
        if info.uses_mpi:
            store, address = rendezvous.rendezvous_mpi(mpi_comm, timeout)
        elif world_size > 1:
            store, address = rendezvous.rendezvous_env(rank, world_size, timeout)
        else:
            store, address = dist.HashStore(), None
        generation = _STATE["generation"]
        _STATE["generation"] += 1
        hosts, machines = rendezvous.join_barrier(store, rank, world_size, timeout, generation)
        gloo_ifname = None
        if backend in ("gloo", "fastpar") and address is not None:  # fastpar's fallback is gloo
            gloo_ifname = rendezvous.gloo_interface(address, len(set(hosts)) > 1)
        pg_store = dist.PrefixStore(f"fastpar/pg/{generation}", store)
        dist.init_process_group(backend, store=pg_store, rank=rank,
                                world_size=world_size,
                                timeout=as_timedelta(timeout))
    else:
        store, gloo_ifname = None, None
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed is already initialised as rank "
                               f"{dist.get_rank()} of {dist.get_world_size()}, but the launcher "
                               f"says rank {rank} of {world_size}")
        pairs = [None] * world_size
        dist.all_gather_object(pairs, (host_id(), machine_id()))
        hosts, machines = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    try:
        # host sub-groups serve the hierarchical engine, which serves CPU tensors only
        groups = build_groups(grid, rank, as_timedelta(timeout),
                              hosts if device.type == "cpu" else ())
        cpus, undo_binding, oversubscribed = _bind(rank, world_size, local_rank,
                                                   local_world_size, device, machines)
        topo = Topology(grid=grid, rank=rank, local_rank=local_rank,
                        local_world_size=local_world_size, device=device,
                        backend=dist.get_backend(), launcher=info.launcher, hosts=hosts,
                        timeout=timeout, mpi_comm=mpi_comm, store=store, cpus=cpus,
                        oversubscribed=oversubscribed, **groups)
    except BaseException:
        if owns_pg:  # no half-made job: the next init starts from scratch
            dist.destroy_process_group()
        if gloo_ifname is not None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        raise
    if rank == 0 and undo_binding is not None:  # said once: init changed the affinity
        print(f"fastpar: init bound each of this host's {local_world_size} ranks to cores of "
              f"its own (rank 0: CPUs {cpus.split(' ')[0]}); FASTPAR_BIND=0 keeps the affinity "
              "as it was", file=sys.stderr, flush=True)
    _STATE["job"] = Job(topology=topo, args=args, owns_pg=owns_pg, undo_binding=undo_binding)
    if gloo_ifname is not None:  # set for this job only: a later init decides again
        _STATE["job"].on_close(lambda: os.environ.pop("GLOO_SOCKET_IFNAME", None))
    return topo


def _bind(rank, world_size, local_rank, local_world_size, device, machines):
    """``runtime.binding.bind_cpus`` with every local rank's CPUs (a collective when the job
    is a multi-rank CPU job that may be bound; the condition is alike on every rank), and
    whether this machine's ranks outnumber the CPUs they may run on together (by machine, not
    host identity: ranks in two namespaces of one machine share its cores)."""
    import torch.distributed as dist

    if world_size == 1 or device.type != "cpu":
        # A GPU job: its host collectives (the shm engine) carry little; no extra collective
        # at init to tell whether its ranks share cores.
        return (*bind_cpus(local_rank, local_world_size, device, []), False)
    everyone = [None] * world_size  # every rank's CPUs (alike on every rank: a collective)
    dist.all_gather_object(everyone, affinity())
    local = [cpus for cpus, m in zip(everyone, machines) if m == machines[rank]]
    # Launcher-bound ranks of one CPU each are not oversubscribed; four on two CPUs are.
    cpus = len(set().union(*map(set, local))) or os.cpu_count() or 1
    return (*bind_cpus(local_rank, local_world_size, device, local), len(local) > cpus)


def job() -> Job:
    """The current ``Job``; ``RuntimeError`` if ``fastpar.init`` was not called."""
    if _STATE["job"] is None:
        raise RuntimeError("fastpar.init() has not been called in this process")
    return _STATE["job"]


def topology() -> Topology:
    """The ``Topology`` of this process; ``RuntimeError`` if ``fastpar.init`` was not called."""
    return job().topology


def is_initialized() -> bool:
    return _STATE["job"] is not None


def shutdown() -> None:
    """Free the job's communicators, destroy the process groups init created. Safe to call
    twice."""
    import torch.distributed as dist

    current = _STATE["job"]
    if current is None or current.closing:  # not re-entered from a closer or a signal handler
        return
    try:
        current.close()  # its closers may still ask for job() (a barrier on a group)
    finally:
        try:
            if current.undo_binding is not None:
                current.undo_binding()
        finally:
            _STATE["job"] = None
            abort.remove()
            if current.owns_pg and dist.is_initialized():
                dist.destroy_process_group()
