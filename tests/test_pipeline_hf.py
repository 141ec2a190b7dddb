"""``fastpar.pipeline.from_hf``: Hugging Face causal LMs cut into pipeline stages under their own
names, each rank reading only its stage's tensors, against the Hugging Face model's own forward,
loss and gradients in one process.

Every run: the whole model's state dict gathered from the stages is the checkpoint's, bit for
bit, under the checkpoint's names; each rank read exactly its stage's tensors; the logits of
``pipe(tokens)`` and one training step's loss and gradients (plain batch, then a left-padded one
with its attention mask and -100 labels) against Hugging Face's float64, within 8x Hugging
Face's own float32 error (float32 roundoff measured on these inputs; for the loss, a scalar,
at least a few float32 roundings of it). The reference loss is
the mean of the microbatches' losses, as the pipeline's (the microbatches of a padded batch
hold different numbers of labelled tokens).
"""

import pytest
import torch

from tests.multirank import run_ranks
from tests.test_hf_models import CONFIGS, VOCAB, make_model

SEQ, BATCH, MICRO = 24, 4, 2


def _batch(seed: int, padded: bool):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    labels = tokens.clone()
    if padded:  # left padding of different lengths, as a batch of prompts has
        for row, pad in enumerate((0, 5, 11, 2)):
            mask[row, :pad] = 0
            labels[row, :pad] = -100
    return tokens, mask, labels


def _cached_reference(path: str, seed: int, padded: bool, dtype):
    """``_reference`` of ``_batch(seed, padded)``, made once per model in the test's process
    (``saved``) and read back by every rank."""
    return torch.load(f"{path}/reference.pt")[(seed, padded, str(dtype))]


def _references(path: str) -> None:
    refs = {}
    for seed in (10, 11):  # dp rank 0's and 1's batches
        for padded in (False, True):
            tokens, mask, labels = _batch(seed, padded)
            for dtype in (torch.float64, torch.float32):
                refs[(seed, padded, str(dtype))] = _reference(path, tokens, mask, labels, dtype,
                                                              padded)
    torch.save(refs, f"{path}/reference.pt")


