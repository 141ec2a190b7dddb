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
Memory: ``plan.memory.predict_memory`` (what the trainer reports beside its measurement) for
every pipeline rank at the stage cut ``Pipeline`` makes; the worst rank's categories.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fastpar.models.config import GPTConfig
from fastpar.pipeline.partition import balanced_bounds
from fastpar.plan import costs
from fastpar.plan import memory as mem_model
from fastpar.plan.cluster import Cluster
from fastpar.plan.layouts import Layout, model_for
from fastpar.plan.pipeline_ends import extended, pipeline_ends


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
    weights = tuple(sum(mem_model.layer_tensors(cfg, tp, i, ep))
                    for i in range(cfg.layers + 2))
    return _bounds(weights, stages)


@functools.lru_cache(maxsize=256)
def _bounds(weights: tuple, stages: int) -> tuple:
    return tuple(balanced_bounds(list(weights), stages))


def predict(cfg: GPTConfig, lay: Layout, cluster: Cluster, global_batch: int, *, dtype,
            overlap_dp: bool = False) -> Prediction:
    """The prediction of ``lay`` (a layout ``layouts.why_not`` accepts). ``overlap_dp``: the
    reduction overlaps the step's compute (FSDP-style prefetch: not what fastpar's trainer
    does, for published systems that do). Attention's kernel: ``cluster.causal_skip``."""
    return Predictor(cfg, cluster, global_batch, dtype=dtype,
                     overlap_dp=overlap_dp).predict(lay)


