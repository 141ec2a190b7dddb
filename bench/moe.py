"""Forward+backward time of fastpar.nn.MoE split into route / dispatch / experts / combine, at
ep N (every rank of the launch in one expert-parallel group) against the same layer on one rank.

    python bench/moe.py                               # ep 1 only
    mpirun -np 2 python bench/moe.py                  # ep 2 against ep 1 (rank 0 alone)
    mpirun -np 4 python bench/moe.py --tokens 1024 --json out.json

Every rank holds ``--tokens`` tokens of its own (weak scaling: the expert work per rank is the
same at every ep, about tokens x top-k rows); the layer is the same at every ep (``seed=0``),
dropless, float32, on CPU, one intra-op thread per rank. Rows of the table:

* ``ep1 alone``: the layer with a group of one rank (every expert local, no communication) on
  rank 0 while the other ranks wait: the reference of the ``vs_ep1`` ratios;
* ``ep1 each``: the same on every rank at once (no communication, but the cores shared as at
  ep N: with more ranks than cores, the part of ep N's time that is not the exchange's);
* ``epN``: the layer over ``fastpar.init(ep=N)``'s ep group (dp = the world).

One rep of each row in turn, ranks lined up before each; ``-w`` warm-up reps, then the median
of ``-n`` reps. A row's numbers are the mean over its ranks of each rank's median.

How the time is split. ``MoE.phase_hook`` is called as each forward phase ends, with the
phase's result; the hook here reads ``time.perf_counter()`` there (on CPU every op has finished
when it returns, so forward times are exact) and registers two autograd hooks for the backward:
a tensor hook on each phase's result, which runs when that tensor's gradient is complete, i.e.
when the backward of everything after it in the forward has run, and a post-hook on the node
of the permute's one op (the gather of the rows in expert order). The CPU autograd engine runs
every node on the calling thread, the ready node made latest in the forward first, and the
phases form a chain (each takes the last one's result; the gates, made in route and used in
combine, have their route nodes run last, being older), so the backward runs the phases one after
the other in reverse, and the time between two hooks is one phase's backward (checked once by
logging every node as it ran). What the
hooks leave (after the permute's node: the router, top-k, softmax and both router losses'
backward) is route's. The hooks' own cost is kept out of the phases, so in each rep the phases
add up to a little less than the total (``unattributed_ms``: the median of the difference); the
``hook%`` line compares the total with the hook off.

    route:    router GEMM, softmax, top-k, router losses, the sort by expert (and backward)
    dispatch: permute (the rows gathered in expert order), the counts' all-to-all (ep > 1),
              the rows' all_to_all_rows out (and their backward: a scatter-add, the transposed
              all-to-all)
    experts:  padding into (L, C_max, hidden), the bmm GEMMs, the unpadding (and backward)
    combine:  the all_to_all_rows back (ep > 1), then the gate-weighted index_add over the k
              choices (the unpermute) (and backward, with the gates' gather)

``a2a%`` is the share of the exchanges alone (counts, out, back: forward and backward).

The all-to-all's bandwidth: each rank sends ``send`` rows out (its slots) and ``recv`` rows back
(what it received), once forward and once backward, so one exchange moves ``(send + recv) / 2 x
hidden x 4`` bytes per rank on average. An exchange blocks until every peer has arrived, so
its time on a rank also holds the wait for a slower peer (after the experts, the rank with more
rows); the rank that arrives last waits for nobody. Lines: "as paid" is the four exchanges'
mean time over ranks (what the layer pays), "last arrival" the mean over the four of the least
time over ranks (the transfer itself: its GB/s is ``algbw_gbps`` in the JSON, ``busbw_gbps``
algbw x (n-1)/n as nccl-tests), "standalone" ``comm.all_to_all_v`` of the layer's counts on its
own. ``bound`` is the time every rank takes to copy the same bytes at once (``memcpy``) over
the exchange's, as bench/collectives.py's bound column: every byte crosses once.
"""

import json
import os
import statistics
import time

import torch

import fastpar
from fastpar import comm
from fastpar.runtime.cli import Parser
from fastpar.runtime.launcher import launched_world_size

# Configuration.
HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 256, 1024, 8, 2, 2048
DTYPE = torch.float32
WARMUP, REPS = 3, 10
THREADS = 1
# Each phase the layer reports (MoE.phase_hook), in the bench's four parts.
PARTS = {"route": ("route",), "dispatch": ("permute", "counts", "a2a_out"),
         "experts": ("experts",), "combine": ("a2a_back", "unpermute")}
