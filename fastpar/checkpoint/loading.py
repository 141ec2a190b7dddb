"""Reading a sharded checkpoint: the index, its integrity, and this rank's slices.

    directory, index = read_index(path)          # a step directory or its parent (latest)
    problems = check_files(directory, index)     # every rank: missing or truncated files
    problems = verify_share(directory, index, rank, world)   # this rank's share of the hashes
    problems = compare(expected, index)          # names, shapes, dtypes against this layout
    fill(directory, index, pieces)               # each piece from the saved boxes it meets

Only ``json`` parses the index and only safetensors reads the files: nothing is unpickled.
"""

from __future__ import annotations

import contextlib
import os

import torch

from fastpar.checkpoint import files, store
from fastpar.checkpoint.boxes import intersect, numel, range_boxes, shift, slices
from fastpar.checkpoint.holdings import Piece

FORMAT = "fastpar-sharded-v1"


def open_index(path) -> tuple[str, dict]:
    """``read_index``, then the index's own consistency and the files' sizes; ValueError."""
    directory, index = read_index(path)
    raise_if(check_index(index) + check_files(directory, index))
    return directory, index


def trainer_checkpoint(path) -> tuple[str, dict, dict]:
    """``(step directory, index, meta)`` of a checkpoint of ``python -m fastpar.train`` (or of
    the commands that write its kind: fastpar.prune, fastpar.quantize); ValueError naming the
    path for any other."""
    directory, index = open_index(path)
    meta = index.get("meta") or {}
    if "model" not in meta:
        raise ValueError(f"{directory} is not a checkpoint of python -m fastpar.train")
    return directory, index, meta


def stored_dtype(index: dict) -> torch.dtype:
    """The dtype the model's float tensors were saved in (float32 where they differ)."""
    kinds = {e["dtype"] for e in index["tensors"]["model"].values()} - {"int8", "uint8"}
    return files.dtype_of(kinds.pop()) if len(kinds) == 1 else torch.float32


def raise_if(problems: list[str], what: str | None = None) -> None:
    if problems:
        raise ValueError((f"{what}: " if what else "") + "; ".join(problems))


def read_index(path) -> tuple[str, dict]:
    return store.read_record(path, "index.json", FORMAT, "a serial checkpoint loads with "
                             "fastpar.checkpoint.serial.load")


def check_index(index: dict) -> list[str]:
    """The index agrees with itself: each piece's key names its tensor and box, and a tensor's
    boxes lie inside it, do not overlap and cover it (so no edit can move or drop a piece)."""
    problems = []
    for section in ("model", "optimizer"):
        for name, e in index["tensors"][section].items():
            shape, boxes = tuple(e["shape"]), []
            for q in e["pieces"]:
                offs, sizes = tuple(q["offsets"]), tuple(q["sizes"])
                if q["key"] != f"{section}/{name}@{','.join(map(str, offs))}":
                    problems.append(f"piece {q['key']} is listed under {section} tensor {name!r}")
                if len(offs) != len(shape) or len(sizes) != len(shape) or any(
                        o < 0 or o + n > d for o, n, d in zip(offs, sizes, shape)):
                    problems.append(f"{section} tensor {name!r}: box {offs} {sizes} is outside "
                                    f"its shape {shape}")
                boxes.append((offs, sizes))
            overlap = _overlap(boxes)
            total = sum(numel(b[1]) for b in boxes)
            if overlap is not None:
                problems.append(f"{section} tensor {name!r}: pieces {overlap[0]} and "
                                f"{overlap[1]} overlap")
            elif total != numel(shape):
                problems.append(f"{section} tensor {name!r}: its pieces hold {total} of its "
                                f"{numel(shape)} elements")
            if len(problems) >= 8:
                return problems
    return problems


def _overlap(boxes):
    """Two boxes that overlap, or None: a sweep along dim 0 compares each box only with those
    whose rows it meets (row bands, the usual pieces, meet few)."""
    active = []
    for box in sorted(boxes, key=lambda b: b[0][:1]):
        lo = box[0][0] if box[0] else 0
        active = [a for a in active if not a[0] or a[0][0] + a[1][0] > lo]
        hit = next((a for a in active if intersect(a, box) is not None), None)
        if hit is not None:
            return hit, box
        active.append(box)
    return None


def check_files(directory: str, index: dict) -> list[str]:
    """Every file the index names is there with its size."""
    problems = []
    for fname, info in sorted(index["files"].items()):
        path = os.path.join(directory, fname)
        if not os.path.isfile(path):
            problems.append(f"{fname} (rank {info['rank']}'s part) is missing")
        elif os.path.getsize(path) != info["bytes"]:
            problems.append(f"{fname} (rank {info['rank']}'s part) has "
                            f"{os.path.getsize(path)} bytes, the index says {info['bytes']} "
                            "(truncated or replaced)")
    return problems


def _pieces(index: dict):
    """``(section, name, dtype, piece)`` of every saved piece, in a fixed order."""
    for section in ("model", "optimizer"):
        for name, entry in index["tensors"][section].items():
            for q in entry["pieces"]:
                yield section, name, entry["dtype"], q


