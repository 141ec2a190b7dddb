"""The trainer fit (``fastpar plan --calibrate`` with a model; docs/design.md, "The trainer
fit"): the real ``Trainer.train_step`` timed on this process for the plan's own model, fitted
per layer and per step. It lives with the trainer, which it runs: the planner stands below the
trainer and takes this function as an argument (``plan.calibrate.calibrate(fit=...)``, passed
by ``python -m fastpar plan``), never importing it.

    fit = trainer_fit(cfg, membw=cluster.membw_Bps, tensor_s=cluster.overhead_tensor_s)
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import statistics
import sys
import time

import torch

import fastpar
from fastpar import runtime
from fastpar.plan.fitting import nnls
from fastpar.plan.cluster import TrainerFit, model_signature
from fastpar.plan.costs import OPTIMIZER_BYTES
from fastpar.plan.memory import layer_tensors
from fastpar.training.args import parse_args
from fastpar.training.trainer import Trainer


def trainer_fit(cfg, membw: float, tensor_s: float, rows: int = 8, steps: int = 16,
                warmup: int = 4, budget_s: float = 0.5) -> TrainerFit | None:
    """The trainer's own step (``fastpar.training.trainer.Trainer.train_step``: the pipeline's executor,
    the meters, clip, AdamW, the loss's all-reduce) timed on this process as a one-rank job on
    one thread, for ``cfg``'s layers at 1 and 3 blocks, 1, ``rows`` / 2 and ``rows`` rows and
    1 and 2 microbatches (16 steps each); at 1 and 3 blocks, ``rows`` rows and 2 microbatches
    again under zb (its split backward's extra host work per microbatch, per block and for the
    two ends together: the zb step less the same point's 1f1b, scaled as the rest); and under
    full recompute (``recompute_fit``: the recompute's saved-tensor hooks and second forward
    cost more host work than the rate model's recomputed forward). From each point's
    fastest step after ``warmup`` less the optimizer's modelled time (``OPTIMIZER_BYTES`` a
    parameter at ``membw``, ``tensor_s`` a tensor: the planner adds it per rank itself),
    fitted by non-negative least squares to ``step = S + m (end(n) + L block(n))``, ``end``
    and ``block`` each ``a + b n`` over a microbatch's n tokens, then scaled by the points'
    median step over fastest (a run reports the median). Returns a ``TrainerFit``
    (``Cluster.trainer_fit``), or None: inside a job (``--layout auto`` plans on rank 0 of a
    running job: it keeps the rate model), for MoE blocks that are not every block (1 and 3
    blocks would mix kinds), when a trainer cannot train the model here (said on standard
    error), or when three blocks of two rows would take more than ``budget_s`` a step
    (``rows`` is lowered first; one row leaves a and b unidentified)."""
    if runtime.is_initialized() or (cfg.moe_experts and cfg.moe_every != 1):
        return None
    base = dataclasses.replace(cfg, recompute="none", context_parallel=None,
                               sequence_parallel=False)
    one = dataclasses.replace(base, layers=1)
    flops = 6 * one.num_params() * cfg.seq_len  # a row's forward and backward, about
    while rows > 2 and 8 * flops * rows / 20e9 > budget_s:  # 3 blocks, 2 microbatches, at
        rows //= 2                                          # ~20 GFLOP/s on one core
    if rows < 2 or 8 * flops * rows / 20e9 > budget_s:
        return None

    def optimizer_s(layers: int) -> float:
        model = dataclasses.replace(base, layers=layers)
        tensors = sum(len(layer_tensors(model, 1, i, 1)) for i in range(layers + 2))
        return OPTIMIZER_BYTES * model.num_params() / membw + tensor_s * tensors

    def step_s(layers: int, batch: int, microbatches: int, schedule: str = "1f1b",
               recompute: str = "none") -> tuple[float, float]:
        args = parse_args(["--preset", "tiny", "--global-batch", str(batch), "--microbatches",
                           str(microbatches), "--steps", str(steps), "--schedule", schedule,
                           "--recompute", recompute])
        model = dataclasses.replace(base, layers=layers, recompute=recompute)
        with contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()), torch.random.fork_rng():
            try:
                trainer = Trainer(args, cfg=model)
                times = []
                for step in range(steps):
                    t0 = time.perf_counter()
                    trainer.train_step(step)
                    times.append(time.perf_counter() - t0)
            finally:
                fastpar.shutdown()
        kept = times[warmup:]
        return min(kept), statistics.median(kept)

    points = [(layers, r, m) for layers in (1, 3) for r in sorted({1, rows // 2, rows})
              for m in (1, 2)]  # rows 2 or 3: rows // 2 is 1, trained once
    design, lows, fastest, ratios, split = [], [], [], [], []
    try:
        for layers, r, m in points:
            n = r * cfg.seq_len
            design.append([1.0, m, m * n, m * layers, m * layers * n])
            low, mid = step_s(layers, r * m, m)
            lows.append(low)
            fastest.append(max(0.0, low - optimizer_s(layers)))
            ratios.append(mid / low)
        for layers in (1, 3):  # zb's split backward against the same point's 1f1b
            low = step_s(layers, rows * 2, 2, "zb")[0]
            split.append((low - lows[points.index((layers, rows, 2))]) / 2)
    except Exception as exc:  # noqa: BLE001 - the rest of the calibration stands without it
        print(f"[fastpar plan] note: no trainer fit ({type(exc).__name__}: {exc}); the rate "
              "model alone", file=sys.stderr, flush=True)
        return None
    # fitted on each point's fastest step (steady where medians jump between runs), then
    # scaled to the median step (what a run's step time reports) by the points' median ratio
    scale = statistics.median(ratios)
    step, e0, e1, b0, b1 = (scale * x for x in nnls(design, fastest))
    zb_block = max(0.0, (split[1] - split[0]) / 2)  # per microbatch: 1 and 3 blocks
    zb_end = max(0.0, split[0] - zb_block)
    return TrainerFit(model_signature(cfg, 4), (b0, b1), (e0, e1), step,
                      (scale * zb_block, scale * zb_end),
                      recompute_fit(step_s, points, lows, cfg.seq_len, rows, scale))


def recompute_fit(step_s, points: list, lows: list, seq_len: int, rows: int,
                  scale: float) -> tuple | None:
    """Full recompute's extra per block and microbatch, ``a + b n`` (``TrainerFit.recompute``):
    at 1 block of ``rows`` rows and 3 blocks of 1 and ``rows`` rows, 2 microbatches, each
    step under ``--recompute full`` over the same point's without (``lows``, ``points``), fitted
    by ``nnls`` and scaled as the rest. None (the planner keeps the rate model's recomputed
    forward) when a point fails to train (said on standard error) or the fit finds no extra."""
    design, extra = [], []
    try:
        for layers, r in ((1, rows), (3, 1), (3, rows)):
            low = step_s(layers, r * 2, 2, recompute="full")[0]
            design.append([2 * layers, 2 * layers * r * seq_len])
            extra.append(low - lows[points.index((layers, r, 2))])
    except Exception as exc:  # noqa: BLE001 - the fit without recompute stands
        print(f"[fastpar plan] note: no recompute fit ({type(exc).__name__}: {exc}); the rate "
              "model's recomputed forward", file=sys.stderr, flush=True)
        return None
    a, b = nnls(design, extra)
    return (scale * a, scale * b) if a or b else None
