"""Each local rank on its own CPUs, unless the launcher already chose.

Ranks that busy-wait for each other (the shm collectives do, for microsecond latency) must not
share a core: two of them on one core take turns instead of running together, and a 4 KB
all_reduce costs ~20 us instead of ~4.5 us (measured on this project's 2-core machine, where
the scheduler left both ranks of a job on one core in about one job in ten). So when the
launcher left every rank free to run anywhere, init gives local rank r the r-th equal share of
the CPUs (and caps torch's intra-op threads at that share unless OMP_NUM_THREADS says
otherwise). A launcher's own binding (``mpirun --bind-to``, ``taskset``, Slurm) is kept;
``FASTPAR_BIND=0`` keeps whatever there is.
"""

from __future__ import annotations

import os

import torch


def _compact(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs, start = [], None
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


def bind_cpus(local_rank: int, local_world_size: int) -> str:
    """Bind this process as the module docstring says; returns what it runs on, and why."""
    if not hasattr(os, "sched_setaffinity"):
        return "any (no CPU affinity on this platform)"
    mine = sorted(os.sched_getaffinity(0))
    every = os.cpu_count() or len(mine)
    if os.environ.get("FASTPAR_BIND", "1") == "0":
        return f"{_compact(mine)} (FASTPAR_BIND=0)"
    if len(mine) < every:
        return f"{_compact(mine)} (bound by the launcher)"
    if local_world_size < 2:
        return f"{_compact(mine)} (one rank on this host)"
    if local_world_size > len(mine):
        return f"{_compact(mine)} (shared: {local_world_size} ranks on {len(mine)} CPUs)"
    cpus = share(mine, local_rank, local_world_size)
    # Every thread of the process (affinity is per thread; later threads inherit it).
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # a thread that just ended
            pass
    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > len(cpus):
        torch.set_num_threads(len(cpus))
    return f"{_compact(cpus)} (fastpar: local rank {local_rank} of {local_world_size})"
