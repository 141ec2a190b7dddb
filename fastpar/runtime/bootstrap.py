"""``fastpar.init`` / ``fastpar.shutdown``: from any launcher to a ready ``Topology``.

Steps, identical under every launcher:

1. ``launcher.detect`` reads the launcher, rank and world size from the environment; under an MPI
   launcher mpi4py (``MPI_Init``) then gives rank, world size and local ranks.
2. The tp/pp degrees are validated on every rank before the rendezvous, so a bad layout fails
   everywhere at once with the same ``ValueError``.
3. Rendezvous on a TCP store. Under MPI, rank 0 starts the store on a free port and broadcasts its
   address over MPI; under torchrun the store comes from ``MASTER_ADDR``/``MASTER_PORT``.
4. A join barrier on the store with a deadline: a rank that cannot reach the store (its error
   names the address), or a peer that never arrives, ends in an error naming the missing ranks on
   every rank that is alive, instead of a wait that lasts until the collective timeout.
5. ``torch.distributed.init_process_group`` on that store, then every group of the grid.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import socket
import threading
import time
from typing import Any

import torch

from fastpar.grid import Grid, Topology, validate_degrees
from fastpar.runtime import launcher as _launcher
from fastpar.runtime.binding import affinity, bind_cpus
from fastpar.runtime.groups import build_groups
from fastpar.runtime.watchdog import deadline


@dataclasses.dataclass
class Job:
    """Everything one ``fastpar.init`` made, freed by ``fastpar.shutdown``.

    ``topology``: the immutable grid and groups. The layers above the runtime keep their
    per-job state as named parts, made on first use and gone with the job, so a second ``init``
    starts clean and the runtime knows nothing of them::

        state = job().part("comm", lambda: CommState(job().topology))   # fastpar.comm.state
        tracker = job().part("nn.random", RNGTracker)                    # fastpar.nn.random

    A part with a ``close()`` method is closed by ``shutdown``, the last made first (so a part
    made from another is closed before it); ``on_close(fn)`` adds any other closer to the same
    order.
    """

    topology: Topology
    args: tuple  # (tp, pp, backend, timeout) as init was called
    owns_pg: bool  # init created the default process group (and so destroys it)
    undo_binding: Any = None  # restores the CPU affinity init changed (runtime.binding)
    parts: dict = dataclasses.field(default_factory=dict)
    closers: list = dataclasses.field(default_factory=list)
    closing: bool = False  # set by close(): no part is made any more, shutdown is not re-entered
    _lock: Any = dataclasses.field(default_factory=threading.RLock, repr=False)

    def part(self, name: str, make):
        """The part ``name``, made by ``make()`` on the first call (once, whichever threads
        ask); ``RuntimeError`` once the job is closing."""
        with self._lock:
            if name not in self.parts:
                if self.closing:
                    raise RuntimeError(f"fastpar: the job is shutting down; its part {name!r} "
                                       "cannot be made now")
                value = make()
                self.parts[name] = value
                if callable(getattr(value, "close", None)):
                    self.on_close(value.close)
            return self.parts[name]

    def on_close(self, fn) -> None:
        """Call ``fn()`` at ``shutdown``, before every closer added earlier."""
        with self._lock:
            self.closers.append(fn)

    def close(self) -> None:
        """Run every closer, the last added first, the parts still there for them to use; one
        that fails does not keep the others from running (the first error is raised once all
        ran). Then the parts go."""
        with self._lock:
            self.closing = True
        first = None
        while self.closers:  # a closer may add one (it runs next)
            try:
                self.closers.pop()()
            except Exception as exc:  # noqa: BLE001 - raised below, after the others
                first = first or exc
        self.parts = {}
        if first is not None:
            raise first


# What timeout=math.inf ("no limit") becomes where a finite duration is needed (a store's or a
# process group's timedelta); the MPI_Init watchdog is not armed at all at or above it.
NO_LIMIT_S = 10 * 365 * 86400.0


def check_timeout(timeout) -> float:
    """``timeout`` as float seconds: positive, ``math.inf`` for no limit; ``ValueError`` for
    anything else (nan, zero, negative, not a number)."""
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        raise ValueError(f"timeout must be a number of seconds, got {timeout!r}") from None
    if math.isnan(seconds) or seconds <= 0 or isinstance(timeout, bool):
        raise ValueError(f"timeout must be a positive number of seconds (math.inf for no "
                         f"limit), got {timeout!r}")
    return seconds


def as_timedelta(seconds: float) -> datetime.timedelta:
    """``seconds`` for torch.distributed (no limit: ``NO_LIMIT_S``)."""
    return datetime.timedelta(seconds=min(seconds, NO_LIMIT_S))


# The one current Job (None outside init/shutdown). "generation" counts inits in this process
# (ranks init in lockstep), so a store that outlives one init (torchrun's agent store) never mixes
# keys of two inits.
_STATE: dict[str, Any] = {"job": None, "generation": 0}


def _mpi_world(info: _launcher.LaunchInfo, timeout: float):
    """Import mpi4py lazily (torchrun and single-process use must not need an MPI library).

    The import runs ``MPI_Init``, which waits without limit for every rank to start, so it runs
    under a watchdog that ends this process with a message after ``timeout`` seconds.
    """
    who = f"rank {info.rank}" + (f" of {info.world_size}" if info.world_size > 0 else "")
    message = (f"fastpar.init: {who} ({info.launcher} launcher): MPI_Init did not complete within "
               f"{timeout:g} s; a rank never started or died before joining MPI. Exiting.")
    try:
        with deadline(timeout if timeout < NO_LIMIT_S else None, message):
            from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            "this process was started by an MPI launcher but mpi4py cannot be imported "
            f"({exc}); install it with `pip install mpi4py` (and `pip install mpich` if the "
            "machine has no MPI library)") from exc
    return MPI


def _routable_address() -> str:
    """An address of this host that peers can reach (override: ``FASTPAR_MASTER_ADDR``)."""
    override = os.environ.get("FASTPAR_MASTER_ADDR")
    if override:
        return override
    try:
        # No packet is sent: connecting a UDP socket only selects the outgoing interface.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            addr = s.getsockname()[0]
        if addr and not addr.startswith("0."):
            return addr
    except OSError:
        pass
    return "127.0.0.1"


def _join_store(host: str, port: int, rank: int, world_size: int, is_master: bool,
                timeout: float):
    import torch.distributed as dist

    try:
        return dist.TCPStore(host, port, world_size, is_master,
                             timeout=as_timedelta(timeout),
                             wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - re-raised with the context a user needs
        what = "could not start the rendezvous store" if is_master else "could not reach rank 0"
        raise RuntimeError(f"fastpar.init: rank {rank} {what} at {host}:{port} within "
                           f"{timeout:g} s: {exc}") from exc


def _rendezvous_mpi(comm, timeout: float):
    rank = comm.Get_rank()
    world_size = comm.Get_size()
    store, error, address = None, None, None
    if rank == 0:
        host = _routable_address()
        port = int(os.environ.get("FASTPAR_MASTER_PORT", "0"))
        try:
            store = _join_store(host, port, rank, world_size, True, timeout)
            address = (host, store.port)
        except RuntimeError as exc:
            error = str(exc)
    address, error = comm.bcast((address, error), root=0)
    if error is not None:
        raise RuntimeError(error if rank == 0 else f"fastpar.init (rank 0 failed): {error}")
    if rank != 0:
        try:
            store = _join_store(address[0], address[1], rank, world_size, False, timeout)
        except RuntimeError as exc:
            error = str(exc)
    # MPI is alive even when TCP is not: let every rank report every rank that failed to connect.
    errors = [e for e in comm.allgather(error) if e is not None]
    if errors:
        raise RuntimeError("; ".join(errors))
    return store


def _rendezvous_env(rank: int, world_size: int, timeout: float):
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        port = int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ValueError(f"rank {rank} of {world_size}: MASTER_PORT must be set to the port of "
                         "rank 0's store (torchrun sets it)") from None
    # torchrun's agent already serves the store on MASTER_PORT; otherwise rank 0 hosts it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return _join_store(host, port, rank, world_size, rank == 0 and not agent_store, timeout)


def _join_barrier(store, rank: int, world_size: int, timeout: float,
                  generation: int) -> tuple[str, ...]:
    """Wait until every rank has checked in and return every rank's host name; on the deadline,
    name the ranks that did not arrive.

    Rank 0 hosts the store (unless torchrun's agent does), so on failure it stays until every
    rank that did arrive has read the missing list (or 5 s pass): they all fail with the same
    message.
    """
    prefix = f"fastpar/join/{generation}"
    store.set(f"{prefix}/{rank}", socket.gethostname())
    arrived = store.add(f"{prefix}/count", 1)
    deadline = time.monotonic() + timeout
    pause = 0.001
    while arrived < world_size:
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"{prefix}/{r}"])]
            gave_up = store.add(f"{prefix}/gave_up", 1)
            linger = time.monotonic() + 5.0
            while rank == 0 and gave_up < world_size - len(missing) and time.monotonic() < linger:
                time.sleep(0.01)
                gave_up = store.add(f"{prefix}/gave_up", 0)
            raise RuntimeError(
                f"fastpar.init: rank {rank} waited {timeout:g} s for all {world_size} ranks to "
                f"join; rank(s) {missing} never arrived (crashed, or cannot reach rank 0's store)")
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
        arrived = store.add(f"{prefix}/count", 0)
    return tuple(store.get(f"{prefix}/{r}").decode() for r in range(world_size))


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


def _abort_job_on_uncaught_exception(comm, rank: int) -> None:
    """Under MPI, an exception nobody catches on one rank ends the whole job at once, with its
    traceback, instead of leaving the other ranks waiting in a collective until the timeout (as
    ``python -m mpi4py`` does). The main thread's exceptions only (a background thread's may
    be meant to end that thread alone); removed again by ``shutdown``.

    The traceback goes straight to file descriptor 2: torch.distributed's own excepthook, which
    init_process_group stacks on top of this one, captures ``sys.stderr`` while it calls the
    hook below it, and the abort would lose that capture."""
    import sys
    import traceback

    if _STATE.get("abort_hook") is not None:
        return
    previous = sys.excepthook

    def abort(exc_type, exc, tb):
        if _STATE.get("abort_hook") is None:  # removed by shutdown, but still in torch's chain
            return previous(exc_type, exc, tb)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        os.write(2, (f"fastpar: uncaught exception on rank {rank}; aborting the MPI job so that "
                     f"no rank waits for it:\n{text}").encode(errors="replace"))
        # The launcher forwards output asynchronously, and the abort ends every rank's output
        # stream: leave it a moment to carry the traceback out first.
        time.sleep(0.5)
        comm.Abort(1)

    abort.previous = previous
    _STATE["abort_hook"] = abort
    sys.excepthook = abort


def _remove_abort_hook() -> None:
    import sys

    hook, _STATE["abort_hook"] = _STATE.get("abort_hook"), None
    if hook is not None and sys.excepthook is hook:
        sys.excepthook = hook.previous


def _this_process(info: _launcher.LaunchInfo, timeout: float):
    """``(mpi_comm, rank, world_size, local_rank, local_world_size)``; MPI is the truth under an
    MPI launcher (local ranks from ``MPI_Comm_split_type(COMM_TYPE_SHARED)``, not host names)."""
    if info.uses_mpi:
        MPI = _mpi_world(info, timeout)
        comm = MPI.COMM_WORLD
        rank = comm.Get_rank()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        local = (node.Get_rank(), node.Get_size())
        node.Free()
        return comm, rank, comm.Get_size(), *local
    # torchrun always sets LOCAL_WORLD_SIZE; a hand-made RANK/WORLD_SIZE environment that does
    # not is taken as one host.
    local_world_size = info.local_world_size if info.local_world_size > 0 else info.world_size
    return None, info.rank, info.world_size, max(info.local_rank, 0), local_world_size


def init(tp: int = 1, pp: int = 1, *, backend: str | None = None,
         timeout: float = 300.0) -> Topology:
    """Join the job started by any launcher and return this rank's ``Topology``.

    Idempotent for the same arguments; calling it again with different ones is an error (call
    ``shutdown()`` first). ``timeout`` (seconds; ``math.inf``: no limit) bounds the rendezvous and
    every later collective on every group of the grid.
    """
    import torch.distributed as dist

    timeout = check_timeout(timeout)
    args = (tp, pp, backend, timeout)
    current = _STATE["job"]
    if current is not None:
        if current.args == args:
            return current.topology
        old = dict(zip(("tp", "pp", "backend", "timeout"), current.args))
        new = dict(zip(("tp", "pp", "backend", "timeout"), args))
        raise RuntimeError(f"fastpar.init was already called with {old}; called again with "
                           f"{new}. Call fastpar.shutdown() first to change the layout.")

    info = _launcher.detect(os.environ)
    mpi_comm, rank, world_size, local_rank, local_world_size = _this_process(info, timeout)
    if mpi_comm is not None:
        _abort_job_on_uncaught_exception(mpi_comm, rank)
    validate_degrees(world_size, tp, pp)
    grid = Grid(world_size, tp, pp)
    device = _choose_device(local_rank, local_world_size)
    shared_gpu = device.type == "cuda" and local_world_size > torch.cuda.device_count()
    backend = backend or ("nccl" if device.type == "cuda" and not shared_gpu else "gloo")

    owns_pg = not dist.is_initialized()
    if owns_pg:
        if info.uses_mpi:
            store = _rendezvous_mpi(mpi_comm, timeout)
        elif world_size > 1:
            store = _rendezvous_env(rank, world_size, timeout)
        else:
            store = dist.HashStore()
        generation = _STATE["generation"]
        _STATE["generation"] += 1
        hosts = _join_barrier(store, rank, world_size, timeout, generation)
        pg_store = dist.PrefixStore(f"fastpar/pg/{generation}", store)
        dist.init_process_group(backend, store=pg_store, rank=rank,
                                world_size=world_size,
                                timeout=as_timedelta(timeout))
    else:
        store = None
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed is already initialised as rank "
                               f"{dist.get_rank()} of {dist.get_world_size()}, but the launcher "
                               f"says rank {rank} of {world_size}")
        hosts = [None] * world_size
        dist.all_gather_object(hosts, socket.gethostname())
        hosts = tuple(hosts)
    try:
        groups = build_groups(grid, rank, as_timedelta(timeout))
        cpus, undo_binding, oversubscribed = _bind(rank, world_size, local_rank,
                                                   local_world_size, device, hosts)
        topo = Topology(grid=grid, rank=rank, local_rank=local_rank,
                        local_world_size=local_world_size, device=device,
                        backend=dist.get_backend(), launcher=info.launcher, hosts=hosts,
                        timeout=timeout, mpi_comm=mpi_comm, store=store, cpus=cpus,
                        oversubscribed=oversubscribed, **groups)
    except BaseException:
        if owns_pg:  # no half-made job: the next init starts from scratch
            dist.destroy_process_group()
        raise
    _STATE["job"] = Job(topology=topo, args=args, owns_pg=owns_pg, undo_binding=undo_binding)
    return topo


def _bind(rank, world_size, local_rank, local_world_size, device, hosts):
    """``runtime.binding.bind_cpus`` with every local rank's CPUs (a collective when the job
    is a multi-rank CPU job that may be bound; the condition is alike on every rank), and
    whether this host's ranks outnumber the CPUs they may run on together."""
    import torch.distributed as dist

    if world_size == 1:
        return (*bind_cpus(local_rank, local_world_size, device, []), False)
    everyone = [None] * world_size  # every rank's CPUs (alike on every rank: a collective)
    dist.all_gather_object(everyone, affinity())
    local = [cpus for cpus, host in zip(everyone, hosts) if host == hosts[rank]]
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
            _remove_abort_hook()
            if current.owns_pg and dist.is_initialized():
                dist.destroy_process_group()
