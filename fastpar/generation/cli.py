"""``python -m fastpar.generate``: run a model: a Hugging Face directory or a trainer checkpoint,
at tp N, on prompts given as text; the tokens stream on rank 0 as they are chosen.

    python -m fastpar.generate --hf-model llama-dir --prompt "Once upon a time"
    mpirun -np 2 python -m fastpar.generate --hf-model llama-dir --tp 2 --prompt-file p.txt \\
        --batch 8 --max-new-tokens 128 --json out.json
    python -m fastpar.generate --resume runs/a --prompt "def main("   # the trainer's GPT

Prompts are tokenized by the model's own tokenizer (the directory's, or the one the trainer
read; the presets' bytes), nothing prepended that it does not add itself, and a batch is
left-padded. ``--json PATH`` writes rank 0's ``{"results": [{"prompt", "prompt_tokens",
"new_tokens", "text"}], "prefill_ms", "decode_ms_per_token", "tokens_per_s", "memory":
{"weights_bytes", "kv_cache_bytes", "peak_bytes"}}``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

import fastpar
from fastpar.checkpoint import loading
from fastpar.checkpoint.sharded import ShardedCheckpointer
from fastpar.generation.loop import generate
from fastpar.hf_files import SafetensorsReader
from fastpar.generation.stages import Stages
from fastpar.models.config import GPTConfig
from fastpar.models.gpt import gpt_layers
from fastpar.models.hf import hf_config, read_hf_config
from fastpar.models.hf_weights import hf_layers
from fastpar.nn.quantized import quantized_meta
from fastpar.runtime.cli import Parser, run_command

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parser() -> Parser:
    p = Parser(prog="python -m fastpar.generate", description=__doc__.split("\n\n")[0])
    p.add_model_source()
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompt-file", metavar="FILE", help="a file of prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="generate all --max-new-tokens")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end a sequence when its text contains TEXT (repeatable)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=1, help="prompts run together (default 1)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="the activations' dtype and the weights' unless --weights")
    p.add_argument("--weights", choices=("int8", "int4"),
                   help="store the linear layers' weights quantized (fastpar.quantize_weights)")
    p.add_argument("--group-size", type=int, default=None, metavar="N",
                   help="input columns per quantization scale (default: 128 int8, 64 int4)")
    p.add_argument("--json", metavar="PATH", help="write the results and timings as JSON")
    return p


class Bytes:
    """The trainer presets' tokenizer: UTF-8 bytes are the ids."""

    eos_token_id = pad_token_id = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HfTokenizer:
    """The directory's tokenizer; its end ids those ``generate`` stops at: the generation
    config's (an id or a list: Llama 3 Instruct's end-of-turn too), else the tokenizer's."""

    def __init__(self, directory: str):
        from transformers import AutoTokenizer, GenerationConfig

        self.inner = AutoTokenizer.from_pretrained(directory)
        self.eos_token_id = self.inner.eos_token_id
        if os.path.exists(os.path.join(directory, "generation_config.json")):
            ends = GenerationConfig.from_pretrained(directory).eos_token_id
            if ends is not None:
                self.eos_token_id = ends
        self.pad_token_id = self.inner.pad_token_id

    def encode(self, text: str) -> list[int]:
        return self.inner(text)["input_ids"]

    def decode(self, ids) -> str:
        return self.inner.decode(ids, skip_special_tokens=True)


def _tokenizer(directory: str | None):
    if directory and any(os.path.exists(os.path.join(directory, f)) for f in
                         ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return HfTokenizer(directory)
    return None


def load_model(args, topo) -> tuple[Stages, GPTConfig, object]:
    """``(this rank's Stages, config, tokenizer)`` of ``--hf-model`` or ``--resume``: only
    this rank's pipeline stage is built, its tp shards read."""
    if args.hf_model:
        cfg, info = hf_config(read_hf_config(args.hf_model))
        tokenizer = _tokenizer(args.hf_model)
        if tokenizer is None:
            raise ValueError(f"{args.hf_model} has no tokenizer files (tokenizer.json, ...)")
        with torch.device(topo.device):
            stages = Stages(hf_layers(cfg, info, SafetensorsReader(args.hf_model),
                                      replicated_kv=True), cfg)
        return stages, cfg, tokenizer
    directory, index, meta = loading.trainer_checkpoint(args.resume)
    cfg = GPTConfig(**meta["model"]).inference()
    hf = meta.get("hf") or {}
    tokenizer = _tokenizer(hf.get("files")) if hf else Bytes()
    if tokenizer is None:
        raise ValueError(f"{directory}: the model's tokenizer ({hf.get('files')}) is gone")
    dtype = loading.stored_dtype(index)
    with torch.device(topo.device):
        stages = Stages(gpt_layers(cfg, replicated_kv=True), cfg)
    stored = meta.get("weights")  # python -m fastpar.quantize's: the layers quantized first
    for layer in stages.layers:
        layer.to(dtype)
        if stored:
            fastpar.quantize_weights(layer, stored["format"], stored["group_size"])
    ShardedCheckpointer().load(directory, stages.module(), None)
    return stages, cfg, tokenizer


def _prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompt_file:
        with open(args.prompt_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        raise ValueError("no prompt: pass --prompt TEXT or --prompt-file FILE")
    return prompts


def _batch(ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(x) for x in ids)
    tokens = torch.full((len(ids), width), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), width), dtype=torch.long)
    for row, x in enumerate(ids):
        tokens[row, width - len(x):] = torch.tensor(x)
        mask[row, width - len(x):] = 1
    return tokens, mask


