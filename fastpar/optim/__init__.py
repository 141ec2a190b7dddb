"""Optimizers that know about the dp group: ``DistributedOptimizer`` (ZeRO-1), ``MasterWeights``
(float32 masters and optimizer state for a bf16 model without ZeRO), and ``clip_grad_norm_`` by
the serial model's global norm for a model sharded over tp and pp."""

from fastpar.optim.clip import clip_grad_norm_
from fastpar.optim.master import MasterWeights
from fastpar.optim.zero import DistributedOptimizer

__all__ = ["DistributedOptimizer", "MasterWeights", "clip_grad_norm_"]
