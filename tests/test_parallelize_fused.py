"""``fastpar.parallelize`` of GPT-2's Conv1D layers and of fused projections split by heads and
halves (GPT-2's ``c_attn``, Phi-3's ``qkv_proj`` and ``gate_up_proj``: fastpar/nn/fused.py),
against the Hugging Face model in one process.

At tp 2 of 4 ranks (two replicas on their own data: a wrong group would mix them) and tp 4:
GPT-2 untied (its embedding and head sharded too) and tied (both left whole by the inferred
plan), Phi-3 under its declared plan (fused outputs gathered whole) and under an explicit plan
that splits them by heads and halves. Logits and every parameter's gradient (gathered) within
8x Hugging Face's own float32 error of its float64 (float32 roundoff measured on these
inputs); ``full_state_dict`` gives back the model's state dict bit for bit and
``load_full_state_dict`` takes it.
"""

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.multirank import run_ranks

VOCAB, SEQ = 128, 16
PHI3_SPLIT = {"model.embed_tokens": "embedding", "lm_head": "column_gather",
              "model.layers.*.self_attn.qkv_proj": "column",
              "model.layers.*.self_attn.o_proj": "row",
              "model.layers.*.mlp.gate_up_proj": "column", "model.layers.*.mlp.down_proj": "row"}


def _model(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    if kind.startswith("gpt2"):
        config = AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=32,
                                      vocab_size=VOCAB, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, tie_word_embeddings=kind == "gpt2-tied")
    else:
        config = AutoConfig.for_model("phi3", hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=4, vocab_size=VOCAB,
                                      max_position_embeddings=32, pad_token_id=0,
                                      tie_word_embeddings=False)
    torch.manual_seed(11)  # the same model on every rank
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name or "ln_" in name else 0.05))
    return model


def _run(model, ids, labels):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    F.cross_entropy(logits.flatten(0, 1).double(), labels.flatten()).backward()
    return logits.detach().double()


def _full_grads(model) -> dict:
    from fastpar.nn.sharding import ShardedModule

    grads = {}
    for prefix, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            if p.grad is None:
                continue
            g = p.grad
            if isinstance(module, ShardedModule) and name in module.shard_dims:
                g = module.gather_full(name, g)
            grads[f"{prefix}.{name}" if prefix else name] = g.double()
    return grads


def body_fused(tp: int):
    import fastpar
    from fastpar.nn.fused import FusedColumnParallelLinear

    topo = fastpar.init(tp=tp)
    g = torch.Generator().manual_seed(20 + topo.dp_rank)
    ids = torch.randint(VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(VOCAB, (2, SEQ), generator=g)
    out = {}
    for kind, plan in (("gpt2", "auto"), ("gpt2-tied", "auto"), ("phi3", "auto"),
                       ("phi3-split", PHI3_SPLIT)):
        base = _model(kind)
        serial64 = copy.deepcopy(base).double()
        ref64 = _run(serial64, ids, labels)
        grads64 = {n: p.grad for n, p in serial64.named_parameters(remove_duplicate=False)}
        serial32 = copy.deepcopy(base)
        ref32 = _run(serial32, ids, labels)
        grads32 = {n: p.grad.double() for n, p in serial32.named_parameters(
            remove_duplicate=False)}
        model = fastpar.parallelize(copy.deepcopy(base), plan)
        logits = _run(model, ids, labels)
        # an attention's view of the config follows the model's (Phi-3's divided heads aside)
        model.config._attn_implementation = "eager"
        follows = all(m.config._attn_implementation == "eager"
                      for m in model.modules() if hasattr(m, "qkv_proj"))
        model.config._attn_implementation = "sdpa"
        grads = _full_grads(model)
        styles = {c["layer"] for c in model.fastpar_changes if "layer" in c}
        fused = [m for m in model.modules() if isinstance(m, FusedColumnParallelLinear)]
        refused = 0
        for m in fused:
            try:
                m.shard_box("weight")
            except ValueError as exc:
                refused += "sharded checkpoint cannot record" in str(exc)
        full = fastpar.full_state_dict(model)
        original = base.state_dict()
        fastpar.load_full_state_dict(model, original)
        again = fastpar.full_state_dict(model)
        out[kind] = {
            "logits": (logits - ref64).abs().max().item(),
            "logits32": (ref32.double() - ref64).abs().max().item(),
            "grad": max((grads[n] - grads64[n]).abs().max().item() for n in grads),
            "grad32": max((grads32[n] - grads64[n]).abs().max().item() for n in grads),
            "scale": max(grads64[n].abs().max().item() for n in grads),
            "missing": sorted(set(grads64) - set(grads)),
            "names": sorted(set(full) ^ set(original)),
            "differ": [n for n in original if not torch.equal(full[n], original[n])
                       or not torch.equal(again[n], original[n])],
            "layers": sorted(styles), "fused": len(fused), "refused": refused,
            "follows": follows,
        }
    return out


@pytest.mark.parametrize("world, tp", [(4, 2), (4, 4)])
def test_conv1d_and_fused_projections_follow_hugging_face(world, tp):
    for rank, result in enumerate(run_ranks(world, body_fused, tp=tp, timeout=300).values()):
        for kind, got in result.items():
            assert got["names"] == [] and got["differ"] == [], (kind, rank, got)
            assert got["missing"] == [], (kind, rank, got)
            assert got["logits"] <= 8 * got["logits32"] + 1e-7, (kind, rank, got)
            assert got["grad"] <= 8 * got["grad32"] + 1e-7 * got["scale"], (kind, rank, got)
        assert "FusedConv1DColumnParallelLinear" in result["gpt2"]["layers"]
        assert {"Conv1DColumnParallelLinear", "Conv1DRowParallelLinear",
                "VocabParallelEmbedding"} <= set(result["gpt2"]["layers"])
        assert "VocabParallelEmbedding" not in result["gpt2-tied"]["layers"]  # left whole
        assert result["phi3-split"]["fused"] == 4 == result["phi3-split"]["refused"]
        assert result["phi3"]["fused"] == 0  # its declared plan gathers: plain column shards
        assert all(got["follows"] for got in result.values())


def body_unknown_layouts():
    """Projections with the known names but another layout are refused, never split wrong:
    GPTBigCode's c_attn (an nn.Linear laid out per head) and GPT-2's cross-attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import fastpar

    fastpar.init(tp=2)
    out = {}
    bigcode = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt_bigcode", n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB, multi_query=False))
    cross = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gpt2", n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB, add_cross_attention=True,
        tie_word_embeddings=False))
    for name, model, plan in (("bigcode", bigcode, {"transformer.h.*.attn.c_attn": "column"}),
                              ("cross", cross, "auto")):
        try:
            fastpar.parallelize(model, plan)
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.quick
def test_fused_projections_of_unknown_layout_are_refused():
    for got in run_ranks(2, body_unknown_layouts, timeout=240).values():
        assert "in a GPTBigCodeAttention, whose layout fastpar does not know" in got["bigcode"]
        assert "cross-attention is not supported" in got["cross"], got
