"""Generation beside Hugging Face's: prefill time, decode milliseconds per token, tokens/s and
memory per rank, at batch 1 and 8, of one Llama-architecture model made from a config.

    python bench/generate.py --json gen.json              # every row, each its own job

Rows: Hugging Face ``generate`` in one process; fastpar at tp 1, tp 2, pp 2 (and pp 2 with one
microbatch: the gain of microbatches); Hugging Face's own tensor parallelism
(``tp_plan="auto"``, under torchrun) with torch.distributed on gloo and on fastpar's backend.
Every row decodes greedily the same prompts for ``--new`` tokens with ``ignore_eos`` (all of
them); the times are the median of ``--repeat`` runs after one warm-up. ``allreduce %``: the
share of fastpar's tp 2 decode step spent in its all-reduces and all-gathers, measured by
torch's profiler over a decode (``--trace-row``). The model (Llama: hidden 768, 12 layers, 12
heads / 4 kv, ffn 2048, vocabulary 32000, untied: 124 M parameters) is saved under
``--model-dir`` once.

    python bench/generate.py --row hf --batch 1       # one row, in this process (the driver's)
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

CONFIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
              max_position_embeddings=1024, tie_word_embeddings=False)
# row -> (ranks, launcher, extra flags of the row)
ROWS = {"hf": (1, "plain"), "fastpar-tp1": (1, "plain"), "fastpar-tp2": (2, "torchrun"),
        "fastpar-pp2": (2, "torchrun"), "fastpar-pp2-1mb": (2, "torchrun"),
        "hf-tp2-gloo": (2, "torchrun"), "hf-tp2-fastpar": (2, "torchrun")}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(path: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.exists(os.path.join(path, "config.json")):
        return
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG))
    model.save_pretrained(path)


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith("VmHWM:")).split()[1]) / 1024


def prompts(batch: int, length: int) -> torch.Tensor:
    return torch.randint(3, CONFIG["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(1))


class Clock:
    """A streamer for Hugging Face's generate: the time of the first new token and the end."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2:  # the first call is the prompt
            self.first = time.perf_counter()

    def end(self):
        pass


def hf_row(args, tp: bool) -> dict:
    from transformers import AutoModelForCausalLM

    kwargs = {"tp_plan": "auto"} if tp else {}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32, **kwargs)
    ids = prompts(args.batch, args.prompt)
    times = []
    for _ in range(args.repeat + 1):
        clock = Clock()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                       streamer=clock, pad_token_id=0)
        end = time.perf_counter()
        times.append((clock.first - start, (end - clock.first) / (args.new - 1), end - start))
    local = [getattr(p, "to_local", lambda p=p: p)() for p in model.parameters()]  # DTensors
    weights = sum(t.numel() * t.element_size() for t in local)
    return summary(args, times[1:], weights, 0)


def fastpar_row(args, tp: int, pp: int, microbatches=None) -> dict:
    import fastpar
    from fastpar.generation import Stages
    from fastpar.hf_files import SafetensorsReader
    from fastpar.models.hf import hf_config, read_hf_config
    from fastpar.models.hf_weights import hf_layers

    fastpar.init(tp=tp, pp=pp)
    cfg, info = hf_config(read_hf_config(args.model_dir))
    stages = Stages(hf_layers(cfg, info, SafetensorsReader(args.model_dir),
                               replicated_kv=True), cfg)
    ids = prompts(args.batch, args.prompt)
    times, cache = [], 0
    for _ in range(args.repeat + 1):
        start = time.perf_counter()
        out = fastpar.generate(stages, ids, args.new, microbatches=microbatches)
        end = time.perf_counter()
        times.append((out.prefill_s, out.decode_s / out.decode_steps, end - start))
        cache = out.kv_cache_bytes
    weights = sum(p.numel() * p.element_size() for m in stages.layers for p in m.parameters())
    row = summary(args, times[1:], weights, cache)
    if args.trace_row and tp > 1:
        row["allreduce_share"] = comm_share(stages, ids, args)
    stages.close()
    fastpar.shutdown()
    return row


