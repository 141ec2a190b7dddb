"""Named random streams (CPU, plus the current CUDA device's): the state behind
``fastpar.nn.random``. One tracker per job, held by the ``Job`` that ``fastpar.init`` builds."""

from __future__ import annotations

import contextlib

import torch


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
