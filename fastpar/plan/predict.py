"""One layout's prediction: step time, tokens/s, MFU, bubble and memory per category of the
worst rank, with every term kept for ``--explain``.

    p = predict(cfg, parse("tp2.pp2.dp1.zero1.mb8"), cluster, global_batch=16, esize=4)
    p.step_time_s, p.bubble, p.memory, p.fits, p.terms

Step time: the pipeline's own timeline (``pipeline.timeline.simulate``) runs every rank's
action list with each F, B, I and W taking what its chunk's layers cost for one microbatch
(``costs.layer_work``, sends to the next stage added to the compute that makes them), then
each rank adds its per-step terms (the gradient reduction over dp x cp and ZeRO's parameter
all-gather, not overlapped by the runtime; the optimizer update); the step is the slowest
rank's. Long pipelines (more than ``SIMULATE_MAX`` compute actions per rank) are simulated at
two microbatch counts pp apart in the steady state and each rank's end extended linearly to
the real count: exact for gpipe and 1f1b, within 1% for zb and interleaved on random
per-stage costs (tests/test_plan.py compares against the full timeline).
Memory: ``training.memory_plan.predict`` (what the trainer reports beside its measurement) for
every pipeline rank at the stage cut ``Pipeline`` makes; the worst rank's categories.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fastpar.models.config import GPTConfig
from fastpar.pipeline.partition import balanced_bounds
from fastpar.pipeline.schedules import SCHEDULES
from fastpar.pipeline.timeline import simulate
from fastpar.plan import costs
from fastpar.plan.cluster import Cluster
from fastpar.plan.layouts import Layout, model_for
from fastpar.plan.model import model_flops_per_token
from fastpar.training import memory_plan

SIMULATE_MAX = 1536  # compute actions per rank simulated in full; longer lists: extended


@dataclasses.dataclass
class Prediction:
    layout: Layout
    step_time_s: float
    tokens_per_s: float
    mfu: float
    bubble: float
    memory: dict  # the worst rank's {category: bytes}
    memory_rank: int  # its pipeline rank
    fits: bool
    memory_budget: float
    terms: dict  # everything --explain prints

    @property
    def memory_total(self) -> int:
        return sum(self.memory.values())

    def to_json(self) -> dict:
        lay = self.layout
        return {"layout": lay.name, "tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "cp": lay.cp,
                "ep": lay.ep, "zero": lay.zero, "recompute": lay.recompute,
                "schedule": lay.schedule, "virtual_stages": lay.virtual_stages,
                "microbatches": lay.microbatches, "step_time_s": self.step_time_s,
                "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "bubble": self.bubble,
                "memory": dict(self.memory), "memory_rank": self.memory_rank,
                "fits": self.fits}


def stage_bounds(cfg: GPTConfig, tp: int, ep: int, stages: int) -> tuple:
    """The layer cuts ``Pipeline`` makes: balanced by each layer's parameters on a tp rank."""
    weights = tuple(sum(memory_plan.layer_tensors(cfg, tp, i, ep))
                    for i in range(cfg.layers + 2))
    return _bounds(weights, stages)


@functools.lru_cache(maxsize=256)
def _bounds(weights: tuple, stages: int) -> tuple:
    return tuple(balanced_bounds(list(weights), stages))


def memory_by_rank(cfg: GPTConfig, lay: Layout, global_batch: int, dtype) -> list[dict]:
    """``memory_plan.predict`` of every pipeline rank of ``lay`` (the trainer's Layout)."""
    cfg = model_for(cfg, lay)
    bounds = stage_bounds(cfg, lay.tp, lay.ep, lay.pp * lay.virtual_stages)
    return [memory_plan.predict(memory_plan.Layout(
        cfg, tp=lay.tp, pp=lay.pp, dp=lay.dp * lay.cp, pp_rank=r, bounds=bounds,
        schedule=lay.schedule, microbatches=lay.microbatches, rows=global_batch // lay.dp,
        zero=lay.zero, dtype=dtype, virtual_stages=lay.virtual_stages, ep=lay.ep, cp=lay.cp))
        for r in range(lay.pp)]


def _ends(schedule: str, pp: int, m: int, v: int, cost) -> tuple[list[float], float]:
    """Each rank's end time and the busy total, from the timeline of the real lists."""
    lists = [SCHEDULES[schedule](pp, m, r, v) for r in range(pp)]
    spans = simulate(lists, cost=cost)
    ends = [row[-1][1] if row else 0.0 for row in spans]
    return ends, sum(b - a for row in spans for a, b, _ in row)


def pipeline_ends(schedule: str, pp: int, m: int, v: int, cost) -> tuple[list[float], float]:
    """``_ends``, or for long lists the ends at two counts one period (pp microbatches) apart,
    extended linearly to ``m`` (the busy total is exact: every microbatch costs the same)."""
    if m * v * 3 <= SIMULATE_MAX or m <= 4 * pp:
        return _ends(schedule, pp, m, v, cost)
    m0, m1 = 2 * pp, 3 * pp
    e0, b0 = _ends(schedule, pp, m0, v, cost)
    e1, b1 = _ends(schedule, pp, m1, v, cost)
    slope = [(b - a) / (m1 - m0) for a, b in zip(e0, e1)]
    return [b + s * (m - m1) for b, s in zip(e1, slope)], b0 + (b1 - b0) / (m1 - m0) * (m - m0)


