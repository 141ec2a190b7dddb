"""Random streams for dropout under tensor parallelism.

* Replicated regions (activations identical on every TP rank) draw from the default generator,
  which every TP rank seeds alike, so all ranks drop the same elements.
* Sharded regions (each rank holds different heads or ffn columns) draw from a per-TP-rank
  stream, so the shards are dropped independently as the serial model's one big tensor would be.

    fastpar.nn.random.seed(1234)              # default stream alike, "tp" stream per rank
    with fastpar.nn.random.fork("tp"):        # inside a sharded region
        h = F.dropout(h, p, training=True)

The tracker belongs to the job (``fastpar.runtime.job().rng``): ``fastpar.shutdown`` drops it and
the next ``init`` starts with fresh streams. ``group=None`` means the topology's tp group, as for
the layers.
"""

from __future__ import annotations

import torch

from fastpar.nn.sharding import resolve_group
from fastpar.runtime import group_rank, job
from fastpar.runtime.rng import RNGTracker

TP_SEED_OFFSET = 2718  # keeps the per-rank streams apart from the default stream's seed


def tracker() -> RNGTracker:
    """The job's tracker (``RuntimeError`` before ``fastpar.init``)."""
    return job().rng


def seed(value: int, group=None) -> None:
    """Seed the default stream with ``value`` (alike on every rank) and the "tp" stream with
    ``value + 2718 + tp_rank``."""
    torch.manual_seed(value)
    tracker().add("tp", value + TP_SEED_OFFSET + group_rank(resolve_group(group)))


def fork(name: str = "tp", group=None):
    """Context manager: draw from stream ``name``. An unseeded "tp" stream starts from the
    default generator's initial seed + 2718 + tp_rank."""
    t = tracker()
    if name not in t.states:
        if name != "tp":
            raise KeyError(f"no RNG stream named {name!r}; add it with tracker().add")
        t.add("tp", torch.initial_seed() + TP_SEED_OFFSET + group_rank(resolve_group(group)))
    return t.fork(name)
