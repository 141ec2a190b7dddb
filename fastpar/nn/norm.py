"""LayerNorm and RMSNorm that also work on sequence-sharded activations.

Their parameters are replicated. Without sequence parallelism every TP rank sees the same tokens
and computes the same gradients. With it each rank sees only its tokens, so the weight (and bias)
enter the computation through ``copy_replicated``: forward ``w``, backward ``dw = all_reduce(dw_n)``
(summed in float32 for a bf16 weight), the gradient of the serial model over the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.nn.sharding import copy_replicated, resolve_group


class _SequenceParallelNorm(nn.Module):
    def __init__(self, sequence_parallel: bool, group):
        super().__init__()
        self.sequence_parallel = sequence_parallel
        self.group = None
        if sequence_parallel:
            self.group = resolve_group(group)

    def _param(self, p):
        if p is None or not self.sequence_parallel:
            return p
        return copy_replicated(p, self.group)


class LayerNorm(_SequenceParallelNorm):
    """``nn.LayerNorm`` over the last dims; ``sequence_parallel=True`` sums parameter gradients
    over the TP group (``group``, default the topology's tp group)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, *, sequence_parallel: bool = False, group=None, device=None,
                 dtype=None):
        super().__init__(sequence_parallel, group)
        if isinstance(normalized_shape, int):
            normalized_shape = (normalized_shape,)
        self.normalized_shape, self.eps = tuple(normalized_shape), eps
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(self.normalized_shape, **factory)) \
            if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(self.normalized_shape, **factory)) \
            if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self._param(self.weight),
                            self._param(self.bias), self.eps)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"sequence_parallel={self.sequence_parallel}")


class RMSNorm(_SequenceParallelNorm):
    """``y = x / sqrt(mean(x**2, -1) + eps) * weight`` (as ``nn.RMSNorm``); ``sequence_parallel``
    as in ``LayerNorm``."""

    def __init__(self, dim: int, eps: float = 1e-6, *, sequence_parallel: bool = False,
                 group=None, device=None, dtype=None):
        super().__init__(sequence_parallel, group)
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self._param(self.weight), self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"
