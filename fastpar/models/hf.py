"""Hugging Face causal-LM configs as fastpar GPT configs: the architectures fastpar's GPT
learns, and a refusal for anything it cannot honour.

    cfg, info = hf_config(read_hf_config("llama-dir"), seq_len=512)   # GPTConfig, HfInfo
    cfg.validate(tp=2)

Architectures (``ARCHITECTURES``, by ``model_type``): Llama (Llama 3's rope scaling too),
Mistral, Qwen2 (biases on q, k, v), Qwen3 (q/k norms, its own head_dim) and GPT-2 (LayerNorm,
GELU's tanh form, learned positions, biases, tied embeddings). Another ``model_type`` is refused
naming it and the list; a field of a listed one that fastpar's GPT cannot honour (a sliding
window shorter than the sequence, a rope scaling other than linear or llama3, biases where the
architecture's fastpar form has none, a dropout that is not fastpar's one dropout) is refused
naming the field, never ignored. A config is first completed with transformers' own defaults
(``resolved``), so a minimal one means what it means to ``from_pretrained``; both layouts are
read: transformers 5's ``rope_parameters`` and the older ``rope_theta`` / ``rope_scaling``.

The weights' names and layouts: ``hf_weights.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os

from fastpar.models.config import GPTConfig

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3")
DTYPES = ("float32", "bfloat16", "float16")  # the weights' dtypes export writes
ARCHITECTURES = (*LLAMA_LIKE, "gpt2")


@dataclasses.dataclass(frozen=True)
class HfInfo:
    """What the GPT config does not hold about the Hugging Face model: its ``model_type``, the
    whole ``config`` (written back on export), the weights' dtype name (``"float32"``...) and,
    for fastpar's quantized format, ``weights`` ``{"format", "group_size"}`` (else None)."""

    model_type: str
    config: dict
    dtype: str
    weights: dict | None = None


QUANT_METHOD = "fastpar"  # quantization_config["quant_method"] of fastpar's int8/int4 format


def quantization_config(weights: dict) -> dict:
    """config.json's ``quantization_config`` of a model quantized by fastpar (``weights``:
    ``{"format", "group_size"}``; the layout: fastpar/nn/qweight.py)."""
    fmt = weights["format"]
    return {"quant_method": QUANT_METHOD, "format": fmt, "bits": 8 if fmt == "int8" else 4,
            "group_size": weights["group_size"], "symmetric": fmt == "int8",
            "tensors": "<linear>.qweight (out, in) int8 | (out, ceil(in / 2)) uint8, the low "
                       "nibble the even column; <linear>.scales (and int4 .offsets) float32 "
                       "(ceil(in / group_size), out): w = scales * q (+ offsets)"}


def _weights(kind: str, d: dict) -> dict | None:
    """A directory's quantized format (fastpar's only), or None for float weights."""
    q = d.get("quantization_config")
    if not q:
        return None
    if not isinstance(q, dict) or q.get("quant_method") != QUANT_METHOD:
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise ValueError(f"{kind}: quantization method {method!r} is not fastpar's; fastpar "
                         "reads float weights and its own int8/int4 format (python -m "
                         "fastpar.quantize --save-hf)")
    if kind == "gpt2":
        raise ValueError("gpt2: fastpar's quantized format is written for Llama-family models")
    if q.get("format") not in ("int8", "int4") or isinstance(q.get("group_size"), bool) or \
            not isinstance(q.get("group_size"), int) or q["group_size"] < 16 or \
            q["group_size"] % 16:
        raise ValueError(f"{kind}: quantization_config {q!r} needs \"format\" int8 or int4 and "
                         "\"group_size\" a multiple of 16")
    return {"format": q["format"], "group_size": q["group_size"]}


WINDOW = 512  # tokens per sequence the commands give a Hugging Face model by default


def window(d: dict, seq_len: int | None = None) -> int:
    """``seq_len``, else the model's context up to ``WINDOW`` tokens (``evaluate``'s and
    ``prune``'s sequences: a context may be 128k)."""
    context = d.get("max_position_embeddings") or d.get("n_positions") or WINDOW
    return seq_len or min(context, WINDOW)


