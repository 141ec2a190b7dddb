"""Weight-only quantization's format: int8 / int4 integers with per-group scales, and its GEMM.

A weight ``W`` (N, K) is cut along K into groups of ``group`` columns of the *serial* weight, so
a tensor-parallel shard whose columns start mid-group (a row-parallel shard of K / tp columns
that is not a multiple of the group: Llama 2 7B's 11008 / 8 = 1376) holds a partial first and
last group and the rank beside it the rest; each group has one scale, computed from the whole
group (a shard's edge groups' statistics are combined over the tp group), so the quantized
model is the same at every tp and a checkpoint reshards exactly. For this shard's column ``k``
(local) in its local group ``j = (lead + k) // group`` (``lead = start % group``, ``start`` the
shard's first serial column)::

    int8:  W[n, k] = scales[j, n] * q[n, k]                    q in [-127, 127], symmetric:
                                                              scales = amax |W| / 127
    int4:  W[n, k] = scales[j, n] * q[n, k] + offsets[j, n]    q in [0, 15], min-max:
                                                              scales = (max - min) / 15,
                                                              offsets = min
    q[n, k] = round((W[n, k] (- offsets)) / scales), clamped   (a constant group: scale 1)

Storage: int8 ``q`` (N, K); int4 two columns per byte, (N, ceil(K / 2)) uint8, column ``k`` in
byte ``k // 2``, the low nibble for even ``k``; ``scales`` and ``offsets`` (groups, N) in float32
(groups as rows: a shard's groups are whole rows of the serial tensor). Per weight with float32
scales: int8 ``1 + 4 / group`` bytes (0.26x of float32 at group 128), int4 ``0.5 + 8 / group``
(0.16x at group 64).

``qmatmul(x, ...)`` computes ``x @ W.T`` in ``x``'s dtype: on CUDA a Triton kernel dequantizes
in its K loop (``fastpar.kernels.qlinear``); on the CPU the native kernel (``torch.ops.fastpar.
qlinear``: reads each integer once, converts and multiplies in float32) serves up to
``DECODE_ROWS`` rows, the decode steps that are bound by reading the weight; more rows (a
prefill, which is bound by compute), any input that needs a gradient, and CUDA without Triton
dequantize the weight and run torch's GEMM.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch
import torch.nn.functional as F

from fastpar import _native

FORMATS = {"int8": 8, "int4": 4}
DEFAULT_GROUP = {"int8": 128, "int4": 64}
DECODE_ROWS = 16
_HAVE_TRITON = importlib.util.find_spec("triton") is not None  # else CUDA dequantizes too


@dataclasses.dataclass(frozen=True)
class Grid:
    """Where a shard's ``columns`` columns, from serial column ``start``, lie among the serial
    weight's groups of ``group`` columns."""

    group: int
    start: int
    columns: int

    @property
    def lead(self) -> int:
        """Columns of the first group before this shard's (held by the rank before)."""
        return self.start % self.group

    @property
    def first(self) -> int:
        """The serial index of this shard's first group."""
        return self.start // self.group

    @property
    def groups(self) -> int:
        """The groups this shard touches (the first and last perhaps in part)."""
        return (self.lead + self.columns - 1) // self.group + 1 if self.columns else 0

    @property
    def owned_first(self) -> int:
        """The first group that starts inside this shard (a checkpoint stores each group's
        scale once: from the shard its first column lies in)."""
        return -(-self.start // self.group)

    def column_groups(self, device=None) -> torch.Tensor:
        """(K,) each column's local group."""
        return (self.lead + torch.arange(self.columns, device=device)) // self.group


def check_format(fmt: str, group_size) -> tuple[int, int]:
    """``(bits, group)`` of a format name and a group size (None: the format's default)."""
    if fmt not in FORMATS:
        raise ValueError(f"weight format must be one of {sorted(FORMATS)}, got {fmt!r}")
    group = DEFAULT_GROUP[fmt] if group_size is None else group_size
    if isinstance(group, bool) or not isinstance(group, int) or group < 16 or group % 16:
        raise ValueError(f"group_size must be a multiple of 16 (at least 16), got {group!r}")
    return FORMATS[fmt], group


def group_stats(w: torch.Tensor, bits: int, grid: Grid) -> torch.Tensor:
    """(groups, N, 1 | 2) float32: each group's max |W| (int8) or (max, -min) (int4) over this
    shard's columns; combined by a max over the shards, the whole groups'."""
    n = w.shape[0]
    pad_front, width = grid.lead, grid.groups * grid.group
    w = w.detach().float()
    if bits == 8:
        padded = w.new_zeros(n, width)
        padded[:, pad_front:pad_front + grid.columns] = w.abs()
        stats = padded.view(n, grid.groups, grid.group).amax(-1)[..., None]
    else:
        high = w.new_full((n, width), -torch.inf)
        low = w.new_full((n, width), -torch.inf)
        high[:, pad_front:pad_front + grid.columns] = w
        low[:, pad_front:pad_front + grid.columns] = -w
        stats = torch.stack([high.view(n, grid.groups, grid.group).amax(-1),
                             low.view(n, grid.groups, grid.group).amax(-1)], -1)
    return stats.transpose(0, 1).contiguous()


def quantize(w: torch.Tensor, bits: int, grid: Grid, stats: torch.Tensor | None = None):
    """``(q, scales, offsets or None)`` of a shard ``w`` (N, K); ``stats``: the whole groups'
    ``group_stats`` (None: this shard's, right when it holds whole groups)."""
    if stats is None:
        stats = group_stats(w, bits, grid)
    w = w.detach().float().contiguous()
    if bits == 8:
        scales = stats[..., 0] / 127
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        offsets = None
    else:
        high, low = stats[..., 0], -stats[..., 1]
        scales = (high - low) / 15
        scales = torch.where(scales > 0, scales, torch.ones_like(scales))
        offsets = low
    cols = grid.column_groups(w.device)
    value = w if offsets is None else w - offsets.t()[:, cols]
    q = torch.round(value / scales.t()[:, cols])
    if bits == 8:
        return q.clamp_(-127, 127).to(torch.int8).contiguous(), scales, None
    q = q.clamp_(0, 15).to(torch.uint8)
    if q.shape[1] % 2:
        q = F.pad(q, (0, 1))
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(), scales, offsets.contiguous()


def unpack(q: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """The integers as (N, K) int16 (int4 nibbles separated)."""
    if bits == 8:
        return q.to(torch.int16)
    both = torch.stack([q & 15, q >> 4], -1).view(q.shape[0], -1)
    return both[:, :columns].to(torch.int16)


def dequantize(q, scales, offsets, bits: int, grid: Grid, dtype=torch.float32) -> torch.Tensor:
    """W (N, K) in ``dtype``: each integer times its group's scale (plus its offset)."""
    cols = grid.column_groups(q.device)
    w = unpack(q, bits, grid.columns).float() * scales.float().t()[:, cols]
    if offsets is not None:
        w = w + offsets.float().t()[:, cols]
    return w.to(dtype)


def qmatmul(x: torch.Tensor, q, scales, offsets, bits: int, grid: Grid) -> torch.Tensor:
    """``x @ W.T`` (..., N) in ``x``'s dtype for x (..., K); see the module docstring."""
    rows = x.numel() // max(x.shape[-1], 1)
    if x.is_cuda and _HAVE_TRITON and not (x.requires_grad and torch.is_grad_enabled()):
        from fastpar.kernels.qlinear import qlinear

        out = qlinear(x.reshape(rows, x.shape[-1]), q, scales, offsets, bits, grid.group,
                      grid.lead)
        return out.view(*x.shape[:-1], q.shape[0])
    if rows <= DECODE_ROWS and x.device.type == "cpu" and _native.available() and not (
            x.requires_grad and torch.is_grad_enabled()):
        out = torch.empty(rows, q.shape[0], dtype=torch.float32)
        torch.ops.fastpar.qlinear(x.reshape(rows, x.shape[-1]).float().contiguous(), q,
                                  scales.float().contiguous(), None if offsets is None else
                                  offsets.float().contiguous(), bits, grid.group, grid.lead, out)
        return out.to(x.dtype).view(*x.shape[:-1], q.shape[0])
    return F.linear(x, dequantize(q, scales, offsets, bits, grid, x.dtype))