class Predictor:
    """``predict`` for many layouts of one (model, cluster, batch), each piece computed once:
    the per-layer costs by shape (tp, cp, ep, recompute, microbatch rows), the stage table by
    cut, the action lists and the timeline by (schedule, pp, microbatches, v, stage costs;
    ZeRO stages share it), the per-rank reduction by (zero, grid). ``lower_bound`` is what
    the search prunes with."""

    def __init__(self, cfg: GPTConfig, cluster: Cluster, global_batch: int, *, dtype,
                 overlap_dp: bool = False):
        self.cfg, self.cluster, self.global_batch = cfg, cluster, global_batch
        self.dtype, self.overlap_dp = dtype, overlap_dp
        self.esize = torch.empty((), dtype=dtype).element_size()
        self._memo: dict = {}

    def _cached(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    # ---- the pieces -------------------------------------------------------------------------

    def _layer(self, recompute: str, tp: int, cp: int, ep: int, rows: int, index: int):
        L = self.cfg.layers
        kind = "embedding" if index == 0 else "head" if index == L + 1 else \
            ("moe" if self.cfg.is_moe(index) else "block")
        key = ("layer", recompute, tp, cp, ep, rows, kind)
        if key not in self._memo:
            def work(tp, recompute, index=index):
                cfg = model_for(self.cfg, Layout(tp=tp, pp=1, dp=1, cp=cp, recompute=recompute))
                return costs.layer_work(cfg, self.cluster, index=index, tp=tp, cp=cp, ep=ep,
                                        rows=rows, esize=self.esize,
                                        causal_skip=self.cluster.causal_skip)

            w = work(tp, recompute)
            fit = self.cluster.fit_for(self.cfg, self.esize)
            if fit is not None:  # measured by the trainer at tp 1
                base, ab, again, comms = work(1, "none"), fit.block, None, None
                if kind in ("embedding", "head"):  # the fit's end is both: each its share
                    ab = costs.end_share(fit.end, base, [work(1, "none", i) for i in (0, L + 1)])
                elif recompute == "full" and fit.recompute is not None:  # measured too: the
                    # layer without, its recompute on I, the collectives with (run again)
                    again, comms, w = fit.recompute, w, work(tp, "none")
                w = costs.fitted(w, base, ab, rows * self.cfg.seq_len / cp, self.cluster,
                                 again=again, comms=comms)
            self._memo[key] = w
        return self._memo[key]

    def bounds(self, tp: int, ep: int, stages: int) -> tuple:
        """``stage_bounds``, once per cut."""
        return self._cached(("bounds", tp, ep, stages),
                            lambda: stage_bounds(self.cfg, tp, ep, stages))

    def rank_layers(self, lay: Layout) -> list[list[int]]:
        """The layers of each pipeline rank (its chunks in order)."""
        bounds = self.bounds(lay.tp, lay.ep, lay.pp * lay.virtual_stages)
        return self._cached(("rank layers", bounds, lay.pp), lambda: [
            [i for c in range(lay.virtual_stages)
             for i in range(bounds[c * lay.pp + r], bounds[c * lay.pp + r + 1])]
            for r in range(lay.pp)])

    def elements(self, lay: Layout) -> list[int]:
        """Parameters of each pipeline rank (its tp shard)."""
        return [e for e, _ in self.tensors(lay)]

    def tensors(self, lay: Layout) -> list[tuple[int, int]]:
        """``(parameters, parameter tensors)`` of each pipeline rank (its tp shard)."""
        def count():
            per_layer = [mem_model.layer_tensors(self.cfg, lay.tp, i, lay.ep)
                         for i in range(self.cfg.layers + 2)]
            return [(sum(sum(per_layer[i]) for i in layers),
                     sum(len(per_layer[i]) for i in layers)) for layers in self.rank_layers(lay)]
        return self._cached(("tensors", lay.tp, lay.ep, lay.pp, lay.virtual_stages), count)

    def stages(self, lay: Layout):
        """``(layer works by index, stages, bounds)``: per model stage ``{"layers", "f", "i",
        "w", "send", "link", "zb"}`` of one microbatch (``link``: the one its send to the next
        stage crosses, None at pp 1; ``zb``: ``_split_extra``)."""
        key = ("stages", lay.tp, lay.cp, lay.ep, lay.pp, lay.virtual_stages, lay.dp,
               lay.microbatches, lay.recompute)
        return self._cached(key, lambda: self._stages(lay))

    def _stages(self, lay: Layout):
        cfg = model_for(self.cfg, lay)
        pp, v = lay.pp, lay.virtual_stages
        bounds = self.bounds(lay.tp, lay.ep, pp * v)
        rows = self.global_batch // lay.dp // lay.microbatches  # sequences per microbatch
        layer = {i: self._layer(lay.recompute, lay.tp, lay.cp, lay.ep, rows, i)
                 for i in range(cfg.layers + 2)}
        stages = []
        for s in range(pp * v):
            works = [layer[i] for i in range(bounds[s], bounds[s + 1])]
            send, link = costs.p2p_time(cfg, self.cluster, tp=lay.tp, cp=lay.cp, dp=lay.dp,
                                        stage=s % pp, rows=rows, esize=self.esize) \
                if pp > 1 else (0.0, None)
            stages.append({"layers": (bounds[s], bounds[s + 1]), "f": sum(w.f for w in works),
                           "i": sum(w.i for w in works), "w": sum(w.w for w in works),
                           "send": send, "link": link,
                           "zb": self._split_extra(range(bounds[s], bounds[s + 1]))})
        return layer, stages, bounds

    def _split_extra(self, layers) -> float:
        """zb's split backward's extra host work per microbatch over ``layers`` (the trainer
        fit's, a block's each, the ends' half each; 0 without a fit), as long as the host's
        ranks sharing its cores make it."""
        fit = self.cluster.fit_for(self.cfg, self.esize)
        if fit is None:
            return 0.0
        block, ends = fit.zb
        last = self.cfg.layers + 1
        return self.cluster.overhead_scale * sum(ends / 2 if i in (0, last) else block
                                                 for i in layers)

    def _action_costs(self, lay: Layout, stages: list) -> dict:
        """``{(rank, chunk, kind): seconds}``: a chunk's compute and the send it makes (its
        bytes on its link).
        The activation goes to the next stage over that stage's link, the gradient back over
        the previous stage's. Under zb, W adds the split backward's extra host work (the
        trainer fit's: the second autograd pass over the weights)."""
        pp, v = lay.pp, lay.virtual_stages
        last = pp * v - 1
        out = {}
        for s, st in enumerate(stages):
            r, c = s % pp, s // pp
            prev = stages[s - 1] if s > 0 else None

            out[r, c, "F"] = st["f"] + (st["send"] if s < last else 0.0)
            out[r, c, "I"] = st["i"] + (prev["send"] if prev else 0.0)
            out[r, c, "W"] = st["w"] + (st["zb"] if lay.schedule == "zb" else 0.0)
            out[r, c, "B"] = st["i"] + st["w"] + (prev["send"] if prev else 0.0)
        return out

    def action_costs(self, lay: Layout) -> dict:
        return self._cached(("costs", lay.schedule, lay.tp, lay.cp, lay.ep, lay.pp,
                             lay.virtual_stages, lay.dp, lay.microbatches, lay.recompute),
                            lambda: self._action_costs(lay, self.stages(lay)[1]))

    def timeline(self, lay: Layout) -> tuple[list[float], float]:
        """Each pipeline rank's end and the busy total (``pipeline_ends``), shared by layouts
        that differ only in ZeRO stage."""
        table = self.action_costs(lay)
        key = ("timeline", lay.schedule, lay.pp, lay.microbatches, lay.virtual_stages,
               tuple(sorted(table.items())))
        return self._cached(key, lambda: self._timeline(lay, table))

    def _timeline(self, lay: Layout, table: dict) -> tuple[list[float], float]:
        ends, busy = pipeline_ends(lay.schedule, lay.pp, lay.microbatches,
                                   lay.virtual_stages,
                                   lambda rank, a: table[rank, a.chunk, a.kind])
        if extended(lay.pp, lay.microbatches, lay.virtual_stages):
            # an end extended from the steady state (zb, interleaved: within 1%) is never
            # below what the rank provably takes (and so never below the search's bound)
            ends = [max(e, f) for e, f in zip(ends, self.pipeline_floor(lay))]
        return ends, busy

    def rank_terms(self, lay: Layout) -> list[dict]:
        """Per pipeline rank: its layers' parameters and the after-pipeline terms (the dp x cp
        reduction, ZeRO's all-gather, the optimizer), before any overlap."""
        key = ("ranks", lay.tp, lay.cp, lay.ep, lay.pp, lay.virtual_stages, lay.dp, lay.zero,
               lay.microbatches, lay.schedule)
        return self._cached(key, lambda: self._rank_terms(lay))

    def _rank_terms(self, lay: Layout) -> list[dict]:
        out = []
        for layers, (elements, tensors) in zip(self.rank_layers(lay), self.tensors(lay)):
            shard = -(-elements // (lay.dp * lay.cp)) if lay.zero else elements
            # ZeRO's inner optimizer and clip loop over its flat shard: one tensor (per dtype
            # and parameter group; the plan's model has one of each), not the parameters
            # the trainer's granularity (--zero-granularity auto): per unit, a reduction per
            # microbatch and (ZeRO-3) a gather around each forward and backward
            unit = mem_model.zero_granularity(lay.zero, "auto", lay.pp, lay.schedule) == "unit"
            red = costs.reduction_terms(
                self.cluster, zero=lay.zero, elements=elements, shard=shard, tp=lay.tp,
                cp=lay.cp, dp=lay.dp, esize=self.esize, tensors=1 if lay.zero else tensors,
                reductions=lay.microbatches if unit else 1,
                gathers=2 * lay.microbatches if unit and lay.zero == 3 else 1)
            fit = self.cluster.fit_for(self.cfg, self.esize)
            if fit is not None:  # the step's host work beyond layers and optimizer, measured
                red["trainer step host"] = fit.step * self.cluster.overhead_scale
            out.append({"red": red, "layers": len(layers), "elements": elements})
        return out

    def _after(self, red: dict, layers: int, pipeline_s: float) -> dict:
        """The after-pipeline terms of a rank whose pipeline ends at ``pipeline_s``: with
        ``overlap_dp`` the reduction hides behind the rank's compute but one layer's share."""
        comm_s = sum(t for k, t in red.items() if k.startswith("dp "))
        if self.overlap_dp and comm_s > 0:
            hidden = 1 - max(comm_s - pipeline_s, comm_s / max(1, layers)) / comm_s
            red = {k: t * (1 - hidden) if k.startswith("dp ") else t for k, t in red.items()}
        return red

    def lower_bound(self, lay: Layout) -> float:
        """At most ``predict(lay).step_time_s``, without the timeline or memory: each rank's
        pipeline end (``pipeline_floor``) plus its after-pipeline terms (which grow with it)."""
        floor = self.pipeline_floor(lay)
        return max(end + sum(self._after(t["red"], t["layers"], end).values())
                   for end, t in zip(floor, self.rank_terms(lay)))

    def pipeline_floor(self, lay: Layout) -> list[float]:
        """A lower bound on each pipeline rank's end: it cannot start before the first
        microbatch's forward reaches it (the stages before it, chunk 0) and is then busy with
        all its own work (every microbatch's F, I, W and sends). Under gpipe and 1f1b every
        rank ends with the same microbatch's B, which leaves the last rank at its end: rank r
        ends at least the B of stages pp-2 .. r later. Under zb the last rank's I of the last
        microbatch follows all its F and I; each rank's then follows the next rank's, and its
        W follows it. Under interleaved the last rank's B of the last microbatch on its last
        chunk follows all its F; that microbatch's B then runs down every stage, each rank
        ending with its chunk 0's."""
        key = ("floor", lay.schedule, lay.tp, lay.cp, lay.ep, lay.pp, lay.virtual_stages,
               lay.dp, lay.microbatches, lay.recompute)
        return self._cached(key, lambda: self._floor(lay))

    def _floor(self, lay: Layout) -> list[float]:
        pp, v, m = lay.pp, lay.virtual_stages, lay.microbatches
        t = self.action_costs(lay)
        ends, head = [], 0.0
        for r in range(pp):
            ends.append(head + m * sum(t[r, c, "F"] + t[r, c, "B"] for c in range(v)))
            head += t[r, 0, "F"]
        last = pp - 1
        if v == 1 and lay.schedule in ("gpipe", "1f1b"):
            after = ends[last]
            for r in range(last - 1, -1, -1):
                after += t[r, 0, "B"]
                ends[r] = max(ends[r], after)
        elif v == 1 and lay.schedule == "zb":
            after = head - t[last, 0, "F"] + m * (t[last, 0, "F"] + t[last, 0, "I"])
            for r in range(last, -1, -1):
                if r < last:
                    after += t[r, 0, "I"]
                ends[r] = max(ends[r], after + t[r, 0, "W"])
        elif lay.schedule == "interleaved":
            after = head - t[last, 0, "F"] + m * sum(t[last, c, "F"] for c in range(v)) + \
                t[last, v - 1, "B"]
            for s in range(pp * v - 2, -1, -1):
                after += t[s % pp, s // pp, "B"]
                if s < pp:
                    ends[s] = max(ends[s], after)
        return ends

    def memory_inputs(self, lay: Layout) -> list:
        """The trainer's ``plan.memory.MemoryInputs`` of every pipeline rank of ``lay``."""
        cfg = model_for(self.cfg, lay)
        bounds = self.bounds(lay.tp, lay.ep, lay.pp * lay.virtual_stages)
        return [mem_model.MemoryInputs(
            cfg, tp=lay.tp, pp=lay.pp, dp=lay.dp * lay.cp, pp_rank=r, bounds=bounds,
            schedule=lay.schedule, microbatches=lay.microbatches,
            rows=self.global_batch // lay.dp, zero=lay.zero, dtype=self.dtype,
            virtual_stages=lay.virtual_stages, ep=lay.ep, cp=lay.cp,
            # the trainer's --zero-prefetch auto (training.optimizer.zero_prefetch)
            prefetch=self.cluster.device == "cuda") for r in range(lay.pp)]

    def state_over_budget(self, lay: Layout) -> bool:
        """Whether some rank's parameters, gradients, optimizer state and buffers alone
        (``mem_model.state_bytes``: no schedule replay) exceed the budget."""
        return any(sum(mem_model.state_bytes(m).values()) > self.cluster.memory_bytes
                   for m in self.memory_inputs(lay))

    # ---- one layout -------------------------------------------------------------------------

    def step(self, lay: Layout) -> tuple[float, list[dict], list[float], float]:
        """``(step seconds, per-rank terms, pipeline ends, busy)`` without memory."""
        ends, busy = self.timeline(lay)
        per_rank = []
        for r, terms in enumerate(self.rank_terms(lay)):
            red = self._after(terms["red"], terms["layers"], ends[r])
            per_rank.append({"pipeline_s": ends[r], **red, "end_s": ends[r] + sum(red.values()),
                             "elements": terms["elements"]})
        return max(r["end_s"] for r in per_rank), per_rank, ends, busy

    def predict(self, lay: Layout) -> Prediction:
        cfg = model_for(self.cfg, lay)
        layer, stages, _ = self.stages(lay)
        step, per_rank, ends, busy = self.step(lay)
        pp = lay.pp
        makespan = max(ends)
        bubble = 1 - busy / (pp * makespan) if makespan > 0 else 0.0
        memory = [mem_model.predict_memory(m) for m in self.memory_inputs(lay)]
        tokens = self.global_batch * cfg.seq_len
        totals = [sum(mem.values()) for mem in memory]
        worst = max(range(pp), key=lambda r: totals[r])
        budget = self.cluster.memory_bytes
        kinds = {0: layer[0], cfg.layers + 1: layer[cfg.layers + 1]}
        for i in range(1, cfg.layers + 1):
            kinds.setdefault("moe" if cfg.is_moe(i) else "block", layer[i])
        terms = {"layer": kinds, "stages": stages, "ranks": per_rank, "makespan_s": makespan,
                 "busy_s": busy, "memory_by_rank": memory,
                 "rows_per_microbatch": self.global_batch // lay.dp // lay.microbatches,
                 "flops_per_token": cfg.flops_per_token(), "esize": self.esize}
        return Prediction(layout=lay, step_time_s=step, tokens_per_s=tokens / step,
                          mfu=tokens / step * cfg.flops_per_token() /
                          (self.cluster.peak_flops * self.cluster.share * lay.ranks),
                          bubble=bubble,
                          memory=memory[worst], memory_rank=worst, fits=totals[worst] <= budget,
                          memory_budget=budget, terms=terms)
