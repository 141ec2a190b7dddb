"""The planner against measured runs (issue 26, item 3): every layout of the main job on this
machine's ranks, predicted by ``fastpar plan`` from a calibration made at the start of this run,
then trained (``fastpar.train``, a few steps) and measured: step time and memory per category.

    python bench/plan_accuracy.py                              # calibrate, then every layout
    python bench/plan_accuracy.py --layouts tp2.pp2,dp4.zero3 --steps 12 --json out.json
    python bench/plan_accuracy.py --cluster c.json             # a calibration made before
    python bench/plan_accuracy.py --hosts 2 --rate 1gbit       # 2 x 2 namespaced hosts (root)

Per layout: ``mpirun -np RANKS python -m fastpar.train --preset PRESET`` with its flags,
``--metrics``; the measured step time is the median of rank 0's steps after ``--warmup`` (each
step ends in the loss's all-reduce, so rank 0's step is the job's); memory per category is each
rank's ``--metrics`` memory record (the trainer's measurement) against the planner's
prediction for that rank's pipeline stage. The table: predicted and measured step time and
their error, the rank of each layout by predicted and by measured time, and the largest
memory error per category over the ranks (categories under 64 KiB measured are skipped: a
ratio of nothing). The targets (issue 26): step time within 10% for every layout, the median
within 5%; memory within 5% per category; the top 3 layouts by prediction the top 3 measured.
Timings on a shared machine are noisy: the header and the JSON carry ``uptime``'s load before
and after; ``--rounds N`` runs every layout N times (the order reversed every other round) and
keeps each layout's fastest run (``rounds_s`` in the JSON: every run's step).

``--hosts H`` runs every job on H hosts made of namespaces on this machine
(``fastpar.testing.cluster``, root; ``--rate`` shapes each host's link): ``mpirun -hosts
h0,.. -ppn RANKS/H`` from h0, so that groups spanning hosts go through the hierarchical engine
and pipeline sends between hosts through gloo, as on a real cluster. The plan's cluster is this
machine's calibration with the hosts' link measured between them (``inter_link``:
``fastpar.plan.calibrate``'s link launch with one rank a host, the all-reduce across them
fitted to alpha-beta), and each host given its share of this machine's cores: the namespaced
hosts share them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from fastpar.plan.cluster import Cluster, Link  # noqa: E402
from fastpar.plan import fitting  # noqa: E402
from fastpar.plan.layouts import parse, why_not  # noqa: E402
from fastpar.plan.predict import Predictor  # noqa: E402
from fastpar.runtime.cli import Parser  # noqa: E402
from fastpar.plan.memory import CATEGORIES  # noqa: E402

PRESET, RANKS, GLOBAL_BATCH, STEPS, WARMUP = "tiny", 4, 16, 10, 4
# tp/pp/dp, ZeRO 0-3, recompute none/full, every schedule; dp the ranks left, mb 2 x pp
LAYOUTS = ["dp4", "tp2", "pp2", "tp2.pp2", "pp4", "dp4.zero1", "dp4.zero2", "dp4.zero3",
           "pp2.zero1", "tp2.zero3", "dp4.full", "tp2.pp2.full", "pp2.gpipe", "pp2.zb",
           "pp2.interleaved.v2", "pp4.zb", "dp4.mb4", "pp2.mb8", "cp2"]
SMALL = 64 * 1024  # bytes: a category measured under this is not compared
MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")


def load() -> str:
    return open("/proc/loadavg").read().split()[0] if os.path.exists("/proc/loadavg") else "?"


def flags(lay) -> list[str]:
    out = ["--tp", str(lay.tp), "--pp", str(lay.pp), "--cp", str(lay.cp),
           "--schedule", lay.schedule, "--virtual-stages", str(lay.virtual_stages),
           "--microbatches", str(lay.microbatches), "--recompute", lay.recompute]
    return out + (["--zero", str(lay.zero)] if lay.zero else [])


def job_env() -> dict:
    return {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


def launch(argv: list[str], args, hosts, timeout: float,
           ppn: int | None = None) -> subprocess.CompletedProcess:
    """``mpirun -np RANKS argv`` here, or from h0 over the namespaced ``hosts`` (``ppn`` ranks
    a host, default RANKS / hosts). On timeout the whole job is killed (its ranks with it:
    no orphan left to slow the next job) and subprocess.TimeoutExpired raised."""
    if hosts is not None:
        return hosts.mpirun(argv, ppn=ppn or args.ranks // args.hosts, env=job_env(),
                            timeout=timeout)
    p = subprocess.Popen([MPIRUN, "-np", str(args.ranks), *argv],
                         env=dict(os.environ, **job_env()), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def run(lay, args, tmp: str, hosts=None) -> dict:
    """One training of ``lay``: rank 0's step times and every rank's memory record."""
    metrics = os.path.join(tmp, f"{lay.name}.jsonl")
    argv = [sys.executable, "-m", "fastpar.train", "--preset", args.preset, "--steps",
            str(args.steps), "--global-batch", str(args.global_batch), "--no-progress",
            "--plot", "", "--log-every", str(args.steps), "--val-every", "1000", "--metrics",
            metrics, *flags(lay)]
    try:
        r = launch(argv, args, hosts, args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {args.timeout:.0f} s"}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    steps, memory = [], {}
    with open(metrics) as f:
        for line in f:
            rec = json.loads(line)
            if "memory" in rec:
                memory[rec["memory"]["rank"]] = rec["memory"]["measured"]
            elif "step_time_s" in rec:
                steps.append(rec["step_time_s"])
    return {"step_s": statistics.median(steps[args.warmup:]), "steps_s": steps,
            "memory": memory}


def inter_link(hosts, args, tmp: str) -> Link:
    """The link between the namespaced hosts: ``fastpar.plan.calibrate``'s link launch with one
    rank a host (all_reduce 4 KiB .. 16 MiB on the engine the policy picks across hosts),
    fitted to alpha-beta as the intra-host link is."""
    out = os.path.join(tmp, "inter_link.json")
    try:
        r = launch([sys.executable, "-m", "fastpar.plan.calibrate", out], args, hosts,
                   args.timeout, ppn=1)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"measuring the hosts' link took over --timeout {args.timeout:g} s") \
            from None
    if r.returncode != 0:
        raise SystemExit(f"measuring the hosts' link failed: {r.stderr.strip()[-500:]}")
    with open(out) as f:
        d = json.load(f)
    alpha, busbw = fitting.fit(d["ranks"], [tuple(x) for x in d["points"]])
    return Link(alpha, busbw, d["engine"])


def across(base: Cluster, args, link: Link) -> Cluster:
    """This machine's calibration (``args.ranks`` ranks on one host) as ``args.hosts`` hosts
    joined by ``link``, each with its share of the cores (the namespaced hosts share them)."""
    cpus = base.cpus_per_host // args.hosts
    return dataclasses.replace(base, name=f"{base.name}, {args.hosts} namespaced hosts",
                               hosts=args.hosts, ranks_per_host=args.ranks // args.hosts,
                               cpus_per_host=cpus, inter=link)


def main() -> int:
    p = Parser(description=__doc__)
    p.add_argument("--preset", default=PRESET)
    p.add_argument("--ranks", type=int, default=RANKS)
    p.add_argument("--global-batch", type=int, default=GLOBAL_BATCH)
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--warmup", type=int, default=WARMUP)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="layout names, comma-separated")
    p.add_argument("--cluster", default=None, help="a cluster file (default: calibrate now)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--rounds", type=int, default=1, help="runs of every layout, alternating "
                   "order; each row is its fastest run's")
    p.add_argument("--hosts", type=int, default=1, help="run on this many hosts made of "
                   "namespaces on this machine (root), the ranks split evenly")
    p.add_argument("--rate", default=None, help="with --hosts: shape each host's link, e.g. "
                   "1gbit (default: unshaped)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    p.check(args.hosts in (1, 2) and args.ranks % args.hosts == 0,
            f"--hosts {args.hosts} must be 1 or 2 (neighbours are paired across two) and "
            f"divide --ranks {args.ranks}")
    p.check(args.rate is None or args.hosts > 1, "--rate shapes the link between --hosts; "
            "give --hosts 2")
    if args.hosts > 1:
        from fastpar.testing._link import tbf_burst
        from fastpar.testing.cluster import NamespaceCluster, cluster_unavailable

        why = cluster_unavailable()
        p.check(why is None, f"--hosts {args.hosts}: no namespaced hosts here ({why})")
        if args.rate is not None:
            try:
                tbf_burst(args.rate)
            except ValueError as exc:
                p.error(f"--rate: {exc}")
    p.check(args.steps > args.warmup, f"--steps {args.steps} must exceed --warmup {args.warmup}")
    p.check(args.rounds >= 1, f"--rounds must be at least 1, got {args.rounds}")
    from fastpar.models import PRESETS

    cfg = PRESETS[args.preset]
    loads = [load()]
    with tempfile.TemporaryDirectory() as tmp, (
            NamespaceCluster(args.hosts, rate=args.rate) if args.hosts > 1
            else contextlib.nullcontext()) as hosts:
        path = args.cluster
        if path is None:
            path = os.path.join(tmp, "cluster.json")
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "fastpar", "plan", "--preset", args.preset,
                            "--ranks", str(args.ranks), "--calibrate", "--cluster", path],
                           check=True, stdout=subprocess.DEVNULL,
                           env=dict(os.environ, PYTHONPATH=ROOT))
            print(f"calibrated in {time.perf_counter() - t0:.0f} s (load {loads[0]})", flush=True)
        cluster = Cluster.load(path).with_ranks(1, args.ranks)
        p.check(hosts is None or cluster.cpus_per_host % args.hosts == 0,
                f"--hosts {args.hosts}: the cluster's {cluster.cpus_per_host} cores do not "
                "split evenly over the hosts (a rank's share of them would change)")
        if hosts is not None:
            t0 = time.perf_counter()
            cluster = across(cluster, args, inter_link(hosts, args, tmp))
            print(f"measured the hosts' link in {time.perf_counter() - t0:.0f} s: alpha "
                  f"{cluster.inter.alpha_s * 1e6:.0f} us, {cluster.inter.busbw_Bps / 1e6:.0f} "
                  f"MB/s ({cluster.inter.engine})", flush=True)
        calibration = cluster.to_json()
        pred = Predictor(cfg, cluster, args.global_batch, dtype=torch.float32)
        layouts = []
        for name in args.layouts.split(","):
            lay = parse(name, args.ranks)
            reason = why_not(cfg, lay, args.ranks, args.global_batch)
            if reason is not None:
                print(f"{lay.name}: cannot run: {reason}", flush=True)
                continue
            layouts.append(lay)
        # every layout once a round, every other round in reverse order; a layout's row is its
        # fastest round's (other work on the machine only adds time)
        runs = {lay.name: [] for lay in layouts}
        for i in range(args.rounds):
            for lay in layouts if i % 2 == 0 else layouts[::-1]:
                got = run(lay, args, tmp, hosts)
                runs[lay.name].append({**got, "load": load()})
                if args.rounds > 1:
                    print(f"round {i + 1}: {lay.name:<34} "
                          + (f"{got['step_s'] * 1e3:8.2f} ms" if "error" not in got
                             else got["error"]) + f"  (load {runs[lay.name][-1]['load']})",
                          flush=True)
        rows = []
        for lay in layouts:
            guess = pred.predict(lay)
            done = [r for r in runs[lay.name] if "error" not in r]
            got = min(done, key=lambda r: r["step_s"]) if done else runs[lay.name][0]
            row = {"layout": lay.name, "predicted_s": guess.step_time_s, **got,
                   "rounds_s": [r.get("step_s") for r in runs[lay.name]]}
            if "error" not in got:
                row["error"] = got["step_s"] / guess.step_time_s - 1
                per_stage = lay.tp * lay.cp * lay.dp
                mem = {}
                for rank, measured in got["memory"].items():
                    want = guess.terms["memory_by_rank"][rank // per_stage]
                    for c in CATEGORIES:
                        if measured[c] >= SMALL:
                            e = want[c] / measured[c] - 1
                            if abs(e) >= abs(mem.get(c, 0.0)):
                                mem[c] = e
                row["memory_error"] = mem
                row["memory_predicted"] = guess.terms["memory_by_rank"]
            rows.append(row)
            print(f"{lay.name:<34} predicted {guess.step_time_s * 1e3:8.2f} ms  measured "
                  + (f"{got['step_s'] * 1e3:8.2f} ms  {row['error']:+7.1%}" if "error" not in got
                     else got["error"]) + f"  (load {row['load']})", flush=True)
    loads.append(load())
    ok = [r for r in rows if "step_s" in r]
    by_pred = sorted(ok, key=lambda r: r["predicted_s"])
    by_meas = sorted(ok, key=lambda r: r["step_s"])
    for r in ok:
        r["rank_predicted"] = by_pred.index(r) + 1
        r["rank_measured"] = by_meas.index(r) + 1
    where = f" on {args.hosts} hosts" + (f" at {args.rate}" if args.rate else "") \
        if args.hosts > 1 else ""
    print(f"\n{args.preset} preset, {args.ranks} ranks{where}, global batch {args.global_batch}, "
          f"{args.steps} steps (median after {args.warmup}); load {loads[0]} -> {loads[1]}")
    head = f"{'layout':<34} {'pred ms':>8} {'meas ms':>8} {'error':>7} {'rank p/m':>8} " + \
        " ".join(f"{c[:7]:>8}" for c in CATEGORIES)
    print(head)
    for r in ok:
        mem = " ".join(f"{r['memory_error'][c]:>+8.1%}" if c in r["memory_error"] else
                       f"{'-':>8}" for c in CATEGORIES)
        print(f"{r['layout']:<34} {r['predicted_s'] * 1e3:>8.2f} {r['step_s'] * 1e3:>8.2f} "
              f"{r['error']:>+7.1%} {r['rank_predicted']:>4}/{r['rank_measured']:<3} {mem}")
    summary = {}
    if ok:
        errs = sorted(abs(r["error"]) for r in ok)
        mem_errs = [abs(e) for r in ok for e in r["memory_error"].values()]
        top3 = [r["layout"] for r in by_pred[:3]] == [r["layout"] for r in by_meas[:3]]
        summary = {"step_median_abs_error": statistics.median(errs), "step_max_abs_error":
                   errs[-1], "memory_max_abs_error": max(mem_errs, default=0.0),
                   "top3_correct": top3, "top3_predicted": [r["layout"] for r in by_pred[:3]],
                   "top3_measured": [r["layout"] for r in by_meas[:3]]}
        print(f"|step error|: median {summary['step_median_abs_error']:.1%} (target 5%), max "
              f"{summary['step_max_abs_error']:.1%} (target 10%); |memory error| max "
              f"{summary['memory_max_abs_error']:.1%} (target 5%); top 3 "
              f"{'correct' if top3 else 'wrong'} (predicted {summary['top3_predicted']}, "
              f"measured {summary['top3_measured']})")
        summary.update(round_spread(ok))
        if summary["rounds_spread_median"] is not None:
            print(f"the measurement's own spread: a layout's slowest round over its fastest "
                  f"+{summary['rounds_spread_median']:.1%} (median over layouts), up to "
                  f"+{summary['rounds_spread_max']:.1%}; a step error below it cannot be told "
                  "from this machine's noise")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {"preset": args.preset, "ranks": args.ranks, "global_batch":
                                  args.global_batch, "steps": args.steps, "warmup": args.warmup,
                                  "rounds": args.rounds, "hosts": args.hosts,
                                  "rate": args.rate,
                                  "load": loads, "cluster": calibration},
                       "rows": rows, "summary": summary}, f, indent=1)
    return 0


def round_spread(rows: list[dict]) -> dict:
    """How far each layout's measured rounds lie apart (``rounds_s``: a step time per round,
    None for a failed one): slowest over fastest - 1 per layout with two or more; their median
    and max over the layouts as ``rounds_spread_median`` and ``rounds_spread_max`` (None for
    one round). The table keeps each layout's fastest round; this says how much a round more
    or less could have moved it."""
    spreads = sorted(max(done) / min(done) - 1 for done in (
        [t for t in r["rounds_s"] if t is not None] for r in rows) if len(done) > 1)
    return {"rounds_spread_median": statistics.median(spreads) if spreads else None,
            "rounds_spread_max": spreads[-1] if spreads else None}


if __name__ == "__main__":
    sys.exit(main())
