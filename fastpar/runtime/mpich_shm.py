"""MPICH's shared memory goes with the job, however the job ends.

MPICH (ch4; 5.0 here) keeps its host's segment of a job, ``/dev/shm/mpich_shm_<job>_<node>``,
named until ``MPI_Finalize``: the first local rank to reach ``MPI_Init`` creates it and the others
open it by that name. A job that ends any other way (``MPI_Abort``, which an uncaught exception
takes under fastpar; a rank killed, and the launcher killing the rest) leaves it behind, 1-4 MB
a job. So ``fastpar.init`` removes the name as soon as every local rank has the segment mapped:
an unlinked file lives on while any process maps it, so the ranks keep their shared memory, and
it goes with the last of them, whoever ends last and however. ``MPI_Finalize`` then finds the
name gone, which it does not mind.
"""

from __future__ import annotations

import contextlib
import os

PREFIX = "/dev/shm/mpich_"  # mpich_shm_* (the segment), mpich_vci_* (more VCIs: its twin)


def mapped(prefix: str = PREFIX) -> set[str]:
    """The files under ``prefix`` that this process maps and that still have their name (a
    removed one shows as ``<path> (deleted)`` in ``/proc/self/maps``)."""
    found = set()
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(prefix) \
                    and not fields[5].endswith(" (deleted)"):
                found.add(fields[5])
    return found


def release(node) -> list[str]:
    """Collective over ``node`` (this host's ranks: ``MPI_COMM_TYPE_SHARED``): remove the name
    of every MPICH segment that each of them maps (no rank of the job opens it again: they all
    have it). Returns the names removed on this rank (its host's rank 0 removes them)."""
    common = set.intersection(*(set(names) for names in node.allgather(sorted(mapped()))))
    if node.Get_rank() != 0:
        return []
    removed = []
    for path in sorted(common):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed
