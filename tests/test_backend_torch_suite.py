"""PyTorch's own distributed test base on the fastpar backend, a subset CI runs (about 25 s):
one test of each kind of operation the base runs on CPU at world size 2, with gloo's
expectations (``BACKEND=fastpar-as-gloo``: every group the base makes is a fastpar group).
The whole runs' counts for fastpar and gloo, and every test that differs: docs/backend.md."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET

from tests.multirank import ROOT

# One test of each kind of operation (each spawns its own two processes, ~4 s here): the async,
# object, rooted (reduce, gather), barrier, sparse and DDP-hook variants (and the plain all-reduce
# beside the coalesced one) ran too until the suite's time mattered; they pass (the whole runs:
# docs/backend.md) and fastpar's own tests cover them.
SUBSET = [
    "test_all_reduce_coalesced_min", "test_broadcast", "test_all_gather", "test_scatter",
    "test_send_recv_any_source", "test_DistributedDataParallelCPU",
]


def test_pytorch_distributed_test_base_subset_on_fastpar(tmp_path):
    report = tmp_path / "junit.xml"
    ids = [f"tests/torch_dist_suite.py::TestDistBackendWithSpawn::{name}" for name in SUBSET]
    env = {**os.environ, "BACKEND": "fastpar-as-gloo", "WORLD_SIZE": "2"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", f"--junitxml={report}", *ids],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    cases = {tc.get("name"): [c.tag for c in tc] for tc in ET.parse(report).iter("testcase")}
    assert sorted(cases) == sorted(SUBSET), proc.stdout[-3000:]
    bad = {name: tags for name, tags in cases.items() if tags}  # failure, error or skipped
    assert not bad, f"{bad}\n{proc.stdout[-5000:]}"
