"""The namespaced multi-host cluster (fastpar.testing.cluster): what a host is, that MPI sees
separate hosts, link shaping, and that nothing is left behind however the harness ends (torchrun
across its hosts: tests/test_cluster_jobs.py). Skipped where namespaces cannot be made (not
root, no iproute2)."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fastpar.testing import cluster
from fastpar.testing.cluster import NamespaceCluster, cluster_unavailable

REASON = cluster_unavailable()
needs_ns = pytest.mark.skipif(REASON is not None, reason=REASON or "")
HERE = os.path.dirname(os.path.abspath(cluster.__file__))
PY = sys.executable


@pytest.fixture(scope="module")
def c():
    if REASON:
        pytest.skip(REASON)
    with NamespaceCluster(2) as made:
        yield made


def _root_state():
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return ({line.split(":")[1].strip() for line in links.splitlines()}, netns,
            set(glob.glob(os.path.join(os.environ.get("TMPDIR", "/tmp"), "fastpar-cluster-*"))))


def _alive(pids, inodes):
    """The cluster's processes still alive: the given pids, or any process in one of the
    namespaces."""
    left = [p for p in pids if os.path.exists(f"/proc/{p}")]
    for d in glob.glob("/proc/[0-9]*"):
        for kind in ("net", "ipc", "uts", "pid", "mnt"):
            try:
                if os.stat(f"{d}/ns/{kind}").st_ino in inodes:
                    left.append(int(d[6:]))
            except OSError:
                pass
    return left


def _assert_nothing_left(before, pids, inodes):
    deadline = time.monotonic() + 10
    while _alive(pids, inodes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive(pids, inodes) == []
    assert _root_state() == before


# A harness that makes a cluster, prints its pids and namespaces, then ends as argv[1] says.
# It imports the harness as a file (no torch), as scripts/cluster.sh does.
CHILD = """
import json, os, sys, time
sys.path.insert(0, sys.argv[2])
import cluster
with cluster.NamespaceCluster(2) as c:
    pids = [c._init.pid, c.reaper, *c.pids]
    ns = [os.stat(f"/proc/{p}/ns/{k}").st_ino for p in [c.reaper, *c.pids]
          for k in ("net", "ipc", "uts", "pid", "mnt")]
    root = {os.stat(f"/proc/self/ns/{k}").st_ino for k in ("net", "ipc", "uts", "pid", "mnt")}
    print(json.dumps({"pids": pids, "ns": [i for i in ns if i not in root]}), flush=True)
    if sys.argv[1] == "raise":
        raise RuntimeError("on purpose")
    if sys.argv[1] == "wait":
        time.sleep(60)
"""


@needs_ns
@pytest.mark.parametrize("how", ["normal", "raise", "SIGINT", "SIGTERM", "SIGKILL"])
def test_teardown_leaves_nothing(how):
    before = _root_state()
    p = subprocess.Popen([PY, "-c", CHILD, {"normal": "normal", "raise": "raise"}.get(how, "wait"),
                          HERE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        made = json.loads(p.stdout.readline() or "null")
        assert made, p.communicate(timeout=10)[1]
        # the switch's netns, the cluster's pid namespace, each host's net, ipc, uts, mnt
        assert len(set(made["ns"])) == 10
        if how.startswith("SIG"):
            p.send_signal(getattr(signal, how))
        _, err = p.communicate(timeout=30)
        assert ("on purpose" in err) == (how == "raise")
    finally:
        p.kill()
        p.wait()
    _assert_nothing_left(before, made["pids"], set(made["ns"]))


@needs_ns
def test_hosts_have_names_addresses_routes_and_resolve_each_other(c):
    assert c.names == ["h0", "h1"] and [c.address(i) for i in (0, 1)] == ["10.77.0.1", "10.77.0.2"]
    script = ("hostname; ip -o -4 addr show dev eth0 | awk '{print $4}'; ip route show default; "
              "getent ahostsv4 h0 | head -1; getent ahostsv4 h1 | head -1; "
              "python3 -c 'import socket; print(socket.gethostbyname(socket.gethostname()))'")
    for i in (0, 1):
        out = c.run(i, ["sh", "-c", script], timeout=20).stdout.split("\n")
        assert out[0] == f"h{i}" and out[1] == f"10.77.0.{i + 1}/24"
        assert out[2].startswith("default via 10.77.0.254 dev eth0")
        assert out[3].startswith("10.77.0.1") and out[4].startswith("10.77.0.2")
        assert out[5] == f"10.77.0.{i + 1}"
    # cwd and environment come along
    r = c.run(1, ["sh", "-c", "pwd; echo $FOO"], env={"FOO": "bar"}, cwd="/tmp")
    assert r.stdout.split() == ["/tmp", "bar"]


@needs_ns
def test_each_host_has_its_own_dev_shm_and_talks_over_eth0(c):
    assert c.run(0, ["sh", "-c", "echo x > /dev/shm/fastpar-cluster-probe"]).returncode == 0
    assert c.run(0, ["ls", "/dev/shm"]).stdout.split() == ["fastpar-cluster-probe"]
    assert c.run(1, ["ls", "/dev/shm"]).stdout.split() == []
    assert not os.path.exists("/dev/shm/fastpar-cluster-probe")
    rate = cluster.throughput(c, 1, 0, nbytes=8 << 20)
    assert rate > 1e8, rate


@needs_ns
def test_mpirun_sees_two_hosts_of_two_ranks(c):
    # rank 0 prints for all (the ranks' own lines would interleave in mpirun's output)
    body = ("import socket; from mpi4py import MPI; w = MPI.COMM_WORLD; "
            "n = w.Split_type(MPI.COMM_TYPE_SHARED).Get_size(); s = w.allreduce(w.Get_rank() + 1); "
            "rows = w.gather([w.Get_rank(), socket.gethostname(), n, s]); "
            "w.Get_rank() or print(rows)")
    r = c.mpirun([PY, "-c", body], ppn=2, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str([[0, "h0", 2, 10], [1, "h0", 2, 10],
                                    [2, "h1", 2, 10], [3, "h1", 2, 10]]), r.stdout




@needs_ns
def test_rate_shapes_each_hosts_egress():
    with NamespaceCluster(2, rate="200mbit") as shaped:
        qdisc = shaped.run(0, ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        assert "tbf" in qdisc and "200Mbit" in qdisc, qdisc
        rate = cluster.throughput(shaped, 0, 1, nbytes=4 << 20)
    assert 0.5 * 200e6 < rate < 1.2 * 200e6, rate


def test_the_harness_imports_no_torch_and_checks_its_arguments():
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import cluster; "
            "assert 'torch' not in sys.modules and 'fastpar' not in sys.modules")
    subprocess.run([PY, "-c", code], check=True, timeout=30)
    for args, msg in ((["--hosts", "0"], "--hosts must be 1..250, got 0"),
                      (["--rate", "1gbps"], "rate '1gbps' is not a tc rate"),
                      (["--host", "3"], "--host 3 is not one of the 2 hosts")):
        r = subprocess.run([PY, os.path.join(HERE, "cluster.py"), *args], capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    with pytest.raises(ValueError, match="3 hostnames for 2 hosts"):
        NamespaceCluster(2, hostnames=["a", "b", "c"])