def _reference(path: str, tokens, mask, labels, dtype, padded: bool):
    """Hugging Face's loss (the mean of the microbatches' losses), gradients and logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    loss = 0
    for part in range(MICRO):
        rows = slice(part * BATCH // MICRO, (part + 1) * BATCH // MICRO)
        out = model(tokens[rows], attention_mask=mask[rows] if padded else None,
                    labels=labels[rows])
        loss = loss + out.loss / MICRO
    loss.backward()
    grads = {n: p.grad.double() for n, p in model.named_parameters()}
    grads.update({"lm_head.weight": model.lm_head.weight.grad.double()})
    with torch.no_grad():
        logits = model(tokens).logits.double()
    return loss.item(), grads, logits


def body_from_hf(path: str, pp: int, schedule: str = "1f1b", virtual_stages: int = 1,
                 in_memory: bool = False):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import fastpar
    from fastpar.pipeline import from_hf

    topo = fastpar.init(pp=pp)
    source = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) if in_memory \
        else path
    pipe = from_hf(source, microbatches=MICRO, schedule=schedule,
                   virtual_stages=virtual_stages)
    out = {}
    # names and values: the gathered state dict is the checkpoint's
    full = fastpar.full_state_dict(pipe)
    stored = load_file(f"{path}/model.safetensors")
    tied = pipe.hf_config.tie_word_embeddings
    out["names"] = sorted((set(full) ^ set(stored)) - ({"lm_head.weight"} if tied else set()))
    out["differ"] = [n for n, t in stored.items() if not torch.equal(full[n], t)]
    mine = {k for chunk in pipe.chunks for k in chunk.state_dict()}
    embed = next(k for k in stored if k.endswith(("embed_tokens.weight", "wte.weight")))
    want = {embed if (k == "lm_head.weight" and tied) else k for k in mine}
    out["reads"] = in_memory or (set(pipe.hf_read) == want and
                                 len(pipe.hf_read) == len(mine))
    out["stages"] = len(mine)
    for padded in (False, True):
        tokens, mask, labels = _batch(10 + topo.dp_rank, padded)
        seed = 10 + topo.dp_rank
        ref64, grads64, logits64 = _cached_reference(path, seed, padded, torch.float64)
        ref32, grads32, logits32 = _cached_reference(path, seed, padded, torch.float32)
        for chunk in pipe.chunks:
            chunk.zero_grad(set_to_none=True)
        loss = pipe.step((tokens, mask) if padded else tokens, labels)
        got = {k: p.grad.double() for chunk in pipe.chunks
               for k, p in chunk.named_parameters(remove_duplicate=False) if p.grad is not None}
        key = "padded" if padded else "plain"
        out[key] = {
            "loss": abs(loss - ref64), "loss32": abs(ref32 - ref64), "value": abs(ref64),
            "grad": max((got[k] - grads64[k]).abs().max().item() for k in got),
            "grad32": max((grads32[k] - grads64[k]).abs().max().item() for k in got),
            "grad_scale": max(grads64[k].abs().max().item() for k in got),
            "grads": sorted(got) == sorted(mine),
        }
    logits = pipe(tokens).double()
    out["logits"] = (logits - logits64).abs().max().item()
    out["logits32"] = (logits32 - logits64).abs().max().item()
    pipe.close()
    return out


def _check(results, kind):
    total = 0
    for rank, got in enumerate(results):
        assert got["names"] == [] and got["differ"] == [], (kind, rank, got)
        assert got["reads"], (kind, rank, "read other tensors than its stage's")
        total += got["stages"]
        assert got["logits"] <= 8 * got["logits32"] + 1e-6, (kind, rank, got)
        for key in ("plain", "padded"):
            g = got[key]
            assert g["grads"], (kind, rank, key, "a parameter got no gradient")
            # a float32 scalar: a few of its roundings (2**-24) when Hugging Face's happened on
            # none
            assert g["loss"] <= max(8 * g["loss32"], 16 * 2**-24 * g["value"]), \
                (kind, rank, key, g)
            assert g["grad"] <= 8 * g["grad32"] + 1e-7 * g["grad_scale"], (kind, rank, key, g)
    return total


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    paths = {}
    for kind in CONFIGS:
        path = str(tmp_path_factory.mktemp(kind))
        make_model(kind, path, **({"sliding_window": 8} if kind == "mistral" else {}))
        _references(path)
        paths[kind] = path
    return paths


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_pp2_follows_hugging_face(saved, kind):
    """pp 2 at world 2: every architecture, tied (Qwen2, GPT-2: the copies' gradients summed
    across the stages) and untied, Mistral with a sliding window shorter than the sequence."""
    _check(run_ranks(2, body_from_hf, path=saved[kind], pp=2, timeout=240).values(), kind)


def test_pp_smaller_than_the_world_and_other_schedules(saved):
    """pp 2 of 4 ranks (two pipelines, each on its own data: a wrong group would mix them),
    interleaved with 2 virtual stages on GPT-2; pp 4 under ZB-H1 on Llama."""
    _check(run_ranks(4, body_from_hf, path=saved["gpt2"], pp=2, schedule="interleaved",
                     virtual_stages=2, timeout=240).values(), "gpt2")
    _check(run_ranks(4, body_from_hf, path=saved["llama"], pp=4, schedule="zb",
                     timeout=240).values(), "llama")


@pytest.mark.quick
def test_one_process_and_a_model_object(saved):
    """pp 1 (the tied head is the embedding itself, as in the model) and a PreTrainedModel
    passed in place of a directory, cut as it is."""
    _check(run_ranks(1, body_from_hf, path=saved["qwen2"], pp=1).values(), "qwen2")
    _check(run_ranks(2, body_from_hf, path=saved["llama"], pp=2, in_memory=True,
                     timeout=240).values(), "llama")


@pytest.mark.quick
def test_other_architectures_are_refused_by_name():
    from transformers import AutoModelForCausalLM, OPTConfig

    from fastpar.pipeline.hf import parts

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(OPTConfig(num_hidden_layers=1,
                                                           hidden_size=16, ffn_dim=32,
                                                           num_attention_heads=2))
    with pytest.raises(ValueError, match="OPTForCausalLM is not supported; supported: Llama"):
        parts(model)


def body_tied_under_data_parallel(path: str):
    """pp 2 x dp 2, a tied GPT-2 under DataParallel (both replicas on one batch, so the
    average is the one-process gradient): the copies' gradients summed after the reduction;
    the global norm counts the tied weight once."""
    import fastpar
    from fastpar.pipeline import from_hf

    topo = fastpar.init(pp=2)
    pipe = from_hf(path, microbatches=MICRO)
    model = fastpar.DataParallel(pipe)
    tokens, mask, labels = _batch(10, False)
    ref64, grads64, _ = _cached_reference(path, 10, False, torch.float64)
    _, grads32, _ = _cached_reference(path, 10, False, torch.float32)
    model.step(tokens, labels)
    got = {k: p.grad.double() for chunk in pipe.chunks
           for k, p in chunk.named_parameters(remove_duplicate=False)}
    norm = fastpar.optim.clip_grad_norm_(pipe, 1e9).item()
    unique = {id(g): g for g in grads64.values()}  # HF's tied weight: one tensor, two names
    want = sum(g.square().sum() for g in unique.values()).sqrt().item()
    return {"grad": max((got[k] - grads64[k]).abs().max().item() for k in got),
            "grad32": max((grads32[k] - grads64[k]).abs().max().item() for k in got),
            "scale": max(grads64[k].abs().max().item() for k in got),
            "norm": abs(norm - want) / want, "stage": topo.pp_rank, "keys": sorted(got)}


def test_tied_weights_under_data_parallel_and_clipping(saved):
    for rank, got in enumerate(run_ranks(4, body_tied_under_data_parallel, path=saved["gpt2"],
                                         timeout=240).values()):
        assert got["grad"] <= 8 * got["grad32"] + 1e-7 * got["scale"], (rank, got)
        assert got["norm"] < 1e-5, (rank, got)  # counted twice it is ~1.4x (tied: 2 of 2)
        assert ("lm_head.weight" in got["keys"]) == (got["stage"] == 1), got


def body_untied_checkpoint_of_a_tied_config(path: str):
    from transformers import AutoModelForCausalLM

    import fastpar
    from fastpar.pipeline import from_hf

    fastpar.init()
    tokens = _batch(3, False)[0]
    pipe = from_hf(path, microbatches=1)
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(tokens).logits
    return {"err": (pipe(tokens) - ref).abs().max().item(), "tied": pipe.tied != []}


@pytest.mark.quick
def test_a_tied_config_with_its_own_head_loads_untied(tmp_path):
    """A checkpoint whose config says tied but which stores a head of its own: loaded untied,
    as transformers loads it (the logits are Hugging Face's)."""
    from safetensors.torch import load_file, save_file

    make_model("qwen2", str(tmp_path))  # tied
    tensors = load_file(str(tmp_path / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed + 0.1 * torch.randn_like(embed)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    got = run_ranks(1, body_untied_checkpoint_of_a_tied_config, path=str(tmp_path)).values()
    for value in got:
        assert value["err"] < 1e-4 and not value["tied"], value
