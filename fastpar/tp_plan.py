"""Tensor-parallel plans for ``fastpar.parallelize``: the styles and their aliases, the plan a
model declares (Hugging Face's ``_tp_plan`` and ``base_model_tp_plan``) or one inferred from
common transformer names, and how a fused projection's parts are read off the model.

    plan = declared_plan(model) or inferred_plan(model)     # module pattern -> style
    parts = fused_parts(name, module, parent, tp, errors)   # (q, k, v) sizes, or None
"""

from __future__ import annotations

from torch import nn

STYLES = {"column": "column", "colwise": "column",
          "column_gather": "column_gather", "colwise_gather_output": "column_gather",
          "colwise_rep": "column_gather",
          "row": "row", "rowwise": "row",
          "row_scatter": "row_scatter", "rowwise_rep": "row_scatter",
          "rowwise_split_input": "row_scatter",
          "embedding": "embedding", "embedding_rowwise": "embedding"}
# Declared (Hugging Face) styles that leave a module replicated: nothing to replace.
REPLICATED_STYLES = {"replicate", "replicated_with_grad_allreduce", "sequence_parallel"}
# Inferred plan: last component of a module name -> style (Llama/Mistral/Qwen/OPT names, Meta
# Llama's w1/w2/w3/tok_embeddings, GPT-2's wte). Only names whose row-parallel partner is known
# too: BERT's query/key/value are not here, as its attention output ("dense") is not.
INFERRED = {"q_proj": "column", "k_proj": "column", "v_proj": "column",
            "gate_proj": "column", "up_proj": "column",
            "fc1": "column", "w1": "column", "w3": "column",
            "o_proj": "row", "out_proj": "row", "down_proj": "row", "fc2": "row", "w2": "row",
            "embed_tokens": "embedding", "word_embeddings": "embedding", "wte": "embedding",
            "tok_embeddings": "embedding", "lm_head": "column_gather",
            # GPT-2's Conv1D layers (its c_attn fused: split by heads, fastpar/nn/fused.py)
            "c_attn": "column", "c_fc": "column", "c_proj": "row"}
CONV1D_NAMES = {"c_attn", "c_fc", "c_proj"}  # inferred only on a Conv1D
ATTENTION_INPUTS = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "qkv_proj",
                    "query_key_value", "c_attn", "Wqkv"}
# Fused projections: one weight stacking q, k and v (or gate and up). Contiguous column shards of
# it would hand a rank all of q and part of k; those whose parts fastpar can read off the model
# (GPT-2's c_attn, Phi-3's qkv_proj and gate_up_proj) are cut part by part ("column"), the
# others refused rather than silently wrong. "column_gather" needs no split: gathered contiguous
# shards are the whole output in order.
FUSED = {"qkv_proj", "query_key_value", "c_attn", "Wqkv", "gate_up_proj"}
HEAD_ATTRS = ("num_heads", "num_key_value_heads", "num_attention_heads", "n_heads", "n_kv_heads")



def declared_plan(model: nn.Module) -> dict[str, str]:
    """Hugging Face's plans: ``_tp_plan`` of any module, ``config.base_model_tp_plan`` of a base
    model, with keys made relative to ``model``."""
    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        own = getattr(module, "_tp_plan", None)
        base = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
        if not isinstance(base, dict) or getattr(module, "base_model", None) is not module:
            base = None
        for part in (own, base):
            for key, style in (part or {}).items() if isinstance(part, dict) else ():
                plan.setdefault(prefix + key, style)
    return plan


def inferred_plan(model: nn.Module) -> dict[str, str]:
    """One exact-name entry per nn.Linear / nn.Embedding / Conv1D whose last name component is
    known; a weight tied to another module's stays out (whole: sharding would untie it)."""
    plan = {}
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            holders[id(p)] = holders.get(id(p), 0) + 1
    for name, module in model.named_modules():
        style = INFERRED.get(name.rsplit(".", 1)[-1])
        if style is None or not (isinstance(module, (nn.Linear, nn.Embedding))
                                 or is_conv1d(module)):
            continue
        if holders.get(id(module.weight), 0) > 1:
            continue
        if (style == "embedding") != isinstance(module, nn.Embedding):
            continue
        if name.rsplit(".", 1)[-1] in CONV1D_NAMES and not is_conv1d(module):
            continue  # GPT-2's names on another model's linears (GPTBigCode): not inferred
        plan[name] = style
    return plan


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear whose weight is stored (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def features(module: nn.Module) -> tuple[int, int]:
    return (module.nx, module.nf) if is_conv1d(module) else (module.in_features,
                                                              module.out_features)


# The fused projections whose layout fastpar knows, by (name, the module holding it): GPT-2's
# self-attention c_attn (q, k, v of split_size each, a Conv1D), Phi-3's qkv_proj (q, k, v by
# its head counts) and gate_up_proj (gate, up: halves). Others of these names are laid out
# otherwise (GPTBigCode's c_attn per head, CodeGen's qkv_proj in blocks): refused.
KNOWN_FUSED = {("c_attn", "GPT2Attention"), ("qkv_proj", "Phi3Attention"),
               ("gate_up_proj", "Phi3MLP")}


def fused_parts(name: str, module, parent, tp: int, errors: list) -> tuple | None:
    """The output sizes of a fused projection's parts, cut at head boundaries, or None (an
    error added)."""
    child, out = name.rsplit(".", 1)[-1], features(module)[1]
    what = f"{name} ({type(module).__name__})"
    if (child, type(parent).__name__) not in KNOWN_FUSED:
        errors.append(f"{what}: a fused projection (q, k and v, or gate and up, stacked in one "
                      f"weight) in a {type(parent).__name__}, whose layout fastpar does not "
                      "know (it splits "
                      f"{', '.join(sorted(f'{c} of {p}' for c, p in KNOWN_FUSED))}); split it "
                      "into separate layers first, or take its output whole (style "
                      "'column_gather')")
        return None
    config = getattr(parent, "config", None)
    if child == "gate_up_proj":
        parts = (out // 2, out // 2)
    elif child == "c_attn":
        if not is_conv1d(module) or getattr(parent, "is_cross_attention", False):
            errors.append(f"{what}: only GPT-2's self-attention c_attn (a Conv1D) is split; "
                          "cross-attention is not supported")
            return None
        parts = (parent.split_size,) * 3
        if parent.num_heads % tp:
            errors.append(f"{what}: {parent.num_heads} heads are not divisible by tp {tp}")
            return None
    else:
        q = config.num_attention_heads
        kv = getattr(parent, "num_key_value_heads", None) or \
            getattr(config, "num_key_value_heads", q)
        if q % tp or kv % tp:
            errors.append(f"{what}: {q} query and {kv} key/value heads must both divide by "
                          f"tp {tp}")
            return None
        parts = (q * parent.head_dim, kv * parent.head_dim, kv * parent.head_dim)
    if sum(parts) != out or any(p % tp for p in parts):
        errors.append(f"{what}: parts {parts} of its {out} outputs do not each divide by tp "
                      f"{tp}")
        return None
    return parts
