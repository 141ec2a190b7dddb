"""A run resumed from a pruned model: ``python -m fastpar.prune --save CKPT``'s checkpoint, or a
checkpoint of a run that started from one (both carry ``meta["pruned"]``). No flag gives a
pruned model's shape, so the run takes its model from the checkpoint: the config (the flags
choose only how it runs: sequence parallelism, overlap, recompute, context parallelism) and a
Hugging Face model's source (``meta["hf"]``: its config for export, its tokenizer's directory).

    meta = pruned_meta(args)          # --resume's metadata if its model is a pruned one
    cfg, info = pruned_source(meta, layout_fields)     # the GPTConfig, the HfInfo or None
    check_flags(p, args)              # flags that would give another shape: one line, exit 2

``fastpar.prune`` saves weights only, at step 0: the resume (``save_resume.Checkpoints``)
then starts a fresh optimizer and learning-rate schedule, and any seed and global batch
continue it (no batch has been drawn yet).
"""

from __future__ import annotations

import dataclasses
import os

# flags that give the model's shape (argparse dest, flag)
SHAPE_FLAGS = (("preset", "--preset"), ("hf_model", "--hf-model"), ("hf_config", "--hf-config"),
               ("seq_len", "--seq-len"), ("layers", "--layers"), ("hidden", "--hidden"),
               ("heads", "--heads"), ("kv_heads", "--kv-heads"),
               ("tie_embeddings", "--tie-embeddings"), ("moe_experts", "--moe-experts"))


def pruned_meta(args) -> dict | None:
    """The metadata of ``--resume``'s checkpoint when its model is a pruned one, else None (no
    ``--resume``, another checkpoint, or one that cannot be read: the resume says why)."""
    path = getattr(args, "resume", None)
    if not path:
        return None
    from fastpar.checkpoint import loading

    try:
        meta = loading.read_index(path)[1].get("meta") or {}
    except (OSError, ValueError, KeyError):
        return None
    return meta if "pruned" in meta else None


def pruned_source(meta: dict, layout_fields: dict):
    """``(GPTConfig, HfInfo or None)`` of a pruned checkpoint's ``meta``, with the run's
    ``layout_fields`` (``args._layout_fields``)."""
    from fastpar.models.config import GPTConfig
    from fastpar.models.hf import HfInfo

    cfg = dataclasses.replace(GPTConfig(**meta["model"]), **layout_fields)
    hf = meta.get("hf")
    info = HfInfo(hf["config"]["model_type"], hf["config"], hf["dtype"]) if hf else None
    return cfg, info


def hf_dir(args) -> str | None:
    """The Hugging Face model's directory (its tokenizer files): ``--hf-model``,
    ``--hf-config``'s folder, or a pruned checkpoint's source; None for fastpar's own GPT."""
    if args.hf_model or args.hf_config:
        return os.path.abspath(args.hf_model or os.path.dirname(args.hf_config))
    return ((pruned_meta(args) or {}).get("hf") or {}).get("files")


def check_flags(p, args) -> dict | None:
    """``p.error`` for a flag that gives the shape of a model resumed from a pruned checkpoint;
    returns ``pruned_meta(args)``."""
    meta = pruned_meta(args)
    if meta is not None:
        given = [flag for dest, flag in SHAPE_FLAGS if getattr(args, dest)]
        p.check(not given, f"{', '.join(given)} with --resume {args.resume}: a pruned model's "
                           "shape is its checkpoint's (python -m fastpar.prune --seq-len sets "
                           "its sequence length)")
    return meta
