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
"shm (symmetric)" for all_reduce, reduce_scatter and all_to_all of a ``comm.symmetric_empty``
input and all_gather into a symmetric output (no staging copies; its JSON records carry
``"symmetric": true``).

More ranks than cores (a laptop): set ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1`` so idle MPICH ranks sleep.

Across hosts (``scripts/cluster.sh`` makes them on one machine): ``--backends hier,mpi,gloo,auto``
(``hier``: the hierarchical engine forced; ``auto``: whatever the policy picks per size) and
``--link-gbit R`` (the rate of each host's link, per direction) add a column ``link%``: the
time the bytes that must cross hosts take at R, as a fraction of the measured time. For H hosts
each host must send (and receive) ``(H-1)/H`` of an all_gather's output or a reduce_scatter's
input, and twice that of an all_reduce's buffer (S for 2 hosts), and a broadcast's whole buffer
reaches the other hosts once.

    scripts/cluster.sh --hosts 2 --rate 1gbit -- mpirun -hosts h0,h1 -ppn 2 \\
        python bench/collectives.py --backends hier,mpi,gloo,auto --link-gbit 1 -b 4K -e 64M -f 4
    scripts/cluster.sh --hosts 2 --rate 1gbit -- mpirun -hosts h0,h1 -ppn 2 \\
        python bench/collectives.py --ops all_gather,reduce_scatter,all_reduce \\
        --backends hier,auto --quant int8 --link-gbit 1 -b 64K -e 64M -f 4

``--quant int8`` (``--quant-block B``, default ``FASTPAR_QUANT_BLOCK`` or 256) measures each
all_reduce / all_gather / reduce_scatter point twice, side by side: full precision, then
``quant=comm.Quant("int8", B)`` on the same tensor (float32 or bfloat16 ``--dtype``). Those
records carry ``wire_bytes``: the bytes each rank sends per call, from the wire format (pieces of
ceil(count / n) elements, as the dtype's elements or as ``quant.packed_bytes``: scales, int8,
padding), to the other hosts where the group spans hosts (the cross-host stage: one piece to
each other host, twice for all_reduce), else to the other ranks; ``--check`` holds an int8
result to the codec's bound (``int8_bound``), not to the dtype's rounding; ``link%`` of an int8
row counts its packed bytes. The summary adds a table of full precision against int8 per op
and size (time ratio, wire bytes, link%).
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
from fastpar.comm import quant as codec

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "sendrecv", "all_to_all")
BACKENDS = ("shm", "gloo", "mpi", "nccl", "cuda_ipc", "nccl_mpi", "hier", "auto")
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0,
              "sendrecv": lambda n: 1.0, "all_to_all": lambda n: (n - 1) / n}
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 4e-3}
QUANT_OPS = ("all_reduce", "all_gather", "reduce_scatter")


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


SYMMETRIC_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def make_call(op, backend, count, dtype, topo, fill, symmetric=False, quant=None):
    """A closure running one collective of ``count`` elements per rank's buffer (see sizes);
    ``symmetric``: the all_reduce / reduce_scatter / all_to_all input, or the all_gather output, comes from
    ``comm.symmetric_empty``; ``quant``: a ``comm.Quant`` (int8 on the wire) or None."""
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
        return lambda: comm.all_reduce(x, quant=quant)
    if op == "all_gather":
        return lambda: comm.all_gather(x, quant=quant)
    if op == "reduce_scatter":
        return lambda: comm.reduce_scatter(x, quant=quant)
    if op == "all_to_all":  # equal splits of the rank's buffer, into one reused output (as
        # nccl-tests: a fresh one per call would time its page faults, not the exchange)
        out = torch.empty_like(x)
        return lambda: comm.all_to_all(x, out=out)
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


def count_wrong(got, want, dtype, bound=None) -> int:
    """Elements of ``got`` farther from the float64 ``want`` than ``bound`` (per element;
    default: the dtype's rounding, relative to max(|want|, 1): for the ops that copy)."""
    got = got.detach().to("cpu").double()
    if got.shape != want.shape:
        return want.numel()
    if bound is None:
        bound = TOL[dtype] * want.abs().clamp_min(1.0)
    return int(((got - want).abs() > bound).sum().item())


