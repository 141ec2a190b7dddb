"""The main job's optimizer set-up, chosen once from the flags: one object with the verbs a
training step needs, so that the step itself never asks which set-up it runs.

    setup = build_setup(pipe, args, group=dpcp, dtype=torch.bfloat16)
    with setup.accumulating():          # the pipeline's microbatches (what holds: see below)
        loss = setup.model.step(x, y)
    setup.sum_tied(embedding_group)     # a tied embedding's copies: one gradient
    norm = setup.clip(max_norm)         # the serial model's global norm (nan when max_norm <= 0)
    setup.opt.step(); setup.opt.zero_grad(set_to_none=True)
    with setup.evaluating(): ...        # validation (ZeRO-3 gathered once per step: whole)
    with setup.gathered(): ...          # every parameter whole (ZeRO-3): checkpoints

The set-ups (AdamW with the flags' betas and weight decay in each):

- ``--zero N``: ``model`` the pipeline in the model's dtype, ``opt`` a ``DistributedOptimizer``
  of stage N (float32 masters of its shard). Stage 1 reduces the gradients at ``opt.step()``.
  Stages 2 and 3 by ``zero_granularity(args)``: "unit" (pp 1's default) reduce-scatters each
  unit's gradients as each microbatch's backward finishes it, keeping only shards, and stage 3
  gathers each unit around its forward and backward (``--zero-keep-gathered``: once per step);
  "step" accumulates whole gradients over the microbatches (``no_sync``), stage 3 with the
  stage's parameters gathered for the whole step, and reduce-scatters once at ``opt.step()``.
  A tied embedding's copies are runs of their own, and their reduced shards are summed;
- float32: ``model`` ``DataParallel(pipe)``, ``opt`` AdamW; gradients all-reduced in buckets
  during the backward;
- ``--dtype bfloat16``: ``model`` ``DataParallel(pipe.to(bf16))`` reducing in float32, ``opt``
  ``MasterWeights`` (float32 masters).

``group``: the ranks the gradients are averaged over (dp, or dp x cp; None: the dp group).
"""

from __future__ import annotations

import contextlib
import math

import torch

from fastpar.data_parallel import DataParallel
from fastpar.models import sum_tied_grads, tied_parameters
from fastpar.optim import DistributedOptimizer, MasterWeights, clip_grad_norm_
from fastpar.plan.memory import ZERO_RUN_BYTES
from fastpar.training.args import zero_granularity


