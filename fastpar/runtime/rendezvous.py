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
from fastpar.runtime import mpich_shm
from fastpar.runtime.failures import everywhere
from fastpar.runtime.hostid import describe, host_id, machine_id, network_id
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
    under a watchdog that ends this process with a message after ``timeout`` seconds, having
    removed the name of MPICH's segment, which ranks that never came together leave named
    (``runtime.mpich_shm``; once MPI_Init returns, ``fastpar.init`` removes it).
    """
    who = f"rank {info.rank}" + (f" of {info.world_size}" if info.world_size > 0 else "")
    message = (f"fastpar.init: {who} ({info.launcher} launcher): MPI_Init did not complete within "
               f"{timeout:g} s; a rank never started or died before joining MPI. Exiting.")
    try:
        with deadline(timeout if timeout < NO_LIMIT_S else None, message, mpich_shm.PREFIX):
            from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError(
            "this process was started by an MPI launcher but mpi4py cannot be imported "
            f"({exc}); install it with `pip install mpi4py` (and `pip install mpich` if the "
            "machine has no MPI library)") from exc
    return MPI


def interface_address(name: str, variable: str = "FASTPAR_SOCKET_IFNAME") -> str:
    """The IPv4 address of network interface ``name`` (``ValueError`` naming the interfaces
    there are, and the ``variable`` that named it, when it has none)."""
    import fcntl
    import struct

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
        return socket.inet_ntoa(packed[20:24])
    except OSError:
        names = ", ".join(n for _, n in socket.if_nameindex())
        raise ValueError(f"{variable}={name}: no interface of that name with an IPv4 "
                         f"address on this host (interfaces: {names})") from None


def interface_of(address: str) -> str | None:
    """The name of this host's interface that holds ``address`` (None if none does)."""
    for _, name in socket.if_nameindex():
        try:
            if interface_address(name) == address:
                return name
        except ValueError:
            continue
    return None


def _outgoing_address(peer: str = "10.255.255.255") -> str | None:
    """The local address this host would send from to ``peer`` (None without a route)."""
    try:
        # No packet is sent: connecting a UDP socket only selects the outgoing interface.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((peer, 1))
            addr = s.getsockname()[0]
        return addr if addr and not addr.startswith("0.") else None
    except OSError:
        return None


