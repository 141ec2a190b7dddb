"""`python -m fastpar info`: alone, under mpirun and torchrun, text and JSON, and bad layouts."""

import json
import os
import subprocess
import sys

from tests.multirank import BIN, ROOT

KEYS = {"world_size", "tp", "pp", "dp", "backend", "versions", "ranks"}
RANK_KEYS = {"rank", "host", "local_rank", "device", "tp_rank", "pp_rank", "dp_rank"}


def run(cmd, timeout=120):
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_info_json_under_mpirun():
    proc = run([os.path.join(BIN, "mpirun"), "-np", "4", sys.executable, "-m", "fastpar", "info",
                "--tp", "2", "--pp", "2", "--json"])
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


def test_info_text_single_process_and_torchrun():
    proc = run([sys.executable, "-m", "fastpar", "info"])
    assert proc.returncode == 0, proc.stderr
    for word in ("torch", "mpi4py", "native", "built", "launcher", "single", "rank map"):
        assert word in proc.stdout
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "-m", "fastpar", "info", "--tp", "2", "--json"])
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["versions"]["launcher"] == "torchrun" and rep["tp"] == 2


def test_info_bad_layout_names_the_numbers():
    proc = run([os.path.join(BIN, "mpirun"), "-np", "3", sys.executable, "-m", "fastpar", "info",
                "--tp", "2"])
    assert proc.returncode != 0
    for rank in range(3):
        assert (f"error on rank {rank}: world_size 3 is not divisible by tp 2 x pp 1"
                in proc.stderr), proc.stderr
