"""Each local rank of a CPU job on its own CPUs, unless the launcher already chose.

Ranks that busy-wait for each other (the shm collectives do, for microsecond latency) must not
share a core: two of them on one core take turns instead of running together, and a 4 KB
all_reduce costs ~20 us instead of ~4.5 us (65-100 us before the shm wait learned to yield
early). On this project's 2-core machine the scheduler left both ranks of a 2-rank job on one
core in one job of three to ten. So when every local rank may run on the same CPUs (the
launcher bound nothing; a container's cpuset counts as the machine), init gives local rank r
the r-th equal share of them and caps torch's intra-op threads at that share unless
OMP_NUM_THREADS says otherwise; shutdown undoes both, and rank 0 says so once, at init. An
affinity set before init is never narrowed: a launcher's own binding (``mpirun --bind-to``,
Slurm), or ``taskset`` on every rank alike (an affinity short of the machine's CPUs), is kept;
GPU jobs are left alone, and ``FASTPAR_BIND=0`` keeps whatever there is.
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


def parse_cpus(text: str) -> list[int]:
    """``"0-2,5"`` -> ``[0, 1, 2, 5]``."""
    out = []
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out += range(int(lo), int(hi or lo) + 1)
    return sorted(out)


def machine_cpus() -> list[int] | None:
    """The CPUs this process's container may use (its cgroup's cpuset, else every online
    CPU); None where neither says."""
    candidates = ["/sys/devices/system/cpu/online"]
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.strip().split(":", 2)
                if controllers == "":  # cgroup v2
                    candidates[:0] = [f"/sys/fs/cgroup{path}/cpuset.cpus.effective",
                                      "/sys/fs/cgroup/cpuset.cpus.effective"]
                elif "cpuset" in controllers.split(","):  # v1
                    candidates[:0] = [f"/sys/fs/cgroup/cpuset{path}/cpuset.effective_cpus"]
    except OSError:
        pass
    for path in candidates:
        try:
            with open(path) as f:
                cpus = parse_cpus(f.read())
            if cpus:
                return cpus
        except (OSError, ValueError):
            continue
    return None


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
    machine = machine_cpus()
    if machine is not None and set(mine) < set(machine):
        return f"{compact(mine)} (set before init, kept: the machine has {compact(machine)})", \
            None
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