def named_interface() -> tuple[str, str] | None:
    """``(variable, interface)`` the user named: ``FASTPAR_SOCKET_IFNAME``, else
    ``GLOO_SOCKET_IFNAME`` (what a torch.distributed user sets; its first name where it lists
    several), else None."""
    for variable in ("FASTPAR_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = os.environ.get(variable, "").split(",")[0].strip()
        if value:
            return variable, value
    return None


def first_interface_address(sys_net: str = "/sys/class/net") -> str | None:
    """The IPv4 address of the first interface (by name) that is up and not loopback, a
    physical one before a virtual one (veth, bridge, docker: under /sys/devices/virtual), as
    NCCL picks when nothing is named; None when there is none."""
    try:
        names = sorted(os.listdir(sys_net))
    except OSError:
        return None

    def up(name):
        try:
            with open(os.path.join(sys_net, name, "operstate")) as f:
                return f.read().strip() in ("up", "unknown")
        except OSError:
            return False

    def virtual(name):
        return "/virtual/" in os.path.realpath(os.path.join(sys_net, name))

    for name in sorted((n for n in names if n != "lo" and up(n)), key=virtual):
        try:
            addr = interface_address(name)
        except ValueError:
            continue
        if not addr.startswith("127."):
            return addr
    return None


def _routable_address(spans_hosts: bool = False, where: str = "") -> str:
    """An address of this host that the job's other ranks can reach: ``FASTPAR_MASTER_ADDR``,
    else the address of the interface ``FASTPAR_SOCKET_IFNAME`` or ``GLOO_SOCKET_IFNAME``
    names, else the one the default route leaves from, else the first interface that is up
    (``first_interface_address``), else loopback, which is refused for a job whose ranks span
    hosts (``where``: which rank is on which host, for the message): they would wait for their
    own loopback."""
    override = os.environ.get("FASTPAR_MASTER_ADDR")
    if override:
        return override
    named = named_interface()
    addr = interface_address(named[1], named[0]) if named else (
        _outgoing_address() or first_interface_address())
    if addr is None or addr.startswith("127."):
        if spans_hosts:
            raise RuntimeError(
                f"fastpar.init: the job spans hosts ({where}) but rank 0 found no address "
                f"the others can reach ({'no default route' if addr is None else addr}, the "
                "loopback is all there is); set FASTPAR_SOCKET_IFNAME=<interface> (e.g. eth0) "
                "or FASTPAR_MASTER_ADDR=<address of rank 0's host>")
        return addr or "127.0.0.1"
    return addr


def gloo_interface(store_address: str, spans_hosts: bool) -> str | None:
    """Name gloo's interface for a job that spans hosts, unless the user did
    (``GLOO_SOCKET_IFNAME``): ``FASTPAR_SOCKET_IFNAME``, else the interface this rank reaches
    rank 0's store from, else (rank 0's own host, where that path is loopback) the default
    route's. gloo otherwise binds to the address its host name resolves to, which is loopback
    on many machines (Debian's 127.0.1.1), and the other hosts' ranks wait for it. Returns the
    name it set (``init`` removes it again at shutdown), or None."""
    if "GLOO_SOCKET_IFNAME" in os.environ or not spans_hosts:
        return None
    ifname = os.environ.get("FASTPAR_SOCKET_IFNAME")
    if not ifname:
        for local in (_outgoing_address(store_address), _outgoing_address(),
                      first_interface_address()):
            if local and not local.startswith("127."):
                ifname = interface_of(local)
                break
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    return ifname


def _join_store(host: str, port: int, rank: int, world_size: int, is_master: bool,
                timeout: float):
    import torch.distributed as dist

    try:
        if not is_master:
            _wait_listening(host, port, timeout)
        return dist.TCPStore(host, port, world_size, is_master,
                             timeout=as_timedelta(timeout),
                             wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - re-raised with the context a user needs
        what = "could not start the rendezvous store" if is_master else "could not reach rank 0"
        raise RuntimeError(f"fastpar.init: rank {rank} {what} at {host}:{port} within "
                           f"{timeout:g} s: {exc}") from exc


def _wait_listening(host: str, port: int, timeout: float) -> None:
    """Return once something accepts connections at host:port; ``TimeoutError`` after
    ``timeout`` seconds. TCPStore's own client retries with a back-off that outlasts its
    timeout (7.8 s for 3 here, torch 2.13), so a rank whose rank 0 never came would fail
    seconds after the time it was given; here it fails on time."""
    start = time.monotonic()
    pause = 0.01
    while True:
        left = timeout - (time.monotonic() - start)
        try:
            socket.create_connection((host, port), timeout=max(0.01, min(left, 1.0))).close()
            return
        except OSError as exc:
            left = timeout - (time.monotonic() - start)
            if left <= 0:
                raise TimeoutError(f"nothing accepted a connection there ({exc})") from None
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.25)


def rendezvous_mpi(comm, timeout: float):
    """Rank 0 starts the store on an address the others can reach (MPI says, before any store
    exists, whether the job spans hosts) and broadcasts it; ``(store, its address)``. A failure
    is raised on every rank alike and said by rank 0 alone (``runtime.failures``)."""
    rank = comm.Get_rank()
    world_size = comm.Get_size()
    store, error, address = None, None, None
    # Loopback is refused only where it cannot serve: ranks on other kernels or in other
    # network namespaces (FASTPAR_HOST_ID's hosts of one machine still meet over loopback).
    seen = comm.allgather((host_id(), network_id()))
    hosts, networks = [h for h, _ in seen], {n for _, n in seen}
    if rank == 0:
        port = int(os.environ.get("FASTPAR_MASTER_PORT", "0"))
        try:
            host = _routable_address(len(networks) > 1, describe(hosts))
            store = _join_store(host, port, rank, world_size, True, timeout)
            address = (host, store.port)
        except (RuntimeError, ValueError) as exc:
            error = str(exc)
    address, error = comm.bcast((address, error), root=0)
    if error is not None:  # rank 0's verdict, raised on every rank and said by rank 0
        raise everywhere(RuntimeError(error if rank == 0 else
                                      f"fastpar.init (rank 0 failed): {error}"), rank)
    if rank != 0:
        try:
            store = _join_store(address[0], address[1], rank, world_size, False, timeout)
        except RuntimeError as exc:
            error = str(exc)
    # MPI is alive even when TCP is not: let every rank report every rank that failed to connect.
    errors = [e for e in comm.allgather(error) if e is not None]
    if errors:
        raise everywhere(RuntimeError("; ".join(errors)), rank)
    return store, address[0]


def rendezvous_env(rank: int, world_size: int, timeout: float):
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        port = int(os.environ["MASTER_PORT"])
    except (KeyError, ValueError):
        raise ValueError(f"rank {rank} of {world_size}: MASTER_PORT must be set to the port of "
                         "rank 0's store (torchrun sets it)") from None
    # torchrun's agent already serves the store on MASTER_PORT; otherwise rank 0 hosts it.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return _join_store(host, port, rank, world_size, rank == 0 and not agent_store,
                       timeout), host


def join_barrier(store, rank: int, world_size: int, timeout: float,
                 generation: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Wait until every rank has checked in and return every rank's host identity and machine
    (``runtime.hostid``); on the deadline, name the ranks that did not arrive.

    Rank 0 hosts the store (unless torchrun's agent does), so on failure it stays until every
    rank that did arrive has read the missing list (or 5 s pass): they all fail with the same
    message.
    """
    prefix = f"fastpar/join/{generation}"
    store.set(f"{prefix}/{rank}", f"{host_id()}\n{machine_id()}")
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
    pairs = [store.get(f"{prefix}/{r}").decode().split("\n") for r in range(world_size)]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
