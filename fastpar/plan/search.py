"""Every layout of a model on a cluster, predicted and ranked, with the reason each one that
cannot run was dropped.

    result = search(cfg, cluster, global_batch=16, dtype=torch.float32)          # every one
    result = search(cfg, cluster, global_batch=16, dtype=torch.float32, top=10)  # the best 10
    result.ranked      # feasible and fitting, fastest first
    result.too_big     # feasible but over the memory budget (by how much: .memory_total)
    result.dropped     # [(layout name, reason)]

``top=k`` finds the same k fastest fitting layouts, in the same order, as the exhaustive
search (tests/test_plan.py compares them) without predicting most layouts: every layout that
can run gets a lower bound on its step time (``Predictor.lower_bound``: no timeline, no
memory); a layout's time is predicted when its bound is the smallest left, and its memory
when its time is the smallest left and no bound is below it (then nothing unseen can be
faster), until k fit. Memory is replayed over the schedule only when the state alone
(parameters, gradients, optimizer, buffers) fits. ``too_big`` then holds the layouts over
budget that are faster than the k-th; ``over_state`` counts those over it on state alone.
"""

from __future__ import annotations

import heapq
import dataclasses

from fastpar.models.config import GPTConfig
from fastpar.plan.cluster import Cluster
from fastpar.plan.layouts import candidates, why_not
from fastpar.plan.predict import Prediction, Predictor


@dataclasses.dataclass
class SearchResult:
    ranked: list[Prediction]
    too_big: list[Prediction]
    dropped: list[tuple[str, str]]
    predicted: int = 0  # layouts whose step time was predicted
    over_state: int = 0  # top=k: of those, layouts whose state alone is over the budget
    pruned: int = 0  # top=k: layouts that can run, never predicted (provably slower)

    def all(self) -> list[Prediction]:
        return self.ranked + self.too_big


def _key(step_time_s: float) -> float:
    """Equal times (to 9 digits: the same work summed in another order) rank by memory."""
    return float(f"{step_time_s:.9g}")


def search(cfg: GPTConfig, cluster: Cluster, global_batch: int, *, dtype,
           overlap_dp: bool = False, top: int | None = None) -> SearchResult:
    pred = Predictor(cfg, cluster, global_batch, dtype=dtype, overlap_dp=overlap_dp)
    runnable, dropped = [], []
    for lay in candidates(cfg, cluster.ranks, cluster.ranks_per_host, global_batch):
        reason = why_not(cfg, lay, cluster.ranks, global_batch)
        if reason is not None:
            dropped.append((lay.name, reason))
        else:
            runnable.append(lay)
    if top is None:
        ranked, too_big = [], []
        for lay in runnable:
            p = pred.predict(lay)
            (ranked if p.fits else too_big).append(p)
        ranked.sort(key=lambda p: (_key(p.step_time_s), p.memory_total))
        too_big.sort(key=lambda p: p.memory_total)
        return SearchResult(ranked, too_big, dropped, len(runnable))
    # Two queues: layouts by their bound (time unknown) and by their predicted time (memory
    # unknown). The fastest predicted one is final once no bound is below its time: its
    # memory is then looked at, and a fitting one is the next row of the answer.
    bounds = sorted((_key(pred.lower_bound(lay)), index) for index, lay in enumerate(runnable))
    bounds.reverse()  # popped from the end: smallest first
    timed: list[tuple] = []  # (time key, index), a heap
    ranked, too_big, simulated, over_state = [], [], 0, 0
    while len(ranked) < top and (bounds or timed):
        if bounds and (not timed or bounds[-1][0] <= timed[0][0]):
            _, index = bounds.pop()
            simulated += 1
            heapq.heappush(timed, (_key(pred.step(runnable[index])[0]), index))
            continue
        key = timed[0][0]
        tied = []  # equal times rank by memory, then in enumeration order
        while timed and timed[0][0] == key:
            tied.append(heapq.heappop(timed)[1])
        fitting = []
        for index in sorted(tied):
            lay = runnable[index]
            if pred.state_over_budget(lay):
                over_state += 1  # over budget before any activation: not predicted in full
                continue
            p = pred.predict(lay)
            (fitting if p.fits else too_big).append(p)
        ranked += sorted(fitting, key=lambda p: p.memory_total)
    too_big.sort(key=lambda p: p.memory_total)
    return SearchResult(ranked[:top], too_big, dropped, simulated, over_state,
                        len(runnable) - simulated)
