"""Collective microbenchmark in the style of nccl-tests: every engine, same run, same sizes.

    mpirun -np 2 python bench/collectives.py --ops all_reduce --backends shm,gloo,mpi \\
        -b 1K -e 64M -f 2 --dtype float32 [--check] [--json PATH] [--plot PATH] [--symmetric]

Sizes follow nccl-tests: the bytes of the all_reduce/broadcast/sendrecv buffer, of the gathered
output for all_gather, of the input for reduce_scatter. Each point: ``-w`` warm-up calls, then
``-n`` timed calls (from 8 MiB up: a fifth of them, at least 5, and 5 for memcpy); the time is
the slowest rank's median over its calls (``p99``: the slowest rank's 99th percentile, the
spread a job sees from call to call). busbw applies the nccl-tests factors (all_reduce
2(n-1)/n, all_gather, reduce_scatter and all_to_all (n-1)/n, broadcast and sendrecv 1; sizes
of all_to_all: each rank's buffer, equal splits). The ``memcpy`` line is this machine's copy of
the same bytes on every rank at once; for all_reduce and all_to_all, the summary's ``bound`` is
that copy time as a fraction of the fastest engine's time (a rank must at least read its input
and write its result: one copy; for all_to_all every byte crossing once). ``--symmetric`` adds a line
"shm (symmetric)" for all_reduce and reduce_scatter of a ``comm.symmetric_empty`` input and
all_gather into a symmetric output (no staging copies; its JSON records carry
``"symmetric": true``).

More ranks than cores (a laptop): set ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` so idle MPICH ranks sleep.

Across hosts (``scripts/cluster.sh`` makes them on one machine): ``--backends hier,mpi,gloo,auto``
(``hier``: the hierarchical engine forced; ``auto``: whatever the policy picks per size) and
``--link-gbit R`` (the rate of each host's link, per direction) add a column ``link%``: the
time the bytes that must cross hosts take at R, as a fraction of the measured time. For H hosts
each host must send (and receive) ``(H-1)/H`` of an all_gather's output or a reduce_scatter's
input, and twice that of an all_reduce's buffer (S for 2 hosts), and a broadcast's whole buffer
reaches the other hosts once.

    scripts/cluster.sh --hosts 2 --rate 1gbit -- mpirun -hosts h0,h1 -ppn 2 \
        python bench/collectives.py --backends hier,mpi,gloo,auto --link-gbit 1 -b 4K -e 64M -f 4
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

import fastpar
from fastpar.runtime.cli import Parser
from fastpar import comm

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv", "all_to_all")
BACKENDS = ("shm", "gloo", "mpi", "nccl", "cuda_ipc", "nccl_mpi", "hier", "auto")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
              "sendrecv": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n}
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def sizes(begin: int, end: int, factor: int) -> list[int]:
    out, s = [], begin
    while s <= end:
        out.append(s)
        s *= factor
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def slowest(value: float, topo) -> float:
    """The maximum over ranks (every rank gets it)."""
    device = topo.device if topo.backend == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t.item()


SYMMETRIC_OPS = ("all_reduce", "all_gather", "reduce_scatter")


def make_call(op, backend, count, dtype, topo, fill, symmetric=False):
    """A closure running one collective of ``count`` elements per rank's buffer (see sizes);
    ``symmetric``: the all_reduce / reduce_scatter input, or the all_gather output, comes from
    ``comm.symmetric_empty``."""
    n, rank, device = topo.world_size, topo.rank, topo.device
    if op == "sendrecv":
        return make_sendrecv(backend, count, dtype, topo, fill)
    per_rank = count // n if op == "all_gather" else count
    x = fill(per_rank, rank).to(device)
    if symmetric and op == "all_gather":  # gathered into a symmetric out, x its own block
        out = comm.symmetric_empty(n * per_rank, dtype=dtype)
        block = out[rank * per_rank:(rank + 1) * per_rank].copy_(x)
        return lambda: comm.all_gather(block, out=out)
    if symmetric:
        x = comm.symmetric_empty(per_rank, dtype=dtype).copy_(x)
    if op == "all_reduce":
        # In place, as nccl-tests: timed calls keep reducing the same buffer (no reset copy);
        # --check uses a fresh closure.
        return lambda: comm.all_reduce(x)
    if op == "all_gather":
        return lambda: comm.all_gather(x)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(x)
    if op == "all_to_all":  # equal splits of the rank's buffer
        return lambda: comm.all_to_all(x)
    return lambda: comm.broadcast(x, src=0)


def make_sendrecv(backend, count, dtype, topo, fill):
    """A ring: every rank sends to rank+1 and receives from rank-1 (nccl-tests sendrecv)."""
    n, rank = topo.world_size, topo.rank
    x = fill(count, rank).to(topo.device)
    out = torch.empty_like(x)
    dst, src = (rank + 1) % n, (rank - 1) % n
    if backend == "mpi":
        world = topo.mpi_comm
        xn, on = x.numpy(), out.numpy()
        return lambda: world.Sendrecv(xn, dest=dst, recvbuf=on, source=src) or out
    import torch.distributed as dist

    if backend == "shm":  # the pipeline's rings: a header (as a pipeline message has) + payload
        from shm_rings import ring_step  # bench/shm_rings.py, beside this script

        return ring_step(_shm_rings(topo, sorted({dst, src})), x, out, dst, src)

    def call():
        ops = [dist.P2POp(dist.isend, x, dst), dist.P2POp(dist.irecv, out, src)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return out
    return call


_RINGS: list = []  # one ShmRings for the whole run (its construction is collective)


def _shm_rings(topo, peers):
    if not _RINGS:
        import torch.distributed as dist

        from shm_rings import ShmRings

        _RINGS.append(ShmRings(dist.group.WORLD, list(range(topo.world_size)), topo.rank, peers,
                               topo.timeout))
    return _RINGS[0]


def call_input(op, count, dtype, n):
    """A tensor of the shape and dtype a call of ``op`` passes (for the route it takes)."""
    return torch.empty(count // n if op == "all_gather" else count, dtype=dtype)


def reference(op, count, dtype, topo, fill):
    n, rank = topo.world_size, topo.rank
    if op == "sendrecv":
        return fill(count, (rank - 1) % n).double()
    if op == "broadcast":
        return fill(count, 0).double()
    per_rank = count // n if op == "all_gather" else count
    inputs = [fill(per_rank, r).double() for r in range(n)]
    if op == "all_reduce":
        return torch.stack(inputs).sum(0)
    if op == "all_gather":
        return torch.cat(inputs)
    if op == "all_to_all":
        return torch.cat([x.chunk(n)[rank] for x in inputs])
    return torch.stack(inputs).sum(0).chunk(n)[rank]


def count_wrong(got, want, dtype) -> int:
    got = got.detach().to("cpu").double()
    if got.shape != want.shape:
        return want.numel()
    bound = TOL[dtype] * want.abs().clamp_min(1.0)
    return int(((got - want).abs() > bound).sum().item())


def time_calls(call, warmup, iters, topo):
    """``(p50, p99)`` seconds over ``iters`` calls, each the slowest rank's."""
    for _ in range(warmup):
        call()
    sync(topo.device)
    torch.distributed.barrier()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        sync(topo.device)
        samples.append(time.perf_counter() - t0)
    samples.sort()
    p99 = samples[min(len(samples) - 1, int(0.99 * len(samples)))]
    return slowest(statistics.median(samples), topo), slowest(p99, topo)


