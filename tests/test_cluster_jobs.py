"""fastpar across real hosts: the namespaced cluster (fastpar.testing.cluster), 2 hosts.

Each launch runs several cases in one job (a launch across hosts costs ~10 s here):
- mpirun 2 x 2: host identities, the hierarchical collectives (MPI across) at every op and dtype
  against float64, then the main job at tp 2 x pp 2 and at tp 2 x dp 2 with ZeRO-1 (dp across
  the hosts) and at pp 4 (shm between the stages of a host, torch across), each against one
  serial process's loss curve;
- torchrun 2 x 2: the hierarchical collectives with gloo across;
- mpirun 3 + 1: uneven hosts fall back to a flat engine, saying why, and stay correct;
- mpirun 2 x 1 on two hosts that share a host name: never shm between them;
- the main job on 2 x 2 with rank 3 (on h1) killed: the job ends, naming the rank and the host;
- the torch.distributed backend "fastpar" on 2 x 2: the world (gloo across) and each host's
  group (the kernels), point to point across the hosts.
Skipped, saying why, where namespaces cannot be made (tests/test_hierarchical.py runs the same
paths on one host with FASTPAR_HOST_ID).
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from fastpar.testing.cluster import NamespaceCluster, cluster_unavailable
from tests.multirank import ROOT, launch_env, read_results, run_ranks
from tests.test_backend import body_across_hosts, check_across_hosts  # noqa: F401
from tests.test_hierarchical import HIER, body_hier
from tests.test_train import BASE, _rank_pids, _wait_lines, assert_parity, body_runs

REASON = cluster_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")
# pp 4: the tiny preset's 4 layers (embedding, 2 blocks, head), one per stage; each stage has
# one neighbour on its host (shm rings) and one on the other (torch / gloo)
STEPS = ["--steps", "6"]  # the serial run's too (the rate schedule depends on the steps)
TRAIN_RUNS = [("tp2_pp2", ["--tp", "2", "--pp", "2", *STEPS]),
              ("tp2_zero", ["--tp", "2", "--zero", *STEPS]), ("pp4", ["--pp", "4", *STEPS]),
              # ZeRO-3 over dp 4 across the hosts, its weights and gradients int8 on the link
              # (once crashed: MPI's numpy views pinned the gather buffers' storage)
              ("zero3_int8", ["--zero", "3", "--quantize-weights", "int8",
                              "--quantize-grads", "int8", "--error-feedback", *STEPS])]


@pytest.fixture(scope="module")
def two_hosts():
    with NamespaceCluster(2) as c:
        yield c


def _worker(outdir, body, kwargs):
    return [sys.executable, "-m", "tests._rank_worker", outdir, f"{__name__}:{body.__name__}",
            json.dumps(kwargs)]


def _results(outdir, nranks, procs):
    got = read_results(outdir, nranks)
    output = "\n".join(p.stdout[-3000:] + p.stderr[-3000:] for p in procs)
    bad = [r for r in range(nranks) if not got.get(r, {}).get("ok")]
    assert not bad, "ranks %s failed:\n%s\n%s" % (
        bad, "\n".join(got[r]["traceback"] for r in bad if r in got), output)
    return [got[r]["value"] for r in range(nranks)]


def on_cluster(c, body, *, launcher="mpirun", mpi_hosts=None, ppn=2, nranks=4, timeout=300,
               env=None, **kwargs):
    """``body(**kwargs)`` on every rank of a job across the cluster's hosts; every rank's
    value. ``mpi_hosts``: MPICH's host list (``["h0:3", "h1:1"]``) instead of ``ppn`` per
    host."""
    env = {**launch_env(nranks, {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}), **(env or {})}
    with tempfile.TemporaryDirectory(prefix="fastpar-cluster-job-") as outdir:
        argv = _worker(outdir, body, kwargs)
        if launcher == "torchrun":
            procs = c.torchrun(["--no-python", *argv], nproc_per_node=ppn, env=env,
                               timeout=timeout)
        elif mpi_hosts is not None:
            mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
            procs = [c.run(0, [mpirun, "-hosts", ",".join(mpi_hosts), "-np", str(nranks), *argv],
                           env=env, timeout=timeout, cwd=ROOT)]
        else:
            procs = [c.mpirun(argv, ppn=ppn, env=env, timeout=timeout)]
        return _results(outdir, nranks, procs)


def body_hier_then_train(runs):
    """The hierarchical collectives on the real hosts, then the main job's runs."""
    result = body_hier(None, expect=HIER)
    import fastpar

    fastpar.shutdown()
    result["train"] = body_runs(runs)
    from fastpar.pipeline import channels as p2p

    topo = fastpar.init(pp=4, timeout=60)  # what pp 4's channels chose on the real hosts
    ch = p2p.Channels(topo.pp_group, all_groups=topo.grid.groups("pp"))
    result["p2p"] = [ch.engine_name, ch.reason]
    fastpar.shutdown()
    return result


def body_flat(expect_reason):
    """A spanning world whose all_reduce the policy sends to a flat engine: the reason, and
    the results (float64 bounds) of every op."""
    import fastpar
    from fastpar.comm import routing

    result = body_hier(None, dtypes=["float32", "bfloat16"], sizes=[5, 4099])
    topo = fastpar.init(timeout=120)
    import torch

    choice = routing.choose("all_reduce", torch.empty(1 << 18), None)[2]
    assert (choice.engine, choice.reason) == ("mpi", f"spans hosts, not hier: {expect_reason}")
    result["hosts"] = list(topo.hosts)
    return result


