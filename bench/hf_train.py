"""Training a Hugging Face Llama with ``fastpar.train --hf-model`` beside plain PyTorch: tokens/s
and peak memory per rank of each layout, the same model trained by its own Hugging Face forward
(one process: a plain loop; dp 2: DistributedDataParallel over gloo) in the same job, and the
times to load the checkpoint into a layout and to export it back.

    python bench/hf_train.py --layouts serial --plain --json one.json
    mpirun -np 2 python bench/hf_train.py --layouts tp2,pp2,dp2z1 --plain --json two.json
    mpirun -np 4 python bench/hf_train.py --layouts tp2pp2 --json four.json

The model (made once from a config with transformers, saved as safetensors under
``--model-dir``): Llama, hidden 512, 8 layers, 8 heads (4 kv), ffn 1408, vocabulary 32000,
untied: about 56 M parameters. Each row: the median step time after the first step (the slowest
rank's), tokens/s of the global batch, the largest peak resident memory of any rank over the
row's run (VmHWM, reset before it), ``vs plain``: tokens/s over the one-process plain loop's
(or DDP's at dp 2); without a pipeline one microbatch, the plain loop's work. ``load s``: the Trainer's construction (init, reading this rank's layers);
``export s``: ``--steps 0 --save-hf`` (a model-only sharded save, then the streamed export).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

# One microbatch where there is no pipeline: the plain loop's work (the trainer's default is
# 2 x pp microbatches, at least 1... 2 at pp 1); a pipeline of 2 stages takes 4.
LAYOUTS = {"serial": ["--microbatches", "1"], "tp2": ["--tp", "2", "--microbatches", "1"],
           "pp2": ["--pp", "2"], "dp2z1": ["--zero", "1", "--microbatches", "1"],
           "tp2pp2": ["--tp", "2", "--pp", "2"]}
CONFIG = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=4, vocab_size=32000,
              max_position_embeddings=1024, tie_word_embeddings=False)


def peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := current RSS


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def make_model(path: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG))
    model.save_pretrained(path)


def common(args, path):
    return ["--hf-model", path, "--steps", str(args.steps), "--seq-len", str(args.seq_len),
            "--global-batch", str(args.global_batch), "--no-progress", "--plot", "",
            "--log-every", str(args.steps), "--val-batches", "1", "--timeout", "600"]


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def fastpar_row(name, args, path) -> dict:
    import fastpar
    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer

    peak_reset()
    t0 = time.perf_counter()
    trainer = Trainer(parse_args(common(args, path) + LAYOUTS[name]))
    load = slowest(time.perf_counter() - t0)
    records = trainer.run()
    step = statistics.median(slowest(r["step_time_s"]) for r in records[1:])
    peak = slowest(peak_mib())
    fastpar.shutdown()
    return {"engine": "fastpar", "layout": name, "step_s": step, "peak_mib": peak,
            "load_s": load, "tokens_per_s": args.global_batch * args.seq_len / step}


def plain_row(args, path) -> dict:
    """The Hugging Face model trained by its own forward: one process, or DDP over gloo."""
    from transformers import AutoModelForCausalLM

    from fastpar.training.data import Sampler, builtin_corpus

    world = dist.get_world_size()
    peak_reset()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model,
                                                          process_group=dist.new_group(
                                                              backend="gloo"))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    sampler = Sampler(builtin_corpus().train, args.seq_len, args.global_batch, 0)
    times = []
    for step in range(args.steps):
        x, y = sampler.shard(step, dist.get_rank(), world)
        dist.barrier()
        t0 = time.perf_counter()
        logits = model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        times.append(slowest(time.perf_counter() - t0))
    step = statistics.median(times[1:])
    return {"engine": "plain" if world == 1 else "DDP (gloo)", "layout": f"dp{world}",
            "step_s": step, "peak_mib": slowest(peak_mib()), "load_s": None,
            "tokens_per_s": args.global_batch * args.seq_len / step}


def export_seconds(args, path) -> float:
    import fastpar
    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer

    out = f"{args.model_dir.rstrip(os.sep)}-export"  # one path: every rank's the same
    shutil.rmtree(out, ignore_errors=True)  # before any rank's Trainer: init is collective
    argv = common(args, path) + ["--steps", "0", "--save-hf", out]
    trainer = Trainer(parse_args(argv))
    t0 = time.perf_counter()
    trainer.run()
    took = slowest(time.perf_counter() - t0)
    lead = dist.get_rank() == 0
    fastpar.shutdown()
    if lead:
        shutil.rmtree(out, ignore_errors=True)
    return took


def main(argv=None) -> None:
    from fastpar.runtime.cli import Parser

    p = Parser(description=__doc__)
    p.add_argument("--layouts", default="serial", help=f"comma-separated of {', '.join(LAYOUTS)}")
    p.add_argument("--plain", action="store_true", help="also the plain PyTorch row")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "fastpar-hf-bench"))
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    import fastpar

    fastpar.init()  # the job's world; each row makes its own groups after
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not os.path.exists(os.path.join(args.model_dir, "config.json")):
        make_model(args.model_dir)
    dist.barrier()
    rows = []
    if args.plain:
        rows.append(plain_row(args, args.model_dir))
    fastpar.shutdown()
    for name in args.layouts.split(","):
        rows.append(fastpar_row(name, args, args.model_dir))
    export = export_seconds(args, args.model_dir)
    if rank == 0:
        base = rows[0]["tokens_per_s"] if args.plain else None
        print(f"{'engine':<12}{'layout':<9}{'step s':>9}{'tokens/s':>10}{'peak MiB':>10}"
              f"{'load s':>8}{'vs plain':>10}")
        for r in rows:
            vs = f"{r['tokens_per_s'] / base:.2f}" if base else "-"
            load = f"{r['load_s']:.2f}" if r["load_s"] is not None else "-"
            print(f"{r['engine']:<12}{r['layout']:<9}{r['step_s']:>9.3f}{r['tokens_per_s']:>10.0f}"
                  f"{r['peak_mib']:>10.0f}{load:>8}{vs:>10}")
        print(f"export (--steps 0 --save-hf, {world} ranks): {export:.2f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, "export_s": export, "config": CONFIG,
                           "world": world}, f, indent=1)


if __name__ == "__main__":
    main()
