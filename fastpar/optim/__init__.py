"""Optimizers that know about the dp group: ``DistributedOptimizer`` (ZeRO-1)."""

from fastpar.optim.zero import DistributedOptimizer

__all__ = ["DistributedOptimizer"]