def predict(cfg: GPTConfig, lay: Layout, cluster: Cluster, global_batch: int, *, dtype,
            overlap_dp: bool = False) -> Prediction:
    """The prediction of ``lay`` (a layout ``layouts.why_not`` accepts). ``overlap_dp``: the reduction overlaps the
    step's compute (FSDP-style prefetch: not what fastpar's trainer does, for published
    systems that do). Attention's kernel: ``cluster.causal_skip``."""
    esize = torch.empty((), dtype=dtype).element_size()
    cfg = model_for(cfg, lay)
    pp, v, m = lay.pp, lay.virtual_stages, lay.microbatches
    bounds = stage_bounds(cfg, lay.tp, lay.ep, pp * v)
    rows = global_batch // lay.dp // m  # sequences per microbatch
    kw = dict(tp=lay.tp, cp=lay.cp, ep=lay.ep, rows=rows, esize=esize,
              causal_skip=cluster.causal_skip)
    layer = {}
    for i in range(cfg.layers + 2):
        kind = 0 if i == 0 else cfg.layers + 1 if i == cfg.layers + 1 else \
            ("moe" if cfg.is_moe(i) else "block")
        if kind not in layer:
            layer[kind] = costs.layer_work(cfg, cluster, index=i, **kw)
        layer[i] = layer[kind]
    stages = []  # per model stage: {"layers", "f", "i", "w", "send"}
    for s in range(pp * v):
        works = [layer[i] for i in range(bounds[s], bounds[s + 1])]
        send = costs.p2p_time(cfg, cluster, tp=lay.tp, cp=lay.cp, dp=lay.dp, stage=s % pp,
                              rows=rows, esize=esize) if pp > 1 else 0.0
        stages.append({"layers": (bounds[s], bounds[s + 1]), "f": sum(w.f for w in works),
                       "i": sum(w.i for w in works), "w": sum(w.w for w in works),
                       "send": send})
    last = pp * v - 1

    def cost(rank: int, a) -> float:
        st = stages[a.chunk * pp + rank]
        s = a.chunk * pp + rank
        fwd_send = st["send"] if s < last else 0.0
        bwd_send = stages[s - 1]["send"] if s > 0 else 0.0  # the gradient goes back one hop
        return {"F": st["f"] + fwd_send, "I": st["i"] + bwd_send, "W": st["w"],
                "B": st["i"] + st["w"] + bwd_send}[a.kind]
    ends, busy = pipeline_ends(lay.schedule, pp, m, v, cost)
    makespan = max(ends)
    bubble = 1 - busy / (pp * makespan) if makespan > 0 else 0.0
    memory = memory_by_rank(cfg, lay, global_batch, dtype)
    per_rank = []
    for r in range(pp):
        layers = [i for c in range(v) for i in range(bounds[c * pp + r], bounds[c * pp + r + 1])]
        elements = sum(n for i in layers for n in memory_plan.layer_tensors(cfg, lay.tp, i,
                                                                             lay.ep))
        shard = -(-elements // (lay.dp * lay.cp)) if lay.zero else elements
        red = costs.reduction_terms(cluster, zero=lay.zero, elements=elements, shard=shard,
                                    tp=lay.tp, cp=lay.cp, dp=lay.dp, esize=esize)
        comm_s = sum(t for k, t in red.items() if k != "optimizer")
        if overlap_dp and comm_s > 0:  # hidden behind the rank's compute but one layer's share
            hidden = 1 - max(comm_s - ends[r], comm_s / max(1, len(layers))) / comm_s
            red = {k: t if k == "optimizer" else t * (1 - hidden) for k, t in red.items()}
        per_rank.append({"pipeline_s": ends[r], **red, "end_s": ends[r] + sum(red.values()),
                         "elements": elements})
    step = max(r["end_s"] for r in per_rank)
    tokens = global_batch * cfg.seq_len
    totals = [sum(mem.values()) for mem in memory]
    worst = max(range(pp), key=lambda r: totals[r])
    fits = totals[worst] <= cluster.memory_bytes
    terms = {"layer": {k: w for k, w in layer.items() if not isinstance(k, int) or k in (
        0, cfg.layers + 1)}, "stages": stages, "ranks": per_rank, "makespan_s": makespan,
        "busy_s": busy, "memory_by_rank": memory, "rows_per_microbatch": rows,
        "flops_per_token": model_flops_per_token(cfg), "esize": esize}
    return Prediction(layout=lay, step_time_s=step, tokens_per_s=tokens / step,
                      mfu=tokens / step * model_flops_per_token(cfg) /
                      (cluster.peak_flops * lay.ranks), bubble=bubble, memory=memory[worst],
                      memory_rank=worst, fits=fits, memory_budget=cluster.memory_bytes,
                      terms=terms)
