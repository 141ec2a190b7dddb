"""Data-parallel step time: how much of the gradient all-reduce fastpar.DataParallel hides behind
backward, against torch's DistributedDataParallel in the same run.

    mpirun -np 2 python bench/data_parallel.py
    mpirun -np 2 python bench/data_parallel.py --hidden 256 --blocks 2 --engines shm --json out.json

Model: ``--blocks`` MLP blocks ``x + fc2(gelu(fc1(x)))`` (h -> 4h -> h), a few million
parameters; every rank draws its own batch of ``--batch`` rows. Variants, each a step of
zero_grad + forward + backward (+ reduction), no optimizer:
  compute      backward alone, no communication
  blocking     backward, then one blocking all-reduce of all gradients (a flat buffer the
               gradients are views of, so no copies) and the division by dp
  dp-sync      fastpar.DataParallel(overlap=False): every bucket reduced after backward
  dp-overlap   fastpar.DataParallel(overlap=True): each bucket launched as backward fills it
               (on shm its buckets are symmetric tensors: reduced where they lie)
  dp-overlap-copy  the same with FASTPAR_SYMMETRIC=0: buckets copied in and out of the shm
               engine's own segment (shown only where dp-overlap's buckets are symmetric)
  torch-ddp    torch.nn.parallel.DistributedDataParallel on gloo (its own buckets, same cap)
The fastpar variants run on each engine of ``--engines`` (shm completes a collective inside the
call, so its buckets reduce inline in the backward hooks; gloo runs them in its own thread).

Timing: warm-up steps, then ``--steps`` rounds that run one step of every variant in turn (so
drift hits all alike), each step after a barrier; a step's time is the slowest rank's; the table
shows the median. ``hidden`` = (blocking - dp-overlap) / (blocking - compute): the fraction of the
exposed communication time that overlap removes (1: all of it, 0: none, < 0: slower than
blocking). One intra-op thread per rank: 2 ranks on 2 cores leave gloo's thread no core of its
own, which caps what overlap can hide on such a machine.
"""

import json
import os
import statistics
import time

import torch

torch.set_num_threads(1)  # one intra-op thread per rank, before any other torch work

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import fastpar  # noqa: E402
from fastpar.runtime.cli import Parser  # noqa: E402
from fastpar import comm  # noqa: E402

# Configuration.
HIDDEN, BLOCKS, BATCH = 512, 2, 64  # 2 blocks of 512 -> 2048 -> 512: 4.2 M parameters
BUCKET_MB = 4.0
ENGINES = "shm,gloo"
WARMUP, STEPS = 3, 15


class Block(nn.Module):
    """``x + fc2(gelu(fc1(x)))``: x (B, h) -> (B, 4h) -> (B, h)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def build(args) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(*[Block(args.hidden) for _ in range(args.blocks)])


class Blocking:
    """Backward, then one blocking all-reduce of a flat buffer every gradient is a view of."""

    def __init__(self, model, group, dp):
        self.model, self.group, self.dp = model, group, dp
        params = list(model.parameters())
        self.flat = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            p.grad = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def __call__(self, x):
        return self.model(x)

    def zero_grad(self):
        self.flat.zero_()

    def finish(self):
        comm.all_reduce(self.flat, group=self.group)
        self.flat.div_(self.dp)


def step_fn(model, x, finish=None):
    def step():
        model.zero_grad()
        model(x).square().mean().backward()
        if finish is not None:
            finish()
    return step


def variants(args, topo, engine):
    """``({name: step function}, buckets, symmetric)`` for one engine (``torch-ddp`` with
    ``engine=None``); ``symmetric``: DataParallel's buckets are symmetric tensors."""
    x = torch.randn(args.batch, args.hidden, generator=torch.Generator().manual_seed(topo.rank))
    g = topo.dp_group
    if engine is None:
        ddp = nn.parallel.DistributedDataParallel(build(args), process_group=g,
                                                  bucket_cap_mb=args.bucket_mb)
        return {"torch-ddp": step_fn(ddp, x)}, None, False
    plain = build(args)
    blocking = Blocking(build(args), g, topo.dp_size)
    dp_sync = fastpar.DataParallel(build(args), bucket_mb=args.bucket_mb, overlap=False)
    dp_over = fastpar.DataParallel(build(args), bucket_mb=args.bucket_mb, overlap=True)
    runs = {"compute": step_fn(plain, x),
            "blocking": step_fn(blocking, x, blocking.finish),
            "dp-sync": step_fn(dp_sync, x),
            "dp-overlap": step_fn(dp_over, x)}
    if any(b.symmetric for b in dp_over.buckets):  # the same with copying buckets, beside it
        os.environ["FASTPAR_SYMMETRIC"] = "0"
        dp_copy = fastpar.DataParallel(build(args), bucket_mb=args.bucket_mb, overlap=True)
        del os.environ["FASTPAR_SYMMETRIC"]
        runs["dp-overlap-copy"] = step_fn(dp_copy, x)
    return runs, len(dp_over.buckets), any(b.symmetric for b in dp_over.buckets)


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def measure(runs: dict, engines: dict, args) -> dict:
    """Median slowest-rank seconds of every ``(engine, variant)``, interleaved rounds."""
    times = {key: [] for key in runs}
    for rep in range(args.warmup + args.steps):
        for key, step in runs.items():
            comm.use_backend(engines[key])
            dist.barrier()
            start = time.perf_counter()
            step()
            t = slowest(time.perf_counter() - start)
            if rep >= args.warmup:
                times[key].append(t)
    comm.use_backend(None)
    return {key: statistics.median(ts) for key, ts in times.items()}


