"""The low-level bits of ``fastpar.testing.cluster``: namespace holders that die with the harness,
pids across pid namespaces, ``nsenter`` command lines. Standard library only (no torch).

Every namespace here is held by a process, never by a bind mount (``ip netns add``), so it goes
away when its last process does. The holders get ``PR_SET_PDEATHSIG=SIGKILL`` in the child
between fork and exec, which the kernel ties to the *thread* that forked: they are started from
the thread that made the cluster (tests and the CLI make it on the main thread).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time

TOOLS = ("ip", "unshare", "nsenter", "setpriv", "tc", "mount")
HOST_NS = ("-u", "-n", "-m", "-i")       # nsenter flags: a host's UTS, net, mount and IPC namespaces
PR_SET_PDEATHSIG = 1

# pid 1 of the cluster's pid namespace: reaps every orphan of every host; SIGTERM ends it (and so
# the kernel kills every process of the cluster).
REAPER = """
import os, signal
signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
signal.signal(signal.SIGCHLD, lambda *a: None)
while True:
    try:
        os.wait()
    except ChildProcessError:
        signal.pause()
"""


def die_with_parent():
    """preexec_fn: SIGKILL this child when the thread that forked it ends."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def spawn(argv: list[str]) -> subprocess.Popen:
    """Start a holder: no terminal input, its own process group (Ctrl-C reaches the harness only,
    which then tears down in order), killed if the harness dies."""
    return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, preexec_fn=die_with_parent,
                            start_new_session=True)


def child_of(proc: subprocess.Popen, what: str, timeout: float = 5.0) -> int:
    """The pid (in our namespace) of the one child ``proc`` forks (``unshare --fork``,
    ``nsenter -p``)."""
    path = f"/proc/{proc.pid}/task/{proc.pid}/children"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            raise RuntimeError(f"cluster: {what} exited with status {proc.returncode}: {err}")
        try:
            kids = open(path).read().split()
        except FileNotFoundError:
            kids = []
        if kids:
            return int(kids[0])
        time.sleep(0.005)
    raise RuntimeError(f"cluster: {what} (pid {proc.pid}) forked no child in {timeout} s")


def inner_pid(pid: int) -> int:
    """``pid``'s number in its own (innermost) pid namespace."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    raise RuntimeError(f"cluster: no NSpid line in /proc/{pid}/status (kernel too old?)")


def wait_exec(pid: int, comm: str, timeout: float = 5.0) -> None:
    """Wait until ``pid`` runs ``comm`` (so the namespaces ``unshare`` makes before exec exist)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if open(f"/proc/{pid}/comm").read().strip() == comm:
                return
        except FileNotFoundError:
            break
        time.sleep(0.005)
    raise RuntimeError(f"cluster: process {pid} did not start {comm!r} in {timeout} s")


def enter(pid: int, argv: list[str], *, cwd: str | None = None, pid_ns: bool = True) -> list[str]:
    """argv that runs ``argv`` in the host whose holder is ``pid``. With ``pid_ns``, nsenter forks
    into the cluster's pid namespace and ``setpriv`` kills the command when nsenter dies."""
    wd = [f"--wd={cwd or os.getcwd()}"]
    if not pid_ns:
        return ["nsenter", "-t", str(pid), *HOST_NS, *wd, "--", *argv]
    return ["nsenter", "-t", str(pid), *HOST_NS, "-p", *wd, "--",
            "setpriv", "--pdeathsig", "KILL", "--", *argv]


def sh(pid: int | None, script: str, what: str, *, net_only: bool = False) -> None:
    """Run a shell script in a host (or, with ``net_only``, only in ``pid``'s network namespace);
    a failure names the step."""
    flags = ["-n"] if net_only else list(HOST_NS)
    r = subprocess.run(["nsenter", "-t", str(pid), *flags, "--", "sh", "-ec", script],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"cluster: {what} failed (status {r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()}")


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill(proc: subprocess.Popen | None, grace: float = 0.0) -> None:
    """Reap a holder, SIGKILLing it (and its process group) if it has not exited within
    ``grace`` seconds."""
    if proc is None:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if proc.stderr:
        proc.stderr.close()


_REASON: list[str | None] = []


def unavailable() -> str | None:
    """None when this machine can make a cluster, else why not (cached for the process)."""
    if _REASON:
        return _REASON[0]
    reason = None
    if sys.platform != "linux":
        reason = f"cluster: needs Linux namespaces (this is {sys.platform})"
    elif os.geteuid() != 0:
        reason = "cluster: needs root (namespaces, veth pairs, mounts)"
    elif missing := [t for t in TOOLS if shutil.which(t) is None]:
        reason = f"cluster: missing tools: {' '.join(missing)}"
    else:
        try:
            r = subprocess.run(["unshare", "--uts", "--net", "--mount", "--ipc", "--pid", "--fork",
                                "sh", "-c", "ip link add fpx0 type veth peer name fpx1"],
                               stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=10)
            if r.returncode != 0:
                reason = f"cluster: cannot make namespaces or a veth: {r.stderr.strip()}"
        except (OSError, subprocess.TimeoutExpired) as e:
            reason = f"cluster: cannot make namespaces: {e}"
    _REASON.append(reason)
    return reason
