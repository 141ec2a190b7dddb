"""Rank pools: one long-lived job per (launcher, world size, launch environment) that runs many
test bodies, so the suite pays a launch (imports, MPI_Init, rendezvous: seconds on 2 cores) once
per pool instead of once per test.

    pool = pool_for("mpirun", 4, {})
    launch = pool.run("tests.test_topology:body_check_layouts", {"layouts": [[2, 2]]},
                      env={"FASTPAR_COMM_BACKEND": "shm"}, timeout=120)

Each rank (``tests._rank_worker --pool``) connects to a Unix socket this process listens on and
runs one body per request. ``fastpar.shutdown()``, the environment and torch's global settings
are put back between bodies. A body that raises fails that test alone: the ranks answer and the
pool goes on. A body that does not finish in time, or a rank that dies, ends the pool: the
ranks' stacks are collected (SIGUSR1, faulthandler) into the failure, the job is killed, and the
next body starts a new pool. ``close_all()`` (pytest's session end) ends them all.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time

from tests.multirank import (SESSION_ENV, Launch, launch_command, launch_env,
                             unlink_unmapped)

START_TIMEOUT = 120.0  # seconds for every rank of a new pool to connect

_POOLS: dict[tuple, "RankPool"] = {}


class PoolBroken(Exception):
    """The pool cannot answer: a rank died, hung or never connected (the message says which)."""


class RankPool:
    def __init__(self, launcher: str, nranks: int, env: dict[str, str]):
        self.launcher, self.nranks, self.env = launcher, nranks, env
        self.dir = tempfile.mkdtemp(prefix="fastpar-pool-")
        self.path = os.path.join(self.dir, "sock")
        self.log_path = os.path.join(self.dir, "output.txt")
        self.proc = None
        self.conns: dict[int, socket.socket] = {}
        self.segments: set[str] = set()   # MPICH's segments its ranks mapped: unlinked at the end
        self.made_then: set[str] = set()  # any made while the ranks started
        self.pids: dict[int, int] = {}
        self.bodies = 0
        self.busy = threading.Lock()  # one body at a time: the ranks run one

    # -- life cycle --------------------------------------------------------------------------
    def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        before = set(glob.glob("/dev/shm/mpich_shm_*"))
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(launch_command(self.launcher, self.nranks,
                                                    ["--pool", self.path]),
                                     env=launch_env(self.nranks, self.env, SESSION_ENV),
                                     cwd=_root(),
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT
        try:
            listener.bind(self.path)
            listener.listen(self.nranks)
            while len(self.conns) < self.nranks:
                listener.settimeout(max(0.1, min(1.0, deadline - time.monotonic())))
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise PoolBroken(f"{self.describe()}: only ranks {sorted(self.conns)} "
                                         f"connected (job exit {self.proc.poll()})\n"
                                         + self._tail()) from None
                    continue
                hello = json.loads(conn.makefile("r").readline())
                self.conns[hello["rank"]] = conn
                self.pids[hello["rank"]] = hello["pid"]
            # MPICH's segments of this job: those its ranks map when it ends (_mapped) and any
            # made before they connected; unlinked at the end, since MPICH leaves them behind
            # when its job is killed (and here, at times, when it ends).
            self.made_then |= set(glob.glob("/dev/shm/mpich_shm_*")) - before
        except BaseException:
            self.kill()
            raise
        finally:
            listener.close()

    def close(self) -> None:
        """End the job politely (ranks leave their loop at EOF), or kill it after 30 s."""
        self._mapped()
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        self._cleanup()

    def kill(self) -> None:
        self._mapped()
        # The ranks too: torchrun starts its workers in sessions of their own.
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()
        self._cleanup()

    def _mapped(self) -> None:
        """Add the MPICH segments the ranks map now to those unlinked at the end."""
        for pid in self.pids.values():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    self.segments |= {line.split()[-1] for line in f
                                      if "/dev/shm/mpich_shm_" in line}
            except OSError:  # gone already
                pass

    def _cleanup(self) -> None:
        for path in self.segments:
            with contextlib.suppress(OSError):
                os.unlink(path)
        # made while the ranks started but never seen mapped by them: perhaps another worker's
        unlink_unmapped(self.made_then - self.segments)
        self.segments, self.made_then = set(), set()
        if getattr(self, "log", None) is not None:
            self.log.close()
            self.log = None
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None and len(self.conns) == self.nranks

    # -- bodies --------------------------------------------------------------------------------
    def run(self, target: str, kwargs: dict, env: dict[str, str], timeout: float) -> Launch:
        """Run ``target(**kwargs)`` on every rank; a ``Launch`` with every rank's result. Raises
        ``PoolBroken`` (after killing the pool) when a rank dies or the body outlasts
        ``timeout``."""
        if not self.busy.acquire(blocking=False):
            raise RuntimeError(f"{self.describe()} is running another body: a pool runs one at "
                               "a time (concurrent jobs: run_ranks(..., own_job=True))")
        try:
            return self._run(target, kwargs, env, timeout)
        except PoolBroken:
            raise  # _broken killed it
        except BaseException:
            # Interrupted while the ranks run the body (pytest's timeout, Ctrl-C, a broken
            # socket): the ranks are mid-body and their answer would be read as the next
            # body's. The pool goes.
            self.kill()
            raise
        finally:
            self.busy.release()

    def _run(self, target: str, kwargs: dict, env: dict[str, str], timeout: float) -> Launch:
        start = time.monotonic()
        offset = os.path.getsize(self.log_path)
        self.bodies += 1
        request = (json.dumps({"id": self.bodies, "target": target, "kwargs": kwargs,
                               "env": env}) + "\n").encode()
        for conn in self.conns.values():
            conn.sendall(request)
        results, buffers = {}, {r: b"" for r in self.conns}
        sel = selectors.DefaultSelector()
        for r, conn in self.conns.items():
            sel.register(conn, selectors.EVENT_READ, r)
        try:
            while len(results) < self.nranks:
                left = start + timeout - time.monotonic()
                if left <= 0:
                    self._broken(f"timed out after {timeout:.0f} s", results, start)
                for key, _ in sel.select(timeout=min(left, 1.0)):
                    r = key.data
                    chunk = key.fileobj.recv(1 << 20)
                    if not chunk:
                        self._broken(f"rank {r} died", results, start)
                    buffers[r] += chunk
                    if buffers[r].endswith(b"\n"):
                        answer = json.loads(buffers[r])
                        if answer.pop("id") != self.bodies:  # cannot happen: the pool is killed
                            self._broken(f"rank {r} answered another body", results, start)
                        results[r] = answer
                        sel.unregister(key.fileobj)
                if self.proc.poll() is not None and len(results) < self.nranks:
                    self._broken(f"the job exited ({self.proc.returncode})", results, start)
        finally:
            sel.close()
        return Launch(self.nranks, self.launcher, 0, time.monotonic() - start,
                      self._output(offset), results, dict(self.pids))

    def _broken(self, why: str, results: dict, start: float):
        """Collect the stacks of the ranks still in the body, kill the pool, raise."""
        waiting = [r for r in range(self.nranks) if r not in results]
        for r in waiting:
            try:
                os.kill(self.pids[r], signal.SIGUSR1)
            except (ProcessLookupError, KeyError):
                pass
        time.sleep(1.0)
        stacks = []
        for r in waiting:
            try:
                with open(f"{self.path}.stacks{r}") as f:
                    text = f.read()
            except OSError:
                text = ""
            stacks.append(f"--- rank {r} (pid {self.pids.get(r)}) stacks ---\n"
                          f"{text.strip() or '(none: the process is gone)'}")
        output = self._tail()
        self.kill()
        failed = [f"--- rank {r} failed ---\n{res.get('traceback', '')}"
                  for r, res in sorted(results.items()) if not res["ok"]]
        raise PoolBroken(f"{self.describe()} {why} ({time.monotonic() - start:.1f} s); ranks "
                         f"that never finished: {waiting}\n" + "\n".join(failed + stacks)
                         + "\n--- pool output (tail) ---\n" + output)

    def describe(self) -> str:
        env = f" env {self.env}" if self.env else ""
        return f"{self.launcher} pool of {self.nranks} ranks{env} (body {self.bodies})"

    def _output(self, offset: int) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            f.seek(offset)
            return f.read()

    def _tail(self) -> str:
        try:
            return self._output(0)[-4000:]
        except (OSError, ValueError, AttributeError):
            return ""


def _root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pool_for(launcher: str, nranks: int, env: dict[str, str]) -> RankPool:
    """The live pool for this key, started on first use (or after the last one broke)."""
    key = (launcher, nranks, tuple(sorted(env.items())))
    pool = _POOLS.get(key)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.kill()
        pool = _POOLS[key] = RankPool(launcher, nranks, env)
        pool.start()
    return pool


def close_all() -> None:
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()
