"""Hugging Face architectures in fastpar's GPT (``fastpar.models.hf``, ``hf_weights``): small
models of each made locally with transformers (``from_config``, every weight perturbed so that
norms and biases matter, ``save_pretrained`` as safetensors), loaded into fastpar's layers at
tp 2 of 4 ranks (tp 1 for GPT-2), against the Hugging Face model's own forward.

- In float64 both models compute the same function: logits within 1e-10 of their scale for
  GPT-2; with rope within 1e-6 (Hugging Face forms its rope angles in float32 whatever the
  model's dtype; fastpar in float64).
- In float32 fastpar's error against Hugging Face's float64 stays within 8x Hugging Face's own
  float32 error (the bound is float32 roundoff measured on these inputs, not a figure).
- Export gives back every tensor of the checkpoint bit for bit (the round trip).
- Refusals name the architecture or the field.
"""

import copy

import pytest
import torch

from fastpar.models.hf import hf_config
from tests.multirank import run_ranks

VOCAB, SEQ = 96, 24

CONFIGS = {
    # Llama 3's rope scaling, with an original context short enough to matter at SEQ
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8}),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=96,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=64, sliding_window=64, rope_theta=5000.0),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                  max_position_embeddings=64),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def make_model(kind: str, path: str, dtype=torch.float32, **overrides) -> None:
    """A small ``kind`` model with every weight perturbed, saved at ``path`` (``overrides``:
    config fields in place of CONFIGS')."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = copy.deepcopy({**CONFIGS[kind], **overrides})  # transformers completes nested
    config = AutoConfig.for_model(fields.pop("model_type"), **{"vocab_size": VOCAB, **fields})
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in name or "ln_" in name else 0.05))
    model.to(dtype).save_pretrained(path)


def body_parity(path: str, tp: int, device: str = "cpu"):
    """fastpar's GPT with the checkpoint's weights at ``tp``, against Hugging Face's forward on
    this rank: the largest errors of fastpar's full logits in float64 and float32 and of Hugging
    Face's own float32, all against Hugging Face's float64; the names of the
    checkpoint's tensors that export does not give back bit for bit."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    import fastpar
    from fastpar.models.hf import read_hf_config
    from fastpar.hf_files import SafetensorsReader
    from fastpar.models.hf_weights import hf_layers, hf_tensors

    topo = fastpar.init(tp=tp)
    cfg, info = hf_config(read_hf_config(path), seq_len=SEQ)
    with torch.device(topo.device if device == "cuda" else "cpu"):
        layers = [f() for f in hf_layers(cfg, info, SafetensorsReader(path))]
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    ref64, ref32 = hf_logits(path, tokens, torch.float64), hf_logits(path, tokens, torch.float32)
    tokens = tokens.to(layers[0].tok.weight.device)
    out = {"hf32": (ref32.double() - ref64).abs().max().item(),
           "scale": ref64.abs().max().item()}
    for dtype in (torch.float64, torch.float32):
        h = tokens
        with torch.no_grad():
            for layer in layers:
                h = layer.to(dtype)(h)
        shards = [torch.empty_like(h) for _ in range(topo.tp_size)]
        dist.all_gather(shards, h.contiguous(), group=topo.tp_group)
        out[str(dtype)] = (torch.cat(shards, dim=-1).double().cpu() - ref64).abs().max().item()
    if device == "cpu":  # the round trip: each layer's full tensors (gathered over tp)
        exported = {name: t for i, layer in enumerate(layers) for name, t in
                    hf_tensors(i, {k: v.float().cpu() for k, v in
                                   fastpar.full_state_dict(layer).items()}, cfg, info)}
        original = {k: v for k, v in load_file(f"{path}/model.safetensors").items()
                    if not k.endswith((".attn.bias", ".attn.masked_bias"))}  # GPT-2 masks
        tied = {"lm_head.weight"}  # a tied head is the embedding: written once
        out["names"] = sorted((set(exported) ^ set(original)) - tied)
        out["differ"] = [n for n, t in original.items()
                         if n in exported and not torch.equal(exported[n], t)]
    return out


