"""`python -m fastpar info`: alone, under mpirun and torchrun, text and JSON, and bad layouts."""

import json
import sys

from tests.multirank import launch

KEYS = {"world_size", "tp", "pp", "dp", "backend", "versions", "ranks", "engines"}
RANK_KEYS = {"rank", "host", "local_rank", "device", "tp_rank", "pp_rank", "dp_rank", "cpus"}




def test_info_json_under_mpirun():
    proc = launch([sys.executable, "-m", "fastpar", "info", "--tp", "2", "--pp", "2", "--json"],
                  nranks=4, launcher="mpirun")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)  # exactly one document: only rank 0 writes
    assert KEYS <= set(rep)
    assert (rep["world_size"], rep["tp"], rep["pp"], rep["dp"]) == (4, 2, 2, 1)
    assert rep["backend"] == "gloo"
    assert rep["versions"]["launcher"] == "pmi"
    assert rep["versions"]["native"].startswith("built"), rep["versions"]
    assert "MPICH" in rep["versions"]["mpi_library"]
    assert [r["rank"] for r in rep["ranks"]] == [0, 1, 2, 3]
    for r in rep["ranks"]:
        assert set(r) == RANK_KEYS
        rank = r["rank"]
        assert (r["tp_rank"], r["dp_rank"], r["pp_rank"]) == (rank % 2, 0, rank // 2)
        assert r["local_rank"] == rank and r["device"] == "cpu"
    # The engine decisions and their reasons, per group and op.
    engines = {(e["group"], e["op"]): e for e in rep["engines"]}
    assert engines[("tp", "all_reduce")]["engine"] == "shm", rep["engines"]
    assert engines[("tp", "all_reduce")]["ranks"] == [0, 1]
    assert engines[("tp", "all_reduce")]["reason"] == "CPU tensors on one host"
    assert engines[("dp", "broadcast")]["engine"] == "local"
    assert engines[("world", "all_gather")]["ranks"] == [0, 1, 2, 3]


def test_info_text_single_process_and_torchrun():
    proc = launch([sys.executable, "-m", "fastpar", "info"])
    assert proc.returncode == 0, proc.stderr
    for word in ("torch", "mpi4py", "native", "built", "launcher", "single", "rank map",
                 "engines on rank 0's groups", "every op  local   group of one rank"):
        assert word in proc.stdout, proc.stdout
    assert "not loaded (single launch)" in proc.stdout
    # our GPU engines say whether they would run here, and why not (this build has no CUDA)
    assert "GPU engines on this machine:" in proc.stdout
    assert "cuda_ipc  off: fastpar._C was built without CUDA" in proc.stdout \
        or "cuda_ipc  2 ranks:" in proc.stdout, proc.stdout
    assert "nccl_mpi  " in proc.stdout
    # Under torchrun (and alone) info never initialises MPI, even with mpi4py installed.
    code = ("import sys; from fastpar import info; rc = info.main(['--tp', '2', '--json']); "
            "assert 'mpi4py.MPI' not in sys.modules, 'info imported mpi4py.MPI'; sys.exit(rc)")
    proc = launch([sys.executable, "-c", code], nranks=2, launcher="torchrun")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["versions"]["launcher"] == "torchrun" and rep["tp"] == 2
    assert rep["versions"]["mpi_library"] == "not loaded (torchrun launch)"


def test_info_bad_layout_names_the_numbers():
    proc = launch([sys.executable, "-m", "fastpar", "info", "--tp", "2"], nranks=3,
                  launcher="mpirun")
    assert proc.returncode == 2
    # Every rank parses the same command line: the job says it once, in one line.
    assert proc.stderr.strip().splitlines() == [
        "python -m fastpar info: error: world_size 3 is not divisible by tp 2 x pp 1 "
        "(see --help)"], proc.stderr
