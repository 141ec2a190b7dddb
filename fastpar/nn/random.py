"""Random streams for dropout under tensor parallelism.

* Replicated regions (activations identical on every TP rank) draw from the default generator,
  which every TP rank seeds alike, so all ranks drop the same elements.
* Sharded regions (each rank holds different heads or ffn columns) draw from a per-TP-rank
  stream, so the shards are dropped independently as the serial model's one big tensor would be.

    fastpar.nn.random.seed(1234)              # default stream alike, "tp" stream per rank
    with fastpar.nn.random.fork("tp"):        # inside a sharded region
        h = F.dropout(h, p, training=True)

The tracker is a part of the job (``fastpar.runtime.job().part("nn.random", ...)``):
``fastpar.shutdown`` drops it and the next ``init`` starts with fresh streams. ``group=None`` means the topology's tp group, as for
the layers.
"""

from __future__ import annotations

import contextlib

import torch

from fastpar.nn.sharding import resolve_group
from fastpar.runtime import group_rank, job

TP_SEED_OFFSET = 2718  # keeps the per-rank streams apart from the default stream's seed


class RNGTracker:
    """Named RNG states (CPU, plus the current CUDA device's when one is in use)."""

    def __init__(self):
        self.states: dict[str, tuple] = {}

    def add(self, name: str, seed: int) -> None:
        cpu = torch.Generator().manual_seed(seed).get_state()
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
                torch.cuda.manual_seed(seed)
                cuda = torch.cuda.get_rng_state()
        self.states[name] = (cpu, cuda)

    @contextlib.contextmanager
    def fork(self, name: str):
        """Run the block on stream ``name``, then store its advanced state and restore the
        default stream."""
        cpu, cuda = self.states[name]
        saved_cpu = torch.get_rng_state()
        saved_cuda = torch.cuda.get_rng_state() if cuda is not None else None
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        try:
            yield
        finally:
            cpu = torch.get_rng_state()
            cuda = torch.cuda.get_rng_state() if cuda is not None else None
            self.states[name] = (cpu, cuda)
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                torch.cuda.set_rng_state(saved_cuda)


def tracker() -> RNGTracker:
    """The job's tracker (``RuntimeError`` before ``fastpar.init``)."""
    return job().part("nn.random", RNGTracker)


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
