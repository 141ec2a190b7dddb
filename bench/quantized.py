"""Training with quantized communication (issue 23): does it converge like full precision, and
is it faster where the link is the bottleneck?

    python bench/quantized.py                              # small preset, 300 steps, 4 ranks
    python bench/quantized.py --preset tiny --steps 100 --runs base,grads-ef --seeds 2
    python bench/quantized.py --cluster --link-gbit 1      # tokens/s on 2 hosts x 2 ranks

Convergence: ``python -m fastpar.train`` under ``mpirun -np N`` (dp N, ZeRO-3, float32), one job
per run, the same data and seed: ``base`` (full precision) and each quantized option:

    weights      --quantize-weights int8         (ZeRO-3's parameter all-gathers)
    grads        --quantize-grads int8           (the gradients' reduce-scatter)
    grads-ef     --quantize-grads int8 --error-feedback
    both-ef      all three
    dp-ef        DataParallel (no ZeRO) with --quantize-grads int8 --error-feedback, beside
                 ``dp`` (DataParallel in full precision)

(one host: the shm engine forced, so that every call is int8 whatever its size) and ``base``
again with seeds 1 .. S-1 (``--seeds S``): how far two full-precision runs that
differ only in their seed end apart is the noise the quantized runs are measured against. For
each run: the mean train loss over the last 10% of the steps and the final validation loss, and
their distance from the full-precision run of the same seed; a run *converges like full
precision* when both distances are within the seeds' largest distance (the tolerance, printed).
All loss curves go in one plot (``--plot``).

Throughput (``--cluster``): the same model on the simulated cluster (``fastpar.testing.
cluster``: 2 hosts x N/2 ranks, links shaped to ``--link-gbit``), base against both-ef (ZeRO-3,
so every step all-gathers the weights and reduce-scatters the gradients across the link):
tokens/s (median of the logged rates after the first log) and the ratio (target >= 1.3x when
the link is the bottleneck). Needs root (namespaces); says so otherwise.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from fastpar.runtime.cli import Parser  # noqa: E402
from fastpar.training.metrics import read_records  # noqa: E402

ZERO3 = ["--zero", "3"]
RUNS = {
    "base": ZERO3,
    "weights": [*ZERO3, "--quantize-weights", "int8"],
    "grads": [*ZERO3, "--quantize-grads", "int8"],
    "grads-ef": [*ZERO3, "--quantize-grads", "int8", "--error-feedback"],
    "both-ef": [*ZERO3, "--quantize-weights", "int8", "--quantize-grads", "int8",
                "--error-feedback"],
    "dp": [],
    "dp-ef": ["--quantize-grads", "int8", "--error-feedback"],
}
BASE_OF = {"dp-ef": "dp"}  # the full-precision run each is compared with (default: base)


def train_argv(args, flags, seed, metrics):
    return [sys.executable, "-m", "fastpar.train", "--preset", args.preset, "--steps",
            str(args.steps), "--log-every", str(args.log_every), "--seed", str(seed),
            "--no-progress", "--plot", "", "--metrics", metrics, *flags]


def run_local(args, name, flags, seed) -> dict:
    """One training job on this host; its records."""
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    with tempfile.TemporaryDirectory(prefix="fastpar-quant-bench-") as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        start = time.perf_counter()
        proc = subprocess.run([mpirun, "-np", str(args.np), *train_argv(args, flags, seed,
                                                                         metrics)],
                              capture_output=True, text=True, cwd=ROOT, timeout=args.timeout,
                              env={**os.environ, "OMP_NUM_THREADS": "1",
                                   # forced: every call int8 whatever its size (unforced, one
                                   # host's calls under 1 MiB stay full precision: the policy)
                                   "FASTPAR_COMM_BACKEND": "shm"},
                              stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise RuntimeError(f"run {name} (seed {seed}) failed ({proc.returncode}):\n"
                               f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        records = [r for r in read_records(metrics) if "loss" in r]
    print(f"  {name:<9} seed {seed}: {time.perf_counter() - start:6.1f} s, last loss "
          f"{records[-1]['loss']:.4f}", flush=True)
    return {"name": name, "seed": seed, "flags": flags, "records": records}


def summarize(run, steps) -> dict:
    recs = run["records"]
    tail = [r["loss"] for r in recs if r["step"] > 0.9 * steps]
    vals = [r["val_loss"] for r in recs if r.get("val_loss") is not None]
    rates = [r["tokens_per_s"] for r in recs[1:] if r.get("tokens_per_s")]
    return {"name": run["name"], "seed": run["seed"], "flags": run["flags"],
            "tail_loss": statistics.fmean(tail), "val_loss": vals[-1] if vals else None,
            "tokens_per_s": statistics.median(rates) if rates else None,
            "curve": [[r["step"], r["loss"]] for r in recs]}


def convergence(args) -> dict:
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"--runs: unknown {unknown}; choose from {', '.join(RUNS)}")
    for n in names:  # every quantized run needs its full-precision partner
        partner = BASE_OF.get(n, "base")
        if n != partner and partner not in names:
            names.insert(0, partner)
    print(f"convergence: preset {args.preset}, {args.steps} steps, mpirun -np {args.np}, "
          f"runs {', '.join(names)}, noise from seeds 0..{args.seeds - 1}", flush=True)
    rows = [summarize(run_local(args, n, RUNS[n], 0), args.steps) for n in names]
    noise = [summarize(run_local(args, "base", RUNS["base"], s), args.steps)
             for s in range(1, args.seeds)]
    base = next(r for r in rows if r["name"] == "base") if "base" in names else None
    tol = {"tail_loss": 0.0, "val_loss": 0.0}
    for r in noise:
        for k in tol:
            tol[k] = max(tol[k], abs(r[k] - base[k]))
    for r in rows:
        ref = next(b for b in rows if b["name"] == BASE_OF.get(r["name"], "base"))
        r["d_tail"] = r["tail_loss"] - ref["tail_loss"]
        r["d_val"] = r["val_loss"] - ref["val_loss"]
        r["converges"] = abs(r["d_tail"]) <= tol["tail_loss"] and \
            abs(r["d_val"]) <= tol["val_loss"] if noise else None
    return {"rows": rows, "noise": noise, "tolerance": tol}


def throughput(args) -> dict:
    from fastpar.testing.cluster import NamespaceCluster, cluster_unavailable

    reason = cluster_unavailable()
    if reason:
        raise SystemExit(f"--cluster: {reason}")
    rate = f"{args.link_gbit:g}gbit"
    out = []
    with NamespaceCluster(2, rate=rate) as c:
        env = c.env({"OMP_NUM_THREADS": "1", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"})
        for repeat in range(args.repeat):
            for name in ("base", "both-ef"):
                with tempfile.TemporaryDirectory(prefix="fastpar-quant-bench-",
                                                 dir=ROOT) as tmp:
                    metrics = os.path.join(tmp, "m.jsonl")
                    proc = c.mpirun(train_argv(args, RUNS[name], 0, metrics), ppn=args.np // 2,
                                    env=env, timeout=args.timeout)
                    if proc.returncode != 0:
                        raise RuntimeError(f"{name} on the cluster failed:\n"
                                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
                    run = {"name": name, "seed": 0, "flags": RUNS[name],
                           "records": [r for r in read_records(metrics) if "loss" in r]}
                s = summarize(run, args.steps)
                s["repeat"] = repeat
                print(f"  {name:<8} round {repeat}: {s['tokens_per_s']:,.0f} tokens/s", flush=True)
                out.append(s)
    best = {n: max(r["tokens_per_s"] for r in out if r["name"] == n) for n in ("base", "both-ef")}
    return {"link_gbit": args.link_gbit, "rows": out, "best": best,
            "ratio": best["both-ef"] / best["base"]}


def plot(rows, path, title):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for r in rows:
        steps, losses = zip(*r["curve"])
        label = r["name"] + ("" if r["seed"] == 0 else f" (seed {r['seed']})")
        ax.plot(steps, losses, "-" if r["seed"] == 0 else ":", label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats per byte)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, format="png")


def main() -> int:
    p = Parser(description=__doc__)
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--np", type=int, default=4, help="ranks (dp); --cluster: split over 2 hosts")
    p.add_argument("--runs", default="base,weights,grads,grads-ef,both-ef,dp,dp-ef")
    p.add_argument("--seeds", type=int, default=3, help="full-precision seeds for the noise")
    p.add_argument("--cluster", action="store_true", help="tokens/s on 2 shaped hosts instead")
    p.add_argument("--link-gbit", type=float, default=1.0)
    p.add_argument("--repeat", type=int, default=2, help="--cluster: rounds (best is shown)")
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG of every run's loss curve")
    args = p.parse_args()
    p.check(args.steps >= 2 * args.log_every, "--steps must be at least 2 x --log-every")
    p.check(args.seeds >= 1, f"--seeds must be at least 1, got {args.seeds}")
    p.check(args.np >= 2 and (not args.cluster or args.np % 2 == 0),
            f"--np must be at least 2 (even with --cluster), got {args.np}")
    if args.cluster:
        result = throughput(args)
        print(f"\nZeRO-3 on 2 hosts x {args.np // 2} ranks, links {args.link_gbit:g} Gbit/s, "
              f"preset {args.preset}: base {result['best']['base']:,.0f} tokens/s, int8 "
              f"weights + gradients {result['best']['both-ef']:,.0f} tokens/s = "
              f"{result['ratio']:.2f}x (target 1.3x)")
    else:
        result = convergence(args)
        tol = result["tolerance"]
        print(f"\nnoise (seeds 1..{args.seeds - 1} against 0): tail loss {tol['tail_loss']:.4f}, "
              f"val loss {tol['val_loss']:.4f}")
        print(f"{'run':<10} {'tail loss':>9} {'d tail':>8} {'val loss':>9} {'d val':>8} "
              f"{'tok/s':>8}  converges like full precision")
        for r in result["rows"]:
            print(f"{r['name']:<10} {r['tail_loss']:>9.4f} {r['d_tail']:>+8.4f} "
                  f"{r['val_loss']:>9.4f} {r['d_val']:>+8.4f} {r['tokens_per_s'] or 0:>8,.0f}  "
                  f"{'-' if r['converges'] is None else ('yes' if r['converges'] else 'NO')}")
        if args.plot:
            plot(result["rows"] + result["noise"], args.plot,
                 f"{args.preset}, {args.steps} steps, dp {args.np}: int8 communication")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), **result}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
