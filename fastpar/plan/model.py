"""The model a plan is for: a preset, the GPT's flags, or a Hugging Face ``config.json``, as a
``GPTConfig`` (the trainer's own; its ``flops_per_token()`` is what MFU counts).

    cfg = build(None, "llama3-8b/config.json", {})

A ``config.json`` of an architecture the trainer trains (``fastpar.models.hf``) is read as the
trainer reads it (``--hf-model``: head_dim, q/k norms, biases, learned positions, exactly); any
other is planned from its sizes alone (``hf_sizes``), which is what a plan needs of it.
"""

from __future__ import annotations

import dataclasses

from fastpar.models.config import PRESETS, GPTConfig
from fastpar.models.hf import ARCHITECTURES, hf_config
from fastpar.plan.cluster import read_json

# config.json keys read, and the GPTConfig field each sets
HF_KEYS = {"hidden_size": "hidden", "num_hidden_layers": "layers",
           "num_attention_heads": "heads", "num_key_value_heads": "kv_heads",
           "intermediate_size": "ffn_hidden", "vocab_size": "vocab_size",
           "max_position_embeddings": "seq_len"}
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def hf_sizes(path: str) -> GPTConfig:
    """A ``GPTConfig`` from any Hugging Face ``config.json``: the sizes above; SwiGLU for
    ``hidden_act`` silu/swish (else GELU), RMSNorm when ``rms_norm_eps`` is given (else
    LayerNorm), rope unless ``position_embedding_type`` says absolute, ``tie_word_embeddings``.
    ValueError naming the file and the key that is missing or wrong."""
    d = read_json(path, "--hf-config")
    if not isinstance(d, dict):
        raise ValueError(f"--hf-config {path}: expected a JSON object")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise ValueError(f"--hf-config {path}: missing {', '.join(missing)}")
    fields = {}
    for key, name in HF_KEYS.items():
        value = d.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--hf-config {path}: {key} must be a positive integer, got "
                             f"{value!r}")
        fields[name] = value
    act = str(d.get("hidden_act", "silu"))
    fields["mlp"] = "swiglu" if act in ("silu", "swish") else "gelu"
    fields["norm"] = "rmsnorm" if "rms_norm_eps" in d else "layernorm"
    fields["positions"] = "learned" if d.get("position_embedding_type") == "absolute" \
        else "rope"
    fields["tie_embeddings"] = bool(d.get("tie_word_embeddings", False))
    fields["bias"] = bool(d.get("attention_bias", False) or d.get("mlp_bias", False))
    return dataclasses.replace(GPTConfig(), **fields)


def _from_hf(path: str, seq_len: int | None) -> GPTConfig:
    d = read_json(path, "--hf-config")
    if isinstance(d, dict) and d.get("model_type") in ARCHITECTURES:
        try:
            return hf_config(d, seq_len=seq_len)[0]
        except ValueError as exc:
            raise ValueError(f"--hf-config {path}: {exc}") from None
    return hf_sizes(path)


def build(preset: str | None, hf_path: str | None, overrides: dict) -> GPTConfig:
    """The plan's model: ``hf_path``'s config, else ``preset`` (default "small"), with
    ``overrides`` (GPTConfig fields; None values ignored) applied."""
    if preset is not None and hf_path is not None:
        raise ValueError(f"--preset {preset} and --hf-config {hf_path}: give one model")
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--preset {preset!r}: expected one of {', '.join(PRESETS)}")
    cfg = _from_hf(hf_path, overrides.get("seq_len")) if hf_path else PRESETS[preset or "small"]
    changes = {k: v for k, v in overrides.items() if v is not None}
    if "heads" in changes and "kv_heads" not in changes:
        changes["kv_heads"] = None  # a new head count: MHA unless told (the trainer's rule)
    cfg = dataclasses.replace(cfg, **changes)
    cfg.validate()
    return cfg

