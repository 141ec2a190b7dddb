"""Pipeline stages straight from a Hugging Face causal LM, its own modules under its own names.

    topo = fastpar.init(pp=2)                                  # mpirun -np 2 python train.py
    pipe = fastpar.pipeline.from_hf("llama-dir", microbatches=4, schedule="1f1b")
    loss = pipe.step(input_ids, input_ids)     # labels as for model(input_ids, labels=...)
    logits = pipe(input_ids)                   # or (input_ids, attention_mask)
    sd = fastpar.full_state_dict(pipe)         # "model.layers.3.mlp.up_proj.weight", ...

The model is cut into its parts, in the order of its config's ``base_model_pp_plan``: the
embedding (GPT-2: ``wte``, then ``wpe`` with the embedding dropout), every decoder layer, the
final norm, then ``lm_head``; each part is a pipeline layer named by its Hugging Face path.
Every rank builds the whole model on the meta device (no memory, no weights), then makes real
only its own stage's parts, reading their tensors alone from the safetensors files
(``fastpar.hf_files``): a rank never holds, or reads, another stage's weights. A model object
passed instead is cut as it is (every rank then built it whole).

What crosses stages is what the Hugging Face model's own forward hands its layers:
``(hidden, position_ids, attention_mask, cos, sin)``. The first stage computes the positions,
and the rotary embeddings once (``model.rotary_emb``, as the model does); the attention mask
given (``(input_ids, attention_mask)`` for a padded batch; ``None`` otherwise) travels as it
came, and each stage builds from it the masks its layers take with Hugging Face's own mask
functions (full or sliding window, per layer as the config says), so a stage's mask is the
model's, not a (B, T, T) tensor on the wire. A tied ``lm_head`` is a copy on the last stage
whose gradient is summed with the embedding's every step (``Pipeline(tied=...)``).

Architectures: those the trainer takes (``ARCHITECTURES``); others are refused by name, since a
model whose forward does more than its parts (a scaled embedding, a soft cap) would be cut wrong.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from fastpar.hf_files import SafetensorsReader
from fastpar.pipeline.pipe import Pipeline

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                 "Qwen3ForCausalLM", "GPT2LMHeadModel")


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: token t predicts label t + 1 (labels unshifted, as for
    ``model(input_ids, labels=labels)``), ``-100`` ignored, the mean in float32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                           ignore_index=-100)


def parts(model) -> list[tuple[str, str]]:
    """``[(path, role)]`` of a causal LM's pipeline layers, in order; roles: embed, positions,
    layer, norm, head."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        raise ValueError(f"fastpar.pipeline.from_hf: architecture {name} is not supported; "
                         f"supported: {', '.join(ARCHITECTURES)}")
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError(f"fastpar.pipeline.from_hf: {name} with add_cross_attention (an "
                         "encoder's states in every layer) is not supported")
    if name == "GPT2LMHeadModel":
        return ([("transformer.wte", "embed"), ("transformer.wpe", "positions")]
                + [(f"transformer.h.{i}", "layer") for i in range(config.n_layer)]
                + [("transformer.ln_f", "norm"), ("lm_head", "head")])
    base = model.base_model_prefix
    plan = config.base_model_pp_plan
    if list(plan) != ["embed_tokens", "layers", "norm"]:
        raise ValueError(f"{name}: base_model_pp_plan {list(plan)} is not embed_tokens, layers, "
                         "norm: fastpar does not know how to cut it")
    return ([(f"{base}.embed_tokens", "embed")]
            + [(f"{base}.layers.{i}", "layer") for i in range(config.num_hidden_layers)]
            + [(f"{base}.norm", "norm"), ("lm_head", "head")])


def _tied(model) -> list[tuple[str, str]]:
    """``[(embedding weight, head weight)]`` when the head is the embedding: the same
    Parameter (the meta skeleton of a tied config, or a model loaded tied)."""
    embed = "transformer.wte" if type(model).__name__ == "GPT2LMHeadModel" else \
        f"{model.base_model_prefix}.embed_tokens"
    if model.get_submodule(embed).weight is not model.get_submodule("lm_head").weight:
        return []
    return [(f"{embed}.weight", "lm_head.weight")]