def sum_bound(op, count, dtype, topo, fill) -> torch.Tensor:
    """Per element, how far a full-precision all_reduce or reduce_scatter may be from the
    float64 sum: n eps sum_r |x_r| (eps = 2u of the dtype), what n - 1 additions in any order
    and a rounding of each partial sum to the dtype can make. (Relative to |sum| alone it is
    not a bound: the hierarchical engine rounds each host's sum to the dtype, and under
    cancellation those roundings are large against the total; bfloat16 showed it.)"""
    n, rank = topo.world_size, topo.rank
    eps = torch.finfo(dtype).eps
    absum = sum(fill(count, r).double().abs() for r in range(n))
    bound = n * eps * absum
    return bound.chunk(n)[rank] if op == "reduce_scatter" else bound


def int8_bound(op, count, dtype, topo, fill, local: int) -> torch.Tensor:
    """Per element, how far a quantized result may be from the float64 reference.

    The codec's bound ``fastpar.comm.quant.bound`` is c amax per block (c = 1/254 + 4u: half
    a step plus four float32 roundings, u = 2^-24); every block's amax is taken as its whole
    input's max A, which holds however an engine cuts the pieces. What is quantized: each
    rank's input (flat engines, ``local`` = 1) or each host's sum of ``local`` ranks' inputs
    in the dtype (the hierarchical engine: |host sum| <= the sum of its ranks' |x|, and its
    rounding adds at most local ud sum |x|, ud the dtype's unit roundoff). Then (the terms of
    ``fastpar.comm.quantized``'s docstring): all_gather c A_r; reduce_scatter b1 = c sum_r A_r
    (1 + local ud) + the host sums' rounding + the float32 sum of the dequantized pieces
    (n u sum |y_r|); all_reduce b1 + c (max |sum| + max b1) (the summed chunk quantized
    again); the output's own rounding to the dtype last (ud (|want| + b))."""
    n, rank = topo.world_size, topo.rank
    u = 2.0**-24
    ud = u if dtype == torch.float32 else 2.0**-8
    c = 1 / 254 + 4 * u
    per_rank = count // n if op == "all_gather" else count
    xs = [fill(per_rank, r).double() for r in range(n)]
    if op == "all_gather":
        want = torch.cat(xs)
        b = torch.cat([torch.full_like(x, c * x.abs().max().item()) for x in xs])
    else:
        want, absum = sum(xs), sum(x.abs() for x in xs)
        intra = local * ud * absum if local > 1 else torch.zeros_like(absum)
        quantized = c * (1 + local * ud) * sum(x.abs().max().item() for x in xs)
        b = quantized + intra + n * u * (absum + quantized + intra)
        if op == "all_reduce":
            b = b + c * (want.abs().max() + b.max())
        else:
            b, want = b.chunk(n)[rank], want.chunk(n)[rank]
    return b * (1 + ud) + ud * want.abs()


