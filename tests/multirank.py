"""Run a test body on N ranks under a real launcher and collect every rank's result.

    from tests.multirank import run_ranks
    launch = run_ranks(4, "tests.test_topology:body_check_layouts", layouts=[[2, 2]])  # mpirun
    launch = run_ranks(2, body_autograd, launcher="torchrun", tp=2, seed=0)
    launch.values()            # every rank's return value, in rank order

A body is a module-level function ``body(**kwargs)`` in an importable module; each rank calls it
and its JSON-serialisable return value is collected. ``run_ranks`` raises ``RankFailure`` showing
each failed rank's traceback, or, on the per-launch timeout, kills the whole job and names the
ranks that never finished. Launching 4 Python+torch processes costs seconds on 2 cores, so a body
should group several checks.

Pass ``check=False`` to get the ``Launch`` back even when ranks fail (for tests of failures).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)  # the venv's mpirun and torchrun live beside its python


class RankFailure(AssertionError):
    pass


@dataclasses.dataclass
class Launch:
    """The outcome of one launch: per-rank results, the job's exit status and output."""

    nranks: int
    launcher: str
    returncode: int | None  # None when the job was killed on timeout
    elapsed: float
    output: str
    results: dict[int, dict]  # rank -> {"ok": bool, "value": ..., "error": str, "traceback": str}

    @property
    def missing(self) -> list[int]:
        return [r for r in range(self.nranks) if r not in self.results]

    @property
    def failed(self) -> list[int]:
        return [r for r, res in sorted(self.results.items()) if not res["ok"]]

    def values(self) -> list[Any]:
        return [self.results[r]["value"] for r in range(self.nranks)]

    def describe(self) -> str:
        lines = [f"{self.launcher} launch of {self.nranks} ranks: exit {self.returncode}, "
                 f"{self.elapsed:.1f} s"]
        if self.missing:
            lines.append(f"ranks that never finished: {self.missing}")
        for r in self.failed:
            lines.append(f"--- rank {r} failed ---\n{self.results[r]['traceback'].rstrip()}")
        lines.append("--- job output (tail) ---\n" + self.output[-4000:])
        return "\n".join(lines)


def _target_name(body: str | Callable) -> str:
    if isinstance(body, str):
        return body
    return f"{body.__module__}:{body.__qualname__}"


def _command(launcher: str, nranks: int, worker_args: list[str]) -> list[str]:
    if launcher == "mpirun":
        return [os.path.join(BIN, "mpirun"), "-np", str(nranks), sys.executable, "-m",
                "tests._rank_worker", *worker_args]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nranks}", "--no-python", sys.executable, "-m",
                "tests._rank_worker", *worker_args]
    if launcher == "plain" and nranks == 1:
        return [sys.executable, "-m", "tests._rank_worker", *worker_args]
    raise ValueError(f"launcher must be 'mpirun', 'torchrun' or 'plain' (1 rank), got "
                     f"{launcher!r} with {nranks} ranks")


@contextlib.contextmanager
def mpich_segments_removed():
    """Remove the /dev/shm segments MPICH creates inside the block: MPICH unlinks its own segment
    only in MPI_Finalize, so a killed, aborted or failed job (tests of failures do this on
    purpose) would leave ~3 MB behind per launch."""
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    try:
        yield
    finally:
        for path in set(glob.glob("/dev/shm/mpich_shm_*")) - before:
            with contextlib.suppress(OSError):
                os.unlink(path)