def _stopper(tokenizer, stops, lead: bool, batch: int):
    """``on_tokens``: streams row 0's text on rank 0 when the batch has one row; ends rows
    whose text holds a stop string."""
    seen = [[] for _ in range(batch)]
    printed = [0]

    def on_tokens(step, tokens, rows):
        for row, t in zip(range(batch)[rows], tokens.tolist()):
            if len(seen[row]) == step:  # the first stage hears them again as they arrive
                seen[row].append(t)
        if lead and batch == 1:
            # a character split over tokens decodes as U+FFFD until its last byte comes
            text = tokenizer.decode(seen[0]).rstrip("\ufffd")
            if len(text) > printed[0]:
                sys.stdout.write(text[printed[0]:])
                sys.stdout.flush()
                printed[0] = len(text)
        if not stops:
            return None
        return torch.tensor([any(s in tokenizer.decode(seen[r]) for s in stops)
                             for r in range(batch)[rows]])
    return on_tokens


def weight_bytes(layers) -> int:
    """The bytes of this rank's weights: every tensor of the layers' state (parameters, and a
    quantized layer's integers and scales)."""
    return sum(t.numel() * t.element_size() for layer in layers
               for t in layer.state_dict().values())


def main(argv=None) -> int:
    """Errors the same on every rank (bad flags, a model it cannot run) are one line, from the
    first rank."""
    return run_command("python -m fastpar.generate", run, parser().parse_args(argv))


def run(args) -> int:
    if args.group_size is not None and not args.weights:
        raise ValueError("--group-size applies to quantized weights: pass --weights int8|int4")
    for name in ("tp", "pp", "batch", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(args, name)}")
    prompts = _prompts(args)
    topo = fastpar.init(tp=args.tp, pp=args.pp)
    if topo.dp_size != 1:
        raise ValueError(f"{topo.world_size} ranks for --tp {args.tp} --pp {args.pp}: "
                         f"generation runs one model, launch exactly {args.tp * args.pp} ranks")
    lead = topo.rank == 0
    stages, cfg, tokenizer = load_model(args, topo)
    layers = stages.layers
    dtype = DTYPES[args.dtype]
    held = quantized_meta(stages.module())  # a quantized checkpoint's or directory's
    if held and args.weights:
        raise ValueError(f"--weights {args.weights}: {args.resume or args.hf_model} holds "
                         f"{held['format']} weights already")
    for layer in layers:
        layer.to(dtype)  # a quantized layer's scales keep their float32 values
        if args.weights:
            fastpar.quantize_weights(layer, args.weights, args.group_size)
    weights = weight_bytes(layers)
    quantized = quantized_meta(stages.module())
    count = sum(p.numel() for layer in layers for p in layer.parameters()) + sum(
        m.weight_numel for m in stages.module().modules() if hasattr(m, "weight_numel"))
    ids = [tokenizer.encode(p) for p in prompts]
    eos = None if args.ignore_eos else tokenizer.eos_token_id
    first_end = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (first_end or 0)
    longest = max(len(x) for x in ids) + args.max_new_tokens
    heads = sum(layer.attn.local_kv_heads for layer in layers if hasattr(layer, "attn"))
    kv = (2 * heads * min(args.batch, len(ids)) * longest * cfg.head_size
          * torch.finfo(dtype).bits // 8)
    if lead:
        stored = args.dtype if not quantized else f"{quantized['format']} linears, {args.dtype}"
        print(f"fastpar.generate: {count / 1e6:.1f}"
              f" M parameters on rank 0 at tp {args.tp} x pp {args.pp}, {stored}: weights "
              f"{weights / 2**20:.1f} MiB, KV cache up to {kv / 2**20:.1f} MiB "
              f"(batch {min(args.batch, len(ids))} x {longest} tokens)", file=sys.stderr,
              flush=True)
    results, prefill, decode_s, steps, made, cache_bytes = [], [], 0.0, 0, 0, 0
    start = time.perf_counter()
    for first in range(0, len(ids), args.batch):
        rows = ids[first:first + args.batch]
        tokens, mask = _batch(rows, pad)
        out = generate(stages, tokens, args.max_new_tokens, attention_mask=mask,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       seed=args.seed + first, eos_token_id=eos, ignore_eos=args.ignore_eos,
                       pad_token_id=pad,
                       on_tokens=_stopper(tokenizer, args.stop, lead, len(rows)))
        prefill.append(out.prefill_s)
        decode_s, steps = decode_s + out.decode_s, steps + out.decode_steps
        cache_bytes = max(cache_bytes, out.kv_cache_bytes)
        for row, new in enumerate(out.new_tokens):
            made += len(new)
            text = tokenizer.decode(new)
            results.append({"prompt": prompts[first + row], "prompt_tokens": rows[row],
                            "new_tokens": new, "text": text})
            if lead and len(rows) > 1:
                print(f"[{first + row}] {prompts[first + row]!r} -> {text!r}", flush=True)
        if lead and len(rows) == 1:
            print(flush=True)
    total = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if topo.device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    record = {"results": results, "prefill_ms": 1e3 * sum(prefill) / len(prefill),
              "decode_ms_per_token": 1e3 * decode_s / max(steps, 1),
              "tokens_per_s": made / total,
              "memory": {"weights_bytes": weights, "kv_cache_bytes": cache_bytes,
                         "peak_bytes": peak}}
    if lead:
        print(f"fastpar.generate: {made} tokens in {total:.2f} s ({record['tokens_per_s']:.1f} "
              f"tokens/s); prefill {record['prefill_ms']:.1f} ms, decode "
              f"{record['decode_ms_per_token']:.2f} ms per token", file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(record, f, indent=1)
    stages.close()
    fastpar.shutdown()
    return 0
