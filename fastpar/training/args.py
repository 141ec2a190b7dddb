"""The main job's command line: every flag, checked before anything starts, and what follows
from it alone (the model config, the learning-rate schedule).

    args = parse_args(["--tp", "2", "--steps", "100"])   # one line and exit 2 on a bad flag
    cfg = model_config(args)                             # the preset with the overrides
    LambdaLR(opt, lr_lambda(args, steps))                # linear warm-up, cosine decay
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

DEFAULT_STEPS = {"tiny": 200, "small": 150, None: 100}  # None: a Hugging Face model


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """``python -m fastpar.train``'s flags (``description``: what --help says above them)."""
    from fastpar.runtime.cli import Parser

    p = Parser(prog="python -m fastpar.train", description=description)
    a = p.add_argument
    a("--layout", default=None, choices=["auto"],
      help="auto: the planner chooses tp, pp, cp, ZeRO, recompute, schedule, virtual stages "
           "and microbatches for this job's ranks and hosts (none of those flags with it)")
    a("--cluster", default=None, help="with --layout auto: the planner's cluster file (python "
      "-m fastpar plan --calibrate --cluster FILE writes one); default: a quick calibration")
    a("--tp", type=int, default=1, help="tensor-parallel size")
    a("--pp", type=int, default=1,
      help="pipeline-parallel size (dp = world / (tp x cp x pp))")
    a("--cp", type=int, default=1,
      help="context-parallel size: each sequence is split over cp ranks (load-balanced chunks), "
           "which see the same batch rows; gradients are averaged over dp x cp")
    a("--cp-type", default="ring", choices=["ring", "ulysses", "auto"],
      help="context-parallel attention: ring (K/V passed around the cp group; any head count, "
           "across hosts, with dropout) or ulysses (all-to-all to heads and back; heads / tp "
           "must be divisible by cp; in a host the faster and lighter: bench/context.py); "
           "auto: nn.context.choose_type's pick for this layout, said at the start")
    a("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb"])
    a("--microbatches", type=int, default=None, help="per step (default: 2 x pp, at least 1)")
    a("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved)")
    a("--preset", default=None, choices=["tiny", "small"],
      help="fastpar's own GPT (default small; not with --hf-model / --hf-config)")
    a("--hf-model", default=None, metavar="DIR",
      help="train a Hugging Face causal LM directory (config.json, safetensors weights): "
           "Llama, Mistral, Qwen2, Qwen3, GPT-2")
    a("--hf-config", default=None, metavar="FILE",
      help="a Hugging Face config.json: that architecture from random weights")
    a("--save-hf", default=None, metavar="DIR",
      help="at the end, write a Hugging Face directory (config.json, safetensors, the "
           "tokenizer files) that from_pretrained loads")
    a("--save-hf-shard-mb", type=int, default=2048,
      help="--save-hf: safetensors files of at most this many MiB (more: an index)")
    a("--steps", type=int, default=None, help="total steps (default: tiny 200, small 150)")
    a("--global-batch", type=int, default=16, help="sequences per step over all dp ranks")
    a("--seq-len", type=int, default=None)
    a("--layers", type=int, default=None)
    a("--hidden", type=int, default=None)
    a("--heads", type=int, default=None)
    a("--kv-heads", type=int, default=None)
    a("--tie-embeddings", action="store_true")
    a("--sequence-parallel", action="store_true")
    a("--overlap", default="auto", choices=["auto", "on", "off"],
      help="overlap the tensor-parallel layers' communication with their GEMMs (auto: the "
           "layers' policy decides; the first step says what it did)")
    a("--recompute", default="none", choices=["none", "selective", "full"],
      help="activations recomputed in backward instead of kept: selective (each attention "
           "core: softmax, dropout, @ v) or full (each block keeps only its input)")
    a("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    a("--min-lr-ratio", type=float, default=0.1, help="cosine decay floor, as a fraction of lr")
    a("--warmup", type=int, default=None, help="linear warm-up steps (default: steps / 10)")
    a("--weight-decay", type=float, default=0.1)
    a("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    a("--seed", type=int, default=0)
    a("--data", default=None,
      help="a text file or directory (default: the Python stdlib, as bytes); with --hf-model "
           "or --hf-config tokenized by the model's tokenizer.json (*.jsonl: JSON lines)")
    a("--data-field", default="text", help="the text field of --data's JSON lines")
    a("--dtype", default="float32", choices=["float32", "bfloat16"])
    a("--zero", type=int, nargs="?", const=1, default=0, choices=[1, 2, 3],
      help="ZeRO stage (alone: 1): 1 shards the optimizer state over dp (x cp), 2 also the "
           "gradients, 3 also the parameters")
    a("--zero-granularity", default="auto", choices=["auto", "unit", "step"],
      help="ZeRO-2/3: unit reduce-scatters each unit's (block's) gradients as each "
           "microbatch's backward finishes it and keeps only shards, and ZeRO-3 gathers each "
           "unit around its forward and backward; step accumulates whole gradients over the "
           "microbatches and reduces once, ZeRO-3 with the stage gathered for the whole step. "
           "auto: unit at --pp 1, step under a pipeline and with --schedule zb")
    a("--zero-keep-gathered", action="store_true",
      help="ZeRO-3 per unit: a unit stays gathered from its first use to the optimizer step "
           "(one all-gather per unit per step instead of two per microbatch; the stage's whole "
           "parameters held meanwhile)")
    a("--zero-prefetch", default="auto", choices=["auto", "on", "off"],
      help="ZeRO-3 per unit: gather the next unit while one computes (on: two units held at "
           "a time; off: one, each gather waited for when its unit runs). auto: on for CUDA, "
           "off on the CPU, where it measured no faster (docs/training.md)")
    a("--quantize-weights", default=None, choices=["int8"],
      help="ZeRO-3's parameter all-gather as block-scaled int8 (the float32 masters and the "
           "optimizer stay full precision)")
    a("--quantize-grads", default=None, choices=["int8"],
      help="the gradients' dp reduction as block-scaled int8 (DataParallel's all-reduce, ZeRO's "
           "reduce-scatter), summed in float32")
    a("--error-feedback", action="store_true",
      help="with --quantize-grads: each rank carries its int8 rounding into its next step")
    a("--moe-experts", type=int, default=0,
      help="Mixture-of-Experts blocks with this many experts (0: dense MLPs)")
    a("--moe-top-k", type=int, default=2, help="experts per token")
    a("--moe-every", type=int, default=1,
      help="every N-th block is a MoE block (1: every block, 2: every other from the second)")
    a("--moe-capacity", type=float, default=None,
      help="capacity factor (default: dropless); dropped tokens pass the residual")
    a("--moe-aux-coef", type=float, default=1e-2, help="load-balancing loss weight")
    a("--moe-z-coef", type=float, default=1e-3, help="router z-loss weight")
    a("--ep", type=int, default=1,
      help="expert-parallel size: the experts are sharded over ep ranks inside dp")
    a("--save", default=None, help="checkpoint directory")
    a("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    a("--sync-save", action="store_true",
      help="training waits for each checkpoint to be written (default: written in the "
           "background while training goes on; on the CPU the next step waits for it before "
           "its optimizer update, on a GPU the pieces are first copied to host memory)")
    a("--resume", default=None, help="checkpoint directory (or one step_* in it) to continue")
    a("--log-every", type=int, default=10)
    a("--val-every", type=int, default=None, help="steps between validations (default: 5 logs)")
    a("--val-batches", type=int, default=4)
    a("--metrics", default=None, help="JSON-lines file (rank 0)")
    a("--plot", default="fastpar_train_loss.png", help="loss plot written at the end ('' : none)")
    a("--timeout", type=float, default=300.0, help="seconds any collective may wait for a peer")
    a("--no-progress", action="store_true", help="no progress bar (log lines only)")
    args = p.parse_args(argv)
    if args.layout == "auto":
        given = explicit_layout_flags(p, argv)
        p.check(not given, f"--layout auto chooses the layout: drop {', '.join(given)}")
    else:
        p.check(args.cluster is None, f"--cluster {args.cluster} is for --layout auto")
    check_args(p, args)
    return args


# the flags --layout auto chooses (argparse dest, flag)
LAYOUT_FLAGS = (("tp", "--tp"), ("pp", "--pp"), ("cp", "--cp"), ("cp_type", "--cp-type"),
                ("ep", "--ep"), ("schedule", "--schedule"), ("microbatches", "--microbatches"),
                ("virtual_stages", "--virtual-stages"), ("zero", "--zero"),
                ("recompute", "--recompute"))


def explicit_layout_flags(parser, argv) -> list[str]:
    """The layout flags present on the command line (abbreviations included): argparse sets
    a default only where the namespace lacks the attribute, so a sentinel survives for every
    flag not given."""
    sentinel = object()
    probe = argparse.Namespace(**{dest: sentinel for dest, _ in LAYOUT_FLAGS})
    parser.parse_args(argv, namespace=probe)
    return [flag for dest, flag in LAYOUT_FLAGS if getattr(probe, dest) is not sentinel]


def check_args(p, args) -> None:
    """Every flag's value against what it can be, before anything starts (one line, exit 2)."""
    at_least_one = ["tp", "pp", "cp", "ep", "moe_top_k", "moe_every", "virtual_stages", "global_batch", "log_every", "val_batches",
                    "steps", "microbatches", "seq_len", "layers", "hidden", "heads", "kv_heads",
                    "val_every"]
    for name in at_least_one:
        value = getattr(args, name)
        if name == "steps" and value == 0 and args.save_hf:
            continue  # --steps 0 --save-hf: a conversion (Hugging Face -> layout -> back)
        p.check(value is None or value >= 1,
                f"--{name.replace('_', '-')} must be at least 1, got {value}"
                + (" (0 with --save-hf: a conversion)" if name == "steps" else ""))
    for name in ("warmup", "save_every"):
        value = getattr(args, name)
        p.check(value is None or value >= 0,
                f"--{name.replace('_', '-')} must be at least 0, got {value}")
    for name in ("clip", "weight_decay"):
        value = getattr(args, name)
        p.check(math.isfinite(value) and value >= 0,
                f"--{name.replace('_', '-')} must be a number >= 0, got {value}")
    p.check(math.isfinite(args.lr) and args.lr > 0, f"--lr must be a number > 0, got {args.lr}")
    p.check(args.moe_experts >= 0, f"--moe-experts must be at least 0, got {args.moe_experts}")
    p.check(args.moe_capacity is None or (math.isfinite(args.moe_capacity) and
                                          args.moe_capacity > 0),
            f"--moe-capacity must be a number > 0, got {args.moe_capacity}")
    for name in ("moe_aux_coef", "moe_z_coef"):
        value = getattr(args, name)
        p.check(math.isfinite(value) and value >= 0,
                f"--{name.replace('_', '-')} must be a number >= 0, got {value}")
    p.check(args.ep == 1 or args.moe_experts > 0,
            f"--ep {args.ep} shards experts: add --moe-experts N")
    p.check(not (args.moe_experts and args.zero),
            f"--zero {args.zero} with --moe-experts: ZeRO does not shard expert parameters "
            "yet (their gradients reduce over the edp group); train MoE without --zero")
    if args.cp > 1:
        p.check(not args.sequence_parallel,
                f"--sequence-parallel with --cp {args.cp}: both split the sequence; use one")
        p.check(not args.moe_experts,
                f"--moe-experts with --cp {args.cp}: not supported yet (expert gradients would "
                "reduce over edp x cp groups)")
    p.check(args.quantize_weights is None or args.zero == 3,
            f"--quantize-weights {args.quantize_weights} quantizes ZeRO-3's parameter "
            f"all-gather; add --zero 3 (this run: --zero {args.zero})")
    p.check(args.zero_granularity == "auto" or args.zero >= 2,
            f"--zero-granularity {args.zero_granularity} chooses how ZeRO-2/3 gather and reduce; "
            f"add --zero 2 or 3 (this run: --zero {args.zero})")
    p.check(not (args.zero_granularity == "unit" and args.schedule == "zb"),
            "--zero-granularity unit with --schedule zb: the split backward computes the "
            "weight gradients (W) apart from the input gradients (I), so the units stay gathered "
            "from I to W and gradients are reduced once per step; use --zero-granularity step")
    p.check(not args.zero_keep_gathered or (args.zero == 3 and
                                            zero_granularity(args) == "unit"),
            f"--zero-keep-gathered keeps ZeRO-3's units gathered across the microbatches of a "
            f"per-unit step; this run has --zero {args.zero}, granularity "
            f"{zero_granularity(args)}")
    p.check(args.zero_prefetch == "auto" or (args.zero == 3 and
                                             zero_granularity(args) == "unit"),
            f"--zero-prefetch {args.zero_prefetch} changes ZeRO-3's per-unit gathers; this run "
            f"has --zero {args.zero}, granularity {zero_granularity(args)}")
    p.check(not args.error_feedback or args.quantize_grads is not None,
            "--error-feedback carries the rounding of --quantize-grads; add --quantize-grads "
            "int8")
    p.check(0 <= args.min_lr_ratio <= 1,
            f"--min-lr-ratio must be between 0 and 1, got {args.min_lr_ratio}")
    p.check(args.timeout > 0, f"--timeout must be > 0 seconds (inf: no limit), got "
                              f"{args.timeout}")
    hf = args.hf_model or args.hf_config
    p.check(not (args.hf_model and args.hf_config),
            "--hf-model and --hf-config: give one model (--hf-model has its config.json)")
    if hf:
        shaped = [flag for flag, value in (
            ("--preset", args.preset), ("--layers", args.layers), ("--hidden", args.hidden),
            ("--heads", args.heads), ("--kv-heads", args.kv_heads),
            ("--tie-embeddings", args.tie_embeddings), ("--moe-experts", args.moe_experts))
            if value]
        source = "--hf-model" if args.hf_model else "--hf-config"
        p.check(not shaped, f"{', '.join(shaped)} with {source}: the model's shape is its "
                            "config.json's")
    from fastpar.training.pruned import check_flags

    pruned = check_flags(p, args)  # a pruned model's --resume: its shape is the checkpoint's
    p.check(args.save_hf is None or hf or (pruned or {}).get("hf"), "--save-hf writes a "
            "Hugging Face model: train one (--hf-model DIR or --hf-config FILE)")
    p.check(args.save_hf is None or not os.path.exists(args.save_hf) or (
        os.path.isdir(args.save_hf) and not os.listdir(args.save_hf)),
        f"--save-hf {args.save_hf} exists and is not an empty directory; not overwritten")
    p.check(args.save_hf_shard_mb >= 1, f"--save-hf-shard-mb must be >= 1, got "
                                        f"{args.save_hf_shard_mb}")
    if not hf:
        args.preset = args.preset or "small"
    for flag, path in (("--data", args.data), ("--resume", args.resume),
                       ("--cluster", args.cluster), ("--hf-model", args.hf_model),
                       ("--hf-config", args.hf_config)):
        p.check(path is None or os.path.exists(path),
                f"{flag} {path}: no such file or directory")
    from fastpar.pipeline.schedules import compile_schedule

    try:  # the schedule's own rules (virtual stages, microbatches) on the host, in microseconds
        compile_schedule(args.schedule, args.pp, args.microbatches or 2 * args.pp,
                         args.virtual_stages)
    except ValueError as exc:
        p.error(f"--schedule {args.schedule} --pp {args.pp} --virtual-stages "
                f"{args.virtual_stages}: {exc}")
    world = p.launched_world()
    if world is not None and args.layout != "auto":  # auto: the planner checks its choice
        mp = args.tp * args.pp
        p.check(world % mp == 0,
                f"--tp {args.tp} x --pp {args.pp} = {mp} does not divide the "
                f"{world} launched rank{'s' if world > 1 else ''} (dp = world / (tp x cp x pp))")
        p.check(world // mp % args.cp == 0,
                f"--cp {args.cp} does not divide world {world} / (tp {args.tp} x pp {args.pp}) "
                f"= {world // mp} (world = tp x cp x dp x pp)")
        dp = world // (mp * args.cp)
        p.check(dp % args.ep == 0, f"--ep {args.ep} does not divide dp {dp} (world {world} / "
                                   f"(tp {args.tp} x pp {args.pp})): experts are sharded over "
                                   "ep ranks inside dp")
        # --cp-type auto is chosen once the hosts are known (Trainer.choose_cp_type); it picks
        # Ulysses only where the ring's checks and Ulysses's both pass, so check the ring's
        checked = argparse.Namespace(**{**vars(args), "cp_type": "ring"}) \
            if args.cp_type == "auto" else args
        try:
            layout_checks(checked, model_config(checked), args.tp, args.pp, dp, args.cp)
        except ValueError as exc:
            p.error(str(exc))


def hf_source(args):
    """``(GPTConfig, HfInfo)`` of ``--hf-model`` / ``--hf-config``, or of a pruned model's
    ``--resume`` (``training.pruned``: HfInfo None when it was fastpar's own GPT), with the
    run's layout choices; None for a preset."""
    from fastpar.training.pruned import pruned_meta, pruned_source

    if (meta := pruned_meta(args)) is not None:
        return pruned_source(meta, _layout_fields(args))
    path = args.hf_model or args.hf_config
    if not path:
        return None
    from fastpar.models.hf import hf_config, read_hf_config

    return hf_config(read_hf_config(path), seq_len=args.seq_len, **_layout_fields(args))


def _layout_fields(args) -> dict:
    """The GPTConfig fields the flags choose for any model: how it runs, not its shape."""
    return {"sequence_parallel": bool(args.sequence_parallel),
            "overlap": {"auto": None, "on": True, "off": False}[args.overlap],
            "recompute": args.recompute,
            "context_parallel": args.cp_type if args.cp > 1 else None}


def model_config(args):
    from fastpar.models import PRESETS

    made = hf_source(args)
    if made is not None:
        return made[0]
    overrides = {k: v for k, v in (("seq_len", args.seq_len), ("layers", args.layers),
                                   ("hidden", args.hidden), ("heads", args.heads),
                                   ("kv_heads", args.kv_heads)) if v is not None}
    if args.tie_embeddings:
        overrides["tie_embeddings"] = True
    overrides.update(_layout_fields(args))
    overrides.update(moe_experts=args.moe_experts, moe_top_k=args.moe_top_k,
                     moe_every=args.moe_every, moe_capacity=args.moe_capacity,
                     moe_aux_coef=args.moe_aux_coef, moe_z_coef=args.moe_z_coef)
    if "heads" in overrides and "kv_heads" not in overrides:
        overrides["kv_heads"] = None  # a new head count: MHA unless told
    return dataclasses.replace(PRESETS[args.preset], **overrides)


def layout_checks(args, cfg, tp: int, pp: int, dp: int, cp: int = 1) -> int:
    """ValueError for a model or batch the layout cannot cut; returns the microbatches."""
    m = args.microbatches or max(1, 2 * pp)
    cfg.validate(tp, args.ep, cp)
    if args.global_batch % (dp * m):
        with_cp = f" x cp {cp}" if cp > 1 else ""
        raise ValueError(f"global batch {args.global_batch} is not divisible by dp {dp} x "
                         f"microbatches {m} (world {tp * pp * dp * cp} = tp {tp}{with_cp} x pp "
                         f"{pp} x dp {dp})")
    return m


def check_layout(args, topo, cfg) -> int:
    """``layout_checks`` on the job's layout (every rank raises alike); returns microbatches."""
    m = layout_checks(args, cfg, topo.tp_size, topo.pp_size, topo.dp_size, topo.cp_size)
    if args.dtype == "bfloat16" and topo.device.type != "cuda":
        print("[fastpar.train] note: bfloat16 on CPU is slow; it is meant for GPUs",
              file=sys.stderr)
    return m


def warmup_steps(args, steps: int) -> int:
    return args.warmup if args.warmup is not None else max(1, steps // 10)


def zero_granularity(args) -> str:
    """How ZeRO-2/3 gather and reduce in this run, "unit" or "step"
    (``plan.memory.zero_granularity`` of the flags)."""
    from fastpar.plan import memory

    return memory.zero_granularity(args.zero, args.zero_granularity, args.pp, args.schedule)


def lr_schedule(args, steps: int) -> dict:
    """What the learning rate of a run is a function of (checkpoints record it as their meta's
    ``"schedule"``)."""
    return {"lr": args.lr, "steps": steps, "warmup": warmup_steps(args, steps),
            "min_lr_ratio": args.min_lr_ratio}


def lr_at(schedule: dict, step: int) -> float:
    """The learning rate of optimizer step ``step`` under ``schedule`` (``lr_schedule``'s)."""
    shape = argparse.Namespace(warmup=schedule["warmup"], min_lr_ratio=schedule["min_lr_ratio"])
    return schedule["lr"] * lr_lambda(shape, schedule["steps"])(step)


def lr_lambda(args, steps: int):
    warmup = warmup_steps(args, steps)

    def f(step: int) -> float:  # step: optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, steps - warmup))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return f
