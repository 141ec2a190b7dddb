"""The trainer's own memory records and step time under each data-parallel mode: plain data
parallelism, ZeRO-1, -2 and -3 (per unit with prefetch on and off, kept gathered, and per
step; ``zero3`` alone takes the trainer's default, prefetch off on the CPU), each
a ``python -m fastpar.train`` job of its own (so no job's peak RSS hides another's), the same
model, data and seed.

    python bench/zero_trainer.py                         # small preset at dp 2 and dp 4, pp 2 x dp 2
    python bench/zero_trainer.py --setups dp2 --steps 20 --json out.json
    python bench/zero_trainer.py --setups dp4-8x512      # 8 blocks of hidden 512 at dp 4

Per job: the largest rank's ``--metrics`` memory record (peak per category, MiB: params, grads,
optimizer, buffers; ``state`` = params + grads + optimizer, the model state; ``pred`` the
prediction's) and
its peak RSS; the median step time over the steps after the first ``--skip``; the last loss
(every mode of one set-up trains the same curve). ``x dp``: the model state over plain data
parallelism's; ``x zero1``: the step time over ZeRO-1's. The targets of issue 43 follow the
table where its rows were measured.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile

from fastpar.runtime.cli import Parser

MiB = 2**20
CATS = ("params", "grads", "optimizer", "buffers")
STATE = CATS[:3]  # the model state
MODES = {  # name -> trainer flags
    "dp": [], "zero1": ["--zero", "1"], "zero2": ["--zero", "2"], "zero3": ["--zero", "3"],
    "zero3-pf": ["--zero", "3", "--zero-prefetch", "on"],
    "zero3-nopf": ["--zero", "3", "--zero-prefetch", "off"],
    "zero3-keep": ["--zero", "3", "--zero-keep-gathered"],
    "zero2-step": ["--zero", "2", "--zero-granularity", "step"],
    "zero2-unit": ["--zero", "2", "--zero-granularity", "unit"],
    "zero3-unit": ["--zero", "3", "--zero-granularity", "unit"],
    "zero3-step": ["--zero", "3", "--zero-granularity", "step"],
}
SETUPS = {  # name -> (ranks, model and layout flags, modes)
    "dp2": (2, ["--preset", "small"], ["dp", "zero1", "zero2", "zero3-pf", "zero3-nopf",
                                       "zero3-keep", "zero3-step"]),
    "dp4": (4, ["--preset", "small"], ["dp", "zero1", "zero2", "zero3-pf", "zero3-nopf",
                                       "zero3-step"]),
    "pp2dp2": (4, ["--preset", "small", "--pp", "2"], ["zero1", "zero2-step", "zero2-unit",
                                                        "zero3-step", "zero3-unit"]),
    "tiny-dp2": (2, ["--preset", "tiny"], ["dp", "zero1", "zero3"]),  # the suite's smoke run
    "dp4-8x512": (4, ["--preset", "small", "--layers", "8", "--hidden", "512",
                      "--global-batch", "16", "--microbatches", "2"],
                  ["dp", "zero1", "zero2", "zero3-pf", "zero3-nopf"]),
}


def run(ranks: int, flags: list, steps: int) -> dict:
    """One trainer job; its records (memory and steps) from ``--metrics``."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")  # the venv's MPICH
        cmd = [mpirun, "-np", str(ranks), sys.executable, "-m", "fastpar.train", *flags,
               "--steps", str(steps), "--no-progress", "--plot", "", "--log-every",
               str(steps), "--val-every", str(10 * steps), "--metrics", metrics]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if proc.returncode != 0:
            return {"error": (proc.stdout + proc.stderr)[-2000:]}
        with open(metrics) as fh:
            return {"records": [json.loads(line) for line in fh if line.strip()]}


def summarise(records: list, skip: int) -> dict:
    steps = [r for r in records if "step_time_s" in r]
    memory = [r["memory"] for r in records if "memory" in r]
    worst = max(memory, key=lambda m: sum(m["measured"][c] for c in STATE))
    return {"state": sum(worst["measured"][c] for c in STATE),
            "pred": sum(worst["predicted"][c] for c in STATE),
            **{c: worst["measured"][c] for c in CATS},
            "rss": max(m["peak_rss"] for m in memory),
            "step_ms": 1e3 * statistics.median(r["step_time_s"] for r in steps[skip:]),
            "loss": steps[-1]["loss"]}


