"""Gradient buckets: trainable parameters packed into flat tensors that one collective reduces.

``plan_buckets`` is a pure function (sizes in, index lists out) so the packing is tested without
processes. A ``Bucket`` owns one flat tensor per (dtype, device) group of parameters; each
parameter's gradient is a view into it (``view_of``), or, when the bucket reduces in another
dtype than the parameter's (``reduce_dtype``), a slot the gradient is copied into.

Order: parameters are taken in reverse registration order, the order backward usually produces
their gradients, so the first bucket fills first. The first bucket of each (dtype, device) group
is small (``FIRST_BUCKET_BYTES``) so that its reduction starts early in the backward.
"""

from __future__ import annotations

import dataclasses

import torch

FIRST_BUCKET_BYTES = 1 << 20  # 1 MiB: the first bucket's cap, so communication starts early
ALIGN_BYTES = 64  # every gradient view starts on a 64-byte boundary inside its bucket


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """What the plan needs to know about one parameter."""

    numel: int
    key: tuple  # (bucket dtype, device): parameters of one key share buckets
    element_size: int  # bytes per element of the bucket dtype


def plan_buckets(specs: list[ParamSpec], bucket_bytes: int,
                 first_bytes: int = FIRST_BUCKET_BYTES) -> list[list[int]]:
    """Index lists (into ``specs``), one per bucket, in launch order.

    ``specs`` are in registration order; buckets are filled in reverse order. A bucket closes when
    the next parameter would take it past its cap (``min(first_bytes, bucket_bytes)`` for the
    first bucket of each key, ``bucket_bytes`` after); a parameter larger than the cap gets a
    bucket of its own. Buckets are ordered by the position of their first parameter in the
    reverse order, so every rank with the same model derives the same list.
    """
    open_: dict[tuple, list[int]] = {}  # key -> the bucket being filled
    used: dict[tuple, int] = {}  # key -> bytes in it
    count: dict[tuple, int] = {}  # key -> buckets closed so far
    buckets: list[list[int]] = []  # in order of opening

    for i in reversed(range(len(specs))):
        s = specs[i]
        nbytes = s.numel * s.element_size
        cap = min(first_bytes, bucket_bytes) if count.get(s.key, 0) == 0 else bucket_bytes
        bucket = open_.get(s.key)
        if bucket is not None and used[s.key] + nbytes > cap:
            count[s.key] = count.get(s.key, 0) + 1
            bucket = None
        if bucket is None:
            bucket = open_[s.key] = []
            used[s.key] = 0
            buckets.append(bucket)
        bucket.append(i)
        used[s.key] += nbytes
    return buckets


class Bucket:
    """One flat tensor holding the gradients of ``params`` (in bucket order), plus the per-cycle
    readiness count the wrapper keeps.

    ``copy`` is True when the bucket's dtype differs from the parameters' (a float32 reduction of
    a bfloat16 model): gradients are then copied in before and cast back after the reduction,
    instead of living in the bucket as views.
    """

    def __init__(self, index: int, params: list[torch.nn.Parameter], names: list[str],
                 dtype: torch.dtype, device: torch.device, alloc=None):
        self.index, self.params, self.names = index, params, names
        self.dtype, self.device = dtype, device
        self.copy = any(p.dtype != dtype for p in params)
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
        self.offsets, end = [], 0
        for p in params:
            self.offsets.append(end)
            end += -(-p.numel() // align) * align
        # the padding stays zero; ``alloc(numel, dtype, device)`` may place the bucket in
        # symmetric memory, where the group's all-reduce needs no copy in or out
        self.data = (alloc(end, dtype, device) if alloc is not None else
                     torch.zeros(end, dtype=dtype, device=device))
        self.symmetric = alloc is not None and device.type == "cpu"
        self.views = [self.data[o:o + p.numel()].view(p.shape)
                      for o, p in zip(self.offsets, params)]
        self.pending = len(params)  # parameters not ready yet in the current cycle

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def __repr__(self) -> str:
        return (f"Bucket({self.index}: {len(self.params)} params, {self.nbytes / 2**20:.3g} MiB "
                f"{str(self.dtype).removeprefix('torch.')}{', copy' if self.copy else ''}"
                f"{', symmetric' if self.symmetric else ''})")
