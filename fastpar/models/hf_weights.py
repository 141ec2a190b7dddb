"""Hugging Face weights in and out of fastpar's GPT layers (``fastpar.models.gpt``), tensor by
tensor: each rank reads only the tensors of the layers it builds, and only their full form (its
shard cut here), and export yields one full tensor at a time.

    reader = fastpar.hf_files.SafetensorsReader("llama-dir")
    load_layer(module, index, cfg, info, reader)      # layer `index` of gpt_layers(cfg)
    for name, tensor in hf_tensors(index, full, cfg, info): ...   # its Hugging Face tensors

Names: a GPT layer ``index`` (0 the embedding, 1..L the blocks, L + 1 the head) has the
parameters of ``gpt.py``; ``sources`` gives, for each, the Hugging Face tensor it comes from
and how: as it is (Llama, Mistral, Qwen2, Qwen3), transposed (GPT-2's Conv1D weights, stored
(in, out)), or a third of GPT-2's fused ``c_attn`` (q, k, v side by side along its outputs).
A tied head reads the embedding's tensor and export writes none for it. Buffers that are not
parameters (GPT-2's old ``attn.bias`` masks) are not read.
"""

from __future__ import annotations

import dataclasses

import torch

from fastpar.models.config import GPTConfig
from fastpar.models.gpt import gpt_layers
from fastpar.models.hf import HfInfo
from fastpar.nn.quantized import quantize_weights
from fastpar.nn.sharding import ShardedModule, copy_into


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a GPT parameter's full tensor lies in a Hugging Face checkpoint: tensor ``name``,
    transposed (``conv1d``: GPT-2 stores its linear weights (in, out)), and of a fused
    projection only outputs ``part`` = (start, stop)."""

    name: str
    conv1d: bool = False
    part: tuple[int, int] | None = None


def sources(cfg: GPTConfig, info: HfInfo, index: int) -> dict[str, Source]:
    """Each parameter of GPT layer ``index`` (its name in the layer) -> its ``Source``; of a
    quantized model (``info.weights``) each linear's integers and scales in place of its
    weight (``_quantized``)."""
    table = _float_sources(cfg, info, index)
    return _quantized(table, cfg, info) if info.weights else table


def _quantized(table: dict[str, Source], cfg: GPTConfig, info: HfInfo) -> dict[str, Source]:
    """The float table with every linear weight (``*_proj.weight``, an untied head's
    ``out.weight``: what ``fastpar.quantize_weights`` quantizes) as its ``qweight``,
    ``scales`` and (int4) ``offsets``, stored as fastpar holds them: (out, in) and (groups,
    out)."""
    parts = ("qweight", "scales") + (("offsets",) if info.weights["format"] == "int4" else ())
    out = {}
    for name, src in table.items():
        linear = name.endswith("_proj.weight") or (name == "out.weight" and
                                                   not cfg.tie_embeddings)
        if not linear:
            out[name] = src
            continue
        if src.conv1d or src.part is not None:
            raise ValueError(f"{info.model_type}: fastpar's quantized format is written for "
                             "Llama-family models (no Conv1D or fused projections)")
        stem, theirs = name.removesuffix(".weight"), src.name.removesuffix(".weight")
        out.update({f"{stem}.{part}": Source(f"{theirs}.{part}") for part in parts})
    return out


def _float_sources(cfg: GPTConfig, info: HfInfo, index: int) -> dict[str, Source]:
    gpt2 = info.model_type == "gpt2"
    top = "transformer." if gpt2 else "model."
    embedding = top + ("wte.weight" if gpt2 else "embed_tokens.weight")
    if index == 0:
        out = {"tok.weight": Source(embedding)}
        if gpt2:
            out["pos.weight"] = Source("transformer.wpe.weight")
        return out
    if index == cfg.layers + 1:
        norm = "transformer.ln_f" if gpt2 else "model.norm"
        out = {"norm.weight": Source(norm + ".weight"),
               "out.weight": Source(embedding if cfg.tie_embeddings else "lm_head.weight")}
        if gpt2:
            out["norm.bias"] = Source(norm + ".bias")
        return out
    return _gpt2_block(cfg, index - 1) if gpt2 else _llama_block(cfg, index - 1)


def _llama_block(cfg: GPTConfig, j: int) -> dict[str, Source]:
    p = f"model.layers.{j}."
    out = {"norm1.weight": Source(p + "input_layernorm.weight"),
           "norm2.weight": Source(p + "post_attention_layernorm.weight")}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        out[f"attn.{proj}.weight"] = Source(f"{p}self_attn.{proj}.weight")
    if cfg.qkv_bias:
        for proj in ("q_proj", "k_proj", "v_proj"):
            out[f"attn.{proj}.bias"] = Source(f"{p}self_attn.{proj}.bias")
    if cfg.qk_norm:
        for norm in ("q_norm", "k_norm"):
            out[f"attn.{norm}.weight"] = Source(f"{p}self_attn.{norm}.weight")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out[f"mlp.{proj}.weight"] = Source(f"{p}mlp.{proj}.weight")
    return out


def _gpt2_block(cfg: GPTConfig, j: int) -> dict[str, Source]:
    p, h = f"transformer.h.{j}.", cfg.hidden
    out = {}
    for ours, theirs in (("norm1", "ln_1"), ("norm2", "ln_2")):
        for kind in ("weight", "bias"):
            out[f"{ours}.{kind}"] = Source(f"{p}{theirs}.{kind}")
    for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
        part = (i * h, (i + 1) * h)
        out[f"attn.{proj}.weight"] = Source(p + "attn.c_attn.weight", True, part)
        out[f"attn.{proj}.bias"] = Source(p + "attn.c_attn.bias", False, part)
    for ours, theirs in (("attn.o_proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"),
                         ("mlp.fc2", "mlp.c_proj")):
        out[f"{ours}.weight"] = Source(f"{p}{theirs}.weight", True)
        out[f"{ours}.bias"] = Source(f"{p}{theirs}.bias")
    return out


def read(reader, src: Source) -> torch.Tensor:
    """The full GPT tensor of ``src`` (float32 copies are the caller's business)."""
    t = reader.get(src.name)
    if src.part is not None:  # outputs are the last dim of a Conv1D weight, the only of a bias
        t = t[..., src.part[0]:src.part[1]]
    return t.t() if src.conv1d else t


def load_layer(module: torch.nn.Module, index: int, cfg: GPTConfig, info: HfInfo,
               reader) -> torch.nn.Module:
    """Give layer ``index`` (built by ``gpt_layers(cfg)``, any tp) the checkpoint's values:
    each parameter its shard of the full tensor, in the parameter's dtype. Raises naming any
    parameter without a source or any source of the wrong shape. A layer on meta stays."""
    table = sources(cfg, info, index)
    seen = set()
    for prefix, owner in module.named_modules():
        # a quantized layer's integers and scales are buffers; other buffers are not weights
        stored = [(n, b) for n, b in owner.named_buffers(recurse=False)
                  if (f"{prefix}.{n}" if prefix else n) in table]
        for name, p in list(owner.named_parameters(recurse=False)) + stored:
            full_name = f"{prefix}.{name}" if prefix else name
            if p.is_meta:
                return module
            if full_name not in table:
                raise ValueError(f"layer {index}: parameter {full_name} has no Hugging Face "
                                 f"source for {info.model_type}")
            full = read(reader, table[full_name])
            sharded = isinstance(owner, ShardedModule)
            want = tuple(owner.full_shape(name)) if sharded else tuple(p.shape)
            if tuple(full.shape) != want:
                raise ValueError(f"layer {index}: {table[full_name].name} has shape "
                                 f"{tuple(full.shape)}, {full_name} needs {want}")
            copy_into(p, owner.shard_full(name, full) if sharded else full)
            seen.add(full_name)
    missing = set(table) - seen
    if missing:
        raise ValueError(f"layer {index}: the model has no {', '.join(sorted(missing))}")
    return module


def hf_plan(cfg: GPTConfig, info: HfInfo, index: int) -> list[tuple[str, list]]:
    """The Hugging Face tensors of GPT layer ``index``, each with the ``(parameter name,
    Source)`` pairs it is made of (``assemble`` makes it); a tied head has none."""
    grouped: dict[str, list] = {}
    for name, src in sources(cfg, info, index).items():
        if index == cfg.layers + 1 and name == "out.weight" and cfg.tie_embeddings:
            continue
        grouped.setdefault(src.name, []).append((name, src))
    return list(grouped.items())


def assemble(parts: list[tuple[Source, torch.Tensor]]) -> torch.Tensor:
    """A Hugging Face tensor from its GPT parts (``(Source, full tensor)``, as ``hf_plan``
    lists them): transposed back, and a fused projection's parts side by side."""
    pieces = [(src.part, t.t() if src.conv1d else t) for src, t in parts]
    if pieces[0][0] is None:
        return pieces[0][1].contiguous()
    pieces.sort(key=lambda piece: piece[0][0])
    return torch.cat([t for _, t in pieces], dim=-1).contiguous()


def hf_tensors(index: int, full: dict[str, torch.Tensor], cfg: GPTConfig,
               info: HfInfo) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of GPT layer ``index`` from its full parameters ``full`` (name
    in the layer -> tensor)."""
    return [(hf_name, assemble([(src, full[name]) for name, src in parts]))
            for hf_name, parts in hf_plan(cfg, info, index)]


def hf_layers(cfg: GPTConfig, info: HfInfo, reader, **kwargs) -> list:
    """``gpt_layers(cfg, **kwargs)``'s factories, each layer given the checkpoint's values as it
    is built: a pipeline stage reads only its own layers' tensors."""
    def loaded(factory, index):
        def make():
            layer = factory()
            if info.weights:  # the quantized structure (collective over tp; none on meta),
                # then the stored values
                quantize_weights(layer, info.weights["format"], info.weights["group_size"])
            return load_layer(layer, index, cfg, info, reader)
        return make

    return [loaded(f, i) for i, f in enumerate(gpt_layers(cfg, **kwargs))]