def table(setup: str, rows: dict) -> list[str]:
    base, z1 = rows.get("dp"), rows.get("zero1")
    out = [f"{setup}: MiB (largest rank)", f"{'mode':<12}" + "".join(
        f"{c:>10}" for c in (*CATS, "state", "pred", "x dp", "RSS", "step ms", "x zero1",
                             "loss"))]
    for mode, r in rows.items():
        if "error" in r:
            out.append(f"{mode:<12} failed: {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        cells = [r[c] / MiB for c in CATS] + [r["state"] / MiB, r["pred"] / MiB]
        x_dp = f"{r['state'] / base['state']:.3f}" if base and "state" in base else "-"
        x_z1 = f"{r['step_ms'] / z1['step_ms']:.2f}" if z1 and "step_ms" in z1 else "-"
        out.append(f"{mode:<12}" + "".join(f"{v:>10.2f}" for v in cells) + f"{x_dp:>10}"
                   f"{r['rss'] / MiB:>10.1f}{r['step_ms']:>10.1f}{x_z1:>10}{r['loss']:>10.4f}")
    return out


def targets(setup: str, ranks: int, flags: list, rows: dict) -> list[str]:
    """Issue 43's targets where this set-up measured their rows (pp 1 only)."""
    from fastpar.plan.memory import layer_tensors
    from fastpar.training.args import model_config, parse_args

    out, dp, z1 = [], rows.get("dp"), rows.get("zero1")
    if "--pp" in flags or not dp or "state" not in dp:
        return out
    cfg = model_config(parse_args(flags))
    unit = 4 * max(sum(layer_tensors(cfg, 1, i)) for i in range(cfg.layers + 2))
    bound = {2: 0.6, 4: 0.4}.get(ranks)
    for mode in ("zero3", "zero3-pf", "zero3-nopf"):
        r = rows.get(mode)
        if r and "state" in r and bound is not None:
            x = r["state"] / dp["state"]
            out.append(f"{'met    ' if x <= bound else 'NOT MET'} {setup} {mode}: model state "
                       f"{x:.3f} of plain dp's (target <= {bound})")
        if r and "step_ms" in r and z1 and "step_ms" in z1:
            x = r["step_ms"] / z1["step_ms"]
            out.append(f"{'met    ' if x <= 1.3 else 'NOT MET'} {setup} {mode}: step time "
                       f"{x:.2f}x ZeRO-1's (target <= 1.3)")
    r = rows.get("zero2")
    if r and "grads" in r:
        limit = dp["grads"] / ranks + unit
        out.append(f"{'met    ' if r['grads'] <= limit else 'NOT MET'} {setup} zero2: peak "
                   f"gradients {r['grads'] / MiB:.2f} MiB (target <= full / dp + one unit = "
                   f"{limit / MiB:.2f})")
    return out


def main() -> None:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setups", default="dp2,dp4,pp2dp2", help=f"of {','.join(SETUPS)}")
    p.add_argument("--modes", default=None, help=f"filter, of {','.join(MODES)}")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the time")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    setups = args.setups.split(",")
    p.check(all(s in SETUPS for s in setups), f"--setups {args.setups}: of {list(SETUPS)}")
    p.check(args.steps > args.skip >= 0, f"--steps {args.steps} must exceed --skip {args.skip}")
    wanted = args.modes.split(",") if args.modes else None
    results = {}
    for setup in setups:
        ranks, flags, modes = SETUPS[setup]
        rows = {}
        for mode in modes:
            if wanted is not None and mode not in wanted:
                continue
            print(f"[bench] {setup} {mode} ...", flush=True)
            got = run(ranks, flags + MODES[mode], args.steps)
            rows[mode] = got if "error" in got else summarise(got["records"], args.skip)
        results[setup] = rows
        print("\n".join(table(setup, rows) + targets(setup, ranks, flags, rows)), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"steps": args.steps, "skip": args.skip, "results": results}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
