"""ZeRO-3's parameter all-gather on CPU ranks of one host, the ways it could run, beside gloo's:
what decided that ZeRO-3 gathers from symmetric master shards into ordinary buffers (and not
into symmetric gather buffers whose pages come and go).

    mpirun -np 2 python bench/zero_gather.py                  # runs of 2, 8 and 32 MiB
    mpirun -np 4 python bench/zero_gather.py --sizes 8M --iters 40 --json out.json

Each rank holds its piece (run / world) of a float32 run and gathers the whole run into a buffer
(timed: the gather with the memory it takes), then checks it and releases it, as ZeRO-3 does
after use (not timed):

  gloo         torch.distributed.all_gather_single over gloo (the standard engine), into a
               buffer released and re-allocated (storage resized) around each gather
  copying      fastpar's shm all_gather of the piece copied into its block (the copying kernel,
               through the segment's halves), the buffer released and re-allocated the same way
  from-master  the piece in symmetric memory (ZeRO-3's float32 master shard): the kernel copies
               every rank's piece straight into the ordinary buffer (ZeRO-3's path)
  sym-release  the buffer itself symmetric: own block written, gathered in place, its pages
               given back after use (``symmetric.release``) and faulted in again at the next
  sym-kept     the same with the pages kept (not an option for ZeRO-3: it would hold every run)

The variants run in turn, iteration by iteration, after one warm-up round; every result is
checked. ``min``/``median`` over iterations; ``x gloo``: gloo's min over the variant's;
``bound``: one memcpy of the run in this process over the variant's min (each rank writes the
whole run once at least). The JSON is a list of ``{variant, bytes, world_size, min_us,
median_us, vs_gloo, bound_fraction, wrong}``.
"""

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fastpar  # noqa: E402
from bench.collectives import parse_size  # noqa: E402
from fastpar import comm  # noqa: E402
from fastpar.comm import symmetric  # noqa: E402
from fastpar.runtime.cli import Parser  # noqa: E402

VARIANTS = ("gloo", "copying", "from-master", "sym-release", "sym-kept")


def run_size(nbytes: int, iters: int, topo) -> list[dict]:
    n, me = topo.world_size, topo.rank
    numel = nbytes // 4 // n * n
    piece = numel // n
    want = torch.arange(n, dtype=torch.float32).repeat_interleave(piece) + 0.5
    mine = torch.full((piece,), me + 0.5)
    master = comm.symmetric_empty(piece).copy_(mine)  # collective: every rank, same order
    sym = {k: comm.symmetric_empty(numel) for k in ("sym-release", "sym-kept")}
    heap = {k: torch.empty(numel) for k in ("gloo", "copying", "from-master")}
    gloo = dist.new_group(backend="gloo")
    wrong = dict.fromkeys(VARIANTS, 0)

    def gather(name) -> torch.Tensor:  # timed: what one gather costs, memory taken included
        if name in heap:
            buf = heap[name]
            buf.untyped_storage().resize_(numel * 4)
            if name == "gloo":
                dist.all_gather_single(buf, mine, group=gloo)
                return buf
            if name == "from-master":
                return comm.all_gather(master, out=buf)
        else:
            buf = sym[name]
        buf[me * piece:(me + 1) * piece].copy_(mine)
        return comm.all_gather(buf[me * piece:(me + 1) * piece], out=buf)

    def after(name, buf) -> None:  # not timed: check, then release as ZeRO-3 does after use
        if not torch.equal(buf, want):
            wrong[name] += 1
        if name in heap:
            buf.untyped_storage().resize_(0)
        elif name == "sym-release":  # after the kernel's exit signal: nobody reads it
            symmetric.release(buf)

    times = {v: [] for v in VARIANTS}
    for it in range(iters + 1):
        for v in VARIANTS:
            dist.barrier(group=gloo)
            t0 = time.perf_counter()
            buf = gather(v)
            if it:  # the first round warms up
                times[v].append(time.perf_counter() - t0)
            after(v, buf)
    src, dst = torch.randn(numel), torch.empty(numel)
    copies = []
    for _ in range(max(5, iters // 2)):
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    bound = min(copies)
    # the slowest rank's min and median decide
    mins = {v: max(_all(min(times[v]))) for v in VARIANTS}
    meds = {v: max(_all(statistics.median(times[v]))) for v in VARIANTS}
    return [{"variant": v, "bytes": numel * 4, "world_size": n, "min_us": 1e6 * mins[v],
             "median_us": 1e6 * meds[v], "vs_gloo": mins["gloo"] / mins[v],
             "bound_fraction": bound / mins[v], "wrong": sum(_all(wrong[v]))}
            for v in VARIANTS]


def _all(x) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def main() -> int:
    p = Parser(prog="zero_gather.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="2M,8M,32M", help="run bytes gathered (K, M suffixes)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    if args.iters < 1:
        p.error(f"--iters must be at least 1, got {args.iters}")
    torch.set_num_threads(1)
    topo = fastpar.init()
    if topo.world_size < 2 or not comm.symmetric_available(None, "all_gather"):
        if topo.rank == 0:
            print("zero_gather.py: needs 2 or more ranks on one host whose collectives go to "
                  "shm (mpirun -np 2 python bench/zero_gather.py)", file=sys.stderr)
        fastpar.shutdown()
        return 2
    rows = [r for size in sizes for r in run_size(size, args.iters, topo)]
    if topo.rank == 0:
        print(f"ZeRO-3's gather of one float32 run, {topo.world_size} ranks, {args.iters} "
              f"iterations (variants interleaved); us, the slowest rank's")
        print(f"{'run':>8} {'variant':<12} {'min':>9} {'median':>9} {'x gloo':>7} "
              f"{'bound':>6} {'wrong':>5}")
        for r in rows:
            print(f"{r['bytes'] / 2**20:>6.1f}Mi {r['variant']:<12} {r['min_us']:>9.0f} "
                  f"{r['median_us']:>9.0f} {r['vs_gloo']:>7.2f} {r['bound_fraction']:>6.2f} "
                  f"{r['wrong']:>5}")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
    bad = sum(r["wrong"] for r in rows)
    fastpar.shutdown()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