def hf_logits(path: str, tokens, dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    make_model(request.param, path)
    return request.param, path


def test_logits_equal_hugging_faces_forward(saved):
    """At tp 2 of 4 ranks (a group that is not the world; tp 1 is the same code with a group of
    one, run by test_a_checkpoint_without_the_base_prefix_loads)."""
    kind, path = saved
    for rank, got in enumerate(run_ranks(4, body_parity, path=path, tp=2,
                                         timeout=240).values()):
        # float64: the same function, but for Hugging Face's rope angles, which it forms in
        # float32 whatever the model's dtype (GPT-2 has no rope)
        assert got["torch.float64"] <= (1e-10 if kind == "gpt2" else 1e-6) * got["scale"], \
            (kind, rank, got)
        assert got["torch.float32"] <= 8 * got["hf32"] + 1e-7, (kind, rank, got)
        assert got["names"] == [] and got["differ"] == [], (kind, got)  # the round trip


@pytest.mark.gpu
def test_logits_on_cuda_at_tp2_gpu(tmp_path):
    """tests/gpu_check.sh: a Llama at tp 2 on the GPU (two ranks sharing it), against Hugging
    Face's own forward: float32 within 8x its own float32 error (TF32 off: torch's default for
    matmuls)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run tests/gpu_check.sh on a GPU machine)")
    make_model("llama", str(tmp_path))
    for got in run_ranks(2, body_parity, launcher="torchrun", env={"FASTPAR_SHARED_GPU": "1"},
                         path=str(tmp_path), tp=2, device="cuda", timeout=300).values():
        assert got["torch.float32"] <= 8 * got["hf32"] + 1e-6, got


@pytest.mark.quick
@pytest.mark.parametrize("change, words", [
    ({"model_type": "falcon"}, "model_type 'falcon' is not supported; fastpar trains llama"),
    ({"sliding_window": 16}, "sliding_window 16 is shorter than seq_len 24"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope scaling 'yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias=True is not supported"),
    ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported"),
    ({"max_position_embeddings": 16}, "seq_len 24 is longer than the model's context 16"),
])
def test_what_fastpar_cannot_honour_is_refused_by_name(change, words):
    d = {**CONFIGS["mistral"], "vocab_size": VOCAB, **change}
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        hf_config(d, seq_len=SEQ)


@pytest.mark.quick
def test_both_rope_layouts_read_alike():
    old = {**CONFIGS["llama"], "vocab_size": VOCAB, "rope_theta": 500000.0}
    new = {k: v for k, v in old.items() if k not in ("rope_scaling", "rope_theta")}
    new["rope_parameters"] = {**old["rope_scaling"], "rope_theta": 500000.0}
    assert hf_config(old, seq_len=SEQ)[0] == hf_config(new, seq_len=SEQ)[0]
    cfg = hf_config(old, seq_len=SEQ)[0]
    assert cfg.rope_base == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"


@pytest.mark.quick
def test_the_planner_reads_a_config_as_the_trainer_does(tmp_path):
    """``fastpar plan --hf-config``: a listed architecture as the trainer reads it (Qwen3's own
    head_dim and q/k norms count in its parameters), any other from its sizes alone."""
    import json

    from fastpar.plan.model import build

    qwen3 = {**CONFIGS["qwen3"], "vocab_size": VOCAB}
    (tmp_path / "qwen3.json").write_text(json.dumps(qwen3))
    cfg = build(None, str(tmp_path / "qwen3.json"), {"seq_len": SEQ})
    assert cfg.head_dim == 24 and cfg.qk_norm and cfg == hf_config(qwen3, seq_len=SEQ)[0]
    other = {"model_type": "falcon", "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "vocab_size": VOCAB}
    (tmp_path / "other.json").write_text(json.dumps(other))
    cfg = build(None, str(tmp_path / "other.json"), {})
    assert (cfg.hidden, cfg.layers, cfg.heads) == (64, 2, 4)


@pytest.mark.quick
def test_a_minimal_config_means_what_it_means_to_transformers(tmp_path):
    """Fields left out take transformers' own defaults (Qwen3's head_dim 128, Mistral's 8 kv
    heads, Qwen3's 32), and a plan at a shorter --seq-len takes a model whose window is that long."""
    import json

    from fastpar.plan.model import build

    qwen3 = {"model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
             "num_hidden_layers": 2, "num_attention_heads": 32, "vocab_size": VOCAB}
    assert hf_config(qwen3, seq_len=SEQ)[0].head_dim == 128
    mistral = {"model_type": "mistral", "hidden_size": 256, "intermediate_size": 512,
               "num_hidden_layers": 2, "num_attention_heads": 16, "vocab_size": VOCAB,
               "max_position_embeddings": 32768, "sliding_window": 4096}
    assert hf_config(mistral, seq_len=SEQ)[0].num_kv_heads == 8
    (tmp_path / "m.json").write_text(json.dumps(mistral))
    assert build(None, str(tmp_path / "m.json"), {"seq_len": 4096}).seq_len == 4096
    with pytest.raises(ValueError, match="sliding_window 4096 is shorter than seq_len 32768"):
        build(None, str(tmp_path / "m.json"), {})


def test_a_checkpoint_without_the_base_prefix_loads(tmp_path):
    """GPT-2's checkpoints on the hub name the base model's tensors without "transformer.":
    they load as the prefixed ones (against Hugging Face's forward of the same file)."""
    from safetensors.torch import load_file, save_file

    make_model("gpt2", str(tmp_path))
    tensors = load_file(f"{tmp_path}/model.safetensors")
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()},
              f"{tmp_path}/model.safetensors", metadata={"format": "pt"})
    got = run_ranks(1, body_parity, path=str(tmp_path), tp=1, timeout=240).values()[0]
    assert got["torch.float64"] <= 1e-10 * got["scale"], got