def wire_bytes(op, count, esize, n, hosts, block=None) -> int:
    """Bytes each rank sends per call (see the module docstring): pieces of ceil(count / n)
    elements, as ``esize``-byte elements or, with a ``block``, in the int8 wire format;
    one to each other host where the group spans hosts, else one to each other rank, twice
    for all_reduce (a reduce-scatter, then an all-gather)."""
    m = -(-count // n)
    piece = codec.packed_bytes(m, block) if block else m * esize
    peers = hosts - 1 if hosts > 1 else n - 1
    return piece * peers * (2 if op == "all_reduce" else 1)


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
        facts = current().resolve(None)[2]
        try:
            policy.choose(op, topo.device.type, facts, 1 << 20, dtype, forced="hier")
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
        from fastpar.comm.engines import nccl_mpi

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
            # --quant: int8 right after full precision at each size (the same tensors; the
            # machine's load drifts less between the two than over a whole sweep)
            quants = [None] + ([args.quant] if args.quant and op in QUANT_OPS and
                               not symmetric else [])
            comm.use_backend(None if backend == "auto" else backend)
            if topo.rank == 0:
                print(f"\n# {op}  backend {label}  ranks {n} on {hosts_of(topo)} host(s)  "
                      f"dtype {args.dtype}")
                print(f"{'size':>12} {'count':>12} {'type':>9}"
                      + (f" {'quant':>5}" if args.quant else "")
                      + f" {'time(us)':>11} {'p99(us)':>10} {'algbw(GB/s)':>12} "
                      f"{'busbw(GB/s)':>12} {'#wrong':>7}"
                      + (f" {'wire(B)':>10}" if len(quants) > 1 else "")
                      + (f" {'link%':>6}" if args.link_gbit else ""))
            for nbytes in args.sizes:
                count = max(nbytes // esize, 1)
                count -= count % n if op in ("all_gather", "reduce_scatter", "all_to_all") else 0
                if count == 0:
                    continue
                for quant in quants:
                    rec = measure(args, topo, op, backend, nbytes, count, dtype, fill,
                                  symmetric, quant)
                    records.append(rec)
                    if topo.rank == 0:
                        print(f"{rec['bytes']:>12} {count:>12} {args.dtype:>9}"
                              + (f" {quant.kind if quant else '-':>5}" if args.quant else "")
                              + f" {rec['time_us']:>11.1f} {rec['p99_us']:>10.1f} "
                              f"{rec['algbw_gbps']:>12.3f} {rec['busbw_gbps']:>12.3f} "
                              f"{rec['wrong'] if rec['wrong'] >= 0 else 'N/A':>7}"
                              + (f" {rec['wire_bytes']:>10}" if len(quants) > 1 else "")
                              + (f" {rec['link_fraction']:>6.0%}" if args.link_gbit else "")
                              + (f"  ({rec['engine']})" if backend == "auto" else ""),
                              flush=True)
            comm.use_backend(None)
    return records


def measure(args, topo, op, backend, nbytes, count, dtype, fill, symmetric, quant) -> dict:
    """One point of the sweep (``nbytes`` asked, ``count`` elements): its record."""
    n, hosts = topo.world_size, hosts_of(topo)
    esize = torch.empty((), dtype=dtype).element_size()
    call = make_call(op, backend, count, dtype, topo, fill, symmetric, quant)
    iters = args.iters if nbytes < (8 << 20) else max(5, args.iters // 5)
    t, p99 = time_calls(call, args.warmup, iters, topo)
    engine = backend
    if backend == "auto":  # a quantized call's route is an all_gather of the input's bytes
        inp = call_input(op, count, dtype, n)
        engine = comm.engine_for("all_gather", inp.view(torch.uint8))[0] if quant else \
            comm.engine_for(op, inp)[0]
    wrong = -1
    if args.check:
        got = make_call(op, backend, count, dtype, topo, fill, symmetric, quant)()
        bound = None
        if quant:  # the hierarchical engine quantizes each host's sum
            local = n // hosts if engine == "hier" else 1
            bound = int8_bound(op, count, dtype, topo, fill, local)
        elif op in ("all_reduce", "reduce_scatter"):
            bound = sum_bound(op, count, dtype, topo, fill)
        wrong = count_wrong(got, reference(op, count, dtype, topo, fill), dtype, bound)
        wrong = int(slowest(float(wrong), topo))
    size = count * esize
    algbw = size / t / 1e9
    rec = {"op": op, "backend": backend, "bytes": size, "count": count, "dtype": args.dtype,
           "world_size": n, "time_us": t * 1e6, "p99_us": p99 * 1e6, "algbw_gbps": algbw,
           "busbw_gbps": algbw * BUS_FACTOR[op](n), "wrong": wrong, "symmetric": symmetric,
           "quant": quant.kind if quant else None}
    if args.quant and op in QUANT_OPS and not symmetric:
        rec["wire_bytes"] = wire_bytes(op, count, esize, n, hosts, quant and quant.block)
        if quant:
            rec["block"] = quant.block
    if args.link_gbit:  # the link's time for the bytes that must cross / ours
        crossing = must_cross(op, size, hosts)
        if quant:  # the same pieces, packed
            crossing *= rec["wire_bytes"] / wire_bytes(op, count, esize, n, hosts)
        bound = crossing * 8 / (args.link_gbit * 1e9)
        rec["link_bound_us"], rec["link_fraction"] = bound * 1e6, bound / t
    if backend == "auto":
        rec["engine"] = engine
    return rec


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
                    "wrong": 0, "symmetric": False, "quant": None})
        if topo.rank == 0:
            print(f"{nbytes:>12} {t * 1e6:>11.1f} {nbytes / t / 1e9:>8.2f}")
    return out


def summary(records: list[dict]) -> None:
    """Ratios a reader wants: each engine against the others, and all_reduce against memcpy."""
    copy = {r["bytes"]: r["time_us"] for r in records if r["op"] == "memcpy"}
    table = {}
    for r in records:
        if r["op"] != "memcpy" and not r["quant"]:  # int8: quant_summary
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
                r["bytes"] == nbytes and "link_fraction" in r and not r["quant"]}
        if link:
            best = max(link, key=link.get)
            parts.append(f"link: {best} at {link[best]:.0%} of the link bound")
        if parts:
            print(f"{op:>15} {nbytes:>10} B  " + "  ".join(parts))


