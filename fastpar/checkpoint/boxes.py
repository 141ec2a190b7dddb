"""Where a rank's elements sit in a serial tensor: boxes, and flat ranges cut into boxes.

A box is a rectangle of a serial tensor, ``(offsets, sizes)`` with one entry per dim (DCP's
chunk and Megatron's sharded-tensor slice say the same thing). Every shard fastpar holds is a
contiguous flat range of a box: a tp shard is a whole box (a ``ShardedModule``'s ``shard_box``),
a ZeRO master shard a range ``[a, b)`` of the row-major flattening of one, so a checkpoint
needs only boxes once a range is cut into them::

    range [a, b) of a box shaped (m, n), row length n:
        head  row a // n, columns a % n .. n            (if a is not at a row start)
        body  rows ceil(a / n) .. b // n, every column   (one box)
        tail  row b // n, columns 0 .. b % n             (if b is not at a row start)

applied again inside the head and tail rows for more dims: at most ``2 * ndim - 1`` boxes, each
of them contiguous in the flat range, so a box's data is ``source[i:j].view(sizes)`` with no
copy. A 0-dim tensor is one element: the box ``((), ())``.
"""

from __future__ import annotations

import math

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def numel(sizes) -> int:
    return math.prod(sizes)


def range_boxes(sizes: tuple[int, ...], a: int, b: int) -> list[tuple[int, Box]]:
    """``[(start, box)]``: the elements ``[a, b)`` of a row-major tensor shaped ``sizes`` as
    boxes relative to it, each with its start in that flat range (starts ascending; the boxes'
    element counts add up to ``b - a``)."""
    total = numel(sizes)
    if not 0 <= a <= b <= total:
        raise ValueError(f"range [{a}, {b}) is outside a tensor of {total} elements {sizes}")
    out: list[tuple[int, Box]] = []

    def cut(dims: tuple[int, ...], prefix: tuple[int, ...], lo: int, hi: int, base: int):
        if lo >= hi:
            return
        if not dims:
            out.append((base, (prefix, ())))
            return
        row = numel(dims[1:])
        if row == 0:
            return
        first, last = -(-lo // row), hi // row  # whole rows [first, last)
        if first > last:  # inside one row
            r = lo // row
            cut(dims[1:], prefix + (r,), lo - r * row, hi - r * row, base)
            return
        if lo < first * row:  # head: the end of row first - 1
            r = first - 1
            cut(dims[1:], prefix + (r,), lo - r * row, row, base)
        if first < last:
            out.append((base + first * row - lo,
                        (prefix + (first,) + (0,) * (len(dims) - 1),
                         (1,) * len(prefix) + (last - first,) + dims[1:])))
        if last * row < hi:  # tail: the start of row last
            cut(dims[1:], prefix + (last,), 0, hi - last * row, base + last * row - lo)

    cut(tuple(sizes), (), a, b, 0)
    # the head and tail boxes carry their leading dims as offsets with size 1
    fixed = []
    for start, (offs, szs) in out:
        lead = len(offs) - len(szs)
        fixed.append((start, (offs, (1,) * lead + szs)))
    return sorted(fixed)


def shift(box: Box, by: tuple[int, ...]) -> Box:
    """``box`` (relative to a box at offsets ``by``) in the coordinates of the serial tensor."""
    return tuple(o + d for o, d in zip(box[0], by)), box[1]


def intersect(x: Box, y: Box) -> Box | None:
    """The common part of two boxes, or None."""
    offs, sizes = [], []
    for ox, sx, oy, sy in zip(x[0], x[1], y[0], y[1]):
        lo, hi = max(ox, oy), min(ox + sx, oy + sy)
        if lo >= hi:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return tuple(offs), tuple(sizes)


def slices(inner: Box, within: Box) -> tuple[slice, ...]:
    """Index of ``inner`` inside a tensor that holds the box ``within``."""
    return tuple(slice(o - w, o - w + s) for o, s, w in zip(inner[0], inner[1], within[0]))


def contains(outer: Box, inner: Box) -> bool:
    return all(oo <= oi and oi + si <= oo + so
               for oo, so, oi, si in zip(outer[0], outer[1], inner[0], inner[1]))
