"""Inspect and export checkpoints without launching ranks.

    python -m fastpar.checkpoint inspect runs/a                  # steps, layout, tensors, sizes
    python -m fastpar.checkpoint inspect runs/a/step_00000100 --verify --json
    python -m fastpar.checkpoint export runs/a model.safetensors # the serial model, one file
    python -m fastpar.checkpoint export runs/a all.safetensors --optimizer
    python -m fastpar.checkpoint export --hf out-dir runs/a      # a Hugging Face directory

``export`` writes the serial layout under the model's own names (the GPT's, for the trainer's
checkpoints), float32 weights of record (a bf16 run's masters), one tensor assembled at a time
from its pieces, so it needs the memory of the largest tensor, not of the model; every piece's
sha256 is verified first. ``--optimizer`` adds the optimizer state as ``"<name>:<kind>"``.
Both commands read the serial format of earlier releases too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


from fastpar.checkpoint import files, loading, store
from fastpar.checkpoint.hf_export import export_hf
from fastpar.checkpoint.boxes import numel

MiB = 2**20


def _serial_record(directory: str) -> dict:
    """An index-shaped description of a serial-format checkpoint (headers only)."""
    from safetensors import safe_open

    with open(os.path.join(directory, "meta.json")) as f:
        record = json.load(f)
    tensors = {}
    for section, fname in (("model", "model.safetensors"), ("optimizer", "optimizer.safetensors")):
        tensors[section] = {}
        with safe_open(os.path.join(directory, fname), "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                dtype = files.NAMES[sl.get_dtype()]
                shape = list(sl.get_shape())
                tensors[section][key] = {"shape": shape, "dtype": files.dtype_name(dtype),
                                         "pieces": [{"file": fname, "key": key,
                                                     "offsets": [0] * len(shape),
                                                     "sizes": shape}]}
    return {"format": record["format"], "step": record["step"], "meta": record["meta"],
            "tensors": tensors, "world": 1,
            "files": {k: {"bytes": v["bytes"], "rank": 0} for k, v in record["files"].items()},
            "optimizer_scalars": record["meta"].get("optimizer_scalars", {})}


def describe(path: str) -> tuple[str, dict, list[int]]:
    """``(step directory, index, every step under the parent)``."""
    directory = store.step_dir_of(path)
    parent = os.path.dirname(directory.rstrip(os.sep))
    steps = sorted(store.step_dirs(parent)) if os.path.isdir(parent) else []
    if store.record_of(directory) == "index.json":
        return directory, loading.read_index(directory)[1], steps
    return directory, _serial_record(directory), steps


def damage(directory: str, index: dict) -> list[str]:
    """What is wrong with the files (sizes, then every piece's sha256); empty if nothing."""
    if index["format"] == loading.FORMAT:
        return loading.check_files(directory, index) or \
            loading.verify_share(directory, index, 0, 1)
    from fastpar.checkpoint import serial

    try:
        serial.load(directory)  # the serial format verifies whole files as it reads them
    except ValueError as exc:
        return [str(exc)]
    return []


def _nbytes(entry: dict) -> int:
    return numel(entry["shape"]) * files.dtype_of(entry["dtype"]).itemsize


def inspect(args) -> int:
    directory, index, steps = describe(args.path)
    problems = damage(directory, index) if args.verify else None
    if args.json:
        print(json.dumps({"path": directory, "steps": steps, "index": index,
                          "problems": problems}, indent=1))
        return 1 if problems else 0
    meta = index["meta"] if isinstance(index["meta"], dict) else {}
    meta = {**index.get("written_by", {}), **meta}  # the saver's words first
    lay = meta.get("layout", {})
    lay = lay if isinstance(lay, dict) else {"layout": lay}
    print(f"checkpoint {directory} ({index['format']})")
    if steps:
        print(f"steps here: {', '.join(map(str, steps))}")
    where = ", ".join(f"{k} {v}" for k, v in lay.items()) or "unknown layout"
    total = sum(i["bytes"] for i in index["files"].values())
    print(f"step {index['step']}: written by {index['world']} rank(s) under {where}, "
          f"dtype {meta.get('dtype', '?')}; {len(index['files'])} files, {total / MiB:.2f} MiB")
    for section in ("model", "optimizer"):
        ts = index["tensors"][section]
        size = sum(_nbytes(e) for e in ts.values())
        elems = sum(numel(e["shape"]) for e in ts.values())
        print(f"{section}: {len(ts)} tensors, {elems:,} elements, {size / MiB:.2f} MiB")
    if index.get("optimizer_scalars"):
        print("optimizer scalars: " + ", ".join(f"{k} {v:g}" for k, v in
                                               index["optimizer_scalars"].items()))
    if args.tensors:
        print(f"{'tensor':<48} {'shape':<16} {'dtype':<9} pieces")
        for section in ("model", "optimizer"):
            for name, e in index["tensors"][section].items():
                label = name if section == "model" else f"[opt] {name}"
                print(f"{label:<48} {str(tuple(e['shape'])):<16} {e['dtype']:<9} "
                      f"{len(e['pieces'])}")
    if problems is not None:
        print("verified: every piece's sha256 matches" if not problems else
              "DAMAGED: " + "; ".join(problems))
    return 1 if problems else 0


def export(args) -> int:
    directory, index, _ = describe(args.path)
    problems = damage(directory, index)
    if problems:
        print(f"export: checkpoint {directory} is damaged: " + "; ".join(problems),
              file=sys.stderr)
        return 1
    if os.path.exists(args.out):
        print(f"export: {args.out} exists; not overwritten", file=sys.stderr)
        return 1
    sections = ("model", "optimizer") if args.optimizer else ("model",)
    items = []
    reader = files.Reader(directory)  # each file opened once for every tensor
    for section in sections:
        for name, e in index["tensors"][section].items():
            def make(section=section, name=name):
                return loading.whole(directory, index, section, name, reader)
            items.append((name, files.dtype_of(e["dtype"]), tuple(e["shape"]), make))
    tmp = f"{args.out}.tmp-{os.getpid()}"
    try:
        out = files.write(tmp, items, {"format": "fastpar-serial-export",
                                       "step": index["step"], "source": directory})
        os.link(tmp, args.out)  # fails rather than replace a file that appeared meanwhile
    finally:
        reader.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"exported step {index['step']} of {directory}: {len(items)} tensors, "
          f"{out['bytes'] / MiB:.2f} MiB -> {args.out}")
    return 0