def run_ranks(nranks: int, body: str | Callable, *, launcher: str = "mpirun",
              timeout: float = 120.0, env: dict | None = None, check: bool = True,
              **kwargs) -> Launch:
    """Run ``body(**kwargs)`` on ``nranks`` ranks; see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="fastpar-ranks-") as outdir:
        args = [outdir, _target_name(body), json.dumps(kwargs)]
        # One intra-op thread per rank unless the caller's environment says otherwise
        # (OMP_NUM_THREADS=2 bash scripts/test.sh runs every rank's kernels on two threads).
        full_env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        if nranks > (os.cpu_count() or 1):
            # More ranks than cores: MPICH's busy-polling ranks would starve the working ones
            # (100 s instead of 5 s for the collective tests); make them sleep when idle.
            full_env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
        out = open(os.path.join(outdir, "output.txt"), "w+")
        start = time.monotonic()
        with mpich_segments_removed():
            proc = subprocess.Popen(_command(launcher, nranks, args), cwd=ROOT, env=full_env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                returncode = None
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        elapsed = time.monotonic() - start
        out.seek(0)
        output = out.read()
        out.close()
        results = {}
        for r in range(nranks):
            path = os.path.join(outdir, f"rank{r}.json")
            if os.path.exists(path):
                with open(path) as f:
                    results[r] = json.load(f)
    launch = Launch(nranks, launcher, returncode, elapsed, output, results)
    if check and (returncode != 0 or launch.missing or launch.failed):
        why = "timed out after %.0f s" % timeout if returncode is None else "failed"
        raise RankFailure(f"{why}: {launch.describe()}")
    return launch


def body_each(target: str, cases: list[dict]) -> list:
    """``target(**case)`` (a body's "module:name") for each case in turn on this rank, ``fastpar.shutdown()`` after each
    (so cases may init different layouts); the list of values."""
    import importlib

    import fastpar

    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    values = []
    for case in cases:
        try:
            values.append(fn(**case))
        finally:
            fastpar.shutdown()
    return values


class PerWorld:
    """Parametrized layouts of one world size share a launch (a launch costs seconds):

        runs = PerWorld(body, {4: [dict(tp=4, seed=1), dict(tp=2, seed=2)], 2: [...]})
        values = runs(4, tp=2, seed=2)     # every rank's body(tp=2, seed=2), in rank order

    The first call for a world size launches all of its cases (``body_each``); a failing case
    fails that launch, so every test of that size reports it."""

    def __init__(self, body, cases: dict[int, list[dict]], **launch_kwargs):
        self.body, self.cases, self.launch_kwargs = _target_name(body), cases, launch_kwargs
        self.values: dict[int, list] = {}

    def __call__(self, world: int, **case) -> list:
        if world not in self.values:
            self.values[world] = run_ranks(world, body_each, target=self.body,
                                           cases=self.cases[world], **self.launch_kwargs).values()
        index = self.cases[world].index(case)
        return [v[index] for v in self.values[world]]


def count_calls(cls, *names: str) -> dict[str, int]:
    """Wrap methods ``names`` of ``cls`` in this process so each call is counted (and passed
    through): how a rank body checks which kernel a collective took. Returns the live counts."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        def counted(self, *args, _real=getattr(cls, name), _name=name, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)
        setattr(cls, name, counted)
    return counts


def segments_of(pids) -> set[str]:
    """fastpar's segments in /dev/shm created by one of ``pids`` (their names carry the
    creator's pid: ``fastpar-<pid>-...``, ``fastpar-p2p-<pid>-...``), so that a check for
    leftovers ignores other jobs running beside the test."""
    import re

    pids = {str(p) for p in pids}
    found = set()
    for path in glob.glob("/dev/shm/fastpar-*"):
        m = re.match(r"fastpar-(?:p2p-)?(\d+)-", os.path.basename(path))
        if m and m.group(1) in pids:
            found.add(path)
    return found


def cut_short_during_setup(code: str, tmp_path, act, keep=lambda path: True):
    """Run ``code`` under ``mpirun -np 2``; it must write each rank's pid to ``tmp_path/pid<r>``
    and then stall inside a segment's set-up. Once a segment of this job (``keep(path)``) is
    in /dev/shm and rank 1 has written its pid, ``act(proc)`` ends the job (a signal to the
    launcher or a rank). Returns ``(segments seen, segments left 0.5 s after the end, output)``."""
    import time

    before = set(glob.glob("/dev/shm/fastpar-*"))

    def ours():  # this job's segments only (other jobs may run beside the test)
        pids = [(tmp_path / f"pid{r}").read_text() for r in (0, 1)
                if (tmp_path / f"pid{r}").exists()]
        return {p for p in segments_of(pids) - before if keep(p)}

    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    with mpich_segments_removed():
        proc = subprocess.Popen([os.path.join(BIN, "mpirun"), "-np", "2", sys.executable, "-c",
                                 code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not ours() or not (tmp_path / "pid1").exists()):
            time.sleep(0.05)
        pending = ours()
        act(proc)
        try:
            output = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            output = proc.communicate()[0]
    time.sleep(0.5)
    return pending, ours(), output
