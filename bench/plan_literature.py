"""The planner against published throughput (issue 26, item 4): each published run's layout
on its published hardware, predicted vs published throughput per GPU, and the error per row.

    python bench/plan_literature.py [--json out.json] [--best]

Sources (the tables are transcribed into ROWS below):
- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM", SC21, https://arxiv.org/abs/2104.04473, Table 1 (weak scaling, GPT 1.7B-1T
  on Selene: DGX A100 80GB, 312 TFLOP/s bf16/fp16, NVLink 600 GB/s, 8 x 200 Gb/s InfiniBand
  per node). Metric: TFLOP/s per GPU by the paper's own count, 96 B s l h^2 (1 + s/6h +
  V/16lh) per iteration (recomputation included), so the error of TFLOP/s is that of time.
- torchtitan, docs/performance.md, https://github.com/pytorch/torchtitan/blob/main/docs/
  performance.md, Llama 3 8B and 70B with FSDP2 on 64 A100 80GB, local batch 1, seq 8192.
  Metric: WPS (tokens/s per GPU).

Assumptions, one per table, not fitted per row (cluster files in bench/clusters/): GEMMs at
80% of peak and attention at 60% (nothing measured on A100 here); NVLink 300 GB/s per direction
as each rank's bus bandwidth, a node's 8 x 200 Gb/s = 200 GB/s to the others; Megatron SC21's
attention materialises the masked scores (no flash: 4 T^2 hd, plus mask-softmax-dropout
traffic), no tp overlap (``overlap=False``), 1F1B (not interleaved), full recomputation,
microbatches of one sequence, no ZeRO; torchtitan: FSDP2 = ZeRO-3 with its all-gathers and
reduce-scatters overlapped by prefetch (``overlap_dp``), flash attention, selective recompute
for "selective op" (fastpar's nearest: the attention core) and full for 70B. Both tables are
assumed to run dense bf16 math; the memory columns are fastpar's own accounting (its AdamW
with float32 masters), not Megatron's or torchtitan's.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from fastpar.models.config import GPTConfig  # noqa: E402
from fastpar.plan.cluster import Cluster  # noqa: E402
from fastpar.plan.layouts import Layout, why_not  # noqa: E402
from fastpar.plan.predict import predict  # noqa: E402
from fastpar.runtime.cli import Parser  # noqa: E402

MEGATRON = "https://arxiv.org/abs/2104.04473"
TITAN = "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md"
# (billions, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU): Table 1
MEGATRON_ROWS = [(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
                 (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
                 (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
                 (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
                 (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
                 (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
                 (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
                 (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
                 (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163)]
# (name, layers, hidden, heads, kv heads, ffn, recompute, WPS per GPU)
TITAN_ROWS = [("Llama 3 8B, selective op", 32, 4096, 32, 8, 14336, "selective", 2973),
              ("Llama 3 8B, selective layer", 32, 4096, 32, 8, 14336, "selective", 2904),
              ("Llama 3 70B, full", 80, 8192, 64, 8, 28672, "full", 331)]


def megatron_flops(b, s, l, h, V):  # the paper's count per iteration (recompute included)
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def rows():
    selene = Cluster.load(os.path.join(HERE, "clusters", "selene_a100.json"))
    for billions, heads, hidden, layers, tp, pp, gpus, batch, tflops in MEGATRON_ROWS:
        cfg = GPTConfig(vocab_size=51200, seq_len=2048, layers=layers, hidden=hidden,
                        heads=heads, mlp="gelu", norm="layernorm", positions="learned",
                        bias=True, overlap=False)
        dp = gpus // (tp * pp)
        lay = Layout(tp=tp, pp=pp, dp=dp, recompute="full", schedule="1f1b",
                     microbatches=batch // dp)
        flops = megatron_flops(batch, 2048, layers, hidden, 51200)
        yield {"source": "Megatron-LM SC21 Table 1", "url": MEGATRON, "model": f"GPT {billions}B",
               "cfg": cfg, "layout": lay, "batch": batch, "gpus": gpus,
               "cluster": selene.with_ranks(gpus // 8, 8), "overlap_dp": False,
               "metric": "TFLOP/s per GPU", "published": tflops,
               "convert": lambda step, f=flops, g=gpus: f / step / g / 1e12}
    titan = Cluster.load(os.path.join(HERE, "clusters", "a100_80gb_fsdp.json"))
    for name, layers, hidden, heads, kv, ffn, recompute, wps in TITAN_ROWS:
        cfg = GPTConfig(vocab_size=128256, seq_len=8192, layers=layers, hidden=hidden,
                        heads=heads, kv_heads=kv, ffn_hidden=ffn)
        lay = Layout(tp=1, pp=1, dp=64, zero=3, recompute=recompute, microbatches=1)
        yield {"source": "torchtitan performance.md", "url": TITAN, "model": name, "cfg": cfg,
               "layout": lay, "batch": 64, "gpus": 64, "cluster": titan, "overlap_dp": True,
               "metric": "tokens/s per GPU", "published": wps,
               "convert": lambda step: 64 * 8192 / step / 64}


def main() -> int:
    p = Parser(prog="bench/plan_literature.py", description=__doc__)
    p.add_argument("--json", default=None)
    p.add_argument("--best", action="store_true",
                   help="also search every layout of each row for the planner's best (the "
                        "pruned search: seconds per row)")
    args = p.parse_args()
    out = []
    print(f"{'source':<26} {'model':<28} {'layout':<36} {'metric':<16} {'published':>9} "
          f"{'predicted':>9} {'error':>7}  {'bubble':>6} {'fits':>5}")
    for row in rows():
        cfg, lay, cluster = row["cfg"], row["layout"], row["cluster"]
        reason = why_not(cfg, lay, cluster.ranks, row["batch"])
        assert reason is None, (row["model"], reason)
        t0 = time.perf_counter()
        pred = predict(cfg, lay, cluster, row["batch"], dtype=torch.bfloat16,
                       overlap_dp=row["overlap_dp"])
        got = row["convert"](pred.step_time_s)
        err = got / row["published"] - 1
        rec = {"source": row["source"], "url": row["url"], "model": row["model"],
               "layout": lay.name, "gpus": row["gpus"], "batch": row["batch"],
               "metric": row["metric"], "published": row["published"], "predicted": got,
               "error": err, "step_time_s": pred.step_time_s, "bubble": pred.bubble,
               "mfu": pred.mfu, "fits": pred.fits, "memory": pred.memory,
               "seconds": time.perf_counter() - t0}
        if args.best:
            from fastpar.plan.search import search

            t0 = time.perf_counter()
            res = search(cfg, cluster, row["batch"], dtype=torch.bfloat16,
                         overlap_dp=row["overlap_dp"], top=1)
            if res.ranked:
                best = res.ranked[0]
                rec["best"] = {"layout": best.layout.name,
                               "predicted": row["convert"](best.step_time_s),
                               "vs_published_layout": pred.step_time_s / best.step_time_s,
                               "bubble": best.bubble, "predicted_layouts": res.predicted,
                               "seconds": time.perf_counter() - t0}
        out.append(rec)
        print(f"{row['source']:<26} {row['model']:<28} {lay.name:<36} {row['metric']:<16} "
              f"{row['published']:>9,.0f} {got:>9,.0f} {err:>+7.1%}  {pred.bubble:>6.1%} "
              f"{str(pred.fits):>5}" + (f"  best: {rec['best']['layout']} "
                                        f"{rec['best']['predicted']:,.0f} "
                                        f"({rec['best']['vs_published_layout']:.2f}x, "
                                        f"{rec['best']['seconds']:.1f} s)" if "best" in rec
                                        else ""), flush=True)
    errs = sorted(abs(r["error"]) for r in out)
    print(f"|error|: median {errs[len(errs) // 2]:.1%}, max {errs[-1]:.1%} over {len(errs)} rows")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