def verify_share(directory: str, index: dict, rank: int, world: int) -> list[str]:
    """Re-hash the pieces that fall to ``rank``: each piece to the least-loaded rank, largest
    first, so the ranks read about equal bytes and every piece is read once."""
    sized = []
    for section, name, dtype, q in _pieces(index):
        nbytes = numel(q["sizes"]) * files.dtype_of(dtype).itemsize
        sized.append((-nbytes, q["file"], q["key"], q["sha256"], dtype, q["sizes"]))
    sized.sort()
    load, mine = [0] * world, {}
    for neg, fname, key, digest, dtype, sizes in sized:
        r = min(range(world), key=lambda j: (load[j], j))
        load[r] -= neg
        if r == rank:
            mine.setdefault(fname, []).append((key, digest, dtype, sizes))
    problems = []
    for fname, keys in sorted(mine.items()):
        problems += files.verify(os.path.join(directory, fname), keys)
    return problems


def compare(expected: dict, index: dict, limit: int = 8,
            sections=("model", "optimizer")) -> list[str]:
    """``expected``: ``{(section, name): (shape, dtype name)}`` of this layout (every rank's).
    What differs from the checkpoint's ``sections``, by kind."""
    saved = {(sec, name): (tuple(e["shape"]), e["dtype"])
             for sec in sections for name, e in index["tensors"][sec].items()}
    out = []
    kinds = (("missing from the checkpoint", sorted(set(expected) - set(saved))),
             ("in the checkpoint but not in this model", sorted(set(saved) - set(expected))))
    for label, keys in kinds:
        if keys:
            names = ", ".join(f"{s}:{n}" for s, n in keys[:limit])
            more = f", ... and {len(keys) - limit} more" if len(keys) > limit else ""
            out.append(f"{len(keys)} tensors {label}: {names}{more}")
    wrong = [f"{s}:{n} (checkpoint {saved[(s, n)][0]} {saved[(s, n)][1]}, this run "
             f"{expected[(s, n)][0]} {expected[(s, n)][1]})"
             for s, n in sorted(set(saved) & set(expected)) if saved[(s, n)] != expected[(s, n)]]
    if wrong:
        more = f", ... and {len(wrong) - limit} more" if len(wrong) > limit else ""
        out.append(f"{len(wrong)} shape or dtype mismatches: {', '.join(wrong[:limit])}{more}")
    return out


def whole(directory: str, index: dict, section: str, name: str, reader=None):
    """Saved tensor ``name`` of ``section`` ("model", "optimizer") assembled from its pieces,
    flat, in its saved dtype (an export's one tensor at a time)."""
    e = index["tensors"][section][name]
    shape = tuple(e["shape"])
    data = torch.empty(numel(shape), dtype=files.dtype_of(e["dtype"]))
    fill(directory, index, [Piece(section, name, shape, ((0,) * len(shape), shape), 0,
                                  numel(shape), data)], reader)
    return data


def fill(directory: str, index: dict, pieces, reader: files.Reader | None = None) -> None:
    """Copy into each piece's ``data`` the saved values of its elements, reading only the
    slices of saved pieces that intersect it; every element must come from exactly one.
    ``reader``: files already open (an export fills one tensor at a time)."""
    with contextlib.nullcontext(reader) if reader is not None else \
            files.Reader(directory) as reader:
        for p in pieces:
            entry = index["tensors"][p.section][p.name]
            saved = [((tuple(q["offsets"]), tuple(q["sizes"])), q) for q in entry["pieces"]]
            for start, sub in range_boxes(p.box[1], p.lo, p.hi):
                serial = shift(sub, p.box[0])
                n = numel(sub[1])
                dest = p.data[start:start + n].view(sub[1])
                covered = 0
                for box, q in saved:
                    inter = intersect(serial, box)
                    if inter is None:
                        continue
                    part = reader.read(q["file"], q["key"], slices(inter, box))
                    dest[slices(inter, serial)].copy_(part)
                    covered += numel(inter[1])
                if covered != n:
                    raise ValueError(f"checkpoint {directory}: {p.section} tensor {p.name!r} "
                                     f"box {serial} has {covered} of its {n} elements saved "
                                     "(pieces missing or overlapping)")


def refresh_params(opt) -> None:
    """The parameters from the masters a load just set (ZeRO: collective over dp)."""
    if hasattr(opt, "refresh_params"):
        opt.refresh_params()


def replica_digest(model, opt) -> tuple[str, str]:
    """``(the shards this rank holds, sha256 of every tensor it holds whole)``: ranks with the
    same keys and boxes are replicas (dp ranks of one tp/pp shard, whatever the groups); a
    released ZeRO-3 parameter is not held whole."""
    import hashlib

    from fastpar.checkpoint.holdings import keyed_tensors

    released = getattr(opt, "sharded", None) is not None
    h, shards = hashlib.sha256(), []
    for key, t, _, box in keyed_tensors(model):
        shards.append((key, box))
        if released and t.requires_grad:
            continue
        h.update(key.encode())
        h.update(files.tensor_bytes(t.detach().contiguous().reshape(-1), 0,
                              t.numel() * t.element_size()))
    return repr(sorted(shards)), h.hexdigest()


def replicas_differ(seen: list[tuple[str, str]]) -> list[str]:
    """Every rank's ``replica_digest``: the groups of replicas whose bytes differ."""
    by_shard = {}
    for rank, (shard, d) in enumerate(seen):
        by_shard.setdefault(shard, {}).setdefault(d, []).append(rank)
    return [" vs ".join(f"ranks {','.join(map(str, r))}" for r in groups.values())
            for groups in by_shard.values() if len(groups) > 1][:3]