def export_to_hf(args) -> int:
    def progress(done, total):
        if done == total or done % 50 == 0:
            print(f"export: {done}/{total} tensors", file=sys.stderr, flush=True)

    if not args.shard_mb > 0:
        raise ValueError(f"--shard-mb must be > 0, got {args.shard_mb}")
    out = export_hf(args.path, args.hf, int(args.shard_mb * MiB), progress)
    print(f"exported step {out['step']} of {args.path} to {args.hf}: {out['tensors']} "
          f"tensors in {', '.join(out['files'])}, {out['bytes'] / MiB:.2f} MiB (peak "
          f"{out['peak_bytes'] / MiB:.2f} MiB assembled at once)")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastpar.checkpoint", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="steps, layout, tensors and sizes of a checkpoint")
    i.add_argument("path", help="a checkpoint directory (its latest) or one step_* in it")
    i.add_argument("--tensors", action="store_true", help="list every tensor")
    i.add_argument("--verify", action="store_true", help="check every piece's sha256")
    i.add_argument("--json", action="store_true", help="the index and what was found, as JSON")
    e = sub.add_parser("export", help="one serial-layout safetensors file, or (--hf DIR) a "
                       "Hugging Face directory")
    e.add_argument("path", help="a checkpoint directory (its latest) or one step_* in it")
    e.add_argument("out", nargs="?", help="the .safetensors file to write (must not exist)")
    e.add_argument("--optimizer", action="store_true", help="also the optimizer state")
    e.add_argument("--hf", metavar="DIR", default=None,
                   help="a Hugging Face model's checkpoint (fastpar.train --hf-model or "
                        "--hf-config): write DIR for from_pretrained (config.json, "
                        "safetensors, the source's tokenizer files)")
    e.add_argument("--shard-mb", type=float, default=2048,
                   help="--hf: safetensors files of at most this many MiB (a larger tensor "
                        "alone)")
    args = p.parse_args(argv)
    if args.command == "export" and (args.hf is None) == (args.out is None):
        p.error("export: give OUT (one safetensors file) or --hf DIR, one of them")
    try:
        if args.command == "export" and args.hf is not None:
            return export_to_hf(args)
        return inspect(args) if args.command == "inspect" else export(args)
    except (OSError, ValueError) as exc:
        print(f"python -m fastpar.checkpoint {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