EXCHANGES = ("counts", "a2a_out", "a2a_back")
TARGET = 0.30  # issue 24: dispatch + combine <= 30% of the layer's time at ep 2


class PhaseClock:
    """``MoE.phase_hook`` timing one forward+backward per phase (see the module docstring)."""

    def begin(self) -> None:
        self.forward, self.backward, self.order = {}, {}, []
        self.mark = time.perf_counter()

    def __call__(self, phase: str, tensor) -> None:
        self.forward[phase] = time.perf_counter() - self.mark
        self.backward[phase] = 0.0
        self.order.append(phase)
        if tensor is not None and tensor.requires_grad:
            tensor.register_hook(lambda grad, p=phase: self._lap(self.owner[p]))
            if phase == "permute":  # its one node done: the permute's backward done
                tensor.grad_fn.register_hook(lambda *grads: self._lap("permute"))
        self.mark = time.perf_counter()  # the hook's own time kept out of the phases

    def begin_backward(self) -> None:
        # A tensor's gradient complete ends the backward of the phase after it (counts moves
        # integers: no backward); the output's, at the start, counts to the last phase.
        order = [p for p in self.order if p != "counts"]
        self.owner = dict(zip(order, order[1:] + order[-1:]))
        self.mark = time.perf_counter()

    def end_backward(self) -> None:
        self._lap("route")

    def _lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.backward[phase] += now - self.mark
        self.mark = now


def step(moe, x, dy, clock) -> dict:
    """One forward+backward (loss: sum(y * dy) + aux_loss); seconds in total and, with a
    ``clock``, per phase."""
    moe.phase_hook = clock
    if clock is not None:
        clock.begin()
    start = time.perf_counter()
    y = moe(x)
    if clock is not None:
        clock.begin_backward()
    torch.autograd.backward([y, moe.aux_loss], [dy, torch.ones_like(moe.aux_loss)])
    if clock is not None:
        clock.end_backward()
    total = time.perf_counter() - start
    moe.zero_grad(set_to_none=True)
    x.grad = None
    if clock is None:
        return {"total": total}
    return {"total": total, "fwd": clock.forward, "bwd": clock.backward}


def summary(samples: list) -> dict:
    """One rank's medians over its reps: the total, each part (forward + backward), the
    exchanges, and every phase's forward and backward."""
    def median(f):
        return statistics.median(f(s) for s in samples)

    out = {"total": median(lambda s: s["total"])}
    if "fwd" not in samples[0]:
        return out
    both = {name: (lambda s, ps=phases: sum(s["fwd"].get(p, 0.0) + s["bwd"].get(p, 0.0)
                                            for p in ps)) for name, phases in PARTS.items()}
    both["a2a"] = lambda s: sum(s["fwd"].get(p, 0.0) + s["bwd"].get(p, 0.0) for p in EXCHANGES)
    out.update({name: median(f) for name, f in both.items()})
    out["unattributed"] = median(lambda s: s["total"] - sum(s["fwd"].values())
                                 - sum(s["bwd"].values()))
    for p in samples[0]["fwd"]:
        out[f"fwd_{p}"] = median(lambda s: s["fwd"][p])
        out[f"bwd_{p}"] = median(lambda s: s["bwd"][p])
    return out


