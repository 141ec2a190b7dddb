"""Weight-only quantization measured: weight memory per rank, validation loss, and decode
tokens/s at batch 1 and 8, of int8 and int4 linears beside the float32 and bfloat16 layers, at
tp 1 and tp 2.

    python bench/quantize.py --json quant.json          # the main job's model and a Llama
    bash scripts/main.sh --save runs/main-ckpt           # first: the main job's trained model

Models: ``main``, the main job's trained checkpoint (``--main-ckpt``; loss: its validation
batches through ``python -m fastpar.evaluate``, the number its run logged), and ``llama``, a
Llama-architecture model made from a config (bench/generate.py's: hidden 768, 12 layers,
124 M parameters, vocabulary 32000, random weights: memory and speed only, its loss says
nothing). Each (model, weights, tp) row is its own job: the model built at tp, cast (bf16) or
quantized (``fastpar.quantize_weights``: every linear but the tied embedding; the embedding
stays float32), then ``fastpar.generate`` of ``--prompt`` random tokens and ``--new`` new ones
(greedy, every token), ``--repeat`` times after a warm-up; the median decode step. ``weights
MiB`` is rank 0's state dict (parameters, integers and scales); ``linears`` its quantized part's
ratio to the same linears in float32. The physical bound: a decode step reads every weight once,
so its time is at least the rank's weight bytes over the memory bandwidth one thread reads
(measured in the row: the median sum of a 256 MiB tensor); ``b1 of bound`` is that floor over
the measured batch-1 step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.generate import make_model  # noqa: E402  (the Llama of the generation bench)

WEIGHTS = ("float32", "bfloat16", "int8", "int4")
MODELS = ("main", "llama")


def build(args, tp: int):
    """``(Stages, vocab)`` of ``args.model`` at ``tp`` (world = tp)."""
    import fastpar
    from fastpar.checkpoint import loading
    from fastpar.checkpoint.sharded import ShardedCheckpointer
    from fastpar.generation import Stages
    from fastpar.hf_files import SafetensorsReader
    from fastpar.models.config import GPTConfig
    from fastpar.models.gpt import gpt_layers
    from fastpar.models.hf import hf_config, read_hf_config
    from fastpar.models.hf_weights import hf_layers

    fastpar.init(tp=tp)
    if args.model == "llama":
        cfg, info = hf_config(read_hf_config(args.model_dir))
        return Stages(hf_layers(cfg, info, SafetensorsReader(args.model_dir)), cfg), cfg
    _, index = loading.open_index(args.main_ckpt)
    cfg = GPTConfig(**index["meta"]["model"])
    stages = Stages(gpt_layers(cfg), cfg)
    ShardedCheckpointer().load(args.main_ckpt, stages.module(), None)
    return stages, cfg


def read_bandwidth() -> float:
    """GB/s one thread reads from memory (the median of 5 sums of a 256 MiB tensor): a decode
    step reads each weight once, so weight bytes / this is its floor."""
    x = torch.ones(64 << 20)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    for _ in range(6):
        start = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    return x.nbytes / statistics.median(times[1:]) / 1e9


def run_row(args) -> dict:
    """One (model, weights, tp) row in this job: both batches."""
    import fastpar
    from fastpar.nn import ColumnParallelLinear, RowParallelLinear
    from fastpar.nn.quantized import QuantizedLinear

    stages, cfg = build(args, args.tp)
    tied = {id(p) for layer in stages.layers for p in getattr(layer, "tied_copies", ())}
    linear_float = sum(m.weight.numel() * 4 for layer in stages.layers for m in layer.modules()
                       if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
                       and id(m.weight) not in tied)
    for layer in stages.layers:
        if args.weights == "bfloat16":
            layer.to(torch.bfloat16)
        elif args.weights != "float32":
            fastpar.quantize_weights(layer, args.weights)
    state = [t for layer in stages.layers for t in layer.state_dict().values()]
    quantized = [m for layer in stages.layers for m in layer.modules()
                 if isinstance(m, QuantizedLinear)]
    linear_bytes = sum(t.nbytes for m in quantized for t in (m.qweight, m.scales, m.offsets)
                       if t is not None)
    row = {"weights_mib": sum(t.nbytes for t in state) / 2**20,
           "read_gbs": read_bandwidth(),
           "linears_ratio": linear_bytes / linear_float if quantized else None,
           "batches": {}}
    for batch in (1, 8):
        ids = torch.randint(0, cfg.vocab_size, (batch, args.prompt),
                            generator=torch.Generator().manual_seed(batch))
        steps = []
        for _ in range(args.repeat + 1):
            out = fastpar.generate(stages, ids, args.new, ignore_eos=True)
            steps.append(out.decode_s / out.decode_steps)
        ms = 1e3 * statistics.median(steps[1:])
        row["batches"][batch] = {"decode_ms_per_token": ms, "tokens_per_s": batch * 1e3 / ms}
    stages.close()
    fastpar.shutdown()
    return row


def launch(args, model: str, weights: str, tp: int) -> dict:
    out = tempfile.mktemp(suffix=".json")
    flags = ["--row", "--model", model, "--weights", weights, "--tp", str(tp), "--new",
             str(args.new), "--prompt", str(args.prompt), "--repeat", str(args.repeat),
             "--model-dir", args.model_dir, "--main-ckpt", args.main_ckpt, "--row-json", out]
    cmd = [sys.executable, __file__, *flags]
    if tp > 1:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpirun"), "-np", str(tp), *cmd]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"row {model} {weights} tp {tp} failed:\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def loss(args, weights: str) -> float:
    """The main model's validation loss with these weights (python -m fastpar.evaluate)."""
    out = tempfile.mktemp(suffix=".json")
    flag = (["--dtype", "bfloat16"] if weights == "bfloat16" else
            ["--weights", weights] if weights != "float32" else [])
    done = subprocess.run([sys.executable, "-m", "fastpar.evaluate", "--resume",
                           args.main_ckpt, "--batches", str(args.val_batches), "--json", out,
                           *flag], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"evaluate {weights} failed:\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)["loss"]


def table(rows: dict, losses: dict) -> str:
    lines = ["| model | weights | tp | weights MiB/rank | linears vs fp32 | val loss (vs fp32) | "
             "decode tok/s b1 (vs fp32) | b1 of bound | decode tok/s b8 (vs fp32) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (model, weights, tp), r in rows.items():
        base = rows[(model, "float32", tp)]
        b1, b8 = r["batches"]["1"], r["batches"]["8"]
        bound_ms = r["weights_mib"] * 2**20 / (r["read_gbs"] * 1e9) * 1e3
        ratio = "-" if r["linears_ratio"] is None else f"{r['linears_ratio']:.3f}"
        lo = losses.get(weights) if model == "main" else None
        said = "-" if lo is None else \
            f"{lo:.4f} ({100 * (lo / losses['float32'] - 1):+.2f}%)"
        vs1 = b1["tokens_per_s"] / base["batches"]["1"]["tokens_per_s"]
        vs8 = b8["tokens_per_s"] / base["batches"]["8"]["tokens_per_s"]
        lines.append(
            f"| {model} | {weights} | {tp} | {r['weights_mib']:.1f} | {ratio} | {said} | "
            f"{b1['tokens_per_s']:.1f} ({vs1:.2f}x) | {bound_ms / b1['decode_ms_per_token']:.2f}"
            f" | {b8['tokens_per_s']:.1f} ({vs8:.2f}x) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from fastpar.runtime.cli import Parser

    p = Parser(description=__doc__)
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated of main, llama")
    p.add_argument("--weights", default=",".join(WEIGHTS), help="comma-separated of "
                   + ", ".join(WEIGHTS))
    p.add_argument("--tps", default="1,2")
    p.add_argument("--new", type=int, default=32, help="tokens generated per row")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--val-batches", type=int, default=16, help="validation batches (main)")
    p.add_argument("--main-ckpt", default=os.path.join(ROOT, "runs", "main-ckpt"))
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                       "fastpar-generate-bench"))
    p.add_argument("--json", default="")
    p.add_argument("--row", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", default="main", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--row-json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row:
        args.weights = args.weights.split(",")[0]
        row = run_row(args)
        if int(os.environ.get("PMI_RANK", os.environ.get("RANK", "0"))) == 0:
            with open(args.row_json, "w") as f:
                json.dump(row, f)
        return
    models, weights = args.models.split(","), args.weights.split(",")
    tps = [int(t) for t in args.tps.split(",")]
    bad = (set(models) - set(MODELS)) | (set(weights) - set(WEIGHTS))
    if bad or "float32" not in weights:
        p.error(f"unknown models or weights {sorted(bad)} (float32 is the baseline: keep it)")
    if "main" in models and not os.path.isdir(args.main_ckpt):
        p.error(f"--main-ckpt {args.main_ckpt} is not there: bash scripts/main.sh --save "
                f"{args.main_ckpt}")
    if "llama" in models:
        make_model(args.model_dir)
    start = time.perf_counter()
    losses = {w: loss(args, w) for w in weights} if "main" in models else {}
    print(f"validation losses: {losses}", file=sys.stderr, flush=True)
    rows = {}
    for model in models:
        for w in weights:
            for tp in tps:
                rows[(model, w, tp)] = launch(args, model, w, tp)
                print(f"{model} {w} tp {tp}: {rows[(model, w, tp)]}", file=sys.stderr,
                      flush=True)
    print(table(rows, losses))
    print(f"({time.perf_counter() - start:.0f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": [{"model": m, "weights": w, "tp": t, **r}
                                for (m, w, t), r in rows.items()], "losses": losses}, f,
                      indent=1)


if __name__ == "__main__":
    main()
