"""The main job: train a GPT with tensor, pipeline and data parallelism, the same as one process.

    mpirun -np 4 python -m fastpar.train --tp 2 --pp 2              # dp = world / (tp x pp)
    python -m fastpar.train --preset tiny --steps 100                # one process, serial
    mpirun -np 4 python -m fastpar.train --tp 2 --pp 2 --save ckpt --save-every 50
    mpirun -np 2 python -m fastpar.train --resume ckpt               # any other layout

Each step: the global batch (a pure function of (seed, step): ``fastpar.training.data``) is cut
into dp slices; ``DataParallel(Pipeline(gpt_layers(cfg)))`` runs the microbatches through the
stages (tp inside each layer) and averages the gradients over dp (``--zero``: a ZeRO-1
``DistributedOptimizer`` reduce-scatters them instead); tied embedding gradients are summed over
the first and last stage; the gradients are clipped by the serial model's global norm; AdamW
steps. The initial weights depend only on ``--seed``, so every layout starts from the serial
model and, up to float32 rounding, follows the same loss curve.

Rank 0 shows a progress bar and a line every ``--log-every`` steps, validation loss every
``--val-every``, JSON lines with ``--metrics``, and a loss plot at the end (``--plot``).
Checkpoints (``--save``) hold the serial layout (safetensors) and reload under any layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import os
import sys
import time

import torch

DEFAULT_STEPS = {"tiny": 200, "small": 150}


def parse_args(argv=None) -> argparse.Namespace:
    from fastpar.cli import Parser

    p = Parser(prog="python -m fastpar.train", description=__doc__)
    a = p.add_argument
    a("--tp", type=int, default=1, help="tensor-parallel size")
    a("--pp", type=int, default=1, help="pipeline-parallel size (dp = world / (tp x pp))")
    a("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved", "zb"])
    a("--microbatches", type=int, default=None, help="per step (default: 2 x pp, at least 1)")
    a("--virtual-stages", type=int, default=1, help="model chunks per rank (interleaved)")
    a("--preset", default="small", choices=["tiny", "small"])
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
    a("--lr", type=float, default=2e-3, help="peak learning rate (AdamW)")
    a("--min-lr-ratio", type=float, default=0.1, help="cosine decay floor, as a fraction of lr")
    a("--warmup", type=int, default=None, help="linear warm-up steps (default: steps / 10)")
    a("--weight-decay", type=float, default=0.1)
    a("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    a("--seed", type=int, default=0)
    a("--data", default=None, help="a text file or directory (default: the Python stdlib)")
    a("--dtype", default="float32", choices=["float32", "bfloat16"])
    a("--zero", action="store_true", help="ZeRO-1: optimizer state sharded over dp")
    a("--save", default=None, help="checkpoint directory")
    a("--save-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    a("--resume", default=None, help="checkpoint directory (or one step_* in it) to continue")
    a("--log-every", type=int, default=10)
    a("--val-every", type=int, default=None, help="steps between validations (default: 5 logs)")
    a("--val-batches", type=int, default=4)
    a("--metrics", default=None, help="JSON-lines file (rank 0)")
    a("--plot", default="fastpar_train_loss.png", help="loss plot written at the end ('' : none)")
    a("--timeout", type=float, default=300.0, help="seconds any collective may wait for a peer")
    a("--no-progress", action="store_true", help="no progress bar (log lines only)")
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def check_args(p, args) -> None:
    """Every flag's value against what it can be, before anything starts (one line, exit 2)."""
    at_least_one = ["tp", "pp", "virtual_stages", "global_batch", "log_every", "val_batches",
                    "steps", "microbatches", "seq_len", "layers", "hidden", "heads", "kv_heads",
                    "val_every"]
    for name in at_least_one:
        value = getattr(args, name)
        p.check(value is None or value >= 1,
                f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("warmup", "save_every"):
        value = getattr(args, name)
        p.check(value is None or value >= 0,
                f"--{name.replace('_', '-')} must be at least 0, got {value}")
    for name in ("clip", "weight_decay"):
        value = getattr(args, name)
        p.check(math.isfinite(value) and value >= 0,
                f"--{name.replace('_', '-')} must be a number >= 0, got {value}")
    p.check(math.isfinite(args.lr) and args.lr > 0, f"--lr must be a number > 0, got {args.lr}")
    p.check(0 <= args.min_lr_ratio <= 1,
            f"--min-lr-ratio must be between 0 and 1, got {args.min_lr_ratio}")
    p.check(args.timeout > 0, f"--timeout must be > 0 seconds (inf: no limit), got "
                              f"{args.timeout}")
    for flag, path in (("--data", args.data), ("--resume", args.resume)):
        p.check(path is None or os.path.exists(path),
                f"{flag} {path}: no such file or directory")
    from fastpar.pipeline.schedules import compile_schedule

    try:  # the schedule's own rules (virtual stages, microbatches) on the host, in microseconds
        compile_schedule(args.schedule, args.pp, args.microbatches or 2 * args.pp,
                         args.virtual_stages)
    except ValueError as exc:
        p.error(f"--schedule {args.schedule} --pp {args.pp} --virtual-stages "
                f"{args.virtual_stages}: {exc}")
    from fastpar.runtime.launcher import launched_world_size

    world = launched_world_size()
    p.check(world % (args.tp * args.pp) == 0,
            f"--tp {args.tp} x --pp {args.pp} = {args.tp * args.pp} does not divide the {world} "
            f"launched rank{'s' if world > 1 else ''} (dp = world / (tp x pp))")


def model_config(args):
    from fastpar.models import PRESETS

    overrides = {k: v for k, v in (("seq_len", args.seq_len), ("layers", args.layers),
                                   ("hidden", args.hidden), ("heads", args.heads),
                                   ("kv_heads", args.kv_heads)) if v is not None}
    if args.tie_embeddings:
        overrides["tie_embeddings"] = True
    if args.sequence_parallel:
        overrides["sequence_parallel"] = True
    overrides["overlap"] = {"auto": None, "on": True, "off": False}[args.overlap]
    if "heads" in overrides and "kv_heads" not in overrides:
        overrides["kv_heads"] = None  # a new head count: MHA unless told
    return dataclasses.replace(PRESETS[args.preset], **overrides)


def check_layout(args, topo, cfg) -> int:
    """ValueError (on every rank) for a batch the layout cannot cut; returns microbatches."""
    dp = topo.dp_size
    m = args.microbatches or max(1, 2 * topo.pp_size)
    cfg.validate(topo.tp_size)
    if args.global_batch % (dp * m):
        raise ValueError(f"global batch {args.global_batch} is not divisible by dp {dp} x "
                         f"microbatches {m} (world {topo.world_size} = tp {topo.tp_size} x pp "
                         f"{topo.pp_size} x dp {dp})")
    if args.dtype == "bfloat16" and topo.device.type != "cuda":
        print("[fastpar.train] note: bfloat16 on CPU is slow; it is meant for GPUs",
              file=sys.stderr)
    return m


def warmup_steps(args, steps: int) -> int:
    return args.warmup if args.warmup is not None else max(1, steps // 10)


def lr_lambda(args, steps: int):
    warmup = warmup_steps(args, steps)

    def f(step: int) -> float:  # step: optimizer steps taken so far
        if step < warmup:
            return (step + 1) / warmup
        frac = min(1.0, (step - warmup) / max(1, steps - warmup))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
    return f


class Trainer:
    """Everything one rank needs for the run, built once (``Trainer(args)``), then ``run()``."""

    def __init__(self, args):
        import fastpar
        from fastpar.models import gpt_layers, gpt_loss
        from fastpar.pipeline import Pipeline
        from fastpar.training.data import Sampler, builtin_corpus, load_corpus, val_batches

        self.args = args
        self.topo = topo = fastpar.init(tp=args.tp, pp=args.pp, timeout=args.timeout)
        self.cfg = cfg = model_config(args)
        self.microbatches = check_layout(args, topo, cfg)
        self.steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.preset]
        corpus = load_corpus(args.data, cfg.seq_len) if args.data else builtin_corpus()
        self.corpus_info = corpus.describe()
        self.sampler = Sampler(corpus.train, cfg.seq_len, args.global_batch, args.seed)
        rows = args.global_batch // topo.dp_size
        self.val = [(x.chunk(topo.dp_size)[topo.dp_rank], y.chunk(topo.dp_size)[topo.dp_rank])
                    for x, y in val_batches(corpus.val, args.val_batches, cfg.seq_len,
                                            args.global_batch)]
        self.rows = rows
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        self.pipe = Pipeline(gpt_layers(cfg, seed=args.seed), loss_fn=gpt_loss,
                             schedule=args.schedule, microbatches=self.microbatches,
                             virtual_stages=args.virtual_stages).to(dtype)
        if args.zero:
            self.model = self.pipe
            self.opt = fastpar.optim.DistributedOptimizer(
                self.pipe.parameters(), torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95),
                weight_decay=args.weight_decay)
        else:
            self.model = fastpar.DataParallel(self.pipe, reduce_dtype=torch.float32
                                              if dtype != torch.float32 else None)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                         weight_decay=args.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(args, self.steps))
        self.stage_modules = list(self.pipe.modules())  # this rank's, for the tied weights
        self.start = 0
        self.records: list[dict] = []
        # Who is who: a launcher that reports a dead process by pid (MPICH) is then readable.
        self.pids = [None] * topo.world_size
        torch.distributed.all_gather_object(self.pids, (os.getpid(), topo.hosts[topo.rank]
                                                        if topo.hosts else ""))

    # ---- one step ----------------------------------------------------------------------------

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step on batch ``step``; returns (global mean loss, grad norm)."""
        from fastpar import comm, optim
        from fastpar.models import sum_tied_grads
        from fastpar.nn import random as tp_random

        topo, args = self.topo, self.args
        tp_random.seed(self.sampler_seed(step))  # dropout streams: a function of (seed, step)
        x, y = self.sampler.shard(step, topo.dp_rank, topo.dp_size)
        loss = self.model.step(x, y)  # this replica's mean; DataParallel reduced the grads
        if self.cfg.tie_embeddings:  # the same on every rank: the embedding group's collective
            sum_tied_grads(self.stage_modules, topo.embedding_group)
        if args.clip <= 0:
            norm = torch.tensor(float("nan"))  # no clip, no norm (ZeRO's step reduces itself)
        elif args.zero:
            norm = self.opt.clip_grad_norm_(args.clip, model=self.pipe)
        else:
            norm = optim.clip_grad_norm_(self.pipe, args.clip)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        total = torch.tensor([loss], dtype=torch.float64)
        comm.all_reduce(total, group=topo.dp_group)  # mean over dp of equal-sized slices
        return total.item() / topo.dp_size, float(norm)

    def sampler_seed(self, step: int) -> int:
        """The dropout streams' seed for ``step``: a hash of (seed, step) in its own namespace
        (not the data sampler's, whose stream for another seed it would otherwise equal)."""
        digest = hashlib.blake2b(f"fastpar.dropout:{self.args.seed}:{step}".encode(),
                                 digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 2

    @torch.no_grad()
    def validate(self) -> float:
        """Mean loss over the fixed validation batches (the same tokens under every layout)."""
        from fastpar import comm
        from fastpar.models import gpt_loss

        self.pipe.eval()
        total = torch.zeros(1, dtype=torch.float64)
        for x, y in self.val:
            logits = self.pipe.forward(x)
            total += gpt_loss(logits.to(self.topo.device), y.to(self.topo.device)).double().cpu()
        self.pipe.train()
        comm.all_reduce(total, group=self.topo.dp_group)
        return total.item() / (len(self.val) * self.topo.dp_size)

    # ---- the run -----------------------------------------------------------------------------

    def run(self) -> list[dict]:
        from fastpar.training.metrics import (MetricsWriter, format_line, plot_losses,
                                              read_records)

        args, topo = self.args, self.topo
        lead = topo.rank == 0
        if args.resume:
            self.resume(args.resume)
        self.check_save_dir()
        if lead:
            self.banner()
        metrics = MetricsWriter(args.metrics if lead else None, resume=bool(args.resume),
                                resume_step=self.start if args.resume else None)
        bar = None
        if lead and not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=self.steps, initial=self.start, desc="train", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        val_every = args.val_every or 5 * args.log_every
        tokens = args.global_batch * self.cfg.seq_len
        window = []
        for step in range(self.start, self.steps):
            t0 = time.perf_counter()
            loss, norm = self.train_step(step)
            dt = time.perf_counter() - t0
            window.append(dt)
            done = step + 1
            rec = {"step": done, "loss": loss, "lr": self.sched.get_last_lr()[0],
                   "step_time_s": dt, "tokens_per_s": tokens / dt}
            if not math.isnan(norm):  # --clip 0 (without --zero): no norm computed
                rec["grad_norm"] = norm
            rec.update(self.mfu(tokens / dt))
            if done % val_every == 0 or done == self.steps:
                rec["val_loss"] = self.validate()
            self.records.append(rec)
            metrics.write(rec)
            if lead and step == self.start:
                self.say_overlap()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            if lead and (done % args.log_every == 0 or done == self.steps or "val_loss" in rec):
                mean = sum(window) / len(window)
                line = format_line({**rec, "step_time_s": mean, "tokens_per_s": tokens / mean})
                (bar.write if bar is not None else print)(line)
                window = []
            if args.save and (done == self.steps or (args.save_every and
                                                      done % args.save_every == 0)):
                self.save(done)
        if bar is not None:
            bar.close()
        metrics.close()
        if lead and args.plot and self.records:
            past = read_records(args.metrics) if args.resume and args.metrics else self.records
            path = plot_losses(past, args.plot)
            print(f"[fastpar.train] loss plot: {os.path.abspath(path)}", flush=True)
        return self.records

    def banner(self) -> None:
        t, cfg = self.topo, self.cfg
        print(f"[fastpar.train] world {t.world_size} = tp {t.tp_size} x pp {t.pp_size} x dp "
              f"{t.dp_size} on {t.device.type}; schedule {self.args.schedule}, "
              f"{self.microbatches} microbatches of {self.rows // self.microbatches} "
              f"sequences; {'ZeRO-1 ' if self.args.zero else ''}AdamW lr {self.args.lr:g}",
              flush=True)
        print(f"[fastpar.train] model: {self.args.preset} preset, {cfg.num_params() / 1e6:.2f} M "
              f"params ({cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}/"
              f"{cfg.num_kv_heads} kv, seq {cfg.seq_len}); steps {self.start} -> {self.steps}, "
              f"global batch {self.args.global_batch}", flush=True)
        print(f"[fastpar.train] data: {self.corpus_info}", flush=True)
        ranks = ", ".join(f"{r}: pid {pid}" + (f" on {host}" if host else "")
                          for r, (pid, host) in enumerate(self.pids[:16]))
        more = f", ... ({len(self.pids)} ranks)" if len(self.pids) > 16 else ""
        print(f"[fastpar.train] ranks: {ranks}{more}", flush=True)

    def say_overlap(self) -> None:
        """What the overlap policy did in the first step's parallel linear layers (rank 0's
        stage), and why: printed once."""
        from fastpar.nn import ColumnParallelLinear, RowParallelLinear

        seen: dict = {}
        for module in self.model.modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) \
                    and module.overlap_decision is not None:
                key = str(module.overlap_decision)
                seen[key] = seen.get(key, 0) + 1
        for decision, count in seen.items():
            print(f"[fastpar.train] overlap of communication in {count} parallel linear "
                  f"layers: {decision}", flush=True)

    def mfu(self, tokens_per_s: float) -> dict:
        """Model-FLOPs utilisation on a GPU: 6 N + 12 L H T FLOPs per token (forward and
        backward, attention included) over the devices' bf16 dense peak."""
        if self.topo.device.type != "cuda":
            return {}
        peak = gpu_peak_flops(torch.cuda.get_device_name(self.topo.device))
        if peak is None:
            return {}
        cfg = self.cfg
        flops = 6 * cfg.num_params() + 12 * cfg.layers * cfg.hidden * cfg.seq_len
        return {"mfu": tokens_per_s * flops / (peak * self.topo.world_size)}

    # ---- checkpoints -------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Collective: gather the serial layout, rank 0 writes it atomically."""
        import fastpar
        from fastpar.training import checkpoint as ckpt
        from fastpar.training.state import serial_optimizer_state

        weights = fastpar.full_state_dict(self.model)
        opt_tensors, scalars = serial_optimizer_state(self.pipe, self.opt)
        if self.topo.rank == 0:
            meta = {"model": dataclasses.asdict(self.cfg), "seed": self.args.seed,
                    "global_batch": self.args.global_batch, "optimizer_scalars": scalars,
                    "scheduler": scheduler_state(self.sched),
                    "schedule": {"steps": self.steps,
                                 "warmup": warmup_steps(self.args, self.steps)},
                    "layout": {"tp": self.topo.tp_size, "pp": self.topo.pp_size,
                               "dp": self.topo.dp_size, "zero": self.args.zero},
                    "dtype": self.args.dtype}
            path = ckpt.save(self.args.save, step, model=weights, optimizer=opt_tensors,
                             meta=meta)
            print(f"[fastpar.train] saved step {step} to {path}", flush=True)
        torch.distributed.barrier()

    def check_save_dir(self) -> None:
        """Before training, not at the first save: checkpoints this run would have to overwrite
        (a finished run's) are an error; checkpoints are never overwritten."""
        save = self.args.save
        if not save or not os.path.isdir(save):
            return
        later = sorted(d for d in os.listdir(save) if d.startswith("step_")
                       and d[5:].isdigit() and int(d[5:]) > self.start)
        if later:
            raise ValueError(f"--save {save} already holds checkpoints past step {self.start} "
                             f"({', '.join(later[:3])}{', ...' if len(later) > 3 else ''}): "
                             f"resume from it (--resume {save}) or save elsewhere")

    def resume(self, where: str) -> None:
        """Continue from a checkpoint saved under any layout of the same model."""
        import fastpar
        from fastpar.training import checkpoint as ckpt
        from fastpar.training.state import load_serial_optimizer_state

        c = ckpt.load(where)
        saved = c.meta.get("model", {})
        mine = dataclasses.asdict(self.cfg)
        diff = [f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in mine.items()
                if k not in ("sequence_parallel", "overlap", "dropout") and saved.get(k) != v]
        if diff:
            raise ValueError(f"checkpoint {c.path} was saved from a different model: "
                             + "; ".join(diff))
        data = [f"{k}: checkpoint {c.meta.get(k)!r}, this run {v!r}"
                for k, v in (("seed", self.args.seed), ("global_batch", self.args.global_batch))
                if c.meta.get(k) != v]
        if data:  # the batches are a function of (seed, step) and the global batch
            raise ValueError(f"checkpoint {c.path} was trained on another data stream: "
                             + "; ".join(data) + " (pass the same --seed and --global-batch)")
        expected = {k: tuple(v.shape) for k, v in fastpar.full_state_dict(self.model).items()}
        ckpt.check_model_shapes(expected, c.model, c.path)
        if c.step > self.steps:
            raise ValueError(f"checkpoint {c.path} is at step {c.step}, past --steps "
                             f"{self.steps}")
        fastpar.load_full_state_dict(self.model, c.model)
        load_serial_optimizer_state(self.pipe, self.opt, c.optimizer,
                                    c.meta.get("optimizer_scalars", {}))
        self.sched.load_state_dict({**self.sched.state_dict(), **c.meta["scheduler"]})
        for group, lr in zip(self.opt.param_groups, self.sched.get_last_lr()):
            group["lr"] = lr
        self.start = c.step
        if self.topo.rank == 0:
            lay = c.meta.get("layout", {})
            print(f"[fastpar.train] resumed {c.path} at step {c.step} (saved under tp "
                  f"{lay.get('tp')} pp {lay.get('pp')} dp {lay.get('dp')})", flush=True)
            if (replanned := self.replanned(c.meta.get("schedule"), c.step)) is not None:
                print(f"[fastpar.train] note: {replanned}", flush=True)

    def replanned(self, saved: dict | None, step: int) -> str | None:
        """What changes in the learning-rate schedule when this run's --steps or --warmup
        differ from the checkpoint's (None: nothing): the schedule is a function of both."""
        warmup = warmup_steps(self.args, self.steps)
        if saved is None:
            return (f"the checkpoint does not record its learning-rate schedule; this run's "
                    f"warms up over {warmup} steps and decays to step {self.steps}")
        if (saved["steps"], saved["warmup"]) == (self.steps, warmup):
            return None
        before = self.args.lr * lr_lambda(
            argparse.Namespace(warmup=saved["warmup"], min_lr_ratio=self.args.min_lr_ratio),
            saved["steps"])(step)
        now = self.args.lr * lr_lambda(self.args, self.steps)(step)
        return (f"the learning-rate schedule is replanned: the checkpoint's ran to step "
                f"{saved['steps']} (warm-up {saved['warmup']}), this run's to step "
                f"{self.steps} (warm-up {warmup}); at step {step} the rate goes from "
                f"{before:.3g} to {now:.3g}")


def scheduler_state(sched) -> dict:
    """The LR scheduler's JSON-able state (LambdaLR keeps its lambdas out of it)."""
    return {k: v for k, v in sched.state_dict().items()
            if isinstance(v, (int, float, list, bool, type(None)))}


# Dense bf16 peak FLOP/s by device-name substring (vendor data sheets, SXM parts).
_PEAKS = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12),
          ("A10", 125e12), ("V100", 125e12))


def gpu_peak_flops(name: str) -> float | None:
    return next((peak for key, peak in _PEAKS if key in name), None)


def main(argv=None) -> int:
    import fastpar

    args = parse_args(argv)
    Trainer(args).run()
    # Only after success: on an error or Ctrl-C the exception must reach fastpar's hook, which
    # aborts the whole job (a peer may sit in a collective that would otherwise wait for this
    # rank until the timeout); shutdown would remove that hook first.
    fastpar.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
