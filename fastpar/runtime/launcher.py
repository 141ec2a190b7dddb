"""Which launcher started this process, read from its environment.

``detect(environ)`` is a pure function of an environment mapping, so every launcher (and every
conflicting mix of them) is unit-tested from fake environments without launching anything.

Recognised launchers and the variables that give them away:

=========  ===========================================================================
torchrun   ``RANK``, ``WORLD_SIZE`` (+ ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_*``)
openmpi    ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_*``
pmi        ``PMI_RANK``, ``PMI_SIZE`` (MPICH/Hydra, Intel MPI, ``srun --mpi=pmi2``)
pmix       ``PMIX_RANK`` (+ ``PMIX_SIZE`` or the job size from the MPI library)
slurm      ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` (only inside a step)
single     none of the above
=========  ===========================================================================

Every MPI-family launcher (openmpi, pmi, pmix, slurm) is bootstrapped through mpi4py, which is
imported lazily, so torchrun and single-process use never need an MPI library.
``FASTPAR_LAUNCHER=torchrun|mpi|single`` overrides detection.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

MPI_FAMILY = ("openmpi", "pmi", "pmix", "slurm")


@dataclasses.dataclass(frozen=True)
class LaunchInfo:
    """What the environment says about this process; ``-1`` marks a value it does not give."""

    launcher: str  # "torchrun", "openmpi", "pmi", "pmix", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int = -1
    local_world_size: int = -1

    @property
    def uses_mpi(self) -> bool:
        return self.launcher in MPI_FAMILY


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None or value == "":
        return -1
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _candidates(env: Mapping[str, str]) -> list[LaunchInfo]:
    found = []
    if "RANK" in env and "WORLD_SIZE" in env:
        found.append(LaunchInfo("torchrun", _int(env, "RANK"), _int(env, "WORLD_SIZE"),
                                _int(env, "LOCAL_RANK"), _int(env, "LOCAL_WORLD_SIZE")))
    if "OMPI_COMM_WORLD_RANK" in env:
        found.append(LaunchInfo("openmpi", _int(env, "OMPI_COMM_WORLD_RANK"),
                                _int(env, "OMPI_COMM_WORLD_SIZE"),
                                _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                                _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")))
    if "PMI_RANK" in env:
        found.append(LaunchInfo("pmi", _int(env, "PMI_RANK"), _int(env, "PMI_SIZE"),
                                _int(env, "MPI_LOCALRANKID"), _int(env, "MPI_LOCALNRANKS")))
    if "PMIX_RANK" in env:
        found.append(LaunchInfo("pmix", _int(env, "PMIX_RANK"), _int(env, "PMIX_SIZE")))
    # SLURM_PROCID is also set in a batch script's own shell; only a job step (srun) launches ranks.
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        found.append(LaunchInfo("slurm", _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                                _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NTASKS_PER_NODE")))
    return found


def _describe(info: LaunchInfo) -> str:
    size = "?" if info.world_size < 0 else str(info.world_size)
    return f"{info.launcher} (rank {info.rank} of {size})"


def detect(env: Mapping[str, str]) -> LaunchInfo:
    """Return the launcher of a process whose environment is ``env``.

    Several launchers may be stacked (``srun`` starting ``mpirun``, Open MPI 5 setting both
    ``OMPI_*`` and ``PMIX_*``); that is fine while they agree on rank and world size. When they
    disagree no rank numbering can be trusted, and ``ValueError`` names every launcher found.
    """
    forced = env.get("FASTPAR_LAUNCHER", "").strip().lower()
    if forced not in ("", "torchrun", "mpi", "single"):
        raise ValueError(f"FASTPAR_LAUNCHER={forced!r} is not one of torchrun, mpi, single")
    if forced == "single":
        return LaunchInfo("single", 0, 1, 0, 1)

    found = _candidates(env)
    if forced == "torchrun":
        found = [c for c in found if c.launcher == "torchrun"]
        if not found:
            raise ValueError("FASTPAR_LAUNCHER=torchrun but RANK and WORLD_SIZE are not set")
    elif forced == "mpi":
        # An MPI library the table does not know: rank and size come from mpi4py itself.
        found = [c for c in found if c.uses_mpi] or [LaunchInfo("pmi", -1, -1)]

    if not found:
        return LaunchInfo("single", 0, 1, 0, 1)

    first = found[0]
    for other in found[1:]:
        sizes_known = first.world_size >= 0 and other.world_size >= 0
        if first.rank != other.rank or (sizes_known and first.world_size != other.world_size):
            names = ", ".join(_describe(c) for c in found)
            raise ValueError(
                f"conflicting launchers in the environment: {names}; unset the variables of the "
                "launcher you did not use, or set FASTPAR_LAUNCHER=torchrun|mpi|single")
    if first.launcher == "torchrun" and not 0 <= first.rank < first.world_size:
        raise ValueError(f"RANK {first.rank} is outside WORLD_SIZE {first.world_size}")
    return first


def launched_world_size() -> int:
    """The number of ranks this process was launched among, before ``fastpar.init`` (for a
    script that needs it to parse its arguments): the launcher's environment, else MPI's world
    (under an MPI launcher that does not say), else 1."""
    import os

    info = detect(os.environ)
    if info.world_size > 0:
        return info.world_size
    if info.uses_mpi:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_size()
    return 1