def quant_summary(records: list[dict]) -> None:
    """--quant: each op, engine and size, full precision against int8 (measured one after the
    other): time ratio, bytes each rank sends, and link% where the link rate is given."""
    pairs = {}
    for r in records:
        if "wire_bytes" in r:
            pairs.setdefault((r["op"], r["backend"], r["bytes"]), {})[r["quant"]] = r
    if not pairs:
        return
    dtype = records[0]["dtype"]
    link = any("link_fraction" in r for r in records)
    print(f"\n# {dtype} against int8 (>1: int8 faster; wire: bytes each rank sends per call)")
    print(f"{'op':>15} {'backend':>8} {'size':>10} {dtype + '(us)':>14} {'int8(us)':>11} "
          f"{'ratio':>6} {'wire ' + dtype:>14} {'wire int8':>11}"
          + (f" {'link% fp':>8} {'link% int8':>10}" if link else ""))
    for (op, backend, nbytes), by in pairs.items():
        full, q = by.get(None), by.get("int8")
        if full is None or q is None:
            continue
        print(f"{op:>15} {backend:>8} {nbytes:>10} {full['time_us']:>14.1f} "
              f"{q['time_us']:>11.1f} {full['time_us'] / q['time_us']:>5.2f}x "
              f"{full['wire_bytes']:>14} {q['wire_bytes']:>11}"
              + (f" {full['link_fraction']:>8.0%} {q['link_fraction']:>10.0%}" if link else ""))


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
            return r["backend"] + (" (symmetric)" if r.get("symmetric") else "") + \
                (f" {r['quant']}" if r.get("quant") else "")

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
    p.add_argument("--quant", choices=codec.KINDS,
                   help="also measure all_reduce / all_gather / reduce_scatter with this "
                   "quantization on the wire, beside full precision (float32, bfloat16)")
    p.add_argument("--quant-block", type=int,
                   help="elements per int8 scale (default FASTPAR_QUANT_BLOCK or "
                   f"{codec.DEFAULT_BLOCK})")
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
    if args.quant_block is not None and not args.quant:
        p.error("--quant-block needs --quant")
    if args.quant:
        if getattr(torch, args.dtype) not in codec.DTYPES:
            p.error(f"--quant {args.quant} takes float32 or bfloat16, got --dtype {args.dtype}")
        try:
            args.quant = codec.Quant(args.quant, args.quant_block) if args.quant_block \
                is not None else codec.spec(args.quant)
        except ValueError as exc:  # a bad block, given or from FASTPAR_QUANT_BLOCK
            p.error(str(exc) if args.quant_block is None else
                    f"--quant-block {args.quant_block}: {exc}")
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
        quant_summary(records)
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
