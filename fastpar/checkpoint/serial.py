"""Training checkpoints: written atomically, verified on load, read without unpickling.

Usage:

    path = save("runs/a", step, model=fastpar.full_state_dict(model),
                optimizer=flat_optimizer_tensors, meta={"model": dataclasses.asdict(cfg), ...})
    ckpt = load("runs/a")              # follows runs/a/latest; or load("runs/a/step_00000100")
    check_model_shapes({k: v.shape for k, v in serial_sd.items()}, ckpt.model, ckpt.path)

No RNG state is saved: ``fastpar.train`` draws its batches and dropout masks from streams seeded
by (seed, step), so a resumed run draws what the uninterrupted one would have.

Layout of a checkpoint directory:

    runs/a/latest                       "step_00000100\\n": always names a complete checkpoint
    runs/a/step_00000100/model.safetensors      serial-layout model tensors (any tp/pp/dp loads it)
    runs/a/step_00000100/optimizer.safetensors  flat name -> tensor
    runs/a/step_00000100/meta.json      {"format", "step", "files": {name: {"bytes", "sha256"}},
                                         "meta": the caller's JSON-serialisable dict}

save() writes everything into a hidden sibling `.tmp-step_XXXXXXXX-<pid>`, fsyncs the files and
the directory, renames it into place, then replaces `latest` (tmp file + fsync + os.replace). An
exception, Ctrl-C or a crash at any point leaves the previous checkpoint and `latest` intact;
leftover `.tmp-*` entries are removed by the next save. One process (rank 0) writes a directory.
By default the newest KEEP = 3 step directories are kept; `keep=None` keeps all.
"""

import dataclasses
import hashlib
import json
import os
import shutil

import torch

from fastpar.checkpoint import store

FORMAT = "fastpar-checkpoint-v1"
KEEP = store.KEEP
FILES = ("model.safetensors", "optimizer.safetensors")


def _safetensors():
    try:
        import safetensors.torch
    except ImportError as exc:  # not a hard dependency of fastpar's communication layers
        raise ImportError("fastpar checkpoints need safetensors: pip install safetensors") from exc
    return safetensors.torch


@dataclasses.dataclass
class Checkpoint:
    step: int
    model: dict        # name -> CPU tensor, serial layout
    optimizer: dict    # name -> CPU tensor
    meta: dict         # what the caller passed to save()
    path: str          # the step directory


def _serialize(tensors, what):
    """name -> tensor  ->  safetensors bytes (CPU, contiguous; tied tensors stored twice)."""
    cpu, seen = {}, set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{what}[{name!r}] is a {type(t).__name__}, not a tensor")
        t = t.detach().to("cpu").contiguous()
        key = t.untyped_storage().data_ptr()
        if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()  # safetensors refuses tensors that share storage
        seen.add(key)
        cpu[name] = t
    return _safetensors().save(cpu)


def _json_path(obj, where="meta"):
    """The first key path in obj that JSON cannot encode faithfully, for the error message."""
    if isinstance(obj, dict):
        items = obj.items()
        bad = next((f"{where} key {k!r}" for k in obj if not isinstance(k, str)), None)
    elif isinstance(obj, (list, tuple)):
        items, bad = enumerate(obj), None
    else:
        ok = isinstance(obj, (str, int, float, bool, type(None)))
        return None if ok else f"{where} ({type(obj).__name__})"
    return bad or next(filter(None, (_json_path(v, f"{where}[{k!r}]") for k, v in items)), None)


