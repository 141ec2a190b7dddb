"""``fastpar.optim.DistributedOptimizer``: ZeRO stages 1, 2 and 3 over the dp group.

    model = build_model()                       # NOT wrapped in fastpar.DataParallel
    opt = fastpar.optim.DistributedOptimizer(model.parameters(), torch.optim.AdamW, lr=3e-4,
                                             stage=2)        # stage=3 also needs module=model
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    with opt.no_sync():                         # accumulation: every microbatch but the last
        loss_fn(model(x0), y0).backward()
    loss_fn(model(x1), y1).backward()           # this dp rank's slice of the batch
    norm = opt.clip_grad_norm_(1.0)             # optional: reduces, then clips
    opt.step(); sched.step(); opt.zero_grad()

The parameters of each (dtype, device) are laid end to end (``fastpar.optim.zero_shards``: runs,
each sharded over the dp ranks r = 0..dp-1). Per step::

    reduce:  g_shard_r = reduce_scatter(flat(param.grad))[r] / dp     # mean over dp
    update:  inner.step() on master_r (this rank's fp32 shard), using g_shard_r
    gather:  params = all_gather(master_r)

What each stage keeps per rank (P parameter bytes, G gradient bytes, S optimizer state):

- stage 1: the parameters are views of one flat buffer and their gradients views of another;
  the fp32 master of a float32 model is this rank's block of the parameter buffer itself.
  P + G + S / dp (+ a G / dp reduced shard).
- stage 2: runs of about ``bucket_mb`` are reduce-scattered as backward fills them
  (``fastpar.optim.zero_grads``), overlapped with the rest of backward; their ``.grad`` are
  dropped at launch, so no full-size gradient outlives its run. P + (P + G + S) / dp + the
  staging (one run's gradients, or dp symmetric rows of at most 1 MiB).
- stage 3: the parameters themselves are 1/dp shards (the masters); each module's are
  all-gathered around its forward and backward (``fastpar.optim.zero_stage3``).
  (P + G + S) / dp + the gathered modules + the staging.

Where the dp group's collectives go to shm (CPU ranks on one host; ``FASTPAR_SYMMETRIC=0``
turns it off) these buffers are symmetric memory (``fastpar.comm.symmetric``), so the shm
kernels read and write them in place, no staging copies: stage 1's flat parameter and gradient
buffers, stage 2's parameter buffer (each run's block is gathered in place), stages 2 and 3's
reduce-scatter staging (dp rows of at most 1 MiB, kept: every run goes through them a chunk
at a time, ``fastpar.optim.zero_grads``), and stage 3's master shards of a float32 or float64
model, which every rank's gathers read in place (the gather buffers stay ordinary memory:
``fastpar.optim.zero_stage3``). Where ``/dev/shm`` has no room for them
(``comm.symmetric.room_for``) they are ordinary memory, with a warning. ``opt.symmetric`` says whether the
parameters' buffers (stage 3: the masters) are; ``opt.grads.symmetric`` whether the staging
is.

A bfloat16 model keeps float32 masters and reduces its gradients in float32 (a float32 copy of
the gradient buffer at stage 1). The inner optimizer (``optimizer_cls``: Adam, AdamW, SGD, ...)
keeps state for 1/dp of the elements; ``group=None`` is the topology's dp group.

Gradients: the optimizer averages the plain per-rank gradients itself, so the model must not also
be wrapped in ``fastpar.DataParallel``. A parameter whose ``.grad`` is None counts as a zero
gradient: its master still steps, so weight decay moves a parameter the serial optimizer would
skip; an untouched Adam/SGD state without decay stays put.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from fastpar import comm
from fastpar.comm import quant as quant_codec
from fastpar.comm import symmetric
from fastpar.optim.clip import check_max_norm, clip_shards_
from fastpar.optim.zero_shards import FlatGroup, master_dtype, run_cuts
from fastpar.optim.inner import InnerOptimizerView
from fastpar.optim.zero_checkpoint import CheckpointMixin
from fastpar.optim.zero_flat import build_flat_buffers, reduce_flat
from fastpar.optim.zero_grads import GradReducer
from fastpar.optim.zero_stage3 import ShardedParams, module_units
from fastpar.runtime import group_rank, group_size, topology

log = logging.getLogger("fastpar.optim")


class DistributedOptimizer(CheckpointMixin, InnerOptimizerView, torch.optim.Optimizer):
    """ZeRO over the dp group; see the module docstring.

    ``params``: an iterable of tensors (one hyper-parameter group; per-group options are not
    supported); frozen ones (``requires_grad=False``) are skipped and stay as they are.
    ``optimizer_cls(masters, **kwargs)`` builds the inner optimizer over one flat master shard
    per (dtype, device). ``stage``: 1, 2 or 3. ``module``: the model holding ``params``
    (stage 3 needs it: its modules are the gather units). ``bucket_mb``: the largest run of
    stages 2 and 3 (a unit larger than it is gathered as several runs; a parameter larger than
    it is a run of its own).
    ``quant_weights="int8"`` (stage 3): the parameters are all-gathered as block-scaled int8
    (like ZeRO++'s qwZ; the masters stay full precision, each gather quantizes them afresh);
    ``quant_grads="int8"``: the gradients are reduce-scattered as int8 (float32 sums), with
    ``error_feedback=True`` carrying each rank's rounding into its next step (one float32 copy
    of the padded gradient per rank, counted as a buffer). See ``fastpar.comm.quant``. Both
    quantize float32 and bfloat16 tensors (a bfloat16 model's gradients reduce in float32); the
    gathers and reductions of a float64 group stay full precision, as ``DataParallel`` keeps its
    float64 buckets.
    ``prefetch`` (stage 3): gather the next module's parameters while the current one computes
    (True: two modules gathered at a time); False gathers each module when it is used, holding
    one module's parameters fewer at the cost of collectives that no longer overlap compute.
    ``keep_gathered`` (stage 3): a module gathered for a training forward or backward stays
    gathered until the step's reduction (one all-gather per module per step, whatever the
    microbatches; ``zero_stage3``). Stage 2 with ``module`` cuts its runs at the module
    boundaries too (a run never spans two gather units: a backward drops each module's
    gradients once it is done). ``isolate``: parameters that each get a run of their own, so
    that every dp rank holds the same element range of each (``grad_shard``: the trainer sums a
    tied embedding's gradient shards).
    Every backward outside ``no_sync()`` reduce-scatters (stages 2 and 3) and the step's
    backwards add up in the master gradients: microbatches may run under ``no_sync()`` (one
    reduction per step, full gradients held meanwhile) or not (one per microbatch, only shards
    held).
    ``param_groups`` and ``state`` are the inner optimizer's, so ``torch.optim.lr_scheduler``
    drives it. Masters are ``float32`` (or ``float64`` for ``float64`` parameters).
    """

    def __init__(self, params, optimizer_cls, *, group=None, stage: int = 1, module=None,
                 bucket_mb: float = 25.0, quant_weights=None, quant_grads=None,
                 error_feedback: bool = False, prefetch: bool = True,
                 keep_gathered: bool = False, isolate=(), **kwargs):
        # torch.optim.Optimizer.__init__ is not called: it would build param_groups of the
        # full parameters; this class delegates them to the inner optimizer instead.
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise TypeError("DistributedOptimizer takes an iterable of tensors; per-group "
                            "options (dicts) are not supported")
        if not all(isinstance(p, torch.Tensor) for p in params):
            raise TypeError("DistributedOptimizer: params must be tensors")
        if any(getattr(p, "expert_parallel", False) for p in params):
            raise ValueError("DistributedOptimizer: expert parameters (fastpar.nn.MoE's, "
                             "sharded over the ep group) are not supported yet: their gradients "
                             "reduce over the edp group, not the dp group it shards over; use "
                             "DataParallel for a model with Mixture-of-Experts layers")
        if stage not in (1, 2, 3) or isinstance(stage, bool):
            raise ValueError(f"DistributedOptimizer: stage must be 1, 2 or 3, got {stage!r}")
        if stage == 3 and not isinstance(module, torch.nn.Module):
            raise ValueError("DistributedOptimizer(stage=3) needs module= the nn.Module that "
                             f"holds the parameters (its modules are gathered one by one); got "
                             f"{type(module).__name__}")
        if not bucket_mb > 0:
            raise ValueError(f"DistributedOptimizer: bucket_mb must be positive, got {bucket_mb}")
        self.quant_weights = quant_codec.spec(quant_weights)
        self.quant_grads = quant_codec.spec(quant_grads)
        if self.quant_weights is not None and stage != 3:
            raise ValueError(f"DistributedOptimizer: quant_weights={quant_weights!r} quantizes the "
                             f"parameters' all-gather of stage 3; stage {stage} gathers no "
                             "parameters before use (its all-gather after the step sends the "
                             "weights of record)")
        if (not prefetch or keep_gathered) and stage != 3:
            what = "prefetch=False" if not prefetch else "keep_gathered=True"
            raise ValueError(f"DistributedOptimizer: {what} changes stage 3's parameter "
                             f"gathers; stage {stage} gathers no parameters before use")
        if error_feedback and self.quant_grads is None:
            raise ValueError("DistributedOptimizer: error_feedback=True needs quant_grads")
        self.error_feedback = bool(error_feedback)
        seen, trainable = set(), []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                trainable.append(p)
        if not trainable:
            raise ValueError("DistributedOptimizer got no trainable parameters")
        self.stage = stage
        self.group = topology().dp_group if group is None else group
        self.dp_size = group_size(self.group, "DistributedOptimizer")
        self.dp_rank = group_rank(self.group, "DistributedOptimizer")
        by_key: dict[tuple, list] = {}  # (dtype, device) -> params, in order of first appearance
        for p in trainable:
            by_key.setdefault((p.dtype, p.device), []).append(p)
        units = module_units(module) if stage == 3 or (stage == 2 and module is not None) \
            else None
        alone = {id(p) for p in isolate}
        self.flat = [FlatGroup(ps, self.dp_size, self.dp_rank,
                               run_cuts(ps, stage, units, bucket_mb, alone))
                     for ps in by_key.values()]
        # Symmetric memory where the dp group's collectives go to shm (CPU, one host): the
        # reduce-scatters read every rank's gradients where they lie (stage 1's flat gradient
        # buffer, stages 2 and 3's staging) and the all-gathers copy the peers' shards straight
        # out of their buffers (the parameter buffer, stage 3's master shards): no staging
        # copies. Not for what goes quantized (its kernels stage the int8 anyway).
        cpu = all(f.device.type == "cpu" for f in self.flat)
        gather = cpu and comm.symmetric_available(self.group, "all_gather")
        scatter = cpu and comm.symmetric_available(self.group, "reduce_scatter")
        if gather or scatter:  # at most: each group's padded buffer and its float32 copy, rows
            need = sum(f.padded * (torch.empty((), dtype=f.dtype).element_size() + 8)
                       for f in self.flat) + self.dp_size * 2**20
            if not symmetric.room_for(need, self.group, "DistributedOptimizer"):
                gather = scatter = False
        self.symmetric = gather and scatter if stage == 1 else gather
        self.grads = self.sharded = None
        if stage < 3:
            for f in self.flat:
                build_flat_buffers(f, self.stage, self.group, self.symmetric)
        else:
            self.symmetric = gather and self.quant_weights is None
            for f in self.flat:  # collective: the same groups, dtypes, order on every rank
                if self.symmetric and f.dtype == master_dtype(f.dtype):
                    shard = comm.symmetric_empty(f.shard, dtype=f.master.dtype, group=self.group)
                    # each run's piece: the same offset on every rank, gathered in place
                    symmetric.register_parts(shard, [(r.soff, r.piece) for r in f.runs])
                    f.master = torch.nn.Parameter(shard.copy_(f.master.detach()))
                    f.master_symmetric = True
            self.symmetric = any(f.master_symmetric for f in self.flat)
            self.sharded = ShardedParams(self.flat, self.group, self.dp_rank, module, units,
                                         quant=self.quant_weights, prefetch=bool(prefetch),
                                         keep_gathered=bool(keep_gathered))
        if stage >= 2:
            self.grads = GradReducer(self.flat, self.group, self.dp_size,
                                     quant=self.quant_grads, error_feedback=self.error_feedback,
                                     symmetric=scatter and self.quant_grads is None)
        self.residuals = {}  # stage 1's error feedback: a float32 flat buffer per group
        self.optimizer_cls, self.kwargs = optimizer_cls, dict(kwargs)
        self.inner = optimizer_cls([f.master for f in self.flat], **kwargs)
        self._reduced = False  # master grads hold this backward's reduced gradient
        log.debug("%r", self)

    # ---- what torch.optim.Optimizer users read (param_groups, state, defaults: the inner ones) --

    def add_param_group(self, param_group) -> None:
        raise NotImplementedError("DistributedOptimizer holds one flat group per dtype; build "
                                  "it with every parameter instead of adding groups")

    def __repr__(self) -> str:
        groups = "; ".join(f.describe() for f in self.flat)
        return (f"DistributedOptimizer({self.optimizer_cls.__name__}, stage={self.stage}, "
                f"dp={self.dp_size}, dp_rank={self.dp_rank}, symmetric={self.symmetric}"
                f"{'' if self.grads is None else f', symmetric staging={self.grads.symmetric}'}, "
                f"{groups})")

    # ---- the step ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Backward inside accumulates into ``.grad`` and communicates nothing (stages 2 and 3:
        the runs are then reduce-scattered once, at the next backward outside or at
        ``reduce()``; stage 1 reduces at the step anyway)."""
        if self.grads is None:
            yield
            return
        old, self.grads.sync = self.grads.sync, False
        try:
            yield
        finally:
            self.grads.sync = old

    def grad_shard(self, p: torch.Tensor) -> torch.Tensor:
        """This rank's reduced gradient of ``p`` (after ``reduce()``): a view of its master
        gradient, ``p``'s run's piece. ``p`` must have been given in ``isolate`` (its run is it
        alone, so every rank's piece holds the same elements of every isolated parameter of
        its shape)."""
        for f in self.flat:
            for i, q in enumerate(f.params):
                if q is p:
                    run = f.run_of[i]
                    if run.last - run.first != 1 or f.master.grad is None:
                        raise ValueError("DistributedOptimizer.grad_shard: the parameter is "
                                         "not isolated (pass it in isolate=) or no gradient "
                                         "was reduced yet")
                    return f.master.grad[run.soff:run.soff + run.piece]
        raise ValueError("DistributedOptimizer.grad_shard: not one of this optimizer's "
                         "parameters")

    def begin_peaks(self) -> None:
        """The memory peaks (gather buffers, gradients, staging) count from now."""
        if self.sharded is not None:
            self.sharded.begin_peaks()
        if self.grads is not None:
            self.grads.begin_peaks()

    def gathered(self):
        """Context: stage 3 keeps every parameter gathered for its duration (collective on
        entry); stages 1 and 2 hold them anyway. For a pipeline step, evaluation, checkpoints."""
        return self.sharded.gathered() if self.sharded is not None else contextlib.nullcontext()

    @torch.no_grad()
    def reduce(self) -> None:
        """Average the gradients over dp into this rank's master shard gradients (collective)."""
        if self.grads is not None:
            self.grads.finish()
        else:
            reduce_flat(self.flat, self.group, self.quant_grads, self.error_feedback,
                        self.residuals)
        if self.sharded is not None and not self.sharded.pinned:
            self.sharded.free_all()  # units whose parameters got no gradient stayed gathered
        self._reduced = True

    @torch.no_grad()
    def _publish(self) -> None:
        """Every rank's parameters from the master shards (collective): stages 1 and 2
        all-gather each run into the parameters' buffer; stage 3 re-gathers only what is
        gathered now (the rest is gathered when its module runs)."""
        if self.sharded is not None:
            self.sharded.refresh()
            return
        for f in self.flat:
            for run in f.runs:
                block = f.run_block(f.param_buf, run)  # (dp * piece,)
                mine = block[self.dp_rank * run.piece:(self.dp_rank + 1) * run.piece]
                if not f.master_is_view:  # cast (a bfloat16 model) or copy (stage 2's runs)
                    mine.copy_(f.master.detach()[run.soff:run.soff + run.piece])
                # symmetric: each rank copies its peers' shards out of their buffers
                comm.all_gather(mine, group=self.group, out=block)

    @torch.no_grad()
    def update(self) -> None:
        """The inner step on the masters, then every rank's parameters from all shards."""
        self.inner.step()
        self._publish()
        self._reduced = False

    def step(self, closure=None):
        """``reduce()`` unless ``clip_grad_norm_`` already did, then ``update()``. Call on every
        dp rank (collective)."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step does not take a closure")
        if not self._reduced:
            self.reduce()
        self.update()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (and the masters'); a pending reduction is dropped.
        Stage 1 of a float32 model keeps its gradients as zeroed views of the flat buffer even
        with ``set_to_none`` (the buffer is their storage: backward accumulates into it)."""
        if self.grads is not None:
            self.grads.abandon()
        for f in self.flat:
            if f.grad_views is not None:
                f.grad_buf.zero_()
                for p, view in zip(f.params, f.grad_views):
                    p.grad = view
                continue
            for p in f.params:
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        self.inner.zero_grad(set_to_none=True)
        self._reduced = False

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        model: torch.nn.Module | None = None) -> torch.Tensor:
        """Scale the dp-averaged gradients so their global norm is at most ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_`` on the serial model; returns the norm before clipping
        (in the masters' dtype). Reduces first (if not yet done), so call it after backward and
        before ``step()``::

            norm = (sum over ranks of sum(w * |g_shard_r| ** p)) ** (1 / p)    # all_reduce
            g_shard_r *= min(1, max_norm / (norm + 1e-6))

        Without ``model`` the sum runs over the dp group with w = 1: right when each dp rank
        holds the whole model (no tensor or pipeline parallelism). Under TP/PP pass ``model``
        (the module holding this rank's parameters): the sum then also runs over the topology's
        mp group (tp x pp) and counts what ``fastpar.optim.clip_grad_norm_`` counts (w = 1 for
        the shards of ``fastpar.nn`` layers; for parameters replicated over tp, w = 1 on tp rank
        0 only), so each serial element counts once. Tied weights count as there: a GPT's tied
        embedding once, its head's copy not (see ``fastpar.optim.clip``).
        """
        check_max_norm(max_norm)
        if not self._reduced:
            self.reduce()
        return clip_shards_(self.flat, self.group, max_norm, norm_type, model)

    # ---- memory ------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes this rank holds for the optimizer: the inner state plus the master shards
        (about 1/dp of a serial optimizer's state plus an fp32 copy of the weights)."""
        total = sum(f.master.numel() * f.master.element_size() for f in self.flat)
        for st in self.inner.state.values():
            total += sum(t.numel() * t.element_size() for t in st.values()
                         if isinstance(t, torch.Tensor))
        return total
