"""``fastpar.parallelize``: turn an existing model's linear and embedding layers tensor-parallel.

    model = LlamaForCausalLM(config)          # or any nn.Module, on every rank, same weights
    fastpar.init(tp=2)
    fastpar.parallelize(model)                # plan="auto": the model's declared plan, else one
                                              # inferred from common transformer names
    fastpar.parallelize(model, {"layers.*.mlp.up_proj": "column", "layers.*.mlp.down_proj": "row"})

A plan maps fnmatch patterns on module names to styles. ``nn.Linear`` takes "column" (alias
"colwise"), "column_gather" ("colwise_gather_output", "colwise_rep": output all-gathered), "row"
("rowwise": input already sharded along its last dim) or "row_scatter" ("rowwise_rep",
"rowwise_split_input": input replicated, scattered first); ``nn.Embedding`` takes "embedding"
("embedding_rowwise", or "rowwise" as Hugging Face writes it). The aliases mean what they mean in
transformers' ``ALL_PARALLEL_STYLES``. Only modules of exactly these types are replaced (a subclass
may change forward), and embeddings without max_norm, scale_grad_by_freq or sparse; a plan entry
that would replace any other module is an error. GPT-2's Conv1D takes the linear styles, its
weight kept (in, out); fused projections under "column" (GPT-2's ``c_attn``, Phi-3's ``qkv_proj``
and ``gate_up_proj``) are cut part by part so each rank holds whole heads (halves), the
attention's head counts and split sizes divided (``fastpar/nn/fused.py``; plans and the parts:
``fastpar/tp_plan.py``).

Each module keeps its name, its existing weights (sharded) and their ``requires_grad``, so
``full_state_dict`` gives the serial keys back. The plan is validated whole before anything is
replaced. The changes are kept in ``model.fastpar_changes`` and logged as a table on the
group's first rank by ``logging.getLogger("fastpar.parallelize")``: at INFO level with
``verbose=True``, at DEBUG otherwise (``logging.basicConfig(level=logging.INFO)`` shows it).

Three silent wrong results are refused or said: the ranks must hold the same weights (a hash of
each parameter, gathered over the group; else ValueError naming them); the share of the
parameters the plan leaves replicated is logged at INFO on the group's first rank, as a warning
when it is most of them; ``model.save_pretrained`` (Hugging Face) takes only the full state dict
(``fastpar.full_state_dict(model)``, collective), as the shards alone are no checkpoint.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging

import torch
from torch import nn

from fastpar.nn.embedding import VocabParallelEmbedding, unsupported_options
from fastpar.nn.fused import (Conv1DColumnParallelLinear, Conv1DRowParallelLinear,
                              FusedColumnParallelLinear, FusedConv1DColumnParallelLinear)
from fastpar.nn.linear import ColumnParallelLinear, RowParallelLinear
from fastpar.nn.sharding import resolve_group
from fastpar.runtime import group_rank, group_size
from fastpar.tp_plan import (ATTENTION_INPUTS, FUSED, HEAD_ATTRS, REPLICATED_STYLES, STYLES,
                             declared_plan, features, fused_parts, inferred_plan, is_conv1d)

log = logging.getLogger("fastpar.parallelize")


def _normalise(style: str, module: nn.Module) -> str | None:
    if isinstance(module, nn.Embedding) and style in ("rowwise", "embedding", "embedding_rowwise"):
        return "embedding"
    if style in REPLICATED_STYLES:
        return None
    return STYLES[style]


def _resolve(model: nn.Module, plan: dict[str, str], tp: int):
    """``[(name, module, kind)]`` to replace (kind: the normalised style), ``{attention module
    name: {head attr: value}}`` to divide, ``{fused projection: its parts' sizes}`` and every
    error found."""
    modules = dict(model.named_modules())
    errors, chosen = [], {}
    for pattern, style in plan.items():
        if style not in STYLES and style not in REPLICATED_STYLES:
            errors.append(f"plan entry {pattern!r}: unknown style {style!r}; expected one of "
                          f"{', '.join(sorted(STYLES))} (or "
                          f"{', '.join(sorted(REPLICATED_STYLES))})")
            continue
        matched = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            errors.append(f"plan entry {pattern!r} ({style}) matches no module of "
                          f"{type(model).__name__}")
        for name in matched:
            if name not in chosen:  # the first pattern that names a module decides its style
                chosen[name] = (pattern, style)
    work, parts = [], {}
    for name, (pattern, style) in chosen.items():
        module = modules[name]
        kind = _normalise(style, module)
        if kind is None:
            continue
        what = f"{name} ({type(module).__name__})"
        base = nn.Embedding if kind == "embedding" else nn.Linear
        conv1d = kind != "embedding" and is_conv1d(module)
        if not conv1d and not isinstance(module, base):
            errors.append(f"{what}: style {style!r} needs an nn.{base.__name__}")
            continue
        if not conv1d and type(module) is not base:
            errors.append(f"{what}: a subclass of nn.{base.__name__}, whose forward the parallel "
                          f"layer cannot reproduce; only exact nn.{base.__name__} is replaced")
            continue
        if kind == "embedding":
            options = unsupported_options(module)
            if options:
                errors.append(f"{what}: {', '.join(options)} is not supported by a "
                              f"vocab-parallel embedding")
                continue
            work.append((name, module, kind))
            continue
        in_features, out_features = features(module)
        if kind == "column" and name.rsplit(".", 1)[-1] in FUSED:
            parent = modules[name.rsplit(".", 1)[0]] if "." in name else model
            found = fused_parts(name, module, parent, tp, errors)
            if found is None:
                continue
            parts[name] = found
        elif kind.startswith("row") and in_features % tp:
            errors.append(f"{what}: in_features {in_features} is not divisible by "
                          f"tp {tp} (style {style!r})")
            continue
        elif not kind.startswith("row") and out_features % tp:
            errors.append(f"{what}: out_features {out_features} is not divisible by "
                          f"tp {tp} (style {style!r})")
            continue
        work.append((name, module, kind))
    heads = _head_changes(model, modules, work, tp, errors)
    _check_ties(model, work, errors)
    return work, heads, parts, errors


def _head_changes(model, modules, work, tp, errors):
    """Attention modules whose column-sharded projections now hold 1/tp of the heads: check the
    head counts they (or their config) declare and collect the attributes to divide."""
    heads = {}
    for name, _, kind in work:
        if kind != "column" or "." not in name:
            continue
        parent_name, child = name.rsplit(".", 1)
        parent = modules[parent_name]
        if child not in ATTENTION_INPUTS and "attention" not in type(parent).__name__.lower():
            continue
        sources = [(parent_name, parent, True),
                   (f"{parent_name}.config", getattr(parent, "config", None), False)]
        for where, holder, adjust in sources:
            for attr in HEAD_ATTRS:
                value = getattr(holder, attr, None) if holder is not None else None
                if not isinstance(value, int) or isinstance(value, bool):
                    continue
                if value % tp:
                    message = (f"{where}.{attr} = {value} is not divisible by tp {tp}: "
                               f"attention heads cannot be split evenly")
                    if message not in errors:
                        errors.append(message)
                elif adjust:
                    heads.setdefault(parent_name, {})[attr] = value
        if child == "c_attn" and isinstance(getattr(parent, "split_size", None), int):
            heads.setdefault(parent_name, {})["split_size"] = parent.split_size  # GPT-2's
    return heads


def _check_ties(model, work, errors):
    owners = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{name}.{pname}" if name else pname)
    for name, module, _ in work:
        shared = owners.get(id(module.weight), [])
        if len(shared) > 1:
            others = ", ".join(s for s in shared if not s.startswith(name + "."))
            errors.append(f"{name}.weight is tied to {others}; sharding it would untie them "
                          f"(untie first, e.g. config.tie_word_embeddings=False, or leave it out "
                          f"of the plan)")


class ConfigView:
    """A module's view of the model's live config with some fields replaced (Phi-3's attention
    reads its query width off the config: its heads are 1/tp here); every other field, and any
    later change (``set_attn_implementation``), is the config's own."""

    def __init__(self, config, fields: dict):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_fields", dict(fields))

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        fields = object.__getattribute__(self, "_fields")
        if name in fields:
            return fields[name]
        return getattr(object.__getattribute__(self, "_config"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_config"), name, value)


def _replacement(module, kind, group, parts=None):
    if kind == "embedding":
        return VocabParallelEmbedding.from_serial(module, group)
    conv1d = is_conv1d(module)
    if kind in ("row", "row_scatter"):
        cls = Conv1DRowParallelLinear if conv1d else RowParallelLinear
        return cls.from_serial(module, group, input_is_parallel=kind == "row")
    if parts is not None:
        cls = FusedConv1DColumnParallelLinear if conv1d else FusedColumnParallelLinear
        return cls.from_serial(module, group, parts=parts)
    cls = Conv1DColumnParallelLinear if conv1d else ColumnParallelLinear
    return cls.from_serial(module, group, gather_output=kind == "column_gather")


def parallelize(model: nn.Module, plan="auto", *, group=None, verbose: bool = False) -> nn.Module:
    """Replace ``model``'s layers named by ``plan`` with tensor-parallel ones, in place; returns
    ``model``. See the module docstring. Raises ``ValueError`` listing every problem before any
    module is replaced. Call on every rank of the TP group, with identical weights."""
    group = resolve_group(group)
    tp = group_size(group)
    source = "explicit"
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"plan must be 'auto' or a dict of pattern -> style, got {plan!r}")
        plan, source = declared_plan(model), "declared"
        if not plan:
            plan, source = inferred_plan(model), "inferred"
        if not plan:
            raise ValueError(f"{type(model).__name__} declares no tensor-parallel plan and has "
                             "no layers with known transformer names; pass plan={pattern: style}")
    elif not isinstance(plan, dict) or not plan:
        raise ValueError(f"plan must be 'auto' or a non-empty dict of pattern -> style, got "
                         f"{plan!r}")
    work, heads, parts, errors = _resolve(model, plan, tp)
    if not errors and tp > 1:
        errors = _differing_weights(model, group)
    if errors:
        raise ValueError(f"fastpar.parallelize({type(model).__name__}, tp={tp}, {source} plan): "
                         + "; ".join(errors))
    if group_rank(group) == 0:
        _say_replicated(model, work, tp)
    changes = []
    modules = dict(model.named_modules())
    for name, module, kind in work:
        parent_name, _, child = name.rpartition(".")
        new = _replacement(module, kind, group, parts.get(name))
        (modules[parent_name] if parent_name else model)._modules[child] = new
        changes.append({"module": name, "style": kind, "from": list(module.weight.shape),
                        "to": list(new.weight.shape), "layer": type(new).__name__})
    for parent_name, attrs in heads.items():
        for attr, value in attrs.items():
            setattr(modules[parent_name], attr, value // tp)
            changes.append({"module": parent_name, "style": "heads", "attr": attr,
                            "from": value, "to": value // tp})
    for name in parts:  # Phi-3's attention reads its query width off the config: its own copy
        parent_name = name.rpartition(".")[0]
        parent = modules[parent_name] if parent_name else model
        if name.endswith("qkv_proj") and getattr(parent, "config", None) is not None:
            divided = {attr: getattr(parent.config, attr) // tp
                       for attr in ("num_attention_heads", "num_key_value_heads")}
            for attr, value in divided.items():
                changes.append({"module": f"{parent_name}.config", "style": "heads",
                                "attr": attr, "from": value * tp, "to": value})
            parent.config = ConfigView(parent.config, divided)
    model.fastpar_changes = changes
    if hasattr(model, "save_pretrained") and tp > 1:
        model.save_pretrained = _gathered_first(model.save_pretrained, changes)
    level = logging.INFO if verbose else logging.DEBUG
    if group_rank(group) == 0 and log.isEnabledFor(level):
        log.log(level, "%s", changes_table(changes, f"{len(work)} layers of "
                                          f"{type(model).__name__} sharded over tp={tp} "
                                          f"({source} plan)"))
    return model


def _differing_weights(model: nn.Module, group) -> list[str]:
    """The parameters whose bytes differ across the tp group (a hash of each, gathered): the
    ranks must start from the same weights, or a replicated weight silently differs per rank
    (an untied head drawn at random on each) and a sharded one is cut from different tensors."""
    mine = {}
    for name, p in model.named_parameters():
        data = p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        mine[name] = hashlib.blake2b(memoryview(data), digest_size=8).hexdigest()
    everyone = [None] * group_size(group)
    torch.distributed.all_gather_object(everyone, mine, group=group)
    differ = [n for n in mine if any(other.get(n) != mine[n] for other in everyone)]
    if not differ:
        return []
    shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    return [f"the ranks hold different weights for {shown}: load or initialise the model "
            "alike on every rank (the same seed, or from_pretrained of the same checkpoint) "
            "before parallelizing"]


def _say_replicated(model: nn.Module, work, tp: int) -> None:
    """The share of the parameters the plan leaves whole on every rank (before any module is
    replaced: serial sizes): INFO, and a warning when it is most of them."""
    total = sum(p.numel() for p in model.parameters())
    sharded = sum(p.numel() for _, module, _ in work for p in module.parameters())
    share = (total - sharded) / total if total else 0.0
    say = log.warning if share > 0.5 else log.info
    say("fastpar.parallelize: %.0f%% of %s's %d parameters stay whole on every rank "
        "(replicated over tp=%d)%s", 100 * share, type(model).__name__, total, tp,
        "; most of the model is not sharded: check the plan" if share > 0.5 else "")


def _gathered_first(save, changes: list[dict]):
    """``model.save_pretrained`` of a parallelized model: only with the full state dict (every
    replaced layer's weight at its serial shape; ``model.state_dict()`` holds the shards)."""
    serial = {c["module"] + ".weight": tuple(c["from"]) for c in changes if "layer" in c}

    def save_pretrained(directory, *args, state_dict=None, **kwargs):
        if state_dict is None or any(
                name in state_dict and tuple(state_dict[name].shape) != shape
                for name, shape in serial.items()):
            raise ValueError(
                "save_pretrained of a tensor-parallel model would write this rank's shards, "
                "which from_pretrained refuses: gather first, on every rank of the group, "
                "state_dict = fastpar.full_state_dict(model), then on one rank "
                "model.save_pretrained(directory, state_dict=state_dict)")
        return save(directory, *args, state_dict=state_dict, **kwargs)
    return save_pretrained


def changes_table(changes: list[dict], title: str) -> str:
    """``model.fastpar_changes`` as the text table ``parallelize`` logs."""
    lines = [f"fastpar.parallelize: {title}"]
    for c in changes:
        if c["style"] == "heads":
            lines.append(f"  {c['module']}.{c['attr']}: {c['from']} -> {c['to']}")
        else:
            lines.append(f"  {c['module']}: {c['style']:<13} weight {c['from']} -> "
                         f"{c['layer']} {c['to']} per rank")
    return "\n".join(lines)