def read_hf_config(path: str) -> dict:
    """config.json of a model directory (or the file itself) as a dict; errors name the path."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: no config.json (a Hugging Face model directory has one)") \
            from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return data


def hf_config(d: dict, seq_len: int | None = None, **overrides) -> tuple[GPTConfig, HfInfo]:
    """The GPTConfig of Hugging Face config ``d`` (a dict), training on ``seq_len`` tokens
    (None: the model's context, ``max_position_embeddings`` / ``n_positions``), and what else
    export needs. ``overrides``: GPTConfig fields of the run (dropout, recompute, ...).
    ``ValueError`` naming the architecture or the field that fastpar cannot honour."""
    kind = d.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"Hugging Face model_type {kind!r} is not supported; fastpar trains "
                         f"{', '.join(ARCHITECTURES)}")
    d = resolved(d)
    fields = _gpt2(d) if kind == "gpt2" else _llama_like(kind, d)
    context = fields.pop("context")
    seq_len = context if seq_len is None else seq_len
    if seq_len > context:
        raise ValueError(f"seq_len {seq_len} is longer than the model's context {context} "
                         f"({'n_positions' if kind == 'gpt2' else 'max_position_embeddings'})")
    window = d.get("sliding_window")
    types = d.get("layer_types") or []
    sliding = d.get("use_sliding_window", kind == "mistral") or "sliding_attention" in types
    if sliding and window is not None and window < seq_len:
        raise ValueError(f"{kind}: sliding_window {window} is shorter than seq_len {seq_len}; "
                         "fastpar attends over the whole causal context (train with --seq-len "
                         f"{window} or less)")
    dtype = str(d.get("dtype") or d.get("torch_dtype") or "float32").replace("torch.", "")
    if dtype not in DTYPES:
        raise ValueError(f"{kind}: dtype {dtype!r} is not one fastpar writes back "
                         f"({', '.join(DTYPES)})")
    cfg = GPTConfig(seq_len=seq_len, **{**fields, **overrides})
    cfg.validate()
    return cfg, HfInfo(kind, dict(d), dtype, _weights(kind, d))


def resolved(d: dict) -> dict:
    """``d`` with transformers' own defaults for what it leaves out (``AutoConfig.for_model``:
    Qwen3's head_dim of 128, Mistral's 8 kv heads, ...), so that fastpar builds the model
    ``from_pretrained`` builds of the same file, and export writes what both read."""
    from transformers import AutoConfig

    # a deep copy: transformers completes nested dicts (rope_scaling) in place
    fields = copy.deepcopy({k: v for k, v in d.items() if k != "model_type"})
    try:
        return AutoConfig.for_model(d["model_type"], **fields).to_dict()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{d['model_type']}: transformers refuses this config: {exc}") from None


def _need(d: dict, *names: str) -> list:
    missing = [n for n in names if not isinstance(d.get(n), int) or d.get(n) < 1]
    if missing:
        raise ValueError(f"Hugging Face config of {d.get('model_type')}: missing or not a "
                         f"positive integer: {', '.join(missing)}")
    return [d[n] for n in names]


def _refuse_if(d: dict, field: str, bad: bool, why: str) -> None:
    if bad:
        raise ValueError(f"{d.get('model_type')}: {field}={d.get(field)!r} is not supported: "
                         f"{why}")


def _rope(d: dict) -> tuple[float, dict | None]:
    """(rope base, rope scaling or None) from either config layout."""
    params = d.get("rope_parameters")
    if params is None:
        params = {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta", 10000.0)}
    params = dict(params)
    base = float(params.pop("rope_theta", d.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return base, None
    if kind not in ("linear", "llama3"):
        raise ValueError(f"{d.get('model_type')}: rope scaling {kind!r} is not supported "
                         "(linear, llama3)")
    keys = ("factor",) if kind == "linear" else (
        "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(f"{d.get('model_type')}: rope scaling {kind!r} without "
                         f"{', '.join(missing)}")
    return base, {"rope_type": kind, **{k: params[k] for k in keys}}


def _llama_like(kind: str, d: dict) -> dict:
    hidden, ffn, layers, heads, vocab, context = _need(
        d, "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "vocab_size", "max_position_embeddings")
    _refuse_if(d, "hidden_act", d.get("hidden_act", "silu") not in ("silu", "swish"),
               "the gated MLP is SiLU's (swiglu)")
    _refuse_if(d, "mlp_bias", bool(d.get("mlp_bias")), "the MLP has no biases here")
    _refuse_if(d, "attention_bias", bool(d.get("attention_bias")) and kind != "qwen2",
               "only Qwen2's q, k, v biases are supported")
    _refuse_if(d, "partial_rotary_factor", d.get("partial_rotary_factor", 1.0) != 1.0,
               "rope turns every dimension of a head here")
    _refuse_if(d, "attention_dropout", bool(d.get("attention_dropout")),
               "fastpar's dropout applies to the embeddings, attention and both residual "
               "branches alike (--dropout)")
    base, scaling = _rope(d)
    head_dim = d.get("head_dim")
    if head_dim == hidden // heads and hidden % heads == 0:
        head_dim = None  # the default width: nothing to say
    return {"context": context, "vocab_size": vocab, "layers": layers, "hidden": hidden,
            "heads": heads, "kv_heads": d.get("num_key_value_heads") or heads,
            "ffn_hidden": ffn, "mlp": "swiglu", "norm": "rmsnorm", "positions": "rope",
            "tie_embeddings": bool(d.get("tie_word_embeddings", False)), "bias": False,
            "qkv_bias": kind == "qwen2", "qk_norm": kind == "qwen3",
            "norm_eps": float(d.get("rms_norm_eps", 1e-6)), "rope_base": base,
            "rope_scaling": scaling, "head_dim": head_dim,
            "init_std": float(d.get("initializer_range", 0.02))}


GELUS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _gpt2(d: dict) -> dict:
    hidden, layers, heads, vocab, context = _need(d, "n_embd", "n_layer", "n_head",
                                                  "vocab_size", "n_positions")
    act = d.get("activation_function", "gelu_new")
    _refuse_if(d, "activation_function", act not in GELUS, f"one of {', '.join(GELUS)}")
    for field, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                        ("add_cross_attention", False)):
        _refuse_if(d, field, bool(d.get(field, want)) != want, f"fastpar's attention has "
                   f"{field}={want}")
    drops = {f: float(d.get(f, 0.1)) for f in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    _refuse_if(d, "attn_pdrop", len(set(drops.values())) > 1,
               f"fastpar has one dropout for all three ({drops})")
    return {"context": context, "vocab_size": vocab, "layers": layers, "hidden": hidden,
            "heads": heads, "ffn_hidden": d.get("n_inner") or 4 * hidden,
            "mlp": GELUS[act], "norm": "layernorm", "positions": "learned",
            "tie_embeddings": bool(d.get("tie_word_embeddings", True)), "bias": True,
            "norm_eps": float(d.get("layer_norm_epsilon", 1e-5)),
            "dropout": drops["resid_pdrop"], "max_positions": context,
            "init_std": float(d.get("initializer_range", 0.02))}
