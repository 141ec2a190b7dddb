"""Who writes what: every element of every serial tensor exactly once, the bytes spread evenly.

    held = [describe(pieces) for each rank]          # all-gathered: metadata only
    mine = assign(held, rank)                         # [(piece index, lo, hi)] to write

Each rank holds pieces: ranges of the flattening of a box of a serial tensor
(``fastpar.checkpoint.holdings``). The same (section, name, box) is held by every replica:
the dp ranks of a tensor without ZeRO, the tp ranks of a replicated one (a norm weight), a dp
rank's ZeRO range of it. ``assign`` cuts each box's flat order at every range end into
segments, and gives each segment to its holders the way Megatron's fully parallel save does:
a large segment split evenly over them, a small one (under ``SPLIT_BYTES`` per holder) whole to
the least-loaded holder, largest segments first, so the ranks write about equal bytes and a
rank without ZeRO writes only about 1/dp of its tensors. Every rank computes the same assignment
from the same metadata, with no further communication. ``check`` refuses what cannot be saved
consistently: a box not covered (an element nobody holds), two boxes of one tensor that
partly overlap, a tensor whose shape or dtype differs between ranks.
"""

from __future__ import annotations

import os
from collections import defaultdict

from fastpar.checkpoint.boxes import intersect, numel

SPLIT_BYTES = 1 << 20


def describe(pieces) -> list[tuple]:
    """Picklable metadata of a rank's pieces: ``(section, name, shape, dtype, box, lo, hi,
    element size)``."""
    return [(p.section, p.name, tuple(p.shape), str(p.data.dtype), p.box, p.lo, p.hi,
             p.data.element_size()) for p in pieces]


def check(held: list[list[tuple]]) -> None:
    """ValueError naming the tensor when the ranks' pieces cannot make one checkpoint."""
    shapes, boxes = {}, defaultdict(set)
    for rank, pieces in enumerate(held):
        for section, name, shape, dtype, box, lo, hi, _ in pieces:
            seen = shapes.setdefault((section, name), (shape, dtype, rank))
            if seen[:2] != (shape, dtype):
                raise ValueError(f"checkpoint: {section} tensor {name!r} is {seen[0]} "
                                 f"{seen[1]} on rank {seen[2]} but {shape} {dtype} on rank "
                                 f"{rank}")
            if any(o < 0 or o + n > d for o, n, d in zip(box[0], box[1], shape)) or \
                    len(box[0]) != len(shape):
                raise ValueError(f"checkpoint: {section} tensor {name!r} {shape} is held on "
                                 f"rank {rank} as box {box}, outside it (a layer's shard_box "
                                 "is wrong)")
            boxes[(section, name)].add(box)
    for (section, name), bs in boxes.items():
        bs = sorted(bs)
        for i, x in enumerate(bs):
            for y in bs[i + 1:]:
                if intersect(x, y) is not None:
                    raise ValueError(f"checkpoint: {section} tensor {name!r} is held as "
                                     f"overlapping boxes {x} and {y} (a layer's shard_box is "
                                     "wrong)")
        total = sum(numel(b[1]) for b in bs)
        if total != numel(shapes[(section, name)][0]):
            raise ValueError(f"checkpoint: the ranks hold {total} elements of {section} "
                             f"tensor {name!r}, which has {numel(shapes[(section, name)][0])}")


def assign(held: list[list[tuple]], rank: int) -> list[tuple[int, int, int]]:
    """``[(index into rank's pieces, lo, hi)]``: the ranges ``rank`` writes."""
    holders = defaultdict(list)  # (section, name, box) -> [(rank, index, lo, hi)]
    size = {}
    for r, pieces in enumerate(held):
        for i, (section, name, shape, dtype, box, lo, hi, esize) in enumerate(pieces):
            holders[(section, name, box)].append((r, i, lo, hi))
            size[(section, name, box)] = (numel(box[1]), esize)
    segments = []  # (bytes, key, a, b, [(rank, index)])
    for key in sorted(holders, key=repr):
        entries = holders[key]
        n, esize = size[key]
        cuts = sorted({0, n, *(e[2] for e in entries), *(e[3] for e in entries)})
        for a, b in zip(cuts, cuts[1:]):
            who = [(r, i) for r, i, lo, hi in entries if lo <= a and b <= hi]
            if not who:
                section, name, box = key
                raise ValueError(f"checkpoint: elements [{a}, {b}) of {section} tensor "
                                 f"{name!r} box {box} are held by no rank")
            segments.append(((b - a) * esize, repr(key), a, b, sorted(who)))
    segments.sort(key=lambda s: (-s[0], s[1], s[2]))
    load = defaultdict(int)
    mine = []
    for nbytes, _, a, b, who in segments:
        if nbytes >= SPLIT_BYTES * len(who):  # even parts, one per holder
            k = len(who)
            for j, (r, i) in enumerate(who):
                lo, hi = a + (b - a) * j // k, a + (b - a) * (j + 1) // k
                load[r] += (hi - lo) * nbytes // (b - a)
                if r == rank and lo < hi:
                    mine.append((i, lo, hi))
            continue
        r, i = min(who, key=lambda w: (load[w[0]], w[0]))
        load[r] += nbytes
        if r == rank:
            mine.append((i, a, b))
    return sorted(mine)


def missing_files(tmp: str, records: list) -> list[str]:
    """The ranks' files (as their records say) that are not in ``tmp`` with their size."""
    out = []
    for rank, rec in enumerate(records):
        if rec is None:
            continue
        path = os.path.join(tmp, rec["file"])
        if not os.path.isfile(path) or os.path.getsize(path) != rec["bytes"]:
            out.append(f"rank {rank}'s {rec['file']} is not in {tmp}")
    return out


def index(fmt: str, step: int, world: int, meta: dict, scalars: dict, records: list) -> dict:
    """The checkpoint's index from every rank's file record: each serial tensor's pieces."""
    tensors = {"model": {}, "optimizer": {}}
    file_info = {}
    for rank, rec in enumerate(records):
        if rec is None:
            continue
        file_info[rec["file"]] = {"bytes": rec["bytes"], "rank": rank}
        for sec, name, shape, dtype, box, key, digest in rec["pieces"]:
            entry = tensors[sec].setdefault(name, {"shape": list(shape), "dtype": dtype,
                                                   "pieces": []})
            entry["pieces"].append({"file": rec["file"], "key": key, "offsets": list(box[0]),
                                    "sizes": list(box[1]), "sha256": digest})
    for sec in tensors:
        tensors[sec] = dict(sorted(tensors[sec].items()))
        for entry in tensors[sec].values():
            entry["pieces"].sort(key=lambda p: p["offsets"])
    return {"format": fmt, "step": int(step), "world": world, "meta": meta,
            "optimizer_scalars": scalars, "tensors": tensors, "files": file_info}
