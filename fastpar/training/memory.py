"""Memory per rank by category, measured beside its prediction (``fastpar.plan.memory``), for the main
job: the end-of-run table and one ``--metrics`` record per rank.

    meter = MemoryMeter(pipe, model, opt, inputs)   # inputs: fastpar.plan.memory.MemoryInputs
    meter.sample()                  # after backward, and again after the optimizer step
    rows = meter.gather()           # collective: every rank's record, on every rank
    print(format_table(rows))       # rank 0
    rows = report(trainer_meter(cfg, args, topo, setup, m, rows), metrics, lead)  # the trainer
    storage_bytes(owned(params, opt))   # the same count for any loop (bench/memory.py)

Measured on the CPU (and, the same way, on a GPU) from the tensors the runtime owns, each
storage counted once, in the first category that holds it, in this order::

    params      the parameters' storage (ZeRO: the flat or gathered buffers they view)
    grads       every .grad, DistributedOptimizer's and MasterWeights' master gradients
    optimizer   masters and optimizer state (tensors of one or more dims; not the 0-dim step)
    buffers     communication storage that is neither: DataParallel's buckets, ZeRO's flat
                gradient buffer, ZeRO-2/3's reduce-scatter staging (its peak in the step),
                the error-feedback residuals of quantized gradients
    activations Pipeline.stats["peak_activation_bytes"]: what autograd saved for the
                microbatches in flight, largest over the steps

A category's peak is its largest value over the samples. ``peak_rss`` is the process's peak
resident set (``getrusage``), the cross-check: it also holds what no category counts (torch and
the interpreter, communicator segments, the data, transients inside a collective). On a GPU the
table adds the allocator's peak (``torch.cuda.max_memory_allocated``).
"""

from __future__ import annotations

import resource
import sys

import torch
import torch.distributed as dist

from fastpar.optim import DistributedOptimizer, MasterWeights
from fastpar.plan.memory import CATEGORIES, MemoryInputs, predict_memory
from fastpar.training.optimizer import zero_prefetch

MiB = 2**20


def _key(t: torch.Tensor):
    # A DTensor (FSDP2's parameters, gradients, state) counts its local shard. No import:
    # where torch.distributed.tensor is not loaded, no DTensor exists.
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        t = t.to_local()
    s = t.untyped_storage()
    return (t.device, s.data_ptr()), s.nbytes()


def owned(params, opt, reducer=None) -> dict[str, list]:
    """The tensors of each category now (some may be None): ``params`` and their ``.grad``; a
    ``DistributedOptimizer``'s or ``MasterWeights``' masters, their gradients and the flat
    gradient buffer; the optimizer state (``opt.inner``'s when it wraps one); a
    ``DataParallel``'s buckets (``reducer``: the wrapper, or one of its reducers)."""
    inner = getattr(opt, "inner", opt)
    params = list(params)
    grads = [p.grad for p in params]
    optim, buffers = [], []
    if isinstance(opt, DistributedOptimizer):
        grads += [f.master.grad for f in opt.flat]
        optim += [f.master for f in opt.flat]
        buffers += [f.grad_buf for f in opt.flat]
        buffers += list(opt.residuals.values())  # error feedback (quant_grads)
        if opt.grads is not None:
            buffers += list(opt.grads.residuals.values())
    elif isinstance(opt, MasterWeights):
        grads += [m.grad for m in opt.masters]
        optim += list(opt.masters)
    optim += [t for st in inner.state.values() for t in st.values()
              if isinstance(t, torch.Tensor) and t.dim() > 0]
    for r in getattr(reducer, "_reducers", [reducer] if reducer is not None else []):
        buffers += [b.data for b in r.buckets]
        buffers += list(r.residuals.values())  # error feedback (quant)
    return {"params": params, "grads": grads, "optimizer": optim, "buffers": buffers}


def storage_bytes(tensors: dict[str, list]) -> dict[str, int]:
    """Bytes per category of ``{category: tensors}`` (``owned``'s), each storage counted once,
    in the first category that holds it; None entries are skipped."""
    seen, out = set(), {}
    for category, ts in tensors.items():
        total = 0
        for t in ts:
            if t is None:
                continue
            key, nbytes = _key(t)
            if key not in seen:
                seen.add(key)
                total += nbytes
        out[category] = total
    return out