def comm_share(stages, ids, args) -> float:
    """The share of a decode's time in fastpar's collectives, from torch's profiler: the
    self CPU time of the events named for them over the whole call's."""
    import fastpar
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fastpar.generate(stages, ids, args.new)
        total = time.perf_counter() - start
    comm = sum(e.cpu_time_total for e in prof.key_averages()
               if any(k in e.key.lower() for k in ("all_reduce", "allreduce", "all_gather",
                                                    "allgather")))
    return comm / 1e6 / total


def summary(args, times, weights: int, cache: int) -> dict:
    prefill = statistics.median(t[0] for t in times)
    per_token = statistics.median(t[1] for t in times)
    total = statistics.median(t[2] for t in times)
    return {"batch": args.batch, "prefill_ms": 1e3 * prefill, "decode_ms_per_token":
            1e3 * per_token, "tokens_per_s": args.batch * args.new / total,
            "weights_mib": weights / 2**20, "kv_cache_mib": cache / 2**20,
            "peak_mib": peak_mib()}


def run_row(args) -> dict:
    name = args.row
    if name == "hf":
        return hf_row(args, tp=False)
    if name.startswith("hf-tp2-"):
        import torch.distributed as dist

        import fastpar  # noqa: F401 - registers the backend "fastpar"

        dist.init_process_group(name.rsplit("-", 1)[1])
        row = hf_row(args, tp=True)
        dist.destroy_process_group()
        return row
    tp, pp = {"fastpar-tp1": (1, 1), "fastpar-tp2": (2, 1), "fastpar-pp2": (1, 2),
              "fastpar-pp2-1mb": (1, 2)}[name]
    return fastpar_row(args, tp, pp, 1 if name.endswith("1mb") else None)


def launch(name: str, args, batch: int) -> dict:
    ranks, launcher = ROWS[name]
    out = tempfile.mktemp(suffix=".json")
    flags = ["--row", name, "--batch", str(batch), "--new", str(args.new), "--prompt",
             str(args.prompt), "--repeat", str(args.repeat), "--model-dir", args.model_dir,
             "--row-json", out] + (["--trace-row"] if name == "fastpar-tp2" else [])
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={ranks}", __file__, *flags]
    else:
        cmd = [sys.executable, __file__, *flags]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"row {name} failed:\n{done.stderr[-3000:]}")
    with open(out) as f:
        return json.load(f)


def table(rows: dict) -> str:
    lines = ["| row | batch | prefill ms | decode ms/token | tokens/s | vs HF | weights MiB/rank "
             "| KV MiB/rank | peak MiB/rank |", "|---|---|---|---|---|---|---|---|---|"]
    for (name, batch), r in rows.items():
        base = rows.get(("hf", batch))
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        share = f" (collectives {100 * r['allreduce_share']:.0f}%)" if "allreduce_share" in r \
            else ""
        lines.append(f"| {name}{share} | {batch} | {r['prefill_ms']:.1f} | "
                     f"{r['decode_ms_per_token']:.2f} | {r['tokens_per_s']:.1f} | {ratio} | "
                     f"{r['weights_mib']:.0f} | {r['kv_cache_mib']:.1f} | {r['peak_mib']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    from fastpar.runtime.cli import Parser

    p = Parser(description=__doc__)
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated of {', '.join(ROWS)}")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--new", type=int, default=32, help="tokens generated per row")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per row")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(),
                                                       "fastpar-generate-bench"))
    p.add_argument("--json", default="")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--row-json", help=argparse.SUPPRESS)
    p.add_argument("--trace-row", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}; rows are {', '.join(ROWS)}")
    if args.new < 2:
        p.error(f"--new must be at least 2, got {args.new}")
    if args.row:  # one row, in this job
        row = run_row(args)
        if int(os.environ.get("RANK", "0")) == 0 and args.row_json:
            with open(args.row_json, "w") as f:
                json.dump(row, f)
        return
    make_model(args.model_dir)
    rows = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for name in args.rows.split(","):
            rows[(name, batch)] = launch(name, args, batch)
            print(f"{name} batch {batch}: {rows[(name, batch)]}", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": CONFIG, "new": args.new, "prompt": args.prompt,
                       "rows": [{"row": n, **r} for (n, _), r in rows.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
