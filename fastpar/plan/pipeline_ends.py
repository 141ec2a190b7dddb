"""Each pipeline rank's end time and the busy total of a layout's step, from the pipeline's own
timeline (``pipeline.timeline.simulate``) of the real action lists; long lists (more than
``SIMULATE_MAX`` compute actions per rank) at two microbatch counts pp apart in the steady
state, extended linearly.

    ends, busy = pipeline_ends("1f1b", pp=4, m=64, v=1, cost=lambda rank, action: seconds)
"""

from __future__ import annotations

import functools

from fastpar.pipeline.schedules import SCHEDULES
from fastpar.pipeline.timeline import simulate

SIMULATE_MAX = 1536  # compute actions per rank simulated in full; longer lists: extended


@functools.lru_cache(maxsize=16)
def _lists(schedule: str, pp: int, m: int, v: int) -> tuple:
    return tuple(SCHEDULES[schedule](pp, m, r, v) for r in range(pp))


def simulated_ends(schedule: str, pp: int, m: int, v: int, cost) -> tuple[list[float], float]:
    """Each rank's end time and the busy total, from the timeline of the real lists."""
    lists = [list(x) for x in _lists(schedule, pp, m, v)]
    spans = simulate(lists, cost=cost)
    ends = [row[-1][1] if row else 0.0 for row in spans]
    return ends, sum(b - a for row in spans for a, b, _ in row)


def extended(pp: int, m: int, v: int) -> bool:
    """Whether ``pipeline_ends`` extends the timeline from its steady state."""
    return not (m * v * 3 <= SIMULATE_MAX or m <= 4 * pp)


def pipeline_ends(schedule: str, pp: int, m: int, v: int, cost) -> tuple[list[float], float]:
    """``simulated_ends``, or for long lists the ends at two counts one period (pp microbatches) apart,
    extended linearly to ``m`` (the busy total is exact: every microbatch costs the same)."""
    if not extended(pp, m, v):
        return simulated_ends(schedule, pp, m, v, cost)
    m0, m1 = 2 * pp, 3 * pp
    e0, b0 = simulated_ends(schedule, pp, m0, v, cost)
    e1, b1 = simulated_ends(schedule, pp, m1, v, cost)
    slope = [(b - a) / (m1 - m0) for a, b in zip(e0, e1)]
    return [b + s * (m - m1) for b, s in zip(e1, slope)], b0 + (b1 - b0) / (m1 - m0) * (m - m0)
