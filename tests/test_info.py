"""`python -m fastpar info`: alone, under mpirun and torchrun, text and JSON, and bad layouts."""

import json
import sys

import pytest

from tests.multirank import launch

KEYS = {"world_size", "tp", "pp", "dp", "cp", "ep", "edp", "backend", "versions", "ranks",
        "engines", "dist_backend"}
RANK_KEYS = {"rank", "host", "local_rank", "device", "tp_rank", "cp_rank", "pp_rank", "dp_rank",
             "ep_rank", "edp_rank", "cpus"}




def test_info_json_under_mpirun():
    proc = launch([sys.executable, "-m", "fastpar", "info", "--tp", "2", "--pp", "2", "--json"],
                  nranks=4, launcher="mpirun")
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)  # exactly one document: only rank 0 writes
    assert KEYS <= set(rep)
    assert (rep["world_size"], rep["tp"], rep["pp"], rep["dp"]) == (4, 2, 2, 1)
    assert (rep["ep"], rep["edp"], rep["cp"]) == (1, 1, 1)
    assert rep["backend"] == "fastpar"  # init's default on CPU: its own torch.distributed backend
    assert rep["versions"]["launcher"] == "pmi"
    assert rep["versions"]["native"].startswith("built"), rep["versions"]
    assert "MPICH" in rep["versions"]["mpi_library"]
    assert [r["rank"] for r in rep["ranks"]] == [0, 1, 2, 3]
    for r in rep["ranks"]:
        assert set(r) == RANK_KEYS
        rank = r["rank"]
        assert (r["tp_rank"], r["dp_rank"], r["pp_rank"]) == (rank % 2, 0, rank // 2)
        assert (r["ep_rank"], r["edp_rank"], r["cp_rank"]) == (0, 0, 0)
        assert r["local_rank"] == rank and r["device"] == "cpu"
    # The engine decisions and their reasons, per group and op.
    engines = {(e["group"], e["op"]): e for e in rep["engines"]}
    assert engines[("tp", "all_reduce")]["engine"] == "shm", rep["engines"]
    assert engines[("tp", "all_reduce")]["ranks"] == [0, 1]
    assert engines[("tp", "all_reduce")]["reason"] == "CPU tensors on one host"
    assert engines[("dp", "broadcast")]["engine"] == "local"
    assert engines[("world", "all_gather")]["ranks"] == [0, 1, 2, 3]
    # ep 1, cp 1: no ep, edp, cp or dpcp rows
    assert {e["group"] for e in rep["engines"]} == {"world", "tp", "dp", "pp"}
    # the torch.distributed backend: registered, with what serves each operation
    assert rep["dist_backend"]["registered"] and rep["dist_backend"]["native"]
    ops = {o["op"]: o for o in rep["dist_backend"]["operations"]}
    assert ops["all_reduce"]["here"].startswith("shm") and "gloo" in ops["all_reduce"]["else"]


def test_info_text_single_process_and_torchrun():
    proc = launch([sys.executable, "-m", "fastpar", "info"])
    assert proc.returncode == 0, proc.stderr
    for word in ("torch", "mpi4py", "native", "built", "launcher", "single", "rank map",
                 "world 1 = tp 1 x cp 1 x pp 1 x dp 1, dp = ep 1 x edp 1,",
                 "tp_rank  cp_rank  pp_rank  dp_rank  ep_rank  edp_rank",
                 "engines on rank 0's groups", "every op  local   group of one rank"):
        assert word in proc.stdout, proc.stdout
    assert "not loaded (single launch)" in proc.stdout
    # our GPU engines say whether they would run here, and why not (this build has no CUDA)
    assert "GPU engines on this machine:" in proc.stdout
    assert 'torch.distributed backend "fastpar": registered' in proc.stdout, proc.stdout
    assert "cuda_ipc  off: fastpar._C was built without CUDA" in proc.stdout \
        or "cuda_ipc  2 ranks:" in proc.stdout, proc.stdout
    assert "nccl_mpi  " in proc.stdout
    # Under torchrun (and alone) info never initialises MPI, even with mpi4py installed.
    # (--ep 2, then --cp 2 in the same job: tp and pp reach init in the mpirun test above)
    code = ("import sys; from fastpar import info; rc = info.main(['--ep', '2', '--json']) or "
            "info.main(['--cp', '2', '--json']); "
            "assert 'mpi4py.MPI' not in sys.modules, 'info imported mpi4py.MPI'; sys.exit(rc)")
    proc = launch([sys.executable, "-c", code], nranks=2, launcher="torchrun")
    assert proc.returncode == 0, proc.stderr
    rep, end = json.JSONDecoder().raw_decode(proc.stdout)  # rank 0's two documents
    cp_rep = json.loads(proc.stdout[end:])
    assert rep["versions"]["launcher"] == "torchrun"
    assert rep["versions"]["mpi_library"] == "not loaded (torchrun launch)"
    assert (rep["tp"], rep["dp"], rep["ep"], rep["edp"]) == (1, 2, 2, 1)
    assert [(r["dp_rank"], r["ep_rank"], r["edp_rank"]) for r in rep["ranks"]] == [(0, 0, 0),
                                                                                  (1, 1, 0)]
    # with ep > 1 the table shows the ep group (both ranks) and the edp group (rank 0 alone)
    engines = {(e["group"], e["op"]): e for e in rep["engines"]}
    assert engines[("ep", "all_to_all")]["ranks"] == [0, 1], rep["engines"]
    assert engines[("edp", "all_reduce")]["ranks"] == [0]
    assert engines[("edp", "all_reduce")]["engine"] == "local"
    # --cp 2 at world 2: tp 1 x cp 2 x dp 1; the cp and the dpcp group are both ranks
    assert (cp_rep["tp"], cp_rep["cp"], cp_rep["dp"], cp_rep["ep"]) == (1, 2, 1, 1)
    assert [(r["cp_rank"], r["dp_rank"]) for r in cp_rep["ranks"]] == [(0, 0), (1, 0)]
    engines = {(e["group"], e["op"]): e for e in cp_rep["engines"]}
    assert engines[("cp", "all_reduce")]["ranks"] == [0, 1], cp_rep["engines"]
    assert engines[("dpcp", "all_reduce")]["ranks"] == [0, 1]
    assert engines[("dp", "all_reduce")]["engine"] == "local"
    assert {e["group"] for e in cp_rep["engines"]} == {"world", "tp", "dp", "pp", "cp", "dpcp"}
    # the text form of that report: cp in the rank map's line and columns, its groups' rows
    from fastpar.info import format_report

    text = format_report(cp_rep).splitlines()
    assert any("rank map: world 2 = tp 1 x cp 2 x pp 1 x dp 1, dp = ep 1 x edp 1," in line
               for line in text), text
    header = next(i for i, line in enumerate(text) if line.split()[:2] == ["rank", "host"])
    cols = text[header].split()
    assert cols[4:8] == ["tp_rank", "cp_rank", "pp_rank", "dp_rank"], cols
    for rank in (0, 1):  # (tp, cp, pp, dp) of each rank under its columns
        row = text[header + 1 + rank].split()
        assert row[0] == str(rank) and row[4:8] == ["0", str(rank), "0", "0"], row
    assert [line.split()[:2] for line in text if line.split()[:1] in (["cp"], ["dpcp"])] == [
        ["cp", "[0,"], ["dpcp", "[0,"]], text


@pytest.mark.quick
def test_info_bad_ep_or_cp_names_the_numbers(capsys, monkeypatch):
    """Checked from the command line before init (in this process: one rank, no launcher)."""
    from fastpar import info

    for var in ("RANK", "WORLD_SIZE", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "SLURM_PROCID", "FASTPAR_LAUNCHER"):
        monkeypatch.delenv(var, raising=False)
    for argv, message in ((["--ep", "2"], "ep 2 does not divide dp 1 (world_size 1 / (tp 1 x "
                                           "pp 1)): expert parallelism cuts the dp ranks into "
                                           "groups of ep"),
                          (["--cp", "2"], "cp 2 does not divide world_size 1 / (tp 1 x pp 1) "
                                          "= 1: the world is tp x cp x dp x pp, so that "
                                          "quotient must be dp x cp"),
                          (["--ep", "0"], "--tp, --pp, --ep and --cp must be at least 1, got 1, "
                                          "1, 0 and 1"),
                          (["--cp", "0"], "--tp, --pp, --ep and --cp must be at least 1, got 1, "
                                          "1, 1 and 0")):
        try:
            info.main(argv)
            raise AssertionError(f"info {argv} did not exit")
        except SystemExit as exc:
            assert exc.code == 2
        err = capsys.readouterr().err
        assert err.strip() == f"python -m fastpar info: error: {message} (see --help)", err


def test_info_bad_layout_names_the_numbers():
    proc = launch([sys.executable, "-m", "fastpar", "info", "--tp", "2"], nranks=3,
                  launcher="mpirun")
    assert proc.returncode == 2
    # Every rank parses the same command line: the job says it once, in one line.
    assert proc.stderr.strip().splitlines() == [
        "python -m fastpar info: error: world_size 3 is not divisible by tp 2 x pp 1 "
        "(see --help)"], proc.stderr