def test_two_by_two_hierarchical_and_main_job_parity(two_hosts):
    serial = run_ranks(1, body_runs, runs=[("serial", STEPS)]).values()[0]["serial"]
    values = on_cluster(two_hosts, body_hier_then_train, runs=TRAIN_RUNS)
    for key in values[0]["digests"]:  # every rank holds the same result
        assert len({v["digests"][key] for v in values}) == 1, key
    assert values[0]["engines"]["all_reduce"][1] == \
        "2 hosts x 2 ranks: shm within each host, mpi across"
    assert len(serial) == 6
    for name, _ in TRAIN_RUNS:  # int8: within 1e-3 over 6 steps (test_train: 10)
        assert_parity(name, values[0]["train"][name], serial)
    assert [v["p2p"] for v in values[:2]] == [
        ["shm+torch", "shm with rank 1 (this host), torch with rank 3 (host h1)"],
        ["shm+torch", "shm with rank 0 (this host), torch with rank 2 (host h1)"]], values[0]


def test_two_by_two_torchrun_gloo_across(two_hosts):
    # every dtype with gloo across: test_hierarchical's round robin on one host. No
    # GLOO_SOCKET_IFNAME (the harness sets one): fastpar names gloo's interface itself.
    values = on_cluster(two_hosts, body_hier, launcher="torchrun", hosts=None, expect=HIER,
                        dtypes=["float32"], sizes=[5, 4099, 65539],
                        env={"GLOO_SOCKET_IFNAME": None})
    assert {v["gloo_ifname"] for v in values} == {"eth0"}
    assert values[0]["engines"]["all_reduce"][1] == \
        "2 hosts x 2 ranks: shm within each host, gloo across"


def test_three_plus_one_falls_back_flat(two_hosts):
    values = on_cluster(two_hosts, body_flat, mpi_hosts=["h0:3", "h1:1"],
                        expect_reason="its hosts hold 3 + 1 of its ranks (uneven)")
    assert [h.split("/")[0] for h in values[0]["hosts"]] == ["h0", "h0", "h0", "h1"]


def test_hosts_with_one_name_never_share_memory():
    with NamespaceCluster(2, hostnames=["node", "node"]) as c:
        values = on_cluster(c, body_flat, ppn=1, nranks=2,
                            expect_reason="one of its ranks per host: nothing to share within "
                                          "a host")
    a, b = values[0]["hosts"]
    assert a.split("/")[0] == b.split("/")[0] == "node" and a != b  # one name, two /dev/shm


def test_killed_rank_on_the_second_host_is_named(two_hosts, tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    argv = [mpirun, "-hosts", "h0,h1", "-ppn", "2", "-np", "4", sys.executable, "-m",
            "fastpar.train", *BASE[:2], "--steps", "100000", "--no-progress", "--plot", "",
            "--tp", "2", "--pp", "2", "--timeout", "60", "--metrics", metrics]
    proc = two_hosts.popen(0, argv, env=launch_env(4), cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL)
    try:
        _wait_lines(metrics, 2, proc, deadline=120)
        pids = _rank_pids(metrics)  # pids in this (the root) pid namespace
        assert set(pids) == {0, 1, 2, 3}, pids
        # rank 2, h1's first: Hydra's proxy then kills rank 3 too and names the first of its
        # processes that ended badly, which was once rank 2 when rank 3 was the one killed
        os.kill(pids[2], signal.SIGKILL)
        start = time.monotonic()
        out = proc.communicate(timeout=60)[0]
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0
    assert elapsed < 30, (elapsed, out[-2000:])
    banner = next(line for line in out.splitlines() if "[fastpar.train] ranks:" in line)
    inner = int(banner.split("2: pid ")[1].split()[0])  # rank 2's pid inside the cluster
    assert f"2: pid {inner} on h1" in banner, banner
    assert f"PID {inner} RUNNING AT h1" in out, out[-2000:]


def test_job_across_hosts_refuses_a_loopback_rendezvous(two_hosts):
    """Rank 0 told to serve the store on loopback (FASTPAR_SOCKET_IFNAME=lo) in a job that
    spans hosts: every rank ends at once with the same status, not after the store's timeout,
    and the fix is named once, on a line of its own, by rank 0 (it was said by all 4 ranks,
    run together on one line)."""
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    start = time.monotonic()
    out = two_hosts.run(0, [mpirun, "-hosts", "h0,h1", "-ppn", "2", "-np", "4", sys.executable,
                            "-m", "fastpar", "info", "--timeout", "60"],
                        env=launch_env(4, {"FASTPAR_SOCKET_IFNAME": "lo"}), cwd=ROOT,
                        timeout=120)
    assert out.returncode == 2 and time.monotonic() - start < 30, (out.returncode, out.stderr)
    text = out.stdout + out.stderr
    refusal = ("the job spans hosts (h0: ranks 0-1; h1: ranks 2-3) but rank 0 found no address "
               "the others can reach (127.0.0.1, the loopback is all there is)")
    assert text.count(refusal) == 1, text[-3000:]
    line = next(line for line in text.splitlines() if refusal in line)
    assert line.startswith("fastpar info: error on rank 0: fastpar.init: the job spans"), line
    assert line.endswith("or FASTPAR_MASTER_ADDR=<address of rank 0's host>"), line
    assert "error on rank 1" not in text and "rank 0 failed" not in text, text[-3000:]


def test_torch_distributed_backend_across_hosts(two_hosts):
    values = on_cluster(two_hosts, body_across_hosts)  # under mpirun: MPI's small calls
    for v in values:  # the world spans the hosts; a host's own group: the kernels
        check_across_hosts(v, mpi=True)
        assert v["local"]["_allgather_base"]["shm"]
