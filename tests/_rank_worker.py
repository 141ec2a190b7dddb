"""One rank of a ``tests.multirank`` launch, in one of two modes:

    python -m tests._rank_worker OUTDIR MODULE:FUNC KWARGS_JSON   # one body, then exit
    python -m tests._rank_worker --pool SOCKET                    # a rank of a rank pool

One body: writes ``OUTDIR/pid<r>`` as it starts, ``OUTDIR/rank<r>.json`` at the end, and
exits non-zero on failure (a launch of its own, for tests that kill ranks, abort the job or
check the job's exit).

Pool (``tests.rank_pool``): connects to the test process's Unix socket, says its rank and pid,
then runs one body per request line ``{"target", "kwargs", "env"}`` and answers each with one
result line, until the socket closes. Between bodies it calls ``fastpar.shutdown()`` and puts
back the environment and the torch settings a body may change, so each body starts as in a
fresh job. SIGUSR1 writes every thread's stack to ``SOCKET.stacks<r>`` (how a hung body is
reported before the pool is killed).
"""

import faulthandler
import importlib
import json
import os
import signal
import socket
import sys
import traceback

from fastpar.runtime.launcher import detect


def _rank() -> int:
    rank = detect(os.environ).rank
    if rank < 0:  # an MPI launcher that does not export the rank: ask MPI
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    return rank


def _call(target: str, kwargs: dict) -> dict:
    """``target(**kwargs)`` as a result record; every failure is reported, never raised."""
    import fastpar

    module, func = target.split(":")
    try:
        value = getattr(importlib.import_module(module), func)(**kwargs)
        result = {"ok": True, "value": value}
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    try:
        fastpar.shutdown()
        _destroy_process_group()  # one a body made without fastpar (a bench's torch baseline)
    except BaseException as exc:  # noqa: BLE001 - a failed teardown fails this body
        if result["ok"]:
            result = {"ok": False, "error": f"fastpar.shutdown: {type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()}
    return result


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _one_body(outdir: str, target: str, kwargs: dict) -> int:
    rank = _rank()
    with open(os.path.join(outdir, f"pid{rank}"), "w") as f:  # Launch.pids
        f.write(str(os.getpid()))
    result = _call(target, kwargs)
    tmp = os.path.join(outdir, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(result, f, default=repr)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.json"))
    return 0 if result["ok"] else 1


class _Restored:
    """What a body may change in this process and the next body must not inherit."""

    def __init__(self):
        import torch

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.torch = (torch.get_default_dtype(), torch.get_num_threads(),
                      torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled())
        self.excepthook = sys.excepthook
        self.handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        self.cpus = os.sched_getaffinity(0)

    def put_back(self) -> None:
        import torch

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        dtype, threads, grad, deterministic = self.torch
        torch.set_default_dtype(dtype)
        torch.set_num_threads(threads)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic)
        sys.excepthook = self.excepthook
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        for tid in os.listdir("/proc/self/task"):  # affinity is per thread (a body may bind)
            try:
                os.sched_setaffinity(int(tid), self.cpus)
            except OSError:  # a thread that just ended
                pass


def _pool(path: str) -> int:
    rank = _rank()
    stacks = open(f"{path}.stacks{rank}", "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    reader = sock.makefile("r")
    sock.sendall((json.dumps({"rank": rank, "pid": os.getpid()}) + "\n").encode())
    restored = _Restored()
    for line in reader:  # one request a line; the pool closes the socket to end
        request = json.loads(line)
        os.environ.update(request["env"])
        try:
            result = _call(request["target"], request["kwargs"])
        finally:
            restored.put_back()
        sys.stdout.flush()
        sys.stderr.flush()
        sock.sendall((json.dumps({"id": request["id"], **result}, default=repr) + "\n").encode())
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--pool":
        sys.exit(_pool(sys.argv[2]))
    sys.exit(_one_body(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])))
