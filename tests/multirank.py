"""Run a test body on N ranks under a real launcher and collect every rank's result.

    from tests.multirank import run_ranks
    launch = run_ranks(4, "tests.test_topology:body_check_layouts", layouts=[[2, 2]])  # mpirun
    launch = run_ranks(2, body_autograd, launcher="torchrun", tp=2, seed=0)
    launch.values()            # every rank's return value, in rank order

A body is a module-level function ``body(**kwargs)`` in an importable module; each rank calls it
and its JSON-serialisable return value is collected. ``run_ranks`` raises ``RankFailure`` showing
each failed rank's traceback, or, on the timeout, the stacks of the ranks that never finished.

Bodies run in a rank pool (``tests.rank_pool``): one job per (launcher, world size, launch
environment) serves every body of the pytest process (each pytest-xdist worker has its own),
with ``fastpar.shutdown()`` and the environment put back between bodies, so a test costs its
body and not a launch. A test of how a job ends (killed ranks, aborts, exit statuses, output)
needs a job of its own: ``own_job=True``, or ``check=False`` to get the ``Launch`` back even
when ranks fail. ``launch(argv, ...)`` runs a command line (the trainer, a bench, ``fastpar
info``) as its own job.
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


# Libraries the bodies use (transformers) never reach for the network, and every rank pool
# shares these (a body's own environment would need a pool of its own: read at import).
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

# fastpar's variables that it reads when a body runs (at init or at a call), never at import:
# a rank pool sets them per body. Any other variable of env= is read at process start (MPICH's,
# OpenMP's, FASTPAR_TRITON_AUTOTUNE at import): such a launch gets a pool of its own.
PER_BODY_ENV = {"FASTPAR_COMM_BACKEND", "FASTPAR_BIND", "FASTPAR_SYMMETRIC", "FASTPAR_CUDA_IPC",
                "FASTPAR_CUDA_IPC_ALGO", "FASTPAR_SIGNAL_OVERLAP", "FASTPAR_SHARED_GPU",
                "FASTPAR_TRACE", "FASTPAR_MASTER_ADDR", "FASTPAR_MASTER_PORT", "FASTPAR_DEBUG",
                "FASTPAR_HOST_ID", "FASTPAR_SOCKET_IFNAME"}
# The environment pools start from: this process's as the session began, so that a test's
# monkeypatched variable does not become part of a pool that later tests share.
SESSION_ENV = dict(os.environ)


class RankFailure(AssertionError):
    pass


@dataclasses.dataclass
class Launch:
    """The outcome of one launch: per-rank results, the job's exit status and output."""

    nranks: int
    launcher: str
    returncode: int | None  # None when the job was killed on timeout
    elapsed: float
    output: str  # a pool body: the pool's output while it ran (forwarded late: a neighbour's too)
    results: dict[int, dict]  # rank -> {"ok": bool, "value": ..., "error": str, "traceback": str}
    pids: dict[int, int] = dataclasses.field(default_factory=dict)  # rank -> pid, of those started

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


@contextlib.contextmanager
def mpich_segments_removed():
    """Remove the /dev/shm segments MPICH creates inside the block: MPICH unlinks its own segment
    only in MPI_Finalize. fastpar.init removes its name once every local rank maps it, and
    MPI_Init's watchdog before it ends a rank (runtime/mpich_shm.py), but a job killed before
    either (tests of failures do this on purpose), or one that never calls fastpar.init, would
    leave 1-4 MB behind per launch. The tests of that removal launch without this block."""
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    try:
        yield
    finally:
        unlink_unmapped(set(glob.glob("/dev/shm/mpich_shm_*")) - before)


def unlink_unmapped(paths, grace: float = 2.0) -> None:
    """Unlink MPICH's segments ``paths`` once no live process maps them or holds them open. A
    killed job's ranks may take a moment to die (``grace`` seconds are given); a job of another
    pytest-xdist worker, running beside this test, keeps its own (MPICH names its segments at
    random, so the creator cannot be told from the name; between shm_open and mmap its
    creator holds it open)."""
    left = {p for p in paths if os.path.exists(p)}
    deadline = time.monotonic() + grace
    while left:
        used = _mpich_segments_in_use()
        for path in left - used:
            with contextlib.suppress(OSError):
                os.unlink(path)
        left &= used
        if not left or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _mpich_segments_in_use() -> set[str]:
    used = set()
    for proc in glob.glob("/proc/[0-9]*"):
        with contextlib.suppress(OSError), open(f"{proc}/maps") as f:
            used |= {line.split()[-1] for line in f if "/dev/shm/mpich_shm_" in line}
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"{proc}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"{proc}/fd/{fd}")
                    if target.startswith("/dev/shm/mpich_shm_"):
                        used.add(target)
    return used


