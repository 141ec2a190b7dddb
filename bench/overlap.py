"""How much communication the overlapped parallel linear layers hide: forward+backward of one
ColumnParallelLinear or RowParallelLinear, sequence parallelism off and on, at a few transformer
shapes, with the engines given.

    mpirun -np 2 python bench/overlap.py                      # CPU: gloo and shm, tp 2
    mpirun -np 2 python bench/overlap.py --backends gloo --overlap-pieces 2,4 --json out.json
    torchrun --nproc-per-node 2 bench/overlap.py --dtype bfloat16   # one GPU per rank

For each case, each a median over reps with the ranks lined up before every rep:
  gemm        the layer's local GEMMs alone (forward and backward of this rank's shard)
  comm        the layer's collectives alone, at the sizes the layer sends
  sequential  the layer with overlap=False (GEMMs, then each collective)
  overlapped  the layer with overlap=True and k pieces (overlap_pieces=k)
and speedup = sequential / overlapped, hidden = (sequential - overlapped) / comm: the fraction of
the communication that no longer costs time (1.0: all of it; negative: the pieces cost more than
it hid). Printed as a table, written as JSON (rank 0).
"""

from __future__ import annotations

import json
import statistics
import time

import torch

import fastpar
from fastpar.runtime.cli import Parser
from fastpar import comm
from fastpar import nn as pnn

# Configuration: (name, tokens per rank's batch, in_features, out_features) of the layer.
SHAPES = (("mlp-up 1024x1024->4096", 1024, 1024, 4096),
          ("mlp-down 1024x4096->1024", 1024, 4096, 1024))
WARMUP, REPS = 2, 7


def median_seconds(fn, barrier, reps=REPS, warmup=WARMUP) -> float:
    times = []
    for i in range(warmup + reps):
        barrier()
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def slowest(value: float, topo) -> float:
    t = torch.tensor([value], dtype=torch.float64,
                     device=topo.device if topo.backend == "nccl" else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


def case_runs(kind, sp, tokens, fin, fout, pieces, topo, dtype):
    """Closures (gemm, comm, sequential, overlapped) for one case on this rank."""
    n, dev, group = topo.tp_size, topo.device, topo.tp_group
    batch, seq = 2, tokens // 2  # (B, T, H), the sequence split over the tp ranks under SP
    kw = dict(sequence_parallel=sp, dtype=dtype, device=dev, seed=0)
    if kind == "column":
        layers = [pnn.ColumnParallelLinear(fin, fout, overlap=ov, overlap_pieces=pieces, **kw)
                  for ov in (False, True)]
        x = torch.randn(batch, seq // n if sp else seq, fin, dtype=dtype, device=dev)
        x_full = torch.randn(batch, seq, fin, dtype=dtype, device=dev)
        w = layers[0].weight.detach()
        dy = torch.randn(batch, seq, fout // n, dtype=dtype, device=dev)
        # SP: all-gather of the input forward, reduce-scatter of dx backward; else dx's all-reduce
        gathered, reduced = x, x_full
    else:
        layers = [pnn.RowParallelLinear(fin, fout, overlap=ov, overlap_pieces=pieces, **kw)
                  for ov in (False, True)]
        x = torch.randn(batch, seq, fin // n, dtype=dtype, device=dev)
        x_full = x
        w = layers[0].weight.detach()
        dy = torch.randn(batch, seq // n if sp else seq, fout, dtype=dtype, device=dev)
        # SP: reduce-scatter of the output forward, all-gather of dy backward; else an all-reduce
        gathered, reduced = dy, torch.randn(batch, seq, fout, dtype=dtype, device=dev)

    def comm_only():
        if sp:
            comm.all_gather(gathered, group, dim=1)
            comm.reduce_scatter(reduced, group, dim=1)
        else:
            comm.all_reduce(reduced.clone(), group)

    w = w.clone().requires_grad_(True)
    xg = x_full.clone().requires_grad_(True)
    dy_local = torch.randn(*xg.shape[:-1], w.shape[0], dtype=dtype, device=dev)

    def gemm_only():
        torch.nn.functional.linear(xg, w).backward(dy_local)

    def layer_step(layer):
        def run():
            xi = x.clone().requires_grad_(True)
            layer(xi).backward(dy)
        return run

    return gemm_only, comm_only, layer_step(layers[0]), layer_step(layers[1])


def main():
    parser = Parser(description=__doc__)
    parser.add_argument("--backends", default="gloo,shm",
                        help="engines to force for the layers' collectives (CPU: gloo,shm; "
                             "GPU: nccl,cuda_ipc,nccl_mpi); 'policy' lets the policy choose")
    parser.add_argument("--overlap-pieces", default="2,4",
                        help="overlap_pieces to try: GEMM pieces per layer call (default 2,4)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=REPS)
    parser.add_argument("--warmup", type=int, default=WARMUP)
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--json", help="write the records here (rank 0)")
    args = parser.parse_args()
    topo = fastpar.init(tp=launched_tp())
    dtype = getattr(torch, args.dtype)
    shapes = (("small 64x32->64", 64, 32, 64),) if args.small else SHAPES
    records = []
    barrier = torch.distributed.barrier
    if topo.rank == 0:
        print(f"# overlap: tp {topo.tp_size}, {topo.device.type}, {args.dtype}, median of "
              f"{args.reps} reps (ms); hidden = (sequential - overlapped) / comm")
        print(f"{'case':<34} {'engine':>8} {'k':>2} {'gemm':>8} {'comm':>8} {'seq':>8} "
              f"{'overlap':>8} {'speedup':>8} {'hidden':>7}")
    for name, tokens, fin, fout in shapes:
        for kind in ("column", "row"):
            for sp in (False, True):
                for backend in args.backends.split(","):
                    comm.use_backend(None if backend == "policy" else backend)
                    for k in (int(c) for c in args.overlap_pieces.split(",")):
                        gemm, comm_only, seq, ovl = case_runs(kind, sp, tokens, fin, fout, k,
                                                              topo, dtype)
                        t = {key: slowest(median_seconds(fn, barrier, args.reps, args.warmup),
                                          topo)
                             for key, fn in (("gemm", gemm), ("comm", comm_only),
                                             ("sequential", seq), ("overlapped", ovl))}
                        rec = {"case": f"{kind} {name}", "sp": sp, "engine": backend,
                               "overlap_pieces": k, "tp": topo.tp_size, "dtype": args.dtype,
                               "device": topo.device.type, **{f"{a}_ms": b * 1e3
                                                              for a, b in t.items()},
                               "speedup": t["sequential"] / t["overlapped"],
                               "hidden": (t["sequential"] - t["overlapped"]) / t["comm"]}
                        records.append(rec)
                        if topo.rank == 0:
                            label = f"{kind}{' sp' if sp else ''} {name}"
                            print(f"{label:<34} {backend:>8} {k:>2} {rec['gemm_ms']:>8.2f} "
                                  f"{rec['comm_ms']:>8.2f} {rec['sequential_ms']:>8.2f} "
                                  f"{rec['overlapped_ms']:>8.2f} {rec['speedup']:>7.2f}x "
                                  f"{rec['hidden']:>7.2f}", flush=True)
                    comm.use_backend(None)
    if topo.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    fastpar.shutdown()


def launched_tp() -> int:
    """Every launched rank in one tp group."""
    from fastpar.runtime.launcher import launched_world_size

    return launched_world_size()


if __name__ == "__main__":
    main()
