"""One rank of a ``tests.multirank.run_ranks`` launch: ``python -m tests._rank_worker OUTDIR
MODULE:FUNC KWARGS_JSON``. Writes ``OUTDIR/rank<r>.json`` and exits non-zero on failure."""

import importlib
import json
import os
import sys
import traceback

from fastpar.runtime.launcher import detect


def main() -> int:
    outdir, target, kwargs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    rank = detect(os.environ).rank
    if rank < 0:  # an MPI launcher that does not export the rank: ask MPI
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    module, func = target.split(":")
    try:
        value = getattr(importlib.import_module(module), func)(**kwargs)
        result = {"ok": True, "value": value}
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()}
    finally:
        import fastpar

        fastpar.shutdown()
    tmp = os.path.join(outdir, f".rank{rank}.json")
    with open(tmp, "w") as f:
        json.dump(result, f, default=repr)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.json"))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