def memcpy_time(nbytes, warmup, iters, topo):
    src = torch.empty(nbytes, dtype=torch.uint8, device=topo.device).fill_(1)
    dst = torch.empty_like(src)
    return time_calls(lambda: dst.copy_(src), warmup, iters, topo)


def hosts_of(topo) -> int:
    return len(set(topo.hosts)) if topo.hosts else 1


def must_cross(op: str, nbytes: int, hosts: int) -> float:
    """Bytes each host must send to the others (see the module docstring)."""
    if hosts < 2:
        return 0.0
    share = (hosts - 1) / hosts
    return {"all_reduce": 2 * share * nbytes, "all_gather": share * nbytes,
            "reduce_scatter": share * nbytes, "broadcast": nbytes,
            "all_to_all": share * nbytes}.get(op, 0.0)


def supported(op, backend, topo, dtype) -> str | None:
    """None, or why this backend cannot run this op here (the row is skipped, saying so)."""
    cuda = topo.device.type == "cuda"
    if backend == "auto":
        return "auto runs collectives only" if op == "sendrecv" else None
    if backend == "hier":
        from fastpar.comm import policy
        from fastpar.comm.state import current

        if op == "sendrecv":
            return "hier has no send/recv"
        layout = current().resolve(None)[2]
        try:
            policy.choose(op, topo.device.type, layout, 1 << 20, dtype, forced="hier")
        except ValueError as exc:
            return str(exc).split(": ", 1)[-1]
    if backend in ("nccl", "cuda_ipc", "nccl_mpi") and not cuda:
        return f"{backend} needs CUDA"
    if backend in ("shm", "mpi") and cuda:
        return f"{backend} is benchmarked on CPU tensors only"
    if backend == "gloo" and cuda and topo.backend != "gloo":
        return "gloo is benchmarked on CUDA tensors only where it is the job's backend " \
               "(FASTPAR_SHARED_GPU: the engine cuda_ipc falls back to)"
    if backend in ("nccl", "nccl_mpi") and topo.world_size > 1 and \
            torch.cuda.device_count() < topo.world_size:
        return (f"NCCL needs one GPU per rank ({topo.world_size} ranks share "
                f"{torch.cuda.device_count()} GPU(s) here)")
    if backend == "nccl" and topo.backend != "nccl":
        return f"the job's torch.distributed backend is {topo.backend}, not nccl"
    if backend == "nccl_mpi":
        from fastpar.comm import nccl_mpi

        why = nccl_mpi.unavailable(mpi_launched=topo.mpi_comm is not None)
        if why:
            return why
        if op == "sendrecv":
            return "nccl_mpi has no send/recv here (pipeline P2P on GPUs uses NCCL)"
    if backend == "cuda_ipc" and op != "all_reduce":
        return "cuda_ipc implements all_reduce only"
    if op == "sendrecv" and backend == "cuda_ipc":
        return "cuda_ipc has no send/recv (pipeline P2P on GPUs uses NCCL)"
    if op == "sendrecv" and backend == "shm" and topo.world_size < 2:
        return "shm send/recv needs 2 ranks"
    if backend == "mpi" and topo.mpi_comm is None:
        return "mpi needs an mpirun launch"
    if backend == "mpi" and dtype not in (torch.float32, torch.float64) and op != "all_to_all":
        return f"mpi through numpy cannot carry {dtype}"
    return None