def launch_command(launcher: str, nranks: int, worker_args: list[str]) -> list[str]:
    """The command line that starts ``tests._rank_worker`` on ``nranks`` ranks."""
    return launch_argv(launcher, nranks, [sys.executable, "-m", "tests._rank_worker",
                                          *worker_args])


def launch_argv(launcher: str, nranks: int, argv: list[str]) -> list[str]:
    """``argv`` (a program and its arguments) started on ``nranks`` ranks by ``launcher``:
    ``mpirun`` (MPICH's Hydra from the venv), ``torchrun`` (standalone), or ``plain`` (1 rank,
    no launcher)."""
    if launcher == "mpirun":
        return [os.path.join(BIN, "mpirun"), "-np", str(nranks), *argv]
    if launcher == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc-per-node={nranks}", "--no-python", *argv]
    if launcher == "plain" and nranks == 1:
        return list(argv)
    raise ValueError(f"launcher must be 'mpirun', 'torchrun' or 'plain' (1 rank), got "
                     f"{launcher!r} with {nranks} ranks")


def launch_env(nranks: int = 1, env: dict | None = None,
               base: dict | None = None) -> dict[str, str]:
    """The environment of every process a test starts: ``base`` (default: this process's),
    with the repository on PYTHONPATH, one intra-op thread per rank unless that environment
    says otherwise (``OMP_NUM_THREADS=2 bash scripts/test.sh`` runs every rank's kernels on two
    threads), and ``env`` on top."""
    base = os.environ if base is None else base
    full = {**OFFLINE, **base, "PYTHONPATH": ROOT + os.pathsep + base.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1"), **(env or {})}
    if nranks > (os.cpu_count() or 1):
        # More ranks than cores: MPICH's busy-polling ranks would starve the working ones
        # (100 s instead of 5 s for the collective tests); make them sleep when idle.
        full.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    return full


def launch(argv: list[str], *, nranks: int = 1, launcher: str = "plain", env: dict | None = None,
           timeout: float = 120.0, **popen) -> subprocess.CompletedProcess:
    """Run a program (``[sys.executable, "-m", "fastpar.train", ...]``) as its own job under
    ``launcher`` and wait for it: the tests of command lines, exit statuses and whole jobs.
    Output is captured as text; MPICH's segments of a job that did not finalise are removed."""
    with mpich_segments_removed():
        return subprocess.run(launch_argv(launcher, nranks, argv), cwd=ROOT,
                              env=launch_env(nranks, env), capture_output=True, text=True,
                              stdin=subprocess.DEVNULL, timeout=timeout, **popen)


def run_ranks(nranks: int, body: str | Callable, *, launcher: str = "mpirun",
              timeout: float = 120.0, env: dict | None = None, check: bool = True,
              own_job: bool = False, **kwargs) -> Launch:
    """Run ``body(**kwargs)`` on ``nranks`` ranks; see the module docstring."""
    target = _target_name(body)
    if check and not own_job:
        from tests import rank_pool

        per_body = {k: v for k, v in (env or {}).items() if k in PER_BODY_ENV}
        at_start = {k: v for k, v in (env or {}).items() if k not in per_body}
        try:
            launch = rank_pool.pool_for(launcher, nranks, at_start).run(target, kwargs,
                                                                         per_body, timeout)
        except rank_pool.PoolBroken as exc:
            raise RankFailure(str(exc)) from None
    else:
        launch = _own_job(nranks, target, launcher, timeout, env, kwargs)
    if check and (launch.returncode != 0 or launch.missing or launch.failed):
        why = "timed out after %.0f s" % timeout if launch.returncode is None else "failed"
        raise RankFailure(f"{why}: {launch.describe()}")
    return launch


def run_script(nranks: int, script: str, *args: str, timeout: float = 180.0,
               env: dict | None = None) -> list[str]:
    """Run ``python script args...`` (a path under the repository, e.g. a bench) as the
    ``__main__`` of every rank of a rank pool, as ``mpirun -np nranks python script ...`` would;
    every rank's standard output, in rank order. A non-zero ``sys.exit`` fails the test."""
    return run_ranks(nranks, body_script, script=script, args=list(args), timeout=timeout,
                     env=env).values()


def body_script(script: str, args: list[str]) -> str:
    import contextlib
    import io
    import runpy

    out = io.StringIO()
    argv, path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    full = os.path.join(ROOT, script)
    sys.path.insert(0, os.path.dirname(full))  # as `python script`: its helpers import
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(full, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            raise AssertionError(f"{script} exited with {exc.code!r}; its output:\n"
                                 f"{out.getvalue()[-3000:]}") from None
    finally:
        sys.argv, sys.path[:] = argv, path
    return out.getvalue()


def run_command(nranks: int, module: str, *argv: str, timeout: float = 240.0) -> list:
    """``python -m module argv...`` (one of fastpar's commands: ``module.main(argv)``) on every
    rank of a rank pool, as ``mpirun -np nranks python -m module ...`` would, without a launch
    of its own: each rank's ``[exit status, standard error]`` in rank order (a bad flag's
    ``SystemExit`` is its status)."""
    return run_ranks(nranks, body_command, module=module, argv=list(argv),
                     timeout=timeout).values()


def body_command(module: str, argv: list[str]) -> list:
    import contextlib
    import importlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = importlib.import_module(module).main(argv)
        except SystemExit as exc:
            code = exc.code
    return [code, err.getvalue()]


def _own_job(nranks, target, launcher, timeout, env, kwargs) -> Launch:
    with tempfile.TemporaryDirectory(prefix="fastpar-ranks-") as outdir:
        args = [outdir, target, json.dumps(kwargs)]
        out = open(os.path.join(outdir, "output.txt"), "w+")
        start = time.monotonic()
        with mpich_segments_removed():
            proc = subprocess.Popen(launch_command(launcher, nranks, args), cwd=ROOT,
                                    env=launch_env(nranks, env), stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
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
        results, pids = read_results(outdir, nranks), read_pids(outdir, nranks)
    return Launch(nranks, launcher, returncode, elapsed, output, results, pids)


def read_results(outdir: str, nranks: int) -> dict[int, dict]:
    """``{rank: result}`` of the ranks of a one-body launch that wrote ``OUTDIR/rank<r>.json``."""
    results = {}
    for r in range(nranks):
        path = os.path.join(outdir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[r] = json.load(f)
    return results


def read_pids(outdir: str, nranks: int) -> dict[int, int]:
    """``{rank: pid}`` of the ranks of a one-body launch that started (``OUTDIR/pid<r>``)."""
    pids = {}
    for r in range(nranks):
        with contextlib.suppress(OSError, ValueError), open(os.path.join(outdir, f"pid{r}")) as f:
            pids[r] = int(f.read())
    return pids


def late_until(store, key: str, limit: float) -> None:
    """A rank that must stay away from a call until its peer has given up on it: wait until
    the peer sets ``key`` in the job's store (``topo.store``), or ``limit`` seconds. Cheaper
    than sleeping the peer's timeout plus a margin for a loaded machine, and as sure. A store
    that stops answering counts as the word: under mpirun it lives in rank 0, which may end
    its body (and the store) as soon as it has set the key. ``key`` must be new to the store
    (a torchrun pool's agent keeps one store for every body): the test passes a fresh one."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            if store.check([key]):
                return
        except Exception:  # noqa: BLE001 - the store's host ended its body: it gave up
            return
        time.sleep(0.05)


def count_calls(cls, *names: str) -> dict[str, int]:
    """Wrap methods ``names`` of ``cls`` in this process so each call is counted (and passed
    through): how a rank body checks which kernel a collective took. Returns the live counts.
    Counting again (the next body of a rank pool) replaces the earlier counter."""
    counts = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(cls, name)
        real = getattr(real, "__wrapped__", real)  # a rank pool's earlier body counted it too

        def counted(self, *args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(self, *args, **kwargs)
        counted.__wrapped__ = real
        setattr(cls, name, counted)
    return counts


def segments_of(pids, paths=None) -> set[str]:
    """fastpar's segments in /dev/shm (or among ``paths``) created by one of ``pids`` (their
    names carry the creator's pid after any tags: ``fastpar-[p2p-|sym-|slots-...]<pid>-...``),
    so that a check for leftovers ignores other jobs running beside the test."""
    import re

    pids = {str(p) for p in pids}
    found = set()
    for path in glob.glob("/dev/shm/fastpar-*") if paths is None else paths:
        m = re.match(r"fastpar-(?:[a-z][a-z0-9]*-)*(\d+)-", os.path.basename(path))
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

    with mpich_segments_removed():
        proc = subprocess.Popen(launch_argv("mpirun", 2, [sys.executable, "-c", code]),
                                env=launch_env(2), cwd=ROOT, stdout=subprocess.PIPE,
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
