"""Reading a sharded checkpoint: the index, its integrity, and this rank's slices.

    directory, index = read_index(path)          # a step directory or its parent (latest)
    problems = check_files(directory, index)     # every rank: missing or truncated files
    problems = verify_share(directory, index, rank, world)   # this rank's share of the hashes
    problems = compare(expected, index)          # names, shapes, dtypes against this layout
    fill(directory, index, pieces)               # each piece from the saved boxes it meets

Only ``json`` parses the index and only safetensors reads the files: nothing is unpickled.
"""

from __future__ import annotations

import json
import os

from fastpar.checkpoint import files, store
from fastpar.checkpoint.boxes import intersect, numel, range_boxes, shift, slices

FORMAT = "fastpar-sharded-v1"


def read_index(path) -> tuple[str, dict]:
    directory = store.resolve(path)
    if store.record_of(directory) != "index.json":
        raise ValueError(f"checkpoint {directory} is not sharded (it has meta.json): load it "
                         "with fastpar.training.checkpoint.load")
    try:
        with open(os.path.join(directory, "index.json"), "rb") as f:
            index = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ValueError(f"index.json: {exc}") from exc
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{directory}/index.json is not a {FORMAT} record")
    return directory, index


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
        sized.append((-nbytes, q["file"], q["key"], q["sha256"]))
    sized.sort()
    load, mine = [0] * world, {}
    for neg, fname, key, digest in sized:
        r = min(range(world), key=lambda j: (load[j], j))
        load[r] -= neg
        if r == rank:
            mine.setdefault(fname, []).append((key, digest))
    problems = []
    for fname, keys in sorted(mine.items()):
        problems += files.verify(os.path.join(directory, fname), keys)
    return problems


def compare(expected: dict, index: dict, limit: int = 8) -> list[str]:
    """``expected``: ``{(section, name): (shape, dtype name)}`` of this layout (every rank's).
    What differs from the checkpoint, by kind."""
    saved = {(sec, name): (tuple(e["shape"]), e["dtype"])
             for sec in ("model", "optimizer") for name, e in index["tensors"][sec].items()}
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


def fill(directory: str, index: dict, pieces) -> None:
    """Copy into each piece's ``data`` the saved values of its elements, reading only the
    slices of saved pieces that intersect it; every element must come from exactly one."""
    with files.Reader(directory) as reader:
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
