"""The main job's trainer: one rank's parts of a run, built once from the flags
(``Trainer(args)``), then ``run()`` (``python -m fastpar.train`` is its command line).

    trainer = Trainer(fastpar.training.args.parse_args(["--tp", "2", "--pp", "2"]))
    trainer.train_step(0)          # one optimizer step; or trainer.run()

What a step does: ``fastpar/train.py``'s module docstring and docs/design.md ("The main job").
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import sys
import time

import torch

import fastpar
from fastpar import comm
from fastpar.checkpoint.sharded import ShardedCheckpointer
from fastpar.comm.policy import QUANT_SHM_MIN_BYTES
from fastpar.models import GPTBlock, gpt_layers, gpt_loss
from fastpar.hf_files import SafetensorsReader
from fastpar.models.hf_weights import hf_layers
from fastpar.nn import ColumnParallelLinear, RowParallelLinear
from fastpar.nn import random as tp_random
from fastpar.nn.context import choose_type, context_positions
from fastpar.pipeline import Pipeline
from fastpar.plan.cluster import gpu_peak_flops
from fastpar.runtime import hostid
from fastpar.training.args import (DEFAULT_STEPS, check_layout, hf_source, lr_lambda,
                                   model_config)
from fastpar.training.auto_layout import choose_layout
from fastpar.training.data import Sampler, val_batches
from fastpar.training.memory import report, trainer_meter
from fastpar.training.metrics import MetricsWriter, format_line, plot_losses, read_records
from fastpar.training.optimizer import build_setup
from fastpar.training.pruned import hf_dir, pruned_meta
from fastpar.training.save_resume import Checkpoints, run_identity
from fastpar.training.hf_run import load_data, save_hf


class Trainer:
    """Everything one rank needs for the run, built once (``Trainer(args)``), then ``run()``."""

    @staticmethod
    def choose_cp_type(args, topo) -> str:
        """``--cp-type auto``: ``nn.context.choose_type`` for this model and layout, said by
        rank 0. One answer for the whole job (every rank reads the same flags and host map):
        "in one host" means every cp group is, so that no group runs another type."""
        cfg = model_config(argparse.Namespace(**{**vars(args), "cp_type": "ring"}))
        same_host = all(len({topo.hosts[r] for r in ranks}) == 1
                        for ranks in topo.grid.groups("cp"))
        kind, why = choose_type(cfg.heads, cfg.num_kv_heads, topo.cp_size, tp=topo.tp_size,
                                same_host=same_host, dropout=cfg.dropout > 0)
        if topo.rank == 0 and topo.cp_size > 1:
            print(f"[fastpar.train] note: --cp-type auto chose {kind}: {why}", flush=True)
        return kind

    def __init__(self, args, cfg=None):
        """``cfg``: a model other than the flags' (the planner's calibration trains the plan's
        own model, whose vocabulary and widths have no flags)."""
        self.layout_lines: list[str] = []  # --layout auto: what it chose and why
        if args.layout == "auto":  # the planner's choice, the same on every rank
            args, self.layout_lines = choose_layout(args)
        self.args = args
        self.topo = topo = fastpar.init(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp,
                                        timeout=args.timeout)
        if args.cp_type == "auto":
            args.cp_type = self.choose_cp_type(args, topo)
        made = hf_source(args) if cfg is None else None  # --hf-model / --hf-config / pruned
        self.hf_info = made[1] if made else None
        if self.hf_info is not None and self.hf_info.weights:
            raise ValueError(f"{args.hf_model or args.hf_config} holds "
                             f"{self.hf_info.weights['format']} weights (fastpar's quantized "
                             "format): quantized models run (generate, evaluate) but do not "
                             "train; train the float model")
        self.hf_dir = hf_dir(args) if self.hf_info is not None else None  # its tokenizer
        self.pruned = pruned_meta(args) if made else None  # a pruned model's: its record
        self.cfg = cfg = made[0] if made else model_config(args) if cfg is None else cfg
        self.microbatches = check_layout(args, topo, cfg)
        self.steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.preset]
        corpus = load_data(args, cfg, topo, self.hf_info, self.hf_dir)
        self.corpus_info = corpus.describe()
        self.sampler = Sampler(corpus.train, cfg.seq_len, args.global_batch, args.seed)
        rows = args.global_batch // topo.dp_size
        self.val = [self.context_slice(x.chunk(topo.dp_size)[topo.dp_rank],
                                       y.chunk(topo.dp_size)[topo.dp_rank])
                    for x, y in val_batches(corpus.val, args.val_batches, cfg.seq_len,
                                            args.global_batch)]
        self.rows = rows
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        layers = hf_layers(cfg, self.hf_info, SafetensorsReader(args.hf_model),
                           seed=args.seed) if args.hf_model else gpt_layers(cfg, seed=args.seed)
        self.pipe = Pipeline(layers, loss_fn=gpt_loss,
                             schedule=args.schedule, microbatches=self.microbatches,
                             virtual_stages=args.virtual_stages)  # float32, as initialised
        self.moe_blocks = [m for m in self.pipe.modules() if isinstance(m, GPTBlock) and m.moe]
        for block in self.moe_blocks:  # the pipeline divides each microbatch's loss by them
            block.aux_scale = 1.0 / self.microbatches
        # gradients averaged over the ranks that see other tokens: dp, and cp's slices
        dpcp = topo.dpcp_group if topo.cp_size > 1 else None  # None: the dp group
        self.setup = build_setup(self.pipe, args, group=dpcp, dtype=dtype)  # chosen once
        self.model, self.opt = self.setup.model, self.setup.opt
        if (args.quantize_grads or args.quantize_weights) and topo.dp_size > 1 and \
                len({topo.hosts[r] for r in topo.ranks("dp")}) == 1 and topo.rank == 0:
            if topo.device.type == "cuda":
                print("[fastpar.train] note: the dp group is on one node: its CUDA calls stay "
                      "full precision (int8 is unmeasured against NCCL there; "
                      "FASTPAR_COMM_BACKEND forces it); across nodes every call is int8",
                      flush=True)
            else:
                print(f"[fastpar.train] note: the dp group is on one host: int8 applies to its "
                      f"calls of {QUANT_SHM_MIN_BYTES >> 20} MiB and more (smaller ones cost "
                      "about what they save there and stay full precision); across hosts every "
                      "call is int8", flush=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(args, self.steps))
        self.memory = trainer_meter(cfg, args, topo, self.setup, self.microbatches, self.rows)
        self.ckpt = None  # sharded checkpoints: their own gloo group (collective to create)
        if args.save or args.resume or args.save_hf:
            self.ckpt = ShardedCheckpointer()
        # save and resume, of the state they save (not of the trainer)
        identity = run_identity(cfg, args, self.steps, topo)
        if self.hf_info is not None:  # what an export to Hugging Face needs (hf_export)
            identity["hf"] = {"config": self.hf_info.config, "dtype": self.hf_info.dtype,
                              "files": self.hf_dir}
        if self.pruned is not None:  # its checkpoints too take their model from themselves
            identity["pruned"] = self.pruned["pruned"]
        self.checkpoints = Checkpoints(
            self.ckpt, self.pipe, self.setup, self.sched, identity, self.steps,
            directory=args.save,
            sync=args.sync_save, hold=topo.device.type == "cpu", lead=topo.rank == 0)
        self.memory_rows: list[dict] = []  # every rank's memory record, after run()
        self.start = 0
        self.records: list[dict] = []
        # Who is who: a launcher that reports a dead process by pid (MPICH) is then readable.
        self.pids = [None] * topo.world_size
        label = hostid.labels(topo.hosts) if topo.hosts else {}
        torch.distributed.all_gather_object(self.pids, (os.getpid(), label.get(
            topo.hosts[topo.rank], "") if topo.hosts else ""))

    # ---- one step ----------------------------------------------------------------------------

    def context_slice(self, x: torch.Tensor, y: torch.Tensor):
        """This rank's tokens and targets of the rows ``x``, ``y`` (B, T): under cp, its slice
        (B, T/cp) in ``fastpar.nn.context``'s layout (chunks r and 2cp-1-r); else the rows."""
        if self.topo.cp_size == 1:
            return x, y
        pos = context_positions(x.shape[1], self.topo.cp_group, x.device)
        return x.index_select(1, pos), y.index_select(1, pos)

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step on batch ``step``; returns (global mean loss, grad norm)."""
        topo, args = self.topo, self.args
        tp_random.seed(self.sampler_seed(step))  # dropout streams: a function of (seed, step)
        for block in self.moe_blocks:
            block.moe_stats = None
        x, y = self.context_slice(*self.sampler.shard(step, topo.dp_rank, topo.dp_size))
        self.memory.begin()  # the step's peaks (ZeRO's gathers, gradients, staging) from here
        with self.setup.accumulating():  # the microbatches (OptimizerSetup says what holds)
            loss = self.model.step(x, y)  # this replica's mean
            self.memory.sample()  # the parameters and gradients at their peak
        if self.cfg.tie_embeddings:  # the same on every rank: the embedding group's collective
            self.setup.sum_tied(topo.embedding_group)
        norm = self.setup.clip(args.clip)
        self.checkpoints.wait_for_reads()  # an async save may still read weights and state
        self.opt.step()
        self.memory.sample()  # the optimizer state and the masters' gradients
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        total = torch.tensor([loss], dtype=torch.float64)
        # mean over dp x cp of equal-sized slices (each rank's: the mean over its tokens)
        comm.all_reduce(total, group=self.loss_group)
        return total.item() / (topo.dp_size * topo.cp_size), float(norm)

    @property
    def loss_group(self):
        """The ranks whose tokens make up the global batch: dp, times cp's slices."""
        return self.topo.dpcp_group if self.topo.cp_size > 1 else self.topo.dp_group

    def moe_record(self) -> dict:
        """What the step's MoE blocks routed, over every rank (collective over the world):
        the load-balancing and z losses (unweighted, mean over blocks, microbatches and dp
        ranks), the tokens per expert (slots, top-k per token) of the busiest and idlest
        expert of any block, and the slots dropped by the capacity."""
        cfg, topo = self.cfg, self.topo
        blocks = cfg.moe_blocks
        table = torch.zeros(len(blocks), 4 + cfg.moe_experts, dtype=torch.float64)
        if topo.tp_rank == 0:  # tp ranks route the same tokens: count them once
            for block in self.moe_blocks:
                st = block.moe_stats
                if st is not None:
                    row = table[blocks.index(block.index)]
                    row[:4] = torch.tensor([st["load_balancing"], st["z_loss"], st["forwards"],
                                            st["dropped"]], dtype=torch.float64)
                    row[4:] = st["load"].double()
        comm.all_reduce(table)
        forwards = table[:, 2].sum().clamp_min(1)
        load = table[:, 4:]
        return {"moe_aux_loss": float(table[:, 0].sum() / forwards),
                "moe_z_loss": float(table[:, 1].sum() / forwards),
                "expert_load_min": int(load.min()), "expert_load_max": int(load.max()),
                "moe_dropped": int(table[:, 3].sum())}

    def sampler_seed(self, step: int) -> int:
        """The dropout streams' seed for ``step``: a hash of (seed, step) in its own namespace
        (not the data sampler's, whose stream for another seed it would otherwise equal)."""
        digest = hashlib.blake2b(f"fastpar.dropout:{self.args.seed}:{step}".encode(),
                                 digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 2

    @torch.no_grad()
    def validation_loss(self) -> float:
        """Mean loss over the fixed validation batches (the same tokens under every layout)."""
        self.pipe.eval()
        total = torch.zeros(1, dtype=torch.float64)
        with self.setup.evaluating():  # ZeRO-3: per unit as it runs, or gathered whole
            for x, y in self.val:
                logits = self.pipe.forward(x)
                total += gpt_loss(logits.to(self.topo.device),
                                  y.to(self.topo.device)).double().cpu()
        self.pipe.train()
        comm.all_reduce(total, group=self.loss_group)
        return total.item() / (len(self.val) * self.topo.dp_size * self.topo.cp_size)

    # ---- the run -----------------------------------------------------------------------------

    def run(self) -> list[dict]:
        args, topo = self.args, self.topo
        lead = topo.rank == 0
        if args.resume:
            self.start = self.checkpoints.resume(args.resume)
        self.checkpoints.check_directory(self.start)
        if lead:
            for line in self.layout_lines:
                print(line, flush=True)
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
            if self.cfg.moe_experts:
                rec.update(self.moe_record())
            rec.update(self.mfu(tokens / dt))
            if done % val_every == 0 or done == self.steps:
                rec["val_loss"] = self.validation_loss()
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
                self.checkpoints.save(done)
        if bar is not None:
            bar.close()
        if args.save:
            self.checkpoints.finish()  # the last save committed, or its error raised
        if args.save_hf:
            save_hf(self)
        if self.ckpt is not None:
            self.ckpt.close()  # and its staging buffer (async saves from a GPU) freed
        self.memory_rows = report(self.memory, metrics, lead)  # collective
        metrics.close()
        if lead and args.plot and self.records:
            past = read_records(args.metrics) if args.resume and args.metrics else self.records
            path = plot_losses(past, args.plot)
            print(f"[fastpar.train] loss plot: {os.path.abspath(path)}", flush=True)
        return self.records

    def banner(self) -> None:
        t, cfg = self.topo, self.cfg
        cp = f" x cp {t.cp_size} ({self.args.cp_type})" if t.cp_size > 1 else ""
        print(f"[fastpar.train] world {t.world_size} = tp {t.tp_size}{cp} x pp {t.pp_size} x dp "
              f"{t.dp_size} on {t.device.type}; schedule {self.args.schedule}, "
              f"{self.microbatches} microbatches of {self.rows // self.microbatches} "
              f"sequences; {f'ZeRO-{self.args.zero} ' if self.args.zero else ''}AdamW lr "
              f"{self.args.lr:g}"
              + ("; bfloat16 compute, float32 master weights, gradients reduced in float32"
                 if self.args.dtype == "bfloat16" else ""), flush=True)
        what = (f"Hugging Face {self.hf_info.model_type} "
                f"({self.args.hf_model or self.args.hf_config or self.hf_dir})"
                if self.hf_info else f"{self.args.preset} preset")
        if self.pruned is not None:
            what = f"{what if self.hf_info else 'fastpar GPT'} pruned by fastpar.prune"
        print(f"[fastpar.train] model: {what}, {cfg.num_params() / 1e6:.2f} M "
              f"params ({cfg.layers} layers, hidden {cfg.hidden}, heads {cfg.heads}/"
              f"{cfg.num_kv_heads} kv, seq {cfg.seq_len}, recompute {cfg.recompute}); steps "
              f"{self.start} -> {self.steps}, global batch {self.args.global_batch}", flush=True)
        if cfg.moe_experts:
            cap = "dropless" if cfg.moe_capacity is None else f"capacity {cfg.moe_capacity:g}"
            print(f"[fastpar.train] MoE: blocks {cfg.moe_blocks} of {cfg.layers}, "
                  f"{cfg.moe_experts} experts, top-{cfg.moe_top_k}, {cap}, ep {t.ep_size} "
                  f"({cfg.moe_experts // t.ep_size} experts per rank, experts' gradients over "
                  f"edp {t.edp_size}); router losses x {cfg.moe_aux_coef:g} (balance, per "
                  f"sequence) and x {cfg.moe_z_coef:g} (z)", flush=True)
        print(f"[fastpar.train] data: {self.corpus_info}", flush=True)
        ranks = ", ".join(f"{r}: pid {pid}" + (f" on {host}" if host else "")
                          for r, (pid, host) in enumerate(self.pids[:16]))
        more = f", ... ({len(self.pids)} ranks)" if len(self.pids) > 16 else ""
        print(f"[fastpar.train] ranks: {ranks}{more}", flush=True)

    def say_overlap(self) -> None:
        """What the overlap policy did in the first step's parallel linear layers (rank 0's
        stage), and why: printed once."""
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
        flops = self.cfg.flops_per_token()
        return {"mfu": tokens_per_s * flops / (peak * self.topo.world_size)}

