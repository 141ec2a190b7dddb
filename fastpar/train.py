"""The main job: train a GPT with tensor, pipeline and data parallelism, the same as one process.

    mpirun -np 4 python -m fastpar.train --tp 2 --pp 2              # dp = world / (tp x pp)
    python -m fastpar.train --preset tiny --steps 100                # one process, serial
    mpirun -np 4 python -m fastpar.train --tp 2 --pp 2 --save ckpt --save-every 50
    mpirun -np 2 python -m fastpar.train --resume ckpt               # any other layout
    mpirun -np 4 python -m fastpar.train --cp 2 --cp-type ulysses --pp 2   # context parallel
    mpirun -np 4 python -m fastpar.train --layout auto --cluster c.json   # the planner chooses

Each step: the global batch (a pure function of (seed, step): ``fastpar.training.data``) is cut
into dp slices; ``DataParallel(Pipeline(gpt_layers(cfg)))`` runs the microbatches through the
stages (tp inside each layer) and averages the gradients over dp (x cp; ``--zero N``: a ZeRO-N
``DistributedOptimizer`` reduce-scatters them instead; at stage 3 each pipeline step runs
with the stage's parameters gathered, see docs/design.md); tied embedding gradients are summed over
the first and last stage; under ``--cp N`` each sequence is split over the cp ranks, which see
the same rows (``fastpar.nn.context``'s layout; attention by ``--cp-type`` ring or ulysses), and
gradients are averaged over dp x cp; the gradients are clipped by the serial model's global norm; AdamW
steps. The initial weights depend only on ``--seed``, so every layout starts from the serial
model and, up to float32 rounding, follows the same loss curve. ``--dtype bfloat16`` computes in
bf16 and reduces gradients in float32 on every axis; AdamW steps float32 master weights with
float32 state (``fastpar.optim.MasterWeights``; with ``--zero`` the ZeRO optimizer's own).

Rank 0 shows a progress bar and a line every ``--log-every`` steps, validation loss every
``--val-every``, JSON lines with ``--metrics``, and a loss plot at the end (``--plot``).
Checkpoints (``--save``) are sharded: every rank writes its own pieces (in the background unless
``--sync-save``) and any layout reloads them (``fastpar.checkpoint``; ``python -m
fastpar.checkpoint export`` writes the serial layout).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import os
import sys
import time

import torch

from fastpar.plan.cluster import gpu_peak_flops
from fastpar.runtime import hostid
from fastpar.training import run_state
from fastpar.training.args import (DEFAULT_STEPS, check_layout, lr_lambda, model_config,
                                   parse_args)

__all__ = ["Trainer", "main", "parse_args", "model_config", "lr_lambda"]


class Trainer:
    """Everything one rank needs for the run, built once (``Trainer(args)``), then ``run()``."""

    @staticmethod
    def choose_cp_type(args, topo) -> str:
        """``--cp-type auto``: ``nn.context.choose_type`` for this model and layout, said by
        rank 0. One answer for the whole job (every rank reads the same flags and host map):
        "in one host" means every cp group is, so that no group runs another type."""
        from fastpar.nn.context import choose_type

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
        import fastpar
        from fastpar.models import gpt_layers, gpt_loss
        from fastpar.pipeline import Pipeline
        from fastpar.training.data import Sampler, builtin_corpus, load_corpus, val_batches

        self.layout_lines: list[str] = []  # --layout auto: what it chose and why
        if args.layout == "auto":  # the planner's choice, the same on every rank
            from fastpar.training.auto_layout import resolve

            args, self.layout_lines = resolve(args)
        self.args = args
        self.topo = topo = fastpar.init(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp,
                                        timeout=args.timeout)
        if args.cp_type == "auto":
            args.cp_type = self.choose_cp_type(args, topo)
        self.cfg = cfg = model_config(args) if cfg is None else cfg
        self.microbatches = check_layout(args, topo, cfg)
        self.steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.preset]
        corpus = load_corpus(args.data, cfg.seq_len) if args.data else builtin_corpus()
        self.corpus_info = corpus.describe()
        self.sampler = Sampler(corpus.train, cfg.seq_len, args.global_batch, args.seed)
        rows = args.global_batch // topo.dp_size
        self.val = [self.context_slice(x.chunk(topo.dp_size)[topo.dp_rank],
                                       y.chunk(topo.dp_size)[topo.dp_rank])
                    for x, y in val_batches(corpus.val, args.val_batches, cfg.seq_len,
                                            args.global_batch)]
        self.rows = rows
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        self.pipe = Pipeline(gpt_layers(cfg, seed=args.seed), loss_fn=gpt_loss,
                             schedule=args.schedule, microbatches=self.microbatches,
                             virtual_stages=args.virtual_stages)  # float32, as initialised
        from fastpar.models import GPTBlock

        self.moe_blocks = [m for m in self.pipe.modules() if isinstance(m, GPTBlock) and m.moe]
        for block in self.moe_blocks:  # the pipeline divides each microbatch's loss by them
            block.aux_scale = 1.0 / self.microbatches
        # gradients averaged over the ranks that see other tokens: dp, and cp's slices
        dpcp = topo.dpcp_group if topo.cp_size > 1 else None  # None: the dp group
        adamw = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": args.weight_decay}
        if args.zero:
            initial = {p: p.detach().clone() for p in self.pipe.parameters()} \
                if dtype != torch.float32 else None
            self.model = self.pipe.to(dtype)  # the same Parameter objects, now bf16
            self.opt = fastpar.optim.DistributedOptimizer(
                self.pipe.parameters(), torch.optim.AdamW, stage=args.zero, module=self.pipe,
                group=dpcp, quant_weights=args.quantize_weights, quant_grads=args.quantize_grads,
                error_feedback=args.error_feedback, **adamw)
            if initial is not None:  # the float32 masters start from the float32 initial weights
                self.opt.load_master_weights(initial)
                del initial
        elif dtype == torch.float32:
            self.model = fastpar.DataParallel(self.pipe, group=dpcp, quant=args.quantize_grads,
                                              error_feedback=args.error_feedback)
            self.opt = torch.optim.AdamW(self.model.parameters(), **adamw)
        else:
            # Masters from the float32 initial weights, then the model computes in bf16;
            # gradients are reduced over dp in float32 (over tp and the tied copies too:
            # fastpar.nn, sum_tied_grads) and AdamW steps the float32 masters.
            self.opt = fastpar.optim.MasterWeights(self.pipe.parameters(), torch.optim.AdamW,
                                                   **adamw)
            self.model = fastpar.DataParallel(self.pipe.to(dtype), group=dpcp,
                                              reduce_dtype=torch.float32,
                                              quant=args.quantize_grads,
                                              error_feedback=args.error_feedback)
        if (args.quantize_grads or args.quantize_weights) and topo.dp_size > 1 and \
                len({topo.hosts[r] for r in topo.ranks("dp")}) == 1 and topo.rank == 0:
            from fastpar.comm.policy import QUANT_SHM_MIN_BYTES
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
        # ZeRO-3: what needs the full parameters (a pipeline step, validation, checkpoints)
        self.gathered = self.opt.gathered if args.zero else contextlib.nullcontext
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lr_lambda(args, self.steps))
        self.stage_modules = list(self.pipe.modules())  # this rank's, for the tied weights
        from fastpar.training.memory import trainer_meter

        self.memory = trainer_meter(self)  # peak bytes by category, and their prediction
        self.ckpt = None  # sharded checkpoints: their own gloo group (collective to create)
        self.ckpt_said = None  # the last save the log has announced as committed
        if args.save or args.resume:
            from fastpar.checkpoint.sharded import ShardedCheckpointer

            self.ckpt = ShardedCheckpointer()
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
        from fastpar.nn.context import context_positions

        pos = context_positions(x.shape[1], self.topo.cp_group, x.device)
        return x.index_select(1, pos), y.index_select(1, pos)

    def train_step(self, step: int) -> tuple[float, float]:
        """One optimizer step on batch ``step``; returns (global mean loss, grad norm)."""
        from fastpar import comm, optim
        from fastpar.models import sum_tied_grads
        from fastpar.nn import random as tp_random

        topo, args = self.topo, self.args
        tp_random.seed(self.sampler_seed(step))  # dropout streams: a function of (seed, step)
        for block in self.moe_blocks:
            block.moe_stats = None
        x, y = self.context_slice(*self.sampler.shard(step, topo.dp_rank, topo.dp_size))
        if args.zero >= 2:  # accumulate over the microbatches, reduce-scatter once at the step
            with self.opt.no_sync(), self.gathered():
                loss = self.model.step(x, y)
                self.memory.sample()  # the gathered parameters, the accumulated gradients
        else:
            loss = self.model.step(x, y)  # this replica's mean; DataParallel reduced the grads
            self.memory.sample()
        if self.cfg.tie_embeddings:  # the same on every rank: the embedding group's collective
            sum_tied_grads(self.stage_modules, topo.embedding_group)
        if args.clip <= 0:
            norm = torch.tensor(float("nan"))  # no clip, no norm (ZeRO's step reduces itself)
        elif args.zero:
            norm = self.opt.clip_grad_norm_(args.clip, model=self.pipe)
        else:
            norm = optim.clip_grad_norm_(self.pipe, args.clip)
        if self.ckpt is not None:  # an async save may still read the weights and the state
            self.ckpt.wait_for_reads()  # (its commit goes on; the next save or the end waits)
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
        from fastpar import comm

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
        from fastpar import comm
        from fastpar.models import gpt_loss

        self.pipe.eval()
        total = torch.zeros(1, dtype=torch.float64)
        with self.gathered():
            for x, y in self.val:
                logits = self.pipe.forward(x)
                total += gpt_loss(logits.to(self.topo.device),
                                  y.to(self.topo.device)).double().cpu()
        self.pipe.train()
        comm.all_reduce(total, group=self.loss_group)
        return total.item() / (len(self.val) * self.topo.dp_size * self.topo.cp_size)

    # ---- the run -----------------------------------------------------------------------------

    def run(self) -> list[dict]:
        from fastpar.training.memory import report
        from fastpar.training.metrics import (MetricsWriter, format_line, plot_losses,
                                              read_records)

        args, topo = self.args, self.topo
        lead = topo.rank == 0
        if args.resume:
            run_state.resume(self, args.resume)
        run_state.check_save_dir(self)
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
                run_state.save(self, done)
        if bar is not None:
            bar.close()
        if args.save:
            run_state.finish_saves(self)  # the last save committed, or its error raised
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
        print(f"[fastpar.train] model: {self.args.preset} preset, {cfg.num_params() / 1e6:.2f} M "
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


def main(argv=None) -> int:
    import fastpar

    args = parse_args(argv, description=__doc__)
    try:
        Trainer(args).run()
    except Exception as exc:  # noqa: BLE001 - said in one line (FASTPAR_DEBUG=1: the traceback)
        if os.environ.get("FASTPAR_DEBUG", "0") == "1":
            raise  # the traceback, and under MPI fastpar's hook aborts the whole job
        end_job_with(exc)
    # Only after success: on Ctrl-C the KeyboardInterrupt must reach fastpar's hook, which
    # aborts the whole job (a peer may sit in a collective that would otherwise wait for this
    # rank until the timeout); shutdown would remove that hook first.
    fastpar.shutdown()
    return 0


def end_job_with(exc: Exception) -> None:
    """A run that failed: one rank says the error in one line (a failure every rank sees: rank
    0; else the first rank to count one in the job's store), the others, which mostly hit the
    same one, say nothing (``runtime.failures``); then the whole job ends with status 1, under
    MPI at once (a peer may be waiting in a collective for this rank)."""
    from fastpar import runtime
    from fastpar.runtime import failures

    topo = runtime.topology() if runtime.is_initialized() else None
    spoke = failures.speaks(exc, topo.store if topo is not None else None,
                            "fastpar/train/failed")
    rank = topo.rank if topo is not None else None
    where = f" on rank {rank}" if rank is not None and topo.world_size > 1 else ""
    words = (f"python -m fastpar.train: error{where}: {type(exc).__name__}: {exc} "
             f"(FASTPAR_DEBUG=1 shows the traceback)\n")
    if spoke:
        print(words, end="", file=sys.stderr, flush=True)
    if topo is not None and topo.mpi_comm is not None and topo.world_size > 1:
        failures.abort_mpi_job(topo.mpi_comm, 1, spoke, words)
    raise SystemExit(1)


if __name__ == "__main__":
    raise SystemExit(main())
