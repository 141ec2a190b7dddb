"""Forward+backward time of fastpar.nn.ParallelMLP: host overhead at tp=1 against the same MLP
built from nn.Linear, and the speed-up of tp=N over tp=1.

    python bench/tp_layers.py                       # tp=1 against nn.Linear
    mpirun -np 2 python bench/tp_layers.py          # also tp=2 against tp=1 (rank 0 alone)
    mpirun -np 2 python bench/tp_layers.py --json out.json

Every process uses one intra-op thread, so tp=N uses N cores and tp=1 one. The tp=1 rows of a
multi-rank run are measured on rank 0 while the other ranks wait.
"""

import json
import statistics
import time

import torch

import fastpar
from fastpar.runtime.cli import Parser
from fastpar.runtime.launcher import launched_world_size
from fastpar.testing import SerialMLP

# Configuration.
BATCH, SEQ, HIDDEN, FFN = 4, 64, 256, 1024
ACTIVATIONS = ("gelu", "swiglu")
DTYPE = torch.float32
WARMUP, REPS = 5, 50
THREADS = 1


def fwd_bwd_seconds(module, x, dy) -> float:
    start = time.perf_counter()
    module(x).backward(dy)
    elapsed = time.perf_counter() - start
    module.zero_grad(set_to_none=True)
    x.grad = None
    return elapsed


def interleaved_medians(runs, barrier) -> list:
    """Median seconds of each ``(module, on_this_rank)`` in ``runs``, timed one rep of each in
    turn (so drift on a shared machine hits all alike); ranks line up before every timed call."""
    times = [[] for _ in runs]
    for i in range(WARMUP + REPS):
        for j, (module, x, dy, here) in enumerate(runs):
            barrier()
            if here:
                elapsed = fwd_bwd_seconds(module, x, dy)
                if i >= WARMUP:
                    times[j].append(elapsed)
    return [statistics.median(t) if t else None for t in times]


def main():
    parser = Parser(description=__doc__)
    parser.add_argument("--json", help="write the records to this path (rank 0)")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--ffn", type=int, default=FFN)
    args = parser.parse_args()
    hidden, ffn = args.hidden, args.ffn
    torch.set_num_threads(THREADS)
    topo = fastpar.init(tp=launched_world_size())  # every rank in one TP group
    tp, rank = topo.tp_size, topo.rank
    import torch.distributed as dist

    # A group of one rank for the tp=1 measurements (new_group is collective: all ranks build all).
    alone = [dist.new_group([r]) for r in range(topo.world_size)][rank]
    gen = torch.Generator().manual_seed(0)
    records = []

    def record(impl, act, degree, seconds, reference):
        records.append({"impl": impl, "activation": act, "tp": degree, "time_ms": seconds * 1e3,
                        "vs_reference": seconds / reference if reference else 1.0,
                        "batch": BATCH, "seq": SEQ, "hidden": hidden, "ffn": ffn,
                        "dtype": str(DTYPE).replace("torch.", ""), "threads": THREADS})

    barrier = dist.barrier if topo.world_size > 1 else (lambda: None)
    for act in ACTIVATIONS:
        x = torch.randn(BATCH, SEQ, hidden, generator=gen, dtype=DTYPE).requires_grad_(True)
        dy = torch.randn(BATCH, SEQ, hidden, generator=gen, dtype=DTYPE)
        torch.manual_seed(0)
        serial = SerialMLP(hidden, ffn, act).to(DTYPE)
        single = fastpar.nn.ParallelMLP(hidden, ffn, act, group=alone, seed=0, dtype=DTYPE)
        runs = [(serial, x, dy, rank == 0), (single, x, dy, rank == 0)]  # tp=1: rank 0 alone
        if tp > 1:
            par = fastpar.nn.ParallelMLP(hidden, ffn, act, seed=0, dtype=DTYPE)
            runs.append((par, x, dy, True))
        medians = interleaved_medians(runs, barrier)
        if rank == 0:
            record("nn.Linear MLP", act, 1, medians[0], medians[0])
            record("fastpar ParallelMLP", act, 1, medians[1], medians[0])
            if tp > 1:
                record("fastpar ParallelMLP", act, tp, medians[2], medians[1])
    if rank == 0:
        print(f"# ParallelMLP forward+backward, x ({BATCH}, {SEQ}, {hidden}), ffn {ffn}, "
              f"{records[0]['dtype']}, {THREADS} thread(s)/rank, median of {REPS}")
        print(f"{'impl':>22} {'act':>7} {'tp':>3} {'time_ms':>9} {'ratio':>7}  ratio is against")
        for r in records:
            against = "itself" if r["impl"].startswith("nn.") else (
                "nn.Linear MLP" if r["tp"] == 1 else "fastpar tp=1")
            print(f"{r['impl']:>22} {r['activation']:>7} {r['tp']:>3} {r['time_ms']:9.3f} "
                  f"{r['vs_reference']:7.3f}  {against}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    fastpar.shutdown()


if __name__ == "__main__":
    main()