def main() -> int:
    p = Parser(description=__doc__)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--blocks", type=int, default=BLOCKS)
    p.add_argument("--batch", type=int, default=BATCH, help="rows per rank per step")
    p.add_argument("--bucket-mb", type=float, default=BUCKET_MB)
    p.add_argument("--engines", default=ENGINES, help="fastpar engines, comma-separated")
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--json", help="write the records to this path")
    args = p.parse_args()

    topo = fastpar.init()
    engine_list = [e for e in args.engines.split(",") if e]
    runs, engines, n_buckets, symmetric = {}, {}, 0, {}
    for engine in engine_list:
        comm.use_backend(engine)  # DataParallel picks symmetric buckets for the engine in use
        steps, n_buckets, symmetric[engine] = variants(args, topo, engine)
        comm.use_backend(None)
        for name, fn in steps.items():
            runs[(engine, name)], engines[(engine, name)] = fn, engine
    for name, fn in variants(args, topo, None)[0].items():
        runs[("gloo", name)], engines[("gloo", name)] = fn, None
    n_params = sum(q.numel() for q in build(args).parameters())
    medians = measure(runs, engines, args)

    records = []
    for (engine, name), t in medians.items():
        records.append({"variant": name, "engine": engine, "step_ms": t * 1e3,
                        "samples_per_s": topo.dp_size * args.batch / t, "params": n_params,
                        "grad_mb": n_params * 4 / 2**20, "bucket_mb": args.bucket_mb,
                        "buckets": n_buckets if name.startswith("dp") else None,
                        "symmetric": bool(symmetric.get(engine)) and name in ("dp-sync",
                                                                              "dp-overlap"),
                        "batch_per_rank": args.batch, "world_size": topo.world_size})
    hidden = {}
    for engine in engine_list:
        t = {name: medians[(engine, name)] for name in ("compute", "blocking", "dp-overlap",
                                                        "dp-sync")}
        exposed = t["blocking"] - t["compute"]
        hidden[engine] = (t["blocking"] - t["dp-overlap"]) / exposed if exposed > 0 else None
    if topo.rank == 0:
        print(f"# fastpar {fastpar.__version__} DataParallel: {topo.world_size} ranks, "
              f"{n_params / 1e6:.2f} M params ({n_params * 4 / 2**20:.1f} MiB of float32 "
              f"gradients), batch {args.batch} per rank, buckets of {args.bucket_mb:g} MiB "
              f"({n_buckets} buckets), median of {args.steps} steps (slowest rank)")
        print(f"{'variant':>15} {'engine':>7} {'step(ms)':>9} {'samples/s':>10} "
              f"{'vs compute':>11}")
        for r in records:
            base = medians[(r["engine"] if r["engine"] in engine_list else engine_list[0],
                            "compute")] if engine_list else None
            ratio = f"{r['step_ms'] / 1e3 / base:>10.2f}x" if base else f"{'-':>11}"
            print(f"{r['variant']:>15} {r['engine']:>7} {r['step_ms']:>9.2f} "
                  f"{r['samples_per_s']:>10.0f} {ratio}")
        for engine, frac in hidden.items():
            shown = "n/a (no exposed communication)" if frac is None else f"{100 * frac:.0f}%"
            print(f"# {engine}: communication hidden by overlap = (blocking - dp-overlap) / "
                  f"(blocking - compute) = {shown}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"records": records, "hidden_fraction": hidden}, f, indent=1)
            print(f"# wrote {args.json}")
    fastpar.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
