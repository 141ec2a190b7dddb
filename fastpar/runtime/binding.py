"""Each local rank of a CPU job on its own CPUs, unless the launcher already chose.

Ranks that busy-wait for each other (the shm collectives do, for microsecond latency) must not
share a core: two of them on one core take turns instead of running together, and a 4 KB
all_reduce costs ~20 us instead of ~4.5 us (65-100 us before the shm wait learned to yield
early). On this project's 2-core machine the scheduler left both ranks of a 2-rank job on one
core in one job of three to ten. So when every local rank may run on the same CPUs (the
launcher bound nothing; a container's cpuset counts as the machine), init gives local rank r
the r-th equal share of them and caps torch's intra-op threads at that share unless
OMP_NUM_THREADS says otherwise; shutdown undoes both. A launcher's own binding
(``mpirun --bind-to``, ``taskset``, Slurm) is kept, GPU jobs are left alone, and
``FASTPAR_BIND=0`` keeps whatever there is.
"""

from __future__ import annotations

import os

import torch


def compact(cpus) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    cpus, runs, start = sorted(cpus), [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            runs.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(runs)


def share(cpus: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """Local rank ``local_rank``'s equal, disjoint share of ``cpus`` (sorted)."""
    per = len(cpus) // local_world_size
    return cpus[local_rank * per:(local_rank + 1) * per]


def affinity() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _set_all_threads(cpus) -> None:
    """Affinity is per thread (later threads inherit it): set it on every thread."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass


def bind_cpus(local_rank: int, local_world_size: int, device: torch.device,
              local_affinities: list[list[int]]):
    """Bind this process as the module docstring says. ``local_affinities``: every local
    rank's CPUs before binding. Returns ``(what it runs on and why, undo)``; ``undo`` is
    ``None`` when nothing was changed."""
    mine = affinity()
    if not mine or not os.path.isdir("/proc/self/task"):
        return "any (no CPU affinity on this platform)", None
    if os.environ.get("FASTPAR_BIND", "1") == "0":
        return f"{compact(mine)} (FASTPAR_BIND=0)", None
    if device.type != "cpu":
        return f"{compact(mine)} (a {device.type} job: not bound)", None
    if local_world_size < 2:
        return f"{compact(mine)} (one rank on this host)", None
    if any(a != mine for a in local_affinities):
        return f"{compact(mine)} (bound by the launcher)", None
    if local_world_size > len(mine):
        return f"{compact(mine)} (shared: {local_world_size} ranks on {len(mine)} CPUs)", None
    cpus = share(mine, local_rank, local_world_size)
    threads = torch.get_num_threads()
    _set_all_threads(cpus)
    if "OMP_NUM_THREADS" not in os.environ and threads > len(cpus):
        torch.set_num_threads(len(cpus))

    def undo():
        _set_all_threads(mine)
        torch.set_num_threads(threads)

    return f"{compact(cpus)} (fastpar: local rank {local_rank} of {local_world_size})", undo
