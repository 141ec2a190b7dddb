"""Every layout of a model on a cluster, predicted and ranked, with the reason each one that
cannot run was dropped.

    result = search(cfg, cluster, global_batch=16, dtype=torch.float32)
    result.ranked      # feasible and fitting, fastest first
    result.too_big     # feasible but over the memory budget (by how much: .memory_total)
    result.dropped     # [(layout name, reason)]
"""

from __future__ import annotations

import dataclasses

from fastpar.models.config import GPTConfig
from fastpar.plan.cluster import Cluster
from fastpar.plan.layouts import candidates, why_not
from fastpar.plan.predict import Prediction, predict


@dataclasses.dataclass
class SearchResult:
    ranked: list[Prediction]
    too_big: list[Prediction]
    dropped: list[tuple[str, str]]

    def all(self) -> list[Prediction]:
        return self.ranked + self.too_big


def search(cfg: GPTConfig, cluster: Cluster, global_batch: int, *, dtype,
           overlap_dp: bool = False) -> SearchResult:
    ranked, too_big, dropped = [], [], []
    for lay in candidates(cfg, cluster.ranks, cluster.ranks_per_host, global_batch):
        reason = why_not(cfg, lay, cluster.ranks, global_batch)
        if reason is not None:
            dropped.append((lay.name, reason))
            continue
        p = predict(cfg, lay, cluster, global_batch, dtype=dtype, overlap_dp=overlap_dp)
        (ranked if p.fits else too_big).append(p)
    # equal times (to 9 digits: the same work summed in another order) rank by memory
    ranked.sort(key=lambda p: (float(f"{p.step_time_s:.9g}"), p.memory_total))
    too_big.sort(key=lambda p: p.memory_total)
    return SearchResult(ranked, too_big, dropped)
