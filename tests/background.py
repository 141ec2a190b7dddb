"""Compile-and-run checks that need no rank and no torch state (nvcc, the C++ self-test), started
when collection ends so they run beside the first tests instead of after them.

A test module lists its jobs in ``BACKGROUND_JOBS(workdir) -> {name: argv or reason}`` (a string
is why the job cannot run here: the test skips with it). ``conftest.pytest_collection_finish``
starts the jobs of every selected module at ``nice`` 10, so the multi-rank tests they overlap keep
the cores first; the suite spends about a third of its time waiting on peers, timeouts and
launches, which is when these run. A test calls ``result(module, name)``: it waits for its job
(starting it first if the module was not collected through the hook) and returns what it did.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile

_WORKDIR: list[str] = []
_JOBS: dict[tuple[str, str], "Job"] = {}


@dataclasses.dataclass
class Job:
    argv: list[str] | str  # a string: why this job cannot run here
    proc: subprocess.Popen | None = None
    done: "Result | None" = None

    def start(self) -> None:
        if isinstance(self.argv, str) or self.proc is not None:
            return
        self.proc = subprocess.Popen(["nice", "-n", "10", *self.argv], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)


@dataclasses.dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (f"`{' '.join(self.argv)}` exited {self.returncode}:\n"
                f"{self.stdout[-3000:]}\n{self.stderr[-3000:]}")


def workdir() -> str:
    if not _WORKDIR:
        _WORKDIR.append(tempfile.mkdtemp(prefix="fastpar-background-"))
    return _WORKDIR[0]


def start_module(module) -> None:
    """Start every job ``module`` declares (once per session)."""
    declare = getattr(module, "BACKGROUND_JOBS", None)
    if declare is None or any(key[0] == module.__name__ for key in _JOBS):
        return
    where = os.path.join(workdir(), module.__name__.rsplit(".", 1)[-1])
    os.makedirs(where, exist_ok=True)
    for name, argv in declare(where).items():
        job = _JOBS[(module.__name__, name)] = Job(argv)
        job.start()


def result(module, name: str, timeout: float = 300.0) -> Result | str:
    """What job ``name`` of ``module`` did, or the reason it could not run (a string)."""
    start_module(module)
    job = _JOBS[(module.__name__, name)]
    if isinstance(job.argv, str):
        return job.argv
    if job.done is None:
        try:
            out, err = job.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.proc.kill()
            out, err = job.proc.communicate()
            err += f"\n(killed: still running after {timeout:.0f} s)"
        job.done = Result(job.argv, job.proc.returncode, out, err)
    return job.done


def close_all() -> None:
    """Kill what still runs (a session cut short) and remove the work directory."""
    for job in _JOBS.values():
        if job.proc is not None and job.proc.poll() is None:
            job.proc.kill()
            job.proc.communicate()
    _JOBS.clear()
    while _WORKDIR:
        shutil.rmtree(_WORKDIR.pop(), ignore_errors=True)
