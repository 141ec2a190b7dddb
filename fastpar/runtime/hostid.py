"""What "the same host" means: ranks that can map the same shared memory.

A host name alone does not say it: containers often share one, and two machines (or two
network namespaces of one machine) with one name would try shared memory between them. So a
rank's host identity is its host name joined with what the kernel says about the memory it
can share (as NCCL's ``NCCL_HOSTID`` overrides NCCL's own notion):

    <hostname>/<boot id>/<device number of the /dev/shm mount>

Two ranks with equal identities run on one kernel (boot id) and see one ``/dev/shm`` (a
private tmpfs, as a container or a mount namespace has, is another device). ``FASTPAR_HOST_ID``
replaces the whole identity for this rank: e.g. to make ranks of one machine behave as two
hosts (testing the multi-host paths), or to keep apart ranks the kernel cannot tell apart.

A rank's *machine* (the boot id) is what shares CPUs, whatever its identity: ranks of one
machine in different namespaces still take turns on the same cores.
"""

from __future__ import annotations

import os
import socket

from fastpar.runtime.binding import compact

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str:
    """This kernel's boot id (``"unknown"`` where the kernel does not say)."""
    try:
        with open(_BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def _shm_device() -> str:
    try:
        st = os.stat("/dev/shm")
    except OSError:
        return "none"
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def host_id() -> str:
    """This rank's host identity (see the module docstring); ``FASTPAR_HOST_ID`` overrides."""
    override = os.environ.get("FASTPAR_HOST_ID")
    if override:
        return override
    return f"{socket.gethostname()}/{boot_id()[:8]}/{_shm_device()}"


def machine_id() -> str:
    """What shares CPUs with this rank: its kernel (boot id), or its host identity where the
    kernel does not say."""
    boot = boot_id()
    return boot if boot != "unknown" else host_id()


def network_id() -> str:
    """This rank's network: its kernel (boot id) and network namespace. Ranks with equal ones
    reach each other over loopback, whatever their host identities say."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot_id()}/{netns}"


def host_name(identity: str) -> str:
    """The host-name part of an identity (the whole override when it has none)."""
    return identity.split("/", 1)[0]


def labels(identities) -> dict[str, str]:
    """A short label for each distinct identity: its host name where that alone tells it
    apart from the others, else the whole identity."""
    distinct = list(dict.fromkeys(identities))
    names = [host_name(i) for i in distinct]
    return {i: (n if names.count(n) == 1 else i) for i, n in zip(distinct, names)}


def describe(identities) -> str:
    """``"h0: ranks 0-1; h1: ranks 2-3"``: every host with its ranks, for messages."""
    label = labels(identities)
    by_host: dict[str, list[int]] = {}
    for rank, ident in enumerate(identities):
        by_host.setdefault(ident, []).append(rank)
    return "; ".join(f"{label[h]}: ranks {compact(r)}" for h, r in by_host.items())
