"""How long ``fastpar.init`` takes: rendezvous, join barrier, process group and every grid group.

    mpirun -np 4 python bench/bootstrap.py --tp 2 --pp 2 [--repeat 5] [--json PATH]
    torchrun --standalone --nproc-per-node 4 bench/bootstrap.py --tp 2 --pp 2

Each repetition is a full ``init`` + ``shutdown``; the time is that of the slowest rank (from the
call to its return), first call (MPI_Init included under mpirun) reported apart from later ones.
"""

import json
import statistics
import sys
import time

t_start = time.perf_counter()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fastpar  # noqa: E402
from fastpar.runtime.cli import Parser  # noqa: E402

t_import = time.perf_counter() - t_start


def main() -> int:
    p = Parser(description=__doc__)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        topo = fastpar.init(tp=args.tp, pp=args.pp)
        local = time.perf_counter() - t0
        t = torch.tensor([local, t_import], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t[0].item())
        slowest_import = t[1].item()
        rank, world, launcher = topo.rank, topo.world_size, topo.launcher
        fastpar.shutdown()
    if rank == 0:
        later = times[1:] or times
        rec = {"world_size": world, "tp": args.tp, "pp": args.pp, "launcher": launcher,
               "import_s": slowest_import, "first_init_s": times[0],
               "later_init_median_s": statistics.median(later), "repeat": args.repeat}
        print(f"{'ranks':>5} {'tp':>3} {'pp':>3} {'launcher':>9} {'import torch+fastpar':>21} "
              f"{'first init':>11} {'later inits (median)':>21}")
        print(f"{world:>5} {args.tp:>3} {args.pp:>3} {launcher:>9} {slowest_import:>20.2f}s "
              f"{times[0]:>10.3f}s {rec['later_init_median_s']:>20.3f}s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rec, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