def run(args, topo) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    n = topo.world_size
    records = []

    def fill(count, rank):
        g = torch.Generator().manual_seed(1000 + rank)
        return torch.randn(count, generator=g).to(dtype)

    for op in args.ops:
        lines = [(b, False) for b in args.backends]
        if args.symmetric and op in SYMMETRIC_OPS and "shm" in args.backends:
            lines.append(("shm", True))
        for backend, symmetric in lines:
            label = backend + (" (symmetric)" if symmetric else "")
            why = supported(op, backend, topo, dtype)
            if why:
                if topo.rank == 0:
                    print(f"# {op} on {label}: skipped, {why}")
                continue
            comm.use_backend(None if backend == "auto" else backend)
            if topo.rank == 0:
                print(f"\n# {op}  backend {label}  ranks {n} on {hosts_of(topo)} host(s)  "
                      f"dtype {args.dtype}")
                print(f"{'size':>12} {'count':>12} {'type':>9} {'time(us)':>11} "
                      f"{'p99(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'#wrong':>7}"
                      + (f" {'link%':>6}" if args.link_gbit else ""))
            for nbytes in args.sizes:
                count = max(nbytes // esize, 1)
                count -= count % n if op in ("all_gather", "reduce_scatter", "all_to_all") else 0
                if count == 0:
                    continue
                call = make_call(op, backend, count, dtype, topo, fill, symmetric)
                iters = args.iters if nbytes < (8 << 20) else max(5, args.iters // 5)
                t, p99 = time_calls(call, args.warmup, iters, topo)
                wrong = -1
                if args.check:
                    got = make_call(op, backend, count, dtype, topo, fill, symmetric)()
                    wrong = count_wrong(got, reference(op, count, dtype, topo, fill), dtype)
                    wrong = int(slowest(float(wrong), topo))
                size = count * esize
                algbw = size / t / 1e9
                rec = {"op": op, "backend": backend, "bytes": size, "count": count,
                       "dtype": args.dtype, "world_size": n, "time_us": t * 1e6,
                       "p99_us": p99 * 1e6, "algbw_gbps": algbw, "busbw_gbps": algbw * BUS_FACTOR[op](n),
                       "wrong": wrong, "symmetric": symmetric}
                if args.link_gbit:  # the link's time for the bytes that must cross / ours
                    bound = must_cross(op, size, hosts_of(topo)) * 8 / (args.link_gbit * 1e9)
                    rec["link_bound_us"], rec["link_fraction"] = bound * 1e6, bound / t
                if backend == "auto":
                    rec["engine"] = comm.engine_for(op, call_input(op, count, dtype, n))[0]
                records.append(rec)
                if topo.rank == 0:
                    print(f"{size:>12} {count:>12} {args.dtype:>9} {t * 1e6:>11.1f} "
                          f"{p99 * 1e6:>10.1f} {algbw:>12.3f} {rec['busbw_gbps']:>12.3f} "
                          f"{wrong if wrong >= 0 else 'N/A':>7}"
                          + (f" {rec['link_fraction']:>6.0%}" if args.link_gbit else "")
                          + (f"  ({rec['engine']})" if backend == "auto" else ""), flush=True)
            comm.use_backend(None)
    return records


def memcpy_reference(args, topo) -> list[dict]:
    out = []
    if topo.rank == 0:
        print("\n# memcpy reference: every rank copies the same bytes at once")
        print(f"{'size':>12} {'time(us)':>11} {'GB/s':>8}")
    for nbytes in args.sizes:
        t, p99 = memcpy_time(nbytes, args.warmup, args.iters if nbytes < (8 << 20) else 5, topo)
        out.append({"op": "memcpy", "backend": "memcpy", "bytes": nbytes, "count": nbytes,
                    "dtype": "uint8", "world_size": topo.world_size, "time_us": t * 1e6,
                    "p99_us": p99 * 1e6,
                    "algbw_gbps": nbytes / t / 1e9, "busbw_gbps": nbytes / t / 1e9,
                    "wrong": 0, "symmetric": False})
        if topo.rank == 0:
            print(f"{nbytes:>12} {t * 1e6:>11.1f} {nbytes / t / 1e9:>8.2f}")
    return out


def summary(records: list[dict]) -> None:
    """Ratios a reader wants: each engine against the others, and all_reduce against memcpy."""
    copy = {r["bytes"]: r["time_us"] for r in records if r["op"] == "memcpy"}
    table = {}
    for r in records:
        if r["op"] != "memcpy":
            name = r["backend"] + (" (symmetric)" if r.get("symmetric") else "")
            table.setdefault((r["op"], r["bytes"]), {})[name] = r["time_us"]
    print("\n# summary: time ratios (>1: the first is faster)")
    for (op, nbytes), by in sorted(table.items()):
        parts = []
        for mine in ("shm", "shm (symmetric)"):
            for other in ("mpi", "gloo") if mine in by else ():
                if other in by:
                    parts.append(f"{mine}/{other} {by[other] / by[mine]:.1f}x")
        if "shm" in by and "shm (symmetric)" in by:
            parts.append(f"symmetric/shm {by['shm'] / by['shm (symmetric)']:.2f}x")
        for mine, other in (("hier", "mpi"), ("hier", "gloo"), ("auto", "mpi"),
                            ("auto", "gloo"), ("cuda_ipc", "nccl"), ("cuda_ipc", "nccl_mpi"), ("nccl_mpi", "nccl"),
                            ("cuda_ipc", "gloo")):
            if mine in by and other in by:
                parts.append(f"{mine}/{other} {by[other] / by[mine]:.2f}x")
        if op in ("all_reduce", "all_to_all") and nbytes in copy:
            best = min(by, key=by.get)
            parts.append(f"bound: {best} at {copy[nbytes] / by[best]:.0%} of memcpy")
            if "shm (symmetric)" in by and best != "shm (symmetric)":
                parts.append(f"shm (symmetric) at {copy[nbytes] / by['shm (symmetric)']:.0%}")
        link = {r["backend"]: r["link_fraction"] for r in records if r["op"] == op and
                r["bytes"] == nbytes and "link_fraction" in r}
        if link:
            best = max(link, key=link.get)
            parts.append(f"link: {best} at {link[best]:.0%} of the link bound")
        if parts:
            print(f"{op:>15} {nbytes:>10} B  " + "  ".join(parts))


def plot(records: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("--plot needs matplotlib: pip install matplotlib")
    ops = sorted({r["op"] for r in records if r["op"] != "memcpy"})
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.5), squeeze=False)
    for ax, op in zip(axes[0], ops):
        def name(r):
            return r["backend"] + (" (symmetric)" if r.get("symmetric") else "")

        for backend in sorted({name(r) for r in records if r["op"] in (op, "memcpy")}):
            rows = [r for r in records if name(r) == backend and r["op"] in (op, "memcpy")]
            ax.plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o",
                    label=backend, linestyle="--" if backend == "memcpy" else "-")
        ax.set(xscale="log", yscale="log", xlabel="bytes", ylabel="busbw (GB/s)",
               title=f"{op}, {records[0]['world_size']} ranks, {records[0]['dtype']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = Parser(description=__doc__)
    p.add_argument("--ops", default="all_reduce", help=f"comma list of {', '.join(OPS)}")
    p.add_argument("--backends", default="shm,gloo,mpi", help=f"comma list of {', '.join(BACKENDS)}")
    p.add_argument("-b", "--minbytes", default="1K")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"])
    p.add_argument("-w", "--warmup", type=int, default=5)
    p.add_argument("-n", "--iters", type=int, default=50)
    p.add_argument("--check", action="store_true", help="count wrong elements vs float64")
    p.add_argument("--json", help="write the records to this path")
    p.add_argument("--plot", help="write busbw vs size to this PNG (needs matplotlib)")
    p.add_argument("--symmetric", action="store_true",
                   help="add all_reduce / all_gather / reduce_scatter on comm.symmetric_empty "
                   "buffers (with shm in --backends)")
    p.add_argument("--link-gbit", type=float, default=0.0,
                   help="each host's link rate in Gbit/s per direction: adds the link%% column "
                   "(the bytes that must cross hosts at that rate, over the measured time)")
    args = p.parse_args()
    args.ops = [o for o in args.ops.split(",") if o]
    args.backends = [b for b in args.backends.split(",") if b]
    for name, allowed, given in (("op", OPS, args.ops), ("backend", BACKENDS, args.backends)):
        bad = [g for g in given if g not in allowed]
        if bad:
            p.error(f"unknown {name}(s) {bad}; choose from {', '.join(allowed)}")
    if args.link_gbit < 0:
        p.error(f"--link-gbit must be >= 0, got {args.link_gbit}")
    if args.stepfactor < 2:
        p.error(f"-f must be at least 2, got {args.stepfactor}")
    args.sizes = sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)
    topo = fastpar.init()
    if topo.rank == 0:
        print(f"# fastpar {fastpar.__version__} collectives: {topo.world_size} ranks "
              f"({topo.launcher}), device {topo.device}, torch {torch.__version__}")
    records = run(args, topo) + memcpy_reference(args, topo)
    if topo.rank == 0:
        summary(records)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
            print(f"# wrote {args.json}")
        if args.plot:
            plot(records, args.plot)
            print(f"# wrote {args.plot}")
    for rings in _RINGS:
        rings.close()
    fastpar.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
