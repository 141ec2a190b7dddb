"""``python -m fastpar.evaluate``: the validation loss of a model, at any layout, its weights as
stored or quantized.

    python -m fastpar.evaluate --resume runs/ckpt                     # a trainer checkpoint
    mpirun -np 2 python -m fastpar.evaluate --resume runs/ckpt --tp 2 --weights int4
    mpirun -np 4 python -m fastpar.evaluate --hf-model llama-dir --tp 2 --pp 2 --data corpus/

The tokens are the trainer's validation batches (``fastpar.training.data.val_batches``: evenly
spaced windows of the validation text, the same at every layout): ``--batches`` batches of
``--batch-size`` sequences (defaults: the trainer's 4, and the checkpoint's global batch or 16) of
the model's ``seq_len`` tokens (``--seq-len``; a Hugging Face directory: 512 at most), from
``--data`` (bytes, or a Hugging Face model's tokenizer: what the trainer reads) or the trainer's
default corpus. So a trainer checkpoint's loss here is the one its run logged as ``val_loss``.
The loss is the mean over batches of each batch's mean token cross-entropy; ``--json PATH``
writes rank 0's ``{"loss", "perplexity", "tokens"}`` (perplexity = exp(loss), tokens: the
targets scored), with ``"weights"`` and ``"layout"`` beside them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import torch

import fastpar
from fastpar import comm
from fastpar.checkpoint import loading
from fastpar.checkpoint.sharded import ShardedCheckpointer
from fastpar.hf_files import SafetensorsReader
from fastpar.models.config import GPTConfig
from fastpar.models.gpt import gpt_layers, gpt_loss
from fastpar.models.hf import hf_config, read_hf_config, window
from fastpar.models.hf_weights import hf_layers
from fastpar.nn.quantized import quantized_meta
from fastpar.pipeline import Pipeline
from fastpar.runtime.cli import Parser, run_command
from fastpar.training.data import val_batches
from fastpar.training.hf_run import text_corpus


def parser() -> Parser:
    p = Parser(prog="python -m fastpar.evaluate", description=__doc__.split("\n\n")[0])
    p.add_model_source()
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--weights", choices=("int8", "int4"),
                   help="quantize the linear layers' weights (fastpar.quantize_weights)")
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="input columns per quantization scale (default: 128 int8, 64 int4)")
    p.add_argument("--data", metavar="PATH", help="text (a file, a folder, JSON lines); "
                   "default: the trainer's corpus")
    p.add_argument("--data-field", default="text", help="the text field of --data's JSON lines")
    p.add_argument("--batches", type=int, default=4, help="validation batches (default 4)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="sequences per batch (default: the checkpoint's global batch, or 16)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--json", metavar="PATH", help="write {loss, perplexity, tokens} as JSON")
    return p


def model_layers(args, topo) -> tuple[list, GPTConfig, dict, str | None]:
    """``(layer factories, config, checkpoint meta, tokenizer directory)`` of ``--resume`` or
    ``--hf-model``; a checkpoint's values are loaded into the pipeline afterwards."""
    if args.hf_model:
        raw = read_hf_config(args.hf_model)
        cfg, info = hf_config(raw, seq_len=window(raw, args.seq_len))
        return hf_layers(cfg, info, SafetensorsReader(args.hf_model)), cfg, {}, args.hf_model
    meta = loading.trainer_checkpoint(args.resume)[2]
    cfg = GPTConfig(**meta["model"]).inference()
    if args.seq_len:
        cfg = dataclasses.replace(cfg, seq_len=args.seq_len)
    tokenizer_dir = (meta.get("hf") or {}).get("files")
    return gpt_layers(cfg), cfg, meta, tokenizer_dir


def main(argv=None) -> int:
    """Errors the same on every rank are one line, from the first rank, exit status 2."""
    return run_command("python -m fastpar.evaluate", run, parser().parse_args(argv))


def run(args) -> int:
    for name in ("tp", "pp", "batches"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.group_size is not None and not args.weights:
        raise ValueError("--group-size applies to quantized weights: pass --weights int8|int4")
    topo = fastpar.init(tp=args.tp, pp=args.pp)
    lead = topo.rank == 0
    layers, cfg, meta, tokenizer_dir = model_layers(args, topo)
    batch = args.batch_size or meta.get("global_batch") or 16
    if batch < topo.dp_size or batch % topo.dp_size:
        raise ValueError(f"--batch-size {batch} must be a multiple of dp {topo.dp_size}")
    rows = batch // topo.dp_size
    corpus = text_corpus(args.data, args.data_field, tokenizer_dir, cfg, topo, "evaluation")
    batches = [(x.chunk(topo.dp_size)[topo.dp_rank], y.chunk(topo.dp_size)[topo.dp_rank])
               for x, y in val_batches(corpus.val, args.batches, cfg.seq_len, batch)]
    with torch.device(topo.device):
        pipe = Pipeline(layers, loss_fn=gpt_loss, microbatches=args.pp if rows % args.pp == 0
                        else 1)
    stored = meta.get("weights")  # python -m fastpar.quantize's: quantized, then loaded
    if stored:
        fastpar.quantize_weights(pipe, stored["format"], stored["group_size"])
    held = quantized_meta(pipe)  # that checkpoint's, or a quantized Hugging Face directory's
    if held and args.weights:
        raise ValueError(f"--weights {args.weights}: {args.resume or args.hf_model} holds "
                         f"{held['format']} weights already")
    if args.resume:
        ShardedCheckpointer().load(args.resume, pipe, None)  # in the dtypes it was saved in
    pipe.to(getattr(torch, args.dtype))  # a quantized layer's scales stay float32
    pipe.eval()
    if args.weights:
        fastpar.quantize_weights(pipe, args.weights, args.group_size)
    total = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for i, (x, y) in enumerate(batches):
            logits = pipe.forward(x.to(topo.device))
            total += gpt_loss(logits, y.to(topo.device)).double().cpu()
            if lead and sys.stderr.isatty():
                print(f"\rfastpar.evaluate: batch {i + 1}/{len(batches)}", end="",
                      file=sys.stderr, flush=True)
    comm.all_reduce(total, group=topo.dp_group)
    loss = total.item() / (len(batches) * topo.dp_size)
    record = {"loss": loss, "perplexity": math.exp(min(loss, 700.0)),
              "tokens": len(batches) * batch * cfg.seq_len,
              "weights": (quantized_meta(pipe) or {}).get("format") or args.dtype,
              "layout": {"tp": topo.tp_size, "pp": topo.pp_size, "dp": topo.dp_size}}
    if lead:
        print(f"\rfastpar.evaluate: loss {loss:.4f}, perplexity {record['perplexity']:.3f} over "
              f"{record['tokens']:,} tokens ({record['weights']} weights, tp {topo.tp_size} x "
              f"pp {topo.pp_size} x dp {topo.dp_size})", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    fastpar.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