def median_seconds(call, barrier, warmup: int, reps: int) -> float:
    times = []
    for i in range(warmup + reps):
        barrier()
        start = time.perf_counter()
        call()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = Parser(description=__doc__)
    p.add_argument("--hidden", type=int, default=HIDDEN)
    p.add_argument("--ffn", type=int, default=FFN)
    p.add_argument("--experts", type=int, default=EXPERTS)
    p.add_argument("--top-k", type=int, default=TOP_K)
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens per rank")
    p.add_argument("-w", "--warmup", type=int, default=WARMUP)
    p.add_argument("-n", "--reps", type=int, default=REPS)
    p.add_argument("--json", help="write the results to this path (rank 0)")
    args = p.parse_args()
    for name in ("hidden", "ffn", "experts", "top_k", "tokens", "reps"):
        value = getattr(args, name)
        p.check(value >= 1, f"--{name.replace('_', '-')} must be at least 1, got {value}")
    p.check(args.warmup >= 0, f"--warmup must be at least 0, got {args.warmup}")
    p.check(args.top_k <= args.experts,
            f"--top-k {args.top_k} is larger than --experts {args.experts}")
    world = launched_world_size()
    p.check(args.experts % world == 0, f"--experts {args.experts} is not divisible by the "
                                       f"{world} ranks (ep = the world)")
    torch.set_num_threads(THREADS)
    load_start = os.getloadavg()
    topo = fastpar.init(ep=world)  # dp = the world, one ep group of every rank
    n, rank = topo.world_size, topo.rank
    import torch.distributed as dist

    # Groups of one rank for ep 1 (new_group is collective: every rank builds every one).
    alone = [dist.new_group([r]) for r in range(n)][rank]
    barrier = dist.barrier if n > 1 else (lambda: None)
    gen = torch.Generator().manual_seed(1000 + rank)  # every rank its own tokens
    x = torch.randn(args.tokens, args.hidden, generator=gen, dtype=DTYPE).requires_grad_(True)
    dy = torch.randn(args.tokens, args.hidden, generator=gen, dtype=DTYPE)

    def layer(group):
        return fastpar.nn.MoE(args.hidden, args.ffn, args.experts, args.top_k, group=group,
                              seed=0, dtype=DTYPE)

    clock, single = PhaseClock(), layer(alone)
    # (row, module, clock, on this rank)
    runs = [("ep1 alone", single, clock, rank == 0)]
    if n > 1:
        parallel = layer(topo.ep_group)
        runs += [("ep1 each", single, clock, True), (f"ep{n}", parallel, clock, True)]
    runs.append(("hook off", runs[-1][1], None, runs[-1][3]))
    samples = [[] for _ in runs]
    for i in range(args.warmup + args.reps):
        for j, (_, module, c, here) in enumerate(runs):
            barrier()
            if here:
                s = step(module, x, dy, c)
                if i >= args.warmup:
                    samples[j].append(s)

    # The layer's exchange on its own, and a copy of its bytes, on every rank at once.
    top = runs[-1][1]
    with torch.no_grad():
        top(x)
    send = top.expert_load.view(top.ep, -1).sum(1)  # rows to each rank (dropless: every slot)
    recv = comm.all_to_all(send, topo.ep_group) if n > 1 else send
    send, recv = send.tolist(), recv.tolist()
    exchange_bytes = (sum(send) + sum(recv)) / 2 * args.hidden * DTYPE.itemsize
    standalone = None
    if n > 1:
        rows = torch.randn(sum(send), args.hidden, dtype=DTYPE)
        standalone = median_seconds(
            lambda: comm.all_to_all_v(rows, send, recv, topo.ep_group), barrier, args.warmup,
            args.reps)
    src = torch.ones(int(exchange_bytes), dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy = median_seconds(lambda: dst.copy_(src), barrier, args.warmup, args.reps)
    mine = {"runs": [summary(s) if s else None for s in samples], "standalone": standalone,
            "memcpy": copy, "bytes": exchange_bytes, "received": sum(recv)}
    every = [None] * n
    if n > 1:
        dist.all_gather_object(every, mine)
    else:
        every = [mine]
    load_end = os.getloadavg()
    if rank == 0:
        report(args, topo, runs, every, load_start, load_end)
    fastpar.shutdown()


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def report(args, topo, runs, every, load_start, load_end) -> None:
    n = topo.world_size
    rows = []
    for j, (name, module, clock, _) in enumerate(runs):
        mine = [e["runs"][j] for e in every if e["runs"][j] is not None]
        row = {"row": name, "ep": module.ep, "ranks": len(mine), "hook": clock is not None,
               "total_ms": mean(m["total"] for m in mine) * 1e3,
               "total_max_ms": max(m["total"] for m in mine) * 1e3}
        for key in mine[0]:
            if key != "total":
                row[f"{key}_ms"] = mean(m[key] for m in mine) * 1e3
        rows.append(row)
    reference = rows[0]["total_ms"]
    for row in rows:
        row["vs_ep1"] = row["total_ms"] / reference
        if row["hook"]:
            phases = sum(row[f"{part}_ms"] for part in PARTS)
            row["phases_ms"] = phases
            row["dispatch_combine"] = (row["dispatch_ms"] + row["combine_ms"]) / phases
            row["a2a_share"] = row["a2a_ms"] / phases
    hooked, off = rows[-2], rows[-1]
    hook_cost = hooked["total_ms"] / off["total_ms"] - 1
    a2a = None
    if n > 1:  # the four exchanges of rows: out and back, forward and backward
        keys = [f"{d}_{p}" for d in ("fwd", "bwd") for p in ("a2a_out", "a2a_back")]
        ranks = [e["runs"][len(runs) - 2] for e in every]
        paid = mean(mean(r[k] for r in ranks) for k in keys)
        transfer = mean(min(r[k] for r in ranks) for k in keys)
        nbytes = mean(e["bytes"] for e in every)
        copy, alone = mean(e["memcpy"] for e in every), mean(e["standalone"] for e in every)
        algbw = nbytes / transfer / 1e9
        a2a = {"bytes": nbytes, "in_layer_us": paid * 1e6, "transfer_us": transfer * 1e6,
               "standalone_us": alone * 1e6, "memcpy_us": copy * 1e6, "algbw_gbps": algbw,
               "busbw_gbps": algbw * (n - 1) / n, "in_layer_bound": copy / paid,
               "bound": copy / transfer, "standalone_bound": copy / alone,
               "received_rows": [e["received"] for e in every]}
    target = None
    if n == 2:
        share = hooked["dispatch_combine"]
        target = {"target": f"dispatch + combine <= {TARGET:.0%} of the layer at ep 2",
                  "measured": share, "met": share <= TARGET}

    print(f"# MoE forward+backward: {args.tokens} tokens/rank, hidden {args.hidden}, ffn "
          f"{args.ffn}, {args.experts} experts, top-{args.top_k}, dropless, float32, {THREADS} "
          f"thread/rank, {n} rank(s), median of {args.reps}; load average "
          f"{load_start[0]:.1f} -> {load_end[0]:.1f} ({os.cpu_count()} cores)")
    print(f"{'row':>10} {'ep':>3} {'total_ms':>9} {'route':>8} {'dispatch':>8} {'experts':>8} "
          f"{'combine':>8} {'d+c%':>6} {'a2a%':>6} {'vs_ep1':>7}")
    for r in rows:
        if not r["hook"]:
            continue
        print(f"{r['row']:>10} {r['ep']:>3} {r['total_ms']:9.2f} {r['route_ms']:8.2f} "
              f"{r['dispatch_ms']:8.2f} {r['experts_ms']:8.2f} {r['combine_ms']:8.2f} "
              f"{r['dispatch_combine']:6.1%} {r['a2a_share']:6.1%} {r['vs_ep1']:7.3f}")
    print(f"hook%: the phase hook costs {hook_cost:+.1%} of {hooked['row']}'s total "
          f"({off['total_ms']:.2f} ms without it); time outside the phases "
          f"{hooked['unattributed_ms']:.2f} ms a rep (the phases are medians taken apart, so "
          f"they add up to the total only roughly)")
    phases = [k[4:-3] for k in hooked if k.startswith("fwd_")]
    print("\n# per phase, ms forward / backward")
    print(f"{'row':>10} " + " ".join(f"{p:>15}" for p in phases))
    for r in rows:
        if r["hook"]:
            print(f"{r['row']:>10} " + " ".join(
                f"{r.get(f'fwd_{p}_ms', 0):7.2f}/{r.get(f'bwd_{p}_ms', 0):<7.2f}"
                for p in phases))
    if a2a:
        print(f"\n# all_to_all_rows in the layer: {a2a['bytes'] / 2**20:.2f} MiB/rank per "
              f"exchange (rows received per rank {a2a['received_rows']})")
        print(f"{'exchange':>28} {'time_us':>8} {'GB/s':>6} {'bound':>6}")
        for label, us, bound in (
                ("in the layer, as paid", a2a["in_layer_us"], a2a["in_layer_bound"]),
                ("in the layer, last arrival", a2a["transfer_us"], a2a["bound"]),
                ("standalone all_to_all_v", a2a["standalone_us"], a2a["standalone_bound"]),
                ("memcpy of the same bytes", a2a["memcpy_us"], 1.0)):
            print(f"{label:>28} {us:8.0f} {a2a['bytes'] / us / 1e3:6.2f} {bound:6.0%}")
    if target:
        print(f"target: {target['target']}: {target['measured']:.1%} "
              f"{'met' if target['met'] else 'NOT met'}")
    if args.json:
        config = {k: getattr(args, k) for k in ("hidden", "ffn", "experts", "top_k", "tokens",
                                                "warmup", "reps")}
        env = {"world_size": n, "threads": THREADS, "cores": os.cpu_count(),
               "load_avg_start": list(load_start), "load_avg_end": list(load_end)}
        with open(args.json, "w") as f:
            json.dump({"config": config, "env": env, "rows": rows, "hook_cost": hook_cost,
                       "a2a": a2a, "target": target}, f, indent=1)


if __name__ == "__main__":
    main()
