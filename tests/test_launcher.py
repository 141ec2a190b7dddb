"""Launcher detection from fake environments: each launcher, stacked ones, conflicting ones."""

import os

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


def test_rendezvous_takes_the_interface_a_torch_user_names(monkeypatch):
    """FASTPAR_SOCKET_IFNAME, else GLOO_SOCKET_IFNAME (its first name), else the default
    route; a name that is not an interface here is refused naming the variable."""
    from fastpar.runtime import rendezvous

    for var in ("FASTPAR_MASTER_ADDR", "FASTPAR_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,eth9")
    assert rendezvous._routable_address() == "127.0.0.1"
    with pytest.raises(RuntimeError, match="no address the others can reach"):
        rendezvous._routable_address(spans_hosts=True, where="ranks 0-1 on a, 2-3 on b")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    with pytest.raises(ValueError, match="GLOO_SOCKET_IFNAME=nosuch0: no interface"):
        rendezvous._routable_address()
    monkeypatch.setenv("FASTPAR_SOCKET_IFNAME", "lo")  # fastpar's own variable comes first
    assert rendezvous._routable_address() == "127.0.0.1"


def test_without_a_default_route_the_first_interface_that_is_up(tmp_path):
    """As NCCL does: the first interface up that is not loopback, physical before virtual
    (a sysfs of this host's real interfaces, linked into tmp_path in another order)."""
    from fastpar.runtime import rendezvous

    real = "/sys/class/net"
    up = [n for n in sorted(os.listdir(real)) if n != "lo"
          and open(os.path.join(real, n, "operstate")).read().strip() in ("up", "unknown")]
    addrs = {}
    for n in up:
        try:
            addrs[n] = rendezvous.interface_address(n)
        except ValueError:
            pass
    (tmp_path / "only_lo").mkdir()
    os.symlink(os.path.realpath(os.path.join(real, "lo")), tmp_path / "only_lo" / "lo")
    assert rendezvous.first_interface_address(str(tmp_path / "only_lo")) is None
    if not addrs:
        pytest.skip("no interface with an IPv4 address is up here besides loopback")
    for n in os.listdir(real):
        os.symlink(os.path.realpath(os.path.join(real, n)), tmp_path / n)
    physical = [n for n in sorted(addrs) if "/virtual/" not in os.path.realpath(f"{real}/{n}")]
    want = addrs[physical[0]] if physical else addrs[sorted(addrs)[0]]
    assert rendezvous.first_interface_address(str(tmp_path)) == want
