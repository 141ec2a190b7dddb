"""A fastpar checkpoint of a Hugging Face model (trained with ``--hf-model`` or ``--hf-config``)
as a Hugging Face directory that ``from_pretrained`` loads, without ranks:

    export_hf("runs/a", "out", shard_bytes=2 << 30)   # python -m fastpar.checkpoint export --hf
    # out/config.json, out/model.safetensors (or model-0000i-of-0000n.safetensors and
    # model.safetensors.index.json), and the source directory's tokenizer files

Streamed: each Hugging Face tensor is assembled from the checkpoint's pieces of the GPT
parameters it is made of (``models.hf_weights.hf_plan``: at most GPT-2's fused q, k, v) when its
turn to be written comes, so the peak is about the largest tensor, not the model. Weights are
written in the source model's dtype (a bf16 checkpoint's float32 masters rounded once; a
float32 model's exactly). Every piece's sha256 is verified first; the directory appears whole
(written beside it, then renamed) or not at all.
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from fastpar.checkpoint import files, loading, store
from fastpar.checkpoint.boxes import numel
from fastpar.models.config import GPTConfig
from fastpar.models.hf import HfInfo, quantization_config
from fastpar.models.hf_weights import assemble, hf_plan

# What a Hugging Face directory holds besides the config and the weights, copied as it is.
QUANTIZED = (".qweight", ".scales", ".offsets")  # a quantized linear's tensors
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "generation_config.json", "chat_template.jinja")


def source_of(meta: dict) -> tuple[GPTConfig, HfInfo, str | None]:
    """``(GPTConfig, HfInfo, the source directory or None)`` from a checkpoint's meta."""
    hf = meta.get("hf") if isinstance(meta, dict) else None
    if not hf:
        raise ValueError("not a Hugging Face model's checkpoint (fastpar.train --hf-model or "
                         "--hf-config writes what export --hf needs)")
    return (GPTConfig(**meta["model"]), HfInfo(hf["config"]["model_type"], hf["config"],
                                                hf["dtype"], meta.get("weights")),
            hf.get("files"))


def export_hf(path: str, out: str, shard_bytes: int = 2 << 30, progress=None) -> dict:
    """Write checkpoint ``path`` (a directory of steps: its latest; or one step) as the Hugging
    Face directory ``out`` (which must not exist or be empty). Returns ``{"files", "bytes",
    "tensors", "peak_bytes"}``: ``peak_bytes``, the largest tensor assembled at once.
    ``progress(done, total)`` is called after each tensor."""
    directory = store.step_dir_of(path)
    _, index = loading.read_index(directory)
    cfg, info, source = source_of(index["meta"])
    problems = loading.check_files(directory, index) or \
        loading.verify_share(directory, index, 0, 1)
    if problems:
        raise ValueError(f"checkpoint {directory} is damaged: " + "; ".join(problems))
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"{out} exists and is not empty; not overwritten")
    dtype = getattr(torch, info.dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the model's dtype {info.dtype!r} is not a torch dtype")
    saved = index["tensors"]["model"]
    reader = files.Reader(directory)
    peak = [0]

    def full(name: str) -> torch.Tensor:
        if name not in saved:
            raise ValueError(f"checkpoint {directory} has no {name}")
        return loading.whole(directory, index, "model", name, reader).view(saved[name]["shape"])

    def maker(layer: int, parts: list, kind: torch.dtype):
        def make():
            t = assemble([(src, full(f"{layer}.{name}")) for name, src in parts]).to(kind)
            peak[0] = max(peak[0], t.nbytes * (1 + len(parts)))
            return t.reshape(-1)
        return make

    items = []  # (hf name, dtype, shape, make), in the model's order
    for layer in range(cfg.layers + 2):
        for hf_name, parts in hf_plan(cfg, info, layer):
            shapes = [tuple(saved[f"{layer}.{name}"]["shape"]) for name, _ in parts]
            shape = list(shapes[0][::-1] if parts[0][1].conv1d else shapes[0])
            if len(parts) > 1:  # fused: the parts side by side along the outputs
                shape[-1] = sum(s[0] if parts[0][1].conv1d else s[-1] for s in shapes)
            # a quantized linear's integers and scales keep their own dtypes
            kind = dtype if not hf_name.endswith(QUANTIZED) else \
                files.dtype_of(saved[f"{layer}.{parts[0][0]}"]["dtype"])
            items.append((hf_name, kind, tuple(shape), maker(layer, parts, kind)))
    tmp = f"{out.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        groups = _shards(items, shard_bytes)
        names = (["model.safetensors"] if len(groups) == 1 else
                 [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                  for i in range(len(groups))])
        total, written, weight_map = 0, 0, {}
        for name, group in zip(names, groups):
            counted = [(k, d, s, _counted(m, progress, written + i + 1, len(items)))
                       for i, (k, d, s, m) in enumerate(group)]
            total += files.write(os.path.join(tmp, name), counted, {"format": "pt"})["bytes"]
            written += len(group)
            weight_map.update({k: name for k, *_ in group})
        if len(groups) > 1:
            _json(os.path.join(tmp, "model.safetensors.index.json"),
                  {"metadata": {"total_size": sum(numel(s) * d.itemsize for _, d, s, _ in items)},
                   "weight_map": weight_map})
        config = {**info.config, "dtype": info.dtype}
        if info.weights:
            config["quantization_config"] = quantization_config(info.weights)
        _json(os.path.join(tmp, "config.json"), config)
        copied = [f for f in TOKENIZER_FILES
                  if source and os.path.isfile(os.path.join(source, f))]
        for f in copied:
            shutil.copyfile(os.path.join(source, f), os.path.join(tmp, f))
        if os.path.exists(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(tmp, out)
    finally:
        reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"files": names + copied, "bytes": total, "tensors": len(items),
            "peak_bytes": peak[0], "step": index["step"]}


def _shards(items: list, limit: int) -> list[list]:
    """Consecutive items in groups of at most ``limit`` bytes (a larger tensor alone)."""
    groups, size = [[]], 0
    for item in items:
        n = numel(item[2]) * item[1].itemsize
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += n
    return groups


def _counted(make, progress, done: int, total: int):
    def run():
        t = make()
        if progress is not None:
            progress(done, total)
        return t
    return run


def _json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
