"""``python -m fastpar plan``: the layouts of a model on a cluster, ranked by predicted step
time, with memory per rank, and why the others were dropped.

    python -m fastpar plan --preset small --ranks 4 --calibrate       # measure this machine
    python -m fastpar plan --preset small --ranks 4 --cluster fastpar_cluster.json
    python -m fastpar plan --hf-config llama/config.json --hosts 8 --ranks-per-host 8 \\
        --cluster h100.json --global-batch 512 --seq-len 8192 --json plan.json
    python -m fastpar plan --preset small --ranks 4 --cluster c.json --explain tp2.pp2.mb8

A cluster is a file (``--cluster``; ``--calibrate`` measures this machine and writes one, to
``--cluster`` or ``fastpar_cluster.json``), or flags (``--peak-tflops``, ``--memory-gb``,
``--membw-gbps``, ``--intra-gbps``, and across hosts ``--inter-gbps``). ``--ranks`` or
``--hosts`` x ``--ranks-per-host`` give the ranks. A bad flag is one line and exit status 2.
"""

from __future__ import annotations

import collections
import json
import sys

import torch

GiB, MiB = 2**30, 2**20


def parse_args(argv):
    from fastpar.runtime.cli import Parser

    p = Parser(prog="python -m fastpar plan", description=__doc__)
    a = p.add_argument
    a("--preset", default=None, help="a fastpar.models preset (tiny, small)")
    a("--hf-config", default=None, help="a Hugging Face config.json")
    for flag in ("layers", "hidden", "heads", "kv-heads", "ffn-hidden", "vocab-size",
                 "moe-experts", "moe-top-k"):
        a(f"--{flag}", type=int, default=None, help="model override")
    a("--mlp", default=None, choices=["swiglu", "gelu"])
    a("--tie-embeddings", action="store_true", default=None)
    a("--sequence-parallel", action="store_true", default=None)
    a("--ranks", type=int, default=None, help="ranks on one host")
    a("--hosts", type=int, default=None)
    a("--ranks-per-host", type=int, default=None)
    a("--global-batch", type=int, default=16, help="sequences per step (default 16)")
    a("--seq-len", type=int, default=None, help="tokens per sequence (default: the model's)")
    a("--dtype", default=None, choices=["float32", "bfloat16"],
      help="default: bfloat16 on a cuda cluster, float32 on cpu")
    a("--cluster", default=None, help="cluster file (JSON); with --calibrate: where to write it")
    a("--calibrate", action="store_true", help="measure this machine first (~1 minute)")
    a("--device", default="cuda", choices=["cuda", "cpu"], help="cluster from flags: device")
    a("--peak-tflops", type=float, default=None, help="cluster from flags: dense peak")
    a("--memory-gb", type=float, default=None, help="cluster from flags: memory per rank")
    a("--membw-gbps", type=float, default=None, help="cluster from flags: GB/s of memory")
    a("--intra-gbps", type=float, default=None, help="GB/s bus bandwidth of a rank in a host")
    a("--intra-latency-us", type=float, default=5.0)
    a("--inter-gbps", type=float, default=None, help="GB/s of a host's links to the others")
    a("--inter-latency-us", type=float, default=10.0)
    a("--gemm-efficiency", type=float, default=0.7, help="cluster from flags: of peak")
    a("--top", type=int, default=10, help="layouts printed (default 10)")
    a("--json", default=None, help="write every predicted layout here")
    a("--all", action="store_true", help="predict every layout (default: the search prunes "
      "to the --top fastest that fit; --json then holds the layouts predicted in full)")
    a("--explain", default=None, metavar="LAYOUT", help="every term of one layout, e.g. "
      "tp2.pp2.dp1.zero1.full.1f1b.mb8")
    args = p.parse_args(argv)
    for name in ("ranks", "hosts", "ranks_per_host", "global_batch", "seq_len", "top"):
        value = getattr(args, name)
        p.check(value is None or value >= 1,
                f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.ranks is not None:
        p.check(args.hosts is None and args.ranks_per_host is None,
                f"--ranks {args.ranks} with --hosts/--ranks-per-host: give one or the other")
    else:
        p.check(args.hosts is not None and args.ranks_per_host is not None,
                "give --ranks N, or --hosts H and --ranks-per-host R")
    return p, args


def model_of(args):
    from fastpar.plan.model import build

    names = {"layers": "layers", "hidden": "hidden", "heads": "heads", "kv_heads": "kv_heads",
             "ffn_hidden": "ffn_hidden", "vocab_size": "vocab_size", "seq_len": "seq_len",
             "mlp": "mlp", "tie_embeddings": "tie_embeddings", "moe_experts": "moe_experts",
             "moe_top_k": "moe_top_k", "sequence_parallel": "sequence_parallel"}
    return build(args.preset, args.hf_config, {f: getattr(args, a) for a, f in names.items()})


def cluster_of(args, p, fit=None):
    from fastpar.plan.cluster import Cluster, Link

    hosts, rph = (1, args.ranks) if args.ranks is not None else (args.hosts, args.ranks_per_host)
    if args.calibrate:
        from fastpar.plan.calibrate import calibrate

        path = args.cluster or "fastpar_cluster.json"
        cluster = calibrate(hosts=hosts, ranks_per_host=rph, inter=_inter(args),
                            cfg=model_of(args), fit=fit)
        cluster.save(path)
        print(f"[fastpar plan] calibrated this machine: {path}", flush=True)
        return cluster
    if args.cluster:
        return Cluster.load(args.cluster).with_ranks(hosts, rph)
    need = [f for f, v in (("--peak-tflops", args.peak_tflops), ("--memory-gb", args.memory_gb),
                           ("--membw-gbps", args.membw_gbps), ("--intra-gbps", args.intra_gbps))
            if v is None]
    if hosts > 1 and args.inter_gbps is None:
        need.append("--inter-gbps")
    if need:
        p.error(f"no cluster: give --cluster FILE, --calibrate, or {' '.join(need)}")
    for flag, v in (("--peak-tflops", args.peak_tflops), ("--memory-gb", args.memory_gb),
                    ("--membw-gbps", args.membw_gbps), ("--intra-gbps", args.intra_gbps),
                    ("--gemm-efficiency", args.gemm_efficiency)):
        p.check(v > 0, f"{flag} must be > 0, got {v}")
    return Cluster(name="flags", device=args.device, hosts=hosts, ranks_per_host=rph,
                   peak_flops=args.peak_tflops * 1e12, memory_bytes=args.memory_gb * 1e9,
                   membw_Bps=args.membw_gbps * 1e9,
                   intra=Link(args.intra_latency_us * 1e-6, args.intra_gbps * 1e9),
                   inter=_inter(args), gemm_efficiency=min(args.gemm_efficiency, 1.0))


def _inter(args):
    from fastpar.plan.cluster import Link

    if args.inter_gbps is None:
        return None
    return Link(args.inter_latency_us * 1e-6, args.inter_gbps * 1e9)


def _unit(budget: float) -> tuple[float, str]:
    return (GiB, "GiB") if budget >= 16 * GiB else (MiB, "MiB")


def header(cfg, cluster, global_batch, dtype) -> str:
    return (f"model: {cfg.num_params() / 1e6:,.1f} M params ({cfg.layers} layers, hidden "
            f"{cfg.hidden}, heads {cfg.heads}/{cfg.num_kv_heads} kv, ffn {cfg.ffn_size}, vocab "
            f"{cfg.vocab_size}, seq {cfg.seq_len}), {str(dtype).removeprefix('torch.')}, global "
            f"batch {global_batch}\ncluster {cluster.name}: {cluster.hosts} host(s) x "
            f"{cluster.ranks_per_host} ranks ({cluster.device}), peak "
            f"{cluster.peak_flops / 1e12:g} TFLOP/s, {cluster.memory_bytes / GiB:.1f} GiB per "
            f"rank")


def table(preds, budget) -> list[str]:
    from fastpar.plan.memory import CATEGORIES

    unit, name = _unit(budget)
    width = max([len(p.layout.name) for p in preds] + [6])
    cats = " ".join(f"{c[:7]:>8}" for c in CATEGORIES)
    lines = [f"{'#':>3} {'layout':<{width}} {'step ms':>9} {'tokens/s':>10} {'MFU':>6} "
             f"{'bubble':>6} {cats} {'total':>8}  ({name}, worst rank)"]
    for k, p in enumerate(preds, 1):
        mem = " ".join(f"{p.memory[c] / unit:>8.2f}" for c in CATEGORIES)
        lines.append(f"{k:>3} {p.layout.name:<{width}} {p.step_time_s * 1e3:>9.2f} "
                     f"{p.tokens_per_s:>10,.0f} {p.mfu:>6.1%} {p.bubble:>6.1%} {mem} "
                     f"{p.memory_total / unit:>8.2f}")
    return lines


def explain(pred, cfg, cluster) -> list[str]:
    """Every term of one prediction."""
    from fastpar.plan.memory import CATEGORIES

    t, lay = pred.terms, pred.layout
    unit, uname = _unit(pred.memory_budget)
    out = [f"layout {lay.name}: {lay.ranks} ranks = tp {lay.tp} x cp {lay.cp} x pp {lay.pp} x "
           f"dp {lay.dp}" + (f" (ep {lay.ep} inside dp)" if lay.ep > 1 else "") +
           f"; {lay.microbatches} microbatches of {t['rows_per_microbatch']} sequences; "
           f"schedule {lay.schedule}" + (f" over {lay.virtual_stages} chunks per rank"
                                          if lay.virtual_stages > 1 else "") +
           f"; ZeRO-{lay.zero}; recompute {lay.recompute}",
           "per microbatch, one rank, ms (f forward, i input gradient + recompute + backward "
           "collectives, w weight gradient):"]
    names = {0: "embedding", cfg.layers + 1: "head", "block": "each block",
             "moe": "each MoE block"}
    for key, work in t["layer"].items():
        out.append(f"  {names[key]}: f {work.f * 1e3:.4f}  i {work.i * 1e3:.4f}  w "
                   f"{work.w * 1e3:.4f}")
        for term, s in work.terms.items():
            out.append(f"    {term:<34} {s * 1e3:>10.4f}")
    zb = lay.schedule == "zb"
    out.append("stages (per microbatch, ms; send: the activation to the next stage" + (
        "; w with the split backward's extra" if zb else "") + "):")
    last = len(t["stages"]) - 1
    for s, st in enumerate(t["stages"]):
        send = st["send"] if s < last else 0.0
        w = st["w"] + (st["zb"] if zb else 0.0)
        out.append(f"  stage {s} (rank {s % lay.pp}, layers {st['layers'][0]}..."
                   f"{st['layers'][1] - 1}): f {st['f'] * 1e3:.4f}  i {st['i'] * 1e3:.4f}  "
                   f"w {w * 1e3:.4f}  send {send * 1e3:.4f}")
    out.append(f"pipeline (pipeline.timeline.simulate of the {lay.schedule} action lists): "
               f"makespan {t['makespan_s'] * 1e3:.3f} ms, busy {t['busy_s'] * 1e3:.3f} "
               f"rank-ms, bubble {pred.bubble:.2%}")
    out.append("per rank, ms (after the pipeline; not overlapped by the trainer):")
    for r, row in enumerate(t["ranks"]):
        extra = "  ".join(f"{k} {v * 1e3:.4f}" for k, v in row.items()
                          if k not in ("pipeline_s", "end_s", "elements"))
        out.append(f"  rank {r}: pipeline {row['pipeline_s'] * 1e3:.3f}  {extra}  -> end "
                   f"{row['end_s'] * 1e3:.3f} ({row['elements']:,} parameters)")
    out.append(f"step {pred.step_time_s * 1e3:.3f} ms (the slowest rank); tokens/s "
               f"{pred.tokens_per_s:,.0f}; MFU {pred.mfu:.2%} ({t['flops_per_token']:.4g} "
               f"FLOPs per token, peak {cluster.peak_flops / 1e12:g} TFLOP/s x {lay.ranks})")
    out.append(f"memory per pipeline rank, {uname} (plan.memory.predict_memory):")
    for r, mem in enumerate(t["memory_by_rank"]):
        cells = "  ".join(f"{c} {mem[c] / unit:.3f}" for c in CATEGORIES)
        out.append(f"  rank {r}: {cells}  total {sum(mem.values()) / unit:.3f}" +
                   ("  <- worst" if r == pred.memory_rank else ""))
    room = pred.memory_budget - pred.memory_total
    out.append(f"fits: {pred.fits} (budget {pred.memory_budget / unit:.2f} {uname}, "
               f"{'room' if room >= 0 else 'over by'} {abs(room) / unit:.2f} {uname})")
    return out


def main(argv=None, fit=None) -> int:
    """The command. ``fit``: what ``--calibrate`` with a model runs to fit the trainer's own
    step (``fastpar.training.fit.trainer_fit``, passed by ``python -m fastpar plan``: the
    planner never imports the trainer); None keeps the rate model alone."""
    from fastpar.plan.layouts import parse, why_not
    from fastpar.plan.predict import predict
    from fastpar.plan.search import search

    p, args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg = model_of(args)
        cluster = cluster_of(args, p, fit)
        layout = parse(args.explain, cluster.ranks) if args.explain else None
    except ValueError as exc:
        p.error(str(exc))
    dtype = getattr(torch, args.dtype or ("bfloat16" if cluster.device == "cuda" else
                                          "float32"))
    print(header(cfg, cluster, args.global_batch, dtype))
    if layout is not None:
        reason = why_not(cfg, layout, cluster.ranks, args.global_batch)
        if reason is not None:
            p.error(f"--explain {args.explain}: cannot run: {reason}")
        pred = predict(cfg, layout, cluster, args.global_batch, dtype=dtype)
        print("\n".join(explain(pred, cfg, cluster)))
        preds = [pred]
    else:
        result = search(cfg, cluster, args.global_batch, dtype=dtype,
                        top=None if args.all else args.top)
        preds = result.all()
        if args.all:
            print(f"{len(result.ranked) + len(result.too_big) + len(result.dropped)} layouts: "
                  f"{len(result.ranked)} fit, {len(result.too_big)} over memory, "
                  f"{len(result.dropped)} cannot run")
        else:
            print(f"{result.predicted + result.pruned + len(result.dropped)} layouts: "
                  f"{len(result.dropped)} cannot run; of the others the search predicted "
                  f"{result.predicted} (the rest are provably slower than row {args.top}), "
                  f"{len(result.too_big) + result.over_state} of them faster but over memory")
        if result.ranked:
            print("\n".join(table(result.ranked[:args.top], cluster.memory_bytes)))
        unit, uname = _unit(cluster.memory_bytes)
        if result.too_big:
            print(f"over memory ({len(result.too_big)}{'' if args.all else ' faster ones'}; the "
                  f"closest {min(3, len(result.too_big))} of the budget "
                  f"{cluster.memory_bytes / unit:.2f} {uname}):")
            for q in result.too_big[:3]:
                print(f"  {q.layout.name}: pipeline rank {q.memory_rank} needs "
                      f"{q.memory_total / unit:.2f} {uname}, over by "
                      f"{(q.memory_total - cluster.memory_bytes) / unit:.2f}")
        groups = collections.defaultdict(list)
        for name, reason in result.dropped:
            groups[reason].append(name)
        if groups:
            print("cannot run (count, reason, e.g.):")
            for reason, names in sorted(groups.items(), key=lambda kv: -len(kv[1])):
                print(f"  {len(names):>5}  {reason}  (e.g. {names[0]})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([q.to_json() for q in preds], f, indent=1)
        print(f"[fastpar plan] {len(preds)} layouts: {args.json}")
    return 0
