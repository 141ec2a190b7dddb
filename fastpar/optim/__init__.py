"""Optimizers that know about the dp group: ``DistributedOptimizer`` (ZeRO-1), and
``clip_grad_norm_`` by the serial model's global norm for a model sharded over tp and pp."""

from fastpar.optim.clip import clip_grad_norm_
from fastpar.optim.zero import DistributedOptimizer

__all__ = ["DistributedOptimizer", "clip_grad_norm_"]
