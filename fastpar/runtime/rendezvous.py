"""Rendezvous: from a launched process to a store every rank of the job has joined.

Under an MPI launcher, rank 0 starts a TCP store on a free port of an address the others can
reach and broadcasts it over MPI (MPI_Init itself under a watchdog: a rank that never starts
ends the job with a message, not a hang); under torchrun the store comes from ``MASTER_ADDR`` /
``MASTER_PORT``. ``join_barrier`` then waits, with a deadline, until every rank has checked in,
and names the ranks that never did.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import time

from fastpar.runtime import launcher as _launcher
from fastpar.runtime.watchdog import deadline


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


def mpi_world(info: _launcher.LaunchInfo, timeout: float):
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


def rendezvous_mpi(comm, timeout: float):
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


def rendezvous_env(rank: int, world_size: int, timeout: float):
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        port = int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ValueError(f"rank {rank} of {world_size}: MASTER_PORT must be set to the port of "
                         "rank 0's store (torchrun sets it)") from None
    # torchrun's agent already serves the store on MASTER_PORT; otherwise rank 0 hosts it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return _join_store(host, port, rank, world_size, rank == 0 and not agent_store, timeout)


def join_barrier(store, rank: int, world_size: int, timeout: float,
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
