"""Structured pruning measured on the main job's trained model: parameters, validation loss
right after pruning and after a short recovery training, and decode speed, for a quarter and a
half of the heads and MLP channels removed by each importance score, beside the unpruned model.

    bash scripts/main.sh --save runs/main-ckpt             # first: the main job's model
    python bench/prune.py --json prune.json                # every row through the commands

Each row runs the commands a user runs: ``python -m fastpar.prune --resume CKPT --heads F
--mlp F --by B --save P`` (activations: ``--batches`` calibration batches of the trainer's
corpus), ``python -m fastpar.evaluate --resume P`` (the main job's validation batches: its run
logged the unpruned loss), ``mpirun -np 2 python -m fastpar.train --resume P --steps N`` (dp 2:
recovery from a fresh optimizer; a quarter of 4 KV groups leaves 3, which tp 2 does not divide),
``evaluate`` again, and ``python -m fastpar.generate`` of ``--new`` tokens at batch 1 (the
decode step's median over ``--repeat`` runs). The unpruned model is trained the same N steps
further (``--steps 150 + N``: its schedule stretched) so that recovery is compared with the
same extra training. Importance must beat random: the ``vs random`` column is the loss gap
after pruning (negative: better than random).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
MPIRUN = os.path.join(os.path.dirname(PY), "mpirun")
SCORES = ("magnitude", "activations", "random")


def run(cmd: list[str], what: str) -> str:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def evaluate(ckpt: str, batches: int) -> float:
    out = tempfile.mktemp(suffix=".json")
    run([PY, "-m", "fastpar.evaluate", "--resume", ckpt, "--batches", str(batches), "--json",
         out], f"evaluate {ckpt}")
    with open(out) as f:
        return json.load(f)["loss"]


def parameters(ckpt: str) -> int:
    from fastpar.checkpoint import loading
    from fastpar.models.config import GPTConfig

    return GPTConfig(**loading.open_index(ckpt)[1]["meta"]["model"]).num_params()


def decode_ms(ckpt: str, args) -> float:
    out = tempfile.mktemp(suffix=".json")
    times = []
    for _ in range(args.repeat):
        run([PY, "-m", "fastpar.generate", "--resume", ckpt, "--prompt", "def main(argv):",
             "--max-new-tokens", str(args.new), "--ignore-eos", "--json", out],
            f"generate {ckpt}")
        with open(out) as f:
            times.append(json.load(f)["decode_ms_per_token"])
    return statistics.median(times)


def recover(ckpt: str, out: str, steps: int) -> str:
    """``steps`` more steps at dp 2, saved under ``out``; returns ``out``."""
    run([MPIRUN, "-np", "2", PY, "-m", "fastpar.train", "--resume", ckpt, "--steps",
         str(steps), "--save", out, "--no-progress", "--plot", "", "--val-every",
         str(steps)], f"train {ckpt}")
    return out


def row(name: str, ckpt: str, recovered: str, args) -> dict:
    return {"row": name, "parameters": parameters(ckpt),
            "loss": evaluate(ckpt, args.val_batches),
            "loss_recovered": evaluate(recovered, args.val_batches),
            "decode_ms_per_token": decode_ms(ckpt, args)}


def table(rows: list[dict]) -> str:
    base = rows[0]
    random = {r["fraction"]: r for r in rows if r.get("by") == "random"}
    lines = ["| model | parameters | val loss | vs random | after recovery | decode ms/token "
             "(vs unpruned) |", "|---|---|---|---|---|---|"]
    for r in rows:
        other = random.get(r.get("fraction"))
        gap = "-" if other is None or r is other else f"{r['loss'] - other['loss']:+.3f}"
        lines.append(f"| {r['row']} | {r['parameters'] / 1e6:.2f} M | {r['loss']:.4f} | {gap} | "
                     f"{r['loss_recovered']:.4f} | {r['decode_ms_per_token']:.2f} "
                     f"({base['decode_ms_per_token'] / r['decode_ms_per_token']:.2f}x) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from fastpar.runtime.cli import Parser

    p = Parser(description=__doc__)
    p.add_argument("--main-ckpt", default=os.path.join(ROOT, "runs", "main-ckpt"))
    p.add_argument("--fractions", default="0.25,0.5", help="of the heads and MLP channels")
    p.add_argument("--by", default=",".join(SCORES), help="comma-separated of "
                   + ", ".join(SCORES))
    p.add_argument("--recovery-steps", type=int, default=50)
    p.add_argument("--batches", type=int, default=4, help="calibration batches (activations)")
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--new", type=int, default=64, help="tokens per decode measurement")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    by = args.by.split(",")
    if set(by) - set(SCORES) or args.recovery_steps < 1:
        p.error(f"--by takes {', '.join(SCORES)}; --recovery-steps at least 1")
    if not os.path.isdir(args.main_ckpt):
        p.error(f"--main-ckpt {args.main_ckpt} is not there: bash scripts/main.sh --save "
                f"{args.main_ckpt}")
    work = tempfile.mkdtemp(prefix="fastpar-prune-bench-")
    start = time.perf_counter()
    try:
        from fastpar.checkpoint import loading

        trained = int(loading.open_index(args.main_ckpt)[1]["step"])
        further = recover(args.main_ckpt, os.path.join(work, "unpruned"),
                          trained + args.recovery_steps)
        rows = [row("unpruned", args.main_ckpt, further, args)]
        for fraction in (float(f) for f in args.fractions.split(",")):
            for score in by:
                pruned = os.path.join(work, f"{score}-{fraction}")
                run([PY, "-m", "fastpar.prune", "--resume", args.main_ckpt, "--heads",
                     str(fraction), "--mlp", str(fraction), "--by", score, "--batches",
                     str(args.batches), "--save", pruned], f"prune {score} {fraction}")
                recovered = recover(pruned, pruned + "-recovered", args.recovery_steps)
                rows.append({**row(f"{score} {fraction:.0%}", pruned, recovered, args),
                             "by": score, "fraction": fraction})
                print(rows[-1], file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows))
    print(f"({time.perf_counter() - start:.0f} s; recovery {args.recovery_steps} steps at dp 2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "recovery_steps": args.recovery_steps}, f, indent=1)


if __name__ == "__main__":
    main()