class MemoryMeter:
    """Peaks per category of one rank's training (see the module docstring)."""

    def __init__(self, pipe, model, opt, inputs: MemoryInputs):
        self.pipe, self.model, self.opt, self.inputs = pipe, model, opt, inputs
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.samples = 0
        self.device = next(pipe.parameters()).device

    def owned(self) -> dict[str, list]:
        """The tensors of each category now (some may be None)."""
        dp = self.model if hasattr(self.model, "_reducers") else None  # a DataParallel
        return owned(self.pipe.parameters(), self.opt, dp)

    def current(self) -> dict[str, int]:
        """Bytes per category now, each storage once (in its first category)."""
        return storage_bytes(self.owned())

    def begin(self) -> None:
        """A step starts: ZeRO's in-step peaks (gathered units, gradients, staging) count from
        here (what ran between steps, a resume or a validation, is not the step's)."""
        if isinstance(self.opt, DistributedOptimizer):
            self.opt.begin_peaks()

    def sample(self) -> None:
        self.samples += 1
        now = self.current()
        for category, nbytes in now.items():
            self.peak[category] = max(self.peak[category], nbytes)
        sharded = getattr(self.opt, "sharded", None)  # ZeRO-3: the units gathered at once
        if sharded is not None:
            self.peak["params"] = max(self.peak["params"], sharded.peak_held)
        self.peak["activations"] = max(self.peak["activations"],
                                       int(self.pipe.stats.get("peak_activation_bytes", 0)))
        grads = getattr(self.opt, "grads", None)  # ZeRO-2/3: the reduce-scatter's staging,
        if grads is not None:  # beside what the buffers hold for good (error feedback)
            self.peak["buffers"] = max(self.peak["buffers"], now["buffers"] + grads.peak_staging)
            # per unit: the master gradients and the .grad not yet reduced, at their most
            self.peak["grads"] = max(self.peak["grads"], grads.peak_grads)

    def record(self) -> dict:
        """``{"memory": {"rank", "measured", "predicted", "peak_rss"}}`` (the contract)."""
        rec = {"rank": dist.get_rank() if dist.is_initialized() else 0,
               "measured": {k: int(self.peak[k]) for k in CATEGORIES},
               "predicted": predict_memory(self.inputs),
               "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if self.device.type == "cuda":  # for the table only (``contract`` drops it)
            rec["device_peak"] = torch.cuda.max_memory_allocated(self.device)
        return {"memory": rec}

    def gather(self) -> list[dict]:
        """Every rank's record in rank order, on every rank (collective over the world)."""
        mine = self.record()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return [mine]
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, mine)
        return rows


def format_table(rows: list[dict]) -> str:
    """Measured / predicted MiB per category and rank, peak RSS beside them."""
    head = f"{'rank':>4} " + " ".join(f"{c:>19}" for c in CATEGORIES) + f" {'peak RSS':>9}"
    lines = ["[fastpar.train] memory per rank, MiB measured / predicted (peak per category):",
             head]
    for row in rows:
        r = row["memory"]
        cells = " ".join(f"{r['measured'][c] / MiB:>9.2f} /{r['predicted'][c] / MiB:>8.2f}"
                         for c in CATEGORIES)
        extra = f" device {r['device_peak'] / MiB:.1f}" if "device_peak" in r else ""
        lines.append(f"{r['rank']:>4} {cells} {r['peak_rss'] / MiB:>9.1f}{extra}")
    return "\n".join(lines)


def contract(row: dict) -> dict:
    """A row as ``--metrics`` writes it: exactly ``{"memory": {"rank", "measured",
    "predicted", "peak_rss"}}``."""
    return {"memory": {k: row["memory"][k] for k in ("rank", "measured", "predicted",
                                                     "peak_rss")}}


def trainer_meter(cfg, args, topo, setup, microbatches: int, rows: int) -> MemoryMeter:
    """The meter of the main job's rank: its model ``cfg`` and flags ``args`` on ``topo``, its
    optimizer set-up (``training.optimizer``: the stages, what runs the step, the optimizer),
    ``microbatches`` per step of ``rows`` rows each (this replica's)."""
    # dp: the ranks ZeRO shards over and gradients reduce over (dp x cp under cp)
    inputs = MemoryInputs(cfg, tp=topo.tp_size, pp=topo.pp_size,
                          dp=topo.dp_size * topo.cp_size,
                          pp_rank=topo.pp_rank, bounds=tuple(setup.pipe.bounds),
                          schedule=args.schedule, microbatches=microbatches,
                          rows=rows, zero=args.zero,
                          dtype=torch.bfloat16 if args.dtype == "bfloat16" else torch.float32,
                          virtual_stages=args.virtual_stages, error_feedback=args.error_feedback,
                          ep=topo.ep_size, cp=topo.cp_size,
                          zero_granularity=args.zero_granularity,
                          keep_gathered=args.zero_keep_gathered,
                          prefetch=zero_prefetch(args, topo.device),
                          symmetric_staging=bool(getattr(getattr(setup.opt, "grads", None),
                                                         "symmetric", False)))
    return MemoryMeter(setup.pipe, setup.model, setup.opt, inputs)


def report(meter: MemoryMeter, metrics, lead: bool) -> list[dict]:
    """Gather every rank's row (collective); rank 0 (``lead``) prints the table and writes one
    record per rank to ``metrics``. Returns the rows; none when no step ran (a resume of a
    finished run: nothing was measured, on any rank)."""
    if not meter.samples:
        return []
    rows = meter.gather()
    if lead:
        print(format_table(rows), flush=True)
        for row in rows:
            metrics.write(contract(row))
    return rows
