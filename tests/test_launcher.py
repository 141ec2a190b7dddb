"""Launcher detection from fake environments: each launcher, stacked ones, conflicting ones."""

import pytest

from fastpar.runtime.launcher import LaunchInfo, detect

pytestmark = pytest.mark.quick  # every test here: the quick tier

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
PMIX = {"PMIX_RANK": "3"}
SLURM = {"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("env, launcher, local", [
    (TORCHRUN, "torchrun", (1, 2)),
    (OPENMPI, "openmpi", (1, 2)),
    (HYDRA, "pmi", (1, 2)),
    (PMIX, "pmix", (-1, -1)),
    (SLURM, "slurm", (1, -1)),
])
def test_each_launcher(env, launcher, local):
    info = detect(env)
    assert info.launcher == launcher
    assert info.rank == 3
    assert info.world_size == (8 if launcher != "pmix" else -1)
    assert (info.local_rank, info.local_world_size) == local
    assert info.uses_mpi == (launcher != "torchrun")


def test_single_process():
    assert detect({}) == LaunchInfo("single", 0, 1, 0, 1)
    assert detect({"PATH": "/bin", "HOME": "/root"}).launcher == "single"
    # A batch script's own shell has SLURM_PROCID but is not a job step: one process.
    assert detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).launcher == "single"


def test_stacked_launchers_that_agree():
    # Open MPI 5 exports both OMPI_* and PMIX_*; srun --mpi=pmix exports SLURM_* and PMIX_*.
    assert detect({**OPENMPI, **PMIX}).launcher == "openmpi"
    assert detect({**SLURM, **PMIX}).launcher == "pmix"
    assert detect({**TORCHRUN, **HYDRA}).launcher == "torchrun"


@pytest.mark.parametrize("env", [
    {**TORCHRUN, **HYDRA, "PMI_RANK": "0"},
    {**OPENMPI, **HYDRA, "PMI_SIZE": "4"},
    {**SLURM, **OPENMPI, "SLURM_PROCID": "5"},
])
def test_conflicting_launchers_name_both(env):
    with pytest.raises(ValueError, match="conflicting launchers") as err:
        detect(env)
    assert str(err.value).count("rank") >= 2


def test_override_and_bad_values():
    assert detect({**HYDRA, "FASTPAR_LAUNCHER": "single"}).launcher == "single"
    assert detect({**TORCHRUN, **HYDRA, "PMI_RANK": "0", "FASTPAR_LAUNCHER": "mpi"}).rank == 0
    assert detect({**TORCHRUN, **HYDRA, "PMI_RANK": "0",
                   "FASTPAR_LAUNCHER": "torchrun"}).rank == 3
    # An MPI library the table does not know: mpi4py supplies the numbers.
    assert detect({"FASTPAR_LAUNCHER": "mpi"}).uses_mpi
    with pytest.raises(ValueError, match="FASTPAR_LAUNCHER='bogus'"):
        detect({"FASTPAR_LAUNCHER": "bogus"})
    with pytest.raises(ValueError, match="RANK and WORLD_SIZE"):
        detect({"FASTPAR_LAUNCHER": "torchrun"})
    with pytest.raises(ValueError, match="RANK='x'"):
        detect({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="RANK 4 is outside WORLD_SIZE 4"):
        detect({"RANK": "4", "WORLD_SIZE": "4"})