def save(dir, step, *, model, optimizer, meta, keep=KEEP):
    """Write checkpoint `dir/step_{step:08d}` and point `dir/latest` at it; returns its path.

    `model` and `optimizer` map names to tensors (any device; saved as contiguous CPU copies),
    `meta` is JSON-serialisable (str keys; tuples come back as lists). An existing step
    directory is never overwritten (ValueError). Tensors that share storage (tied weights) are
    stored once per name. Peak host memory is about twice the serialised size.
    """
    step = int(step)
    if step < 0 or (keep is not None and int(keep) < 1):
        raise ValueError(f"save needs step >= 0 and keep >= 1 (or None), got step {step}, "
                         f"keep {keep}")
    bad = _json_path(meta)
    if bad:
        raise ValueError(f"checkpoint meta must be JSON-serialisable; {bad} is not")
    os.makedirs(dir, exist_ok=True)
    store.clean(dir)  # leftovers of interrupted saves
    name = store.step_name(step)
    store.check_new(dir, step)
    blobs = {"model.safetensors": _serialize(model, "model"),
             "optimizer.safetensors": _serialize(optimizer, "optimizer")}
    files = {f: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
             for f, b in blobs.items()}
    record = json.dumps({"format": FORMAT, "step": step, "files": files, "meta": meta}, indent=1)
    tmp = os.path.join(dir, f".tmp-{name}-{os.getpid()}")
    try:
        os.mkdir(tmp)
        for fname, blob in blobs.items():
            store.write_file(os.path.join(tmp, fname), blob)
        store.write_file(os.path.join(tmp, "meta.json"), record.encode())  # last: complete
        return store.publish(dir, tmp, step, keep)
    except BaseException:  # includes KeyboardInterrupt: the partial tmp dir goes, then re-raise
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read_verified(path, fname, want):
    """The bytes of path/fname, checked against meta.json's size and sha256."""
    bad = f"checkpoint {path} is incomplete or corrupt: "
    if not isinstance(want, dict) or not {"bytes", "sha256"} <= set(want):
        raise ValueError(f"{bad}meta.json has no size and sha256 for {fname}")
    if not os.path.isfile(os.path.join(path, fname)):
        raise ValueError(f"{bad}{fname} is missing")
    with open(os.path.join(path, fname), "rb") as f:
        data = f.read()
    if len(data) != want["bytes"]:
        raise ValueError(f"{bad}{fname} has {len(data)} bytes, meta.json says {want['bytes']}")
    digest = hashlib.sha256(data).hexdigest()
    if digest != want["sha256"]:
        raise ValueError(f"{bad}{fname} has sha256 {digest[:16]}..., meta.json says "
                         f"{want['sha256'][:16]}...")
    return data


def load(path):
    """Read and verify a checkpoint -> Checkpoint(step, model, optimizer, meta, path).

    `path` is a step directory or a directory save() wrote into. Each file's size and sha256
    are checked against meta.json; nothing is unpickled (safetensors + JSON).
    """
    path, record = store.read_record(path, "meta.json", FORMAT, "it is sharded: load it with "
                                     "fastpar.checkpoint (fastpar.train --resume does)")
    tensors = {}
    for fname in FILES:
        data = _read_verified(path, fname, record.get("files", {}).get(fname))
        try:
            tensors[fname] = _safetensors().load(data)
        except Exception as exc:
            raise ValueError(f"checkpoint {path}: {fname} is not valid safetensors: {exc}") from exc
    return Checkpoint(step=int(record["step"]), model=tensors["model.safetensors"],
                      optimizer=tensors["optimizer.safetensors"], meta=record["meta"], path=path)


def check_model_shapes(expected, got, where, limit=10):
    """ValueError unless `got` (name -> tensor) has exactly the keys and shapes of `expected`
    (name -> torch.Size or tuple); the message lists the first `limit` of each kind."""
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = [f"{k} (model {tuple(expected[k])}, checkpoint {tuple(got[k].shape)})"
             for k in sorted(set(expected) & set(got))
             if tuple(expected[k]) != tuple(got[k].shape)]
    parts = []
    for label, items in (("missing keys", missing), ("unexpected keys", unexpected),
                         ("shape mismatches", wrong)):
        if items:
            more = f", ... and {len(items) - limit} more" if len(items) > limit else ""
            parts.append(f"{len(items)} {label}: {', '.join(items[:limit])}{more}")
    if parts:
        raise ValueError(f"checkpoint {where} was saved from a different model: "
                         + "; ".join(parts))
