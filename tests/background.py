"""Compile-and-run checks that need no rank and no torch state (nvcc, the C++ self-test), started
when collection ends so they run beside the first tests instead of after them.

A test module lists its jobs in ``BACKGROUND_JOBS(workdir) -> {name: argv or reason}`` (a string
is why the job cannot run here: the test skips with it). ``conftest.pytest_collection_finish``
starts the jobs of every selected module at ``nice`` 10, so the multi-rank tests they overlap keep
the cores first. A test calls ``result(module, name)``: it waits for its job (starting it first if
the module was not collected through the hook) and returns what it did.

Under pytest-xdist every worker collects every module, but each job runs once: the first worker
to claim it (a file made with O_EXCL in the run's shared directory, ``FASTPAR_TEST_SHARED``, which
conftest makes before the workers start) starts it; the job's shell writes its output and exit
status there, and whichever worker runs the test reads them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time

SHARED_ENV = "FASTPAR_TEST_SHARED"  # the run's directory, shared by pytest-xdist's workers
_OWN_SHARED: list[str] = []         # made here (no controller made one): removed at close
_STARTED: dict[str, subprocess.Popen] = {}  # jobs this process started, by key
_DECLARED: dict[str, dict] = {}  # module name -> its BACKGROUND_JOBS(...), as this process asked


@dataclasses.dataclass
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str

    def describe(self) -> str:
        return (f"`{' '.join(self.argv)}` exited {self.returncode}:\n"
                f"{self.stdout[-3000:]}\n{self.stderr[-3000:]}")


def shared_dir() -> str:
    """The run's shared directory: the controller's (``FASTPAR_TEST_SHARED``) or one of this
    process's own."""
    path = os.environ.get(SHARED_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="fastpar-tests-")
        os.environ[SHARED_ENV] = path
        _OWN_SHARED.append(path)
    return path


def _prefix(module_name: str) -> str:
    """Where the module's jobs' files (claim, output, exit status) lie: shared by the workers."""
    where = os.path.join(shared_dir(), "background")
    os.makedirs(where, exist_ok=True)
    return os.path.join(where, module_name.rsplit(".", 1)[-1] + "-")


def _declared(module) -> dict:
    """The module's ``BACKGROUND_JOBS``, asked once per process, with a work directory of this
    process's own (it may write files there: it runs in every worker)."""
    key = module.__name__
    if key not in _DECLARED:
        declare = getattr(module, "BACKGROUND_JOBS", None)
        where = os.path.join(shared_dir(), "work", f"{key.rsplit('.', 1)[-1]}-{os.getpid()}")
        if declare is not None:
            os.makedirs(where, exist_ok=True)
        _DECLARED[key] = {} if declare is None else declare(where)
    return _DECLARED[key]


def start_module(module) -> None:
    """Start every job ``module`` declares that no process of this run has claimed yet."""
    prefix = _prefix(module.__name__)
    for name, argv in _declared(module).items():
        if isinstance(argv, str):
            continue
        try:
            os.close(os.open(prefix + name + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue  # another worker runs it
        with open(prefix + name + ".argv", "w") as f:  # what ran, for a reader's message
            json.dump(list(argv), f)
        base = shlex.quote(prefix + name)
        # the shell writes the exit status last (renamed into place): a reader that finds it
        # finds the output complete
        script = (f'"$@" >{base}.out 2>{base}.err; echo $? >{base}.rc.tmp; '
                  f"mv {base}.rc.tmp {base}.rc")
        _STARTED[prefix + name] = subprocess.Popen(
            ["nice", "-n", "10", "sh", "-c", script, "sh", *argv],
            stdin=subprocess.DEVNULL, start_new_session=True)


def result(module, name: str, timeout: float = 300.0) -> Result | str:
    """What job ``name`` of ``module`` did, or the reason it could not run (a string)."""
    argv = _declared(module)[name]
    if isinstance(argv, str):
        return argv
    start_module(module)
    base = _prefix(module.__name__) + name
    deadline = time.monotonic() + timeout
    while not os.path.exists(base + ".rc"):
        if time.monotonic() > deadline:
            _stop(base)  # if this process started it; else its starter ends it at close
            return Result(argv, -1, _read(base + ".out"),
                          _read(base + ".err") + f"\n(still running after {timeout:.0f} s)")
        time.sleep(0.2)
    with contextlib.suppress(OSError):  # read: its starter need not wait for it at close
        os.close(os.open(base + ".read", os.O_CREAT | os.O_WRONLY))
    with contextlib.suppress(OSError, ValueError), open(base + ".argv") as f:
        argv = json.load(f)
    return Result(argv, int(_read(base + ".rc").strip() or -1), _read(base + ".out"),
                  _read(base + ".err"))


def _read(path: str) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return f.read()
    return ""


def _stop(key: str) -> None:
    proc = _STARTED.get(key)
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def close_all(interrupted: bool = False, wait: float = 600.0) -> None:
    """End the jobs this process started. A pytest-xdist worker's job that no test has read
    yet may be another worker's to read: unless the session was interrupted, it is waited for
    (up to ``wait`` seconds). Anything else still running is killed at once (one process, a
    session stopped early, ``--collect-only``). The shared directory goes with the process
    that made it."""
    worker = bool(os.environ.get("PYTEST_XDIST_WORKER"))
    deadline = time.monotonic() + (wait if worker and not interrupted else 0)
    for key, proc in _STARTED.items():
        if worker and not interrupted and not os.path.exists(key + ".read"):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        _stop(key)
    _STARTED.clear()
    _DECLARED.clear()
    while _OWN_SHARED:
        shutil.rmtree(_OWN_SHARED.pop(), ignore_errors=True)