class HFStage(nn.Module):
    """A pipeline chunk of a Hugging Face causal LM: its parts placed under their dotted paths
    (so the state dict has the model's own keys) and run in order, with the glue the model's
    forward does between them."""

    def __init__(self, model, built: list[tuple[str, nn.Module]], roles: dict[str, str]):
        super().__init__()
        self.config = model.config
        self.gpt2 = type(model).__name__ == "GPT2LMHeadModel"
        self.base = model.base_model_prefix
        self._masks: dict = {}  # this forward's masks, one per kind
        self.steps = [(name, roles[name]) for name, _ in built]
        for name, module in built:
            parent = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, module)
        if any(r == "embed" for _, r in self.steps) and not self.gpt2:
            rotary = model.get_submodule(f"{model.base_model_prefix}.rotary_emb")
            # its inverse frequencies are buffers no checkpoint holds: computed afresh
            self.get_submodule(model.base_model_prefix).add_module(
                "rotary_emb", type(rotary)(config=self.config))
        if any(r == "positions" for _, r in self.steps):
            self.transformer.add_module("drop", nn.Dropout(self.config.embd_pdrop))

    def forward(self, x):
        self._masks = {}
        for name, role in self.steps:
            x = getattr(self, "_" + role)(self.get_submodule(name), x)
        self._masks = {}
        return x

    def _embed(self, module, x):
        ids, mask = (x, None) if isinstance(x, torch.Tensor) else (x[0], x[1])
        hidden = module(ids)
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        cos = sin = None
        if not self.gpt2:
            rotary = self.get_submodule(f"{self.base}.rotary_emb")
            cos, sin = rotary(hidden, position_ids=positions)
        return hidden, positions, mask, cos, sin

    def _positions(self, module, x):
        hidden, positions, mask, cos, sin = x
        hidden = self.transformer.drop(hidden + module(positions).to(hidden.dtype))
        return hidden, positions, mask, cos, sin

    def _layer(self, module, x):
        from transformers.masking_utils import (create_causal_mask,
                                                create_sliding_window_causal_mask)

        hidden, positions, mask, cos, sin = x
        index = int(module.self_attn.layer_idx if not self.gpt2 else module.attn.layer_idx)
        kind = _mask_kind(self.config, index)
        if kind not in self._masks:
            make = create_sliding_window_causal_mask if kind == "sliding_attention" \
                else create_causal_mask
            self._masks[kind] = make(config=self.config, inputs_embeds=hidden,
                                     attention_mask=mask, cache=None, position_ids=positions)
        layer_mask = self._masks[kind]
        if self.gpt2:
            hidden = module(hidden, None, layer_mask, None, use_cache=False,
                            position_ids=positions)
        else:
            hidden = module(hidden, attention_mask=layer_mask, position_ids=positions,
                            position_embeddings=(cos, sin), use_cache=False)
        return hidden, positions, mask, cos, sin

    def _norm(self, module, x):
        return (module(x[0]),) + tuple(x[1:])

    def _head(self, module, x):
        return module(x[0])


def _mask_kind(config, index: int) -> str:
    """The mask layer ``index`` takes, as the model's forward chooses it."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[index]
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "sliding_attention"
    return "full_attention"


def _materialize(module: nn.Module, name: str, reader: SafetensorsReader, tied: dict,
                 dtype) -> nn.Module:
    """A meta part made real: its parameters and persistent buffers read from ``reader`` (a
    tied copy under the weight it copies when the checkpoint stores only that one)."""
    module = module.to_empty(device="cpu")
    with torch.no_grad():
        for key, tensor in module.state_dict(keep_vars=True).items():
            full = f"{name}.{key}"
            source = full if reader.has(full) or full not in tied else tied[full]
            value = reader.get(source)
            if value.shape != tensor.shape:
                raise ValueError(f"{reader.path}: tensor {source} has shape "
                                 f"{tuple(value.shape)}, the model's {full} {tuple(tensor.shape)}")
            tensor.copy_(value)
    return module.to(dtype) if dtype is not None else module


def from_hf(model, *, microbatches: int, schedule: str = "1f1b", loss_fn=None,
            dtype=torch.float32, **kwargs) -> Pipeline:
    """A ``Pipeline`` over the pp group of a Hugging Face causal LM: ``model`` a directory
    (config.json and safetensors weights: each rank reads only its stage's tensors) or a
    ``PreTrainedModel`` (cut as it is). loss_fn(logits, labels): default ``causal_lm_loss``.
    dtype: the parts' dtype (float32 by default; ``None`` keeps the checkpoint's, or a model's
    own). Other keywords go to ``Pipeline`` (virtual_stages, balance, trace, p2p, ...).
    Collective over the world. The pipeline comes in eval mode, as ``from_pretrained``'s model
    does (``pipe.train()`` turns dropout on); a tied config whose checkpoint stores a different
    ``lm_head.weight`` is loaded untied, as transformers loads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    reader = None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        config = AutoConfig.from_pretrained(path)
        reader = SafetensorsReader(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    elif not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"from_hf takes a Hugging Face model directory or a PreTrainedModel, "
                        f"got {type(model).__name__}")
    order = parts(model)
    roles = dict(order)
    ties = _tied(model)
    if reader is not None:  # a tied config whose checkpoint holds its own head: loaded untied
        check = SafetensorsReader(reader.path)  # (as transformers does), not a stage's reads
        ties = [(first, copy) for first, copy in ties if not check.has(copy)
                or torch.equal(check.get(first), check.get(copy))]
    tied_from = {copy: first for first, copy in ties}

    def stage(built):
        if reader is not None:
            built = [(name, _materialize(m, name, reader, tied_from, dtype)) for name, m in built]
            names = dict(built)
            for first, copy in ties:  # both on this stage: one Parameter, as the model has
                owner, leaf = first.rsplit(".", 1)
                head, head_leaf = copy.rsplit(".", 1)
                if owner in names and head in names:
                    setattr(names[head], head_leaf, getattr(names[owner], leaf))
        elif dtype is not None:
            built = [(name, m.to(dtype)) for name, m in built]
        return HFStage(model, built, roles)

    pipe = Pipeline({name: model.get_submodule(name) for name, _ in order},
                    loss_fn=loss_fn or causal_lm_loss, schedule=schedule,
                    microbatches=microbatches, stage=stage, tied=ties, **kwargs)
    pipe.hf_config = model.config
    pipe.hf_read = list(reader.read) if reader is not None else []
    return pipe.eval()  # as from_pretrained returns a model: pipe.train() turns dropout on