class OptimizerSetup:
    """What every set-up has: ``pipe`` (this rank's stages), ``model`` (what runs a step),
    ``opt`` (what the LR schedule, the checkpoints and the memory meter see)."""

    def __init__(self, pipe, model, opt):
        self.pipe, self.model, self.opt = pipe, model, opt

    def accumulating(self):
        """Around a step's forward and backward: the state its microbatches accumulate in."""
        return contextlib.nullcontext()

    def gathered(self):
        """Every parameter of this rank's stages whole (a no-op but under ZeRO-3)."""
        return contextlib.nullcontext()

    def evaluating(self):
        """Around validation's forwards: what the parameters need (ZeRO-3 per unit: nothing,
        each unit is gathered as it runs)."""
        return self.gathered()

    def sum_tied(self, group) -> None:
        """A tied embedding's copies get the sum of their gradients, here and over ``group``
        (the embedding group), before clipping (``models.sum_tied_grads``)."""
        sum_tied_grads(self.pipe.modules(), group)

    def clip(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients by the serial model's global norm; returns the norm (nan when
        ``max_norm <= 0``: no clip, no norm)."""
        if max_norm <= 0:
            return torch.tensor(math.nan)
        return clip_grad_norm_(self.pipe, max_norm)


def zero_prefetch(args, device: torch.device) -> bool:
    """Whether ZeRO-3 per unit prefetches the next unit (``--zero-prefetch``). auto: on a GPU,
    where the gather runs beside the compute; not on the CPU, where the shm gathers take the
    same cores and prefetch measured no faster (20 steps at dp 2: 362 and 341 ms against 353
    and 344 without) while holding a second unit."""
    if args.zero_prefetch == "auto":
        return device.type == "cuda"
    return args.zero_prefetch == "on"


class ZeroSetup(OptimizerSetup):
    """``--zero N``: the pipeline runs unwrapped; ``DistributedOptimizer`` owns the reduction."""

    def __init__(self, pipe, args, group, dtype, adamw: dict):
        initial = {p: p.detach().clone() for p in pipe.parameters()} \
            if dtype != torch.float32 else None
        model = pipe.to(dtype)  # the same Parameter objects, now in the model's dtype
        self.stage, self.granularity = args.zero, zero_granularity(args)
        # stages 2 and 3: each tied copy a run of its own, so their shards can be summed
        tied = tied_parameters(pipe.modules()) if self.stage >= 2 else []
        opt = DistributedOptimizer(
            pipe.parameters(), torch.optim.AdamW, stage=args.zero, module=pipe, group=group,
            quant_weights=args.quantize_weights, quant_grads=args.quantize_grads,
            error_feedback=args.error_feedback, isolate=tied, bucket_mb=ZERO_RUN_BYTES / 2**20,
            keep_gathered=self.stage == 3 and args.zero_keep_gathered,
            # (stages 1 and 2 gather nothing before use: the optimizer's default)
            prefetch=self.stage != 3 or zero_prefetch(args, next(pipe.parameters()).device),
            **adamw)
        if initial is not None:  # the float32 masters start from the float32 initial weights
            opt.load_master_weights(initial)
        super().__init__(pipe, model, opt)

    @contextlib.contextmanager
    def accumulating(self):
        """Stages 2 and 3 per step: the microbatches accumulate whole gradients (``no_sync``),
        ZeRO-3's parameters gathered for the whole step; ``opt.step()`` reduce-scatters once.
        Per unit (and stage 1): nothing to hold, the optimizer's hooks do the work."""
        if self.stage < 2 or self.granularity == "unit":
            yield
            return
        with self.opt.no_sync(), self.opt.gathered():
            yield

    def gathered(self):
        return self.opt.gathered()

    def evaluating(self):
        if self.granularity == "unit":
            return contextlib.nullcontext()
        return self.opt.gathered()

    def sum_tied(self, group) -> None:
        """Stages 2 and 3: the reduction completed, then the copies' reduced shards summed
        (the same elements on every rank: each copy is a run of its own)."""
        if self.stage < 2:
            super().sum_tied(group)
            return
        self.opt.reduce()
        sum_tied_grads(self.pipe.modules(), group, grad_of=self.opt.grad_shard)

    def clip(self, max_norm: float) -> torch.Tensor:
        if max_norm <= 0:
            return torch.tensor(math.nan)  # ZeRO's step reduces its own shards
        return self.opt.clip_grad_norm_(max_norm, model=self.pipe)


def build_setup(pipe, args, group, dtype: torch.dtype) -> OptimizerSetup:
    """The set-up the flags ask for (the table above), over ``pipe`` as initialised (float32).
    ``args``: ``lr``, ``weight_decay``, ``zero``, ``quantize_grads``, ``quantize_weights``,
    ``error_feedback``."""
    adamw = {"lr": args.lr, "betas": (0.9, 0.95), "weight_decay": args.weight_decay}
    reduce = {"group": group, "quant": args.quantize_grads,
              "error_feedback": args.error_feedback}
    if args.zero:
        return ZeroSetup(pipe, args, group, dtype, adamw)
    if dtype == torch.float32:
        model = DataParallel(pipe, **reduce)
        return OptimizerSetup(pipe, model, torch.optim.AdamW(model.parameters(), **adamw))
    # Masters from the float32 initial weights, then the model computes in bf16; gradients
    # are reduced over dp in float32 (over tp and the tied copies too: fastpar.nn,
    # sum_tied_grads) and AdamW steps the float32 masters.
    opt = MasterWeights(pipe.parameters(), torch.optim.AdamW, **adamw)
    return OptimizerSetup(pipe, DataParallel(pipe.to(dtype), reduce_dtype=torch.float32,
                                             **reduce), opt)
