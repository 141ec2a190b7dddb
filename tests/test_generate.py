"""``fastpar.generate`` (prefill, then decode with a KV cache) against Hugging Face's own
``generate`` on the same weights, for every architecture the trainer takes.

Greedy decoding in float32 gives exactly Hugging Face's tokens (``sequences`` equal), for a
batch of one prompt and a left-padded batch of prompts of different lengths, with and without an
end token (a finished row padded as Hugging Face pads it), at tp 1, 2, 2 of 4 ranks and 4.
Sampling with a seed gives the same tokens at every tp size. Bad input gets one line naming the
values.
"""

import pytest
import torch

from tests.multirank import run_command, run_ranks
from tests.test_hf_models import CONFIGS, VOCAB, make_model

NEW = 10
SAMPLING = dict(temperature=0.9, top_k=40, top_p=0.9, seed=5)


def _prompts():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding of different lengths
    mask[2, :1] = 0
    mask[3, :6] = 0
    return ids, mask


def references(path: str, device: str = "cpu") -> dict:
    """Hugging Face's greedy sequences for each case (one prompt, the padded batch; without and
    with an end token: the one row 0 made third), made once in the test's process."""
    from transformers import AutoModelForCausalLM

    ids, mask = _prompts()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    out = {}
    for name, rows in (("one", slice(0, 1)), ("padded", slice(0, 4))):
        x, m = ids[rows].to(device), mask[rows].to(device)
        ref = hf.generate(x, attention_mask=m, max_new_tokens=NEW, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
        eos = int(ref[0, x.shape[1] + 2])
        out[name] = (None, ref.cpu().tolist())
        out[name + "_eos"] = (eos, hf.generate(x, attention_mask=m, max_new_tokens=NEW,
                                               do_sample=False, eos_token_id=eos,
                                               pad_token_id=0).cpu().tolist())
    # a prompt of one token and one new token, two rows
    out["short"] = (None, hf.generate(ids[:2, -1:].to(device), max_new_tokens=1,
                                      do_sample=False, eos_token_id=None,
                                      pad_token_id=0).cpu().tolist())
    return out


def _ender(step, tokens, rows):
    """``on_tokens`` ending every row at step 2 (as a stop string would)."""
    return torch.full((tokens.shape[0],), step >= 2, dtype=torch.bool)


def body_generate(paths: dict, refs: dict, tp: int, pp: int = 1, device: str = "cpu"):
    import fastpar
    from fastpar.generation import Stages
    from fastpar.hf_files import SafetensorsReader
    from fastpar.models.hf import hf_config, read_hf_config
    from fastpar.models.hf_weights import hf_layers

    topo = fastpar.init(tp=tp, pp=pp)
    ids, mask = _prompts()
    out = {}
    for kind, path in paths.items():
        cfg, info = hf_config(read_hf_config(path))
        factories = hf_layers(cfg, info, SafetensorsReader(path), replicated_kv=True)
        with torch.device(topo.device if device == "cuda" else "cpu"):
            layers = Stages(factories, cfg) if pp > 1 else [f() for f in factories]
        got = {"cases": {}}
        for case, (eos, ref) in refs[kind].items():
            if case == "short":
                mine = fastpar.generate(layers, ids[:2, -1:], 1, pad_token_id=0)
                got["cases"][case] = mine.sequences.tolist() == ref
                continue
            rows = slice(0, 1) if case.startswith("one") else slice(0, 4)
            mine = fastpar.generate(layers, ids[rows], NEW, attention_mask=mask[rows],
                                    eos_token_id=eos, pad_token_id=0)
            new = ref[0][ids.shape[1]:]
            stops = eos is None or (mine.new_tokens[0][-1] == eos and
                                    len(mine.new_tokens[0]) == new.index(eos) + 1)
            got["cases"][case] = mine.sequences.tolist() == ref and stops
        # every row ended by the caller at step 2 (a stop string): under pp the first stage
        # stops and drains the microbatches still on their way
        ended = fastpar.generate(layers, ids, NEW, attention_mask=mask, on_tokens=_ender,
                                 pad_token_id=0)
        padded = refs[kind]["padded"][1]
        got["cases"]["stopped"] = (ended.sequences.tolist() ==
                                   [row[:ids.shape[1] + 3] for row in padded]
                                   and all(len(r) == 3 for r in ended.new_tokens))
        if pp == 1:  # fixed-shape decode steps (what a CUDA graph captures), and captured
            for mode in ["static"] + (["cuda_graph"] if device == "cuda" else []):
                mine = fastpar.generate(layers, ids, NEW, attention_mask=mask, decode=mode,
                                        pad_token_id=0)
                got["cases"][mode] = mine.sequences.tolist() == padded
        sampled = fastpar.generate(layers, ids, NEW, attention_mask=mask, **SAMPLING)
        got["sampled"] = sampled.new_tokens
        got["cache_bytes"] = sampled.kv_cache_bytes
        if pp > 1:
            got["one_microbatch"] = fastpar.generate(layers, ids, NEW, attention_mask=mask,
                                                     microbatches=1, **SAMPLING).new_tokens
            layers.close()
        out[kind] = got
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    paths = {}
    for kind in CONFIGS:
        paths[kind] = str(tmp_path_factory.mktemp(kind))
        # 4 kv heads: tp 4 divides them
        make_model(kind, paths[kind], **({"num_key_value_heads": 4} if kind != "gpt2" else {}))
    return paths


CASES = {"one", "padded", "one_eos", "padded_eos", "short", "stopped"}


def _check(results, sampled_at_tp1=None):
    for rank, result in enumerate(results):
        for kind, got in result.items():
            assert CASES <= set(got["cases"]), (kind, got["cases"])
            for case, same in got["cases"].items():
                assert same, (kind, rank, case, "differs from Hugging Face's")
            if sampled_at_tp1 is not None:
                assert got["sampled"] == sampled_at_tp1[kind], (kind, rank)
    return {kind: got["sampled"] for kind, got in results[0].items()}


@pytest.fixture(scope="module")
def at_tp1(saved):
    """Hugging Face's references, and tp 1's run: its sampled tokens are every layout's."""
    refs = {kind: references(path) for kind, path in saved.items()}
    one = list(run_ranks(1, body_generate, paths=saved, refs=refs, tp=1,
                         timeout=300).values())
    return refs, one, _check(one)


def test_greedy_equals_hugging_face_and_sampling_is_the_same_at_every_tp(saved, at_tp1):
    """tp 1, tp 2 of 4 ranks (two replicas) and tp 4 (Llama and GPT-2); per kind the sampled
    tokens of every layout equal tp 1's; the cache of tp 4 holds a quarter of tp 1's per
    rank."""
    refs, one, sampled = at_tp1
    four = list(run_ranks(4, body_generate, paths=saved, refs=refs, tp=2,
                          timeout=300).values())
    _check(four, sampled)
    quarter = list(run_ranks(4, body_generate, paths=saved, refs=refs, tp=4,
                             timeout=300).values())
    _check(quarter, sampled)
    for kind in saved:
        assert quarter[0][kind]["cache_bytes"] * 4 == one[0][kind]["cache_bytes"], kind


def test_kv_heads_replicated_when_tp_exceeds_them(tmp_path):
    """tp 4 over 2 KV heads (Llama; Qwen3 with its k norm): each rank holds the KV head its
    query heads use, so the cache per rank is one head's, half of one process's; greedy tokens
    Hugging Face's. Training through such a layer is refused."""
    paths = {}
    for kind in ("llama", "qwen3"):
        paths[kind] = str(tmp_path / kind)
        make_model(kind, paths[kind])  # 4 query heads, 2 KV heads
    refs = {kind: references(path) for kind, path in paths.items()}
    one = run_ranks(1, body_generate, paths=paths, refs=refs, tp=1, timeout=300).values()
    four = run_ranks(4, body_generate, paths=paths, refs=refs, tp=4, timeout=300).values()
    _check(list(one))
    _check(list(four), _check(list(one)))
    for kind in paths:
        assert four[0][kind]["cache_bytes"] * 2 == one[0][kind]["cache_bytes"], kind
    for said in run_ranks(4, body_replicated_training, path=paths["llama"]).values():
        assert "serve inference only" in said, said


def body_replicated_training(path: str) -> str:
    import fastpar
    from fastpar.hf_files import SafetensorsReader
    from fastpar.models.hf import hf_config, read_hf_config
    from fastpar.models.hf_weights import hf_layers

    fastpar.init(tp=4)
    cfg, info = hf_config(read_hf_config(path))
    layers = [f() for f in hf_layers(cfg, info, SafetensorsReader(path), replicated_kv=True)]
    try:
        layers[1](layers[0](torch.zeros(1, 4, dtype=torch.long)))
    except ValueError as exc:
        return str(exc)
    return "trained"


def test_pipeline_parallel_generation_equals_hugging_face(saved, at_tp1):
    """pp 2 and tp 2 x pp 2, every architecture (the padded batch as two microbatches in
    flight, and as one), and pp 3 (Llama: a middle stage passes the stop on): greedy tokens
    Hugging Face's, sampled ones tp 1's."""
    refs, _, sampled = at_tp1
    for world, tp, paths in ((2, 1, saved), (4, 2, saved), (3, 1, {"llama": saved["llama"]})):
        results = list(run_ranks(world, body_generate, paths=paths, refs=refs, tp=tp,
                                 pp=world // tp,
                                 timeout=300).values())
        _check(results, sampled)
        for result in results:
            for kind, got in result.items():
                assert got["one_microbatch"] == sampled[kind], (world, kind)


@pytest.mark.gpu
def test_generation_on_cuda_at_tp2_and_pp2_gpu(tmp_path):
    """tests/gpu_check.sh: Llama and GPT-2 on the GPU at tp 2 and at pp 2 (two ranks sharing
    it): greedy tokens those of Hugging Face's generate on the GPU (TF32 off: torch's default
    for matmuls), at tp 2 also with the decode step captured as a CUDA graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (run tests/gpu_check.sh on a GPU machine)")
    paths = {}
    for kind in ("llama", "gpt2"):
        paths[kind] = str(tmp_path / kind)
        make_model(kind, paths[kind])
    refs = {kind: references(path, "cuda") for kind, path in paths.items()}
    for tp, pp in ((2, 1), (1, 2)):
        results = run_ranks(2, body_generate, launcher="torchrun", paths=paths, refs=refs,
                            tp=tp, pp=pp, device="cuda", env={"FASTPAR_SHARED_GPU": "1"},
                            timeout=300).values()
        _check(list(results))


@pytest.mark.quick
def test_bad_input_is_refused_in_one_line(saved):
    run_ranks(1, body_refusals, path=saved["llama"])


def body_refusals(path: str):
    import fastpar
    from fastpar.hf_files import SafetensorsReader
    from fastpar.models.hf import hf_config, read_hf_config
    from fastpar.models.hf_weights import hf_layers

    fastpar.init()
    cfg, info = hf_config(read_hf_config(path))
    layers = [f() for f in hf_layers(cfg, info, SafetensorsReader(path))]
    ids = torch.zeros(1, 60, dtype=torch.long)
    with pytest.raises(ValueError, match="a prompt of 60 tokens and 10 new ones exceed the "
                                         "model's context of 64 positions"):
        fastpar.generate(layers, ids, 10)
    right = torch.ones(2, 4, dtype=torch.long)
    right[0, -1] = 0
    with pytest.raises(ValueError, match="pad prompts on the left"):
        fastpar.generate(layers, torch.zeros(2, 4, dtype=torch.long), 2, attention_mask=right)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer, got 0"):
        fastpar.generate(layers, ids[:, :4], 0)
    with pytest.raises(TypeError, match="takes a fastpar GPT"):
        fastpar.generate(torch.nn.Linear(2, 2), ids, 1)
    with pytest.raises(ValueError, match="decode='cuda_graph' needs the model on a CUDA"):
        fastpar.generate(layers, ids[:, :4], 1, decode="cuda_graph")
    with pytest.raises(ValueError, match="top_p must be in"):
        fastpar.generate(layers, ids[:, :4], 1, temperature=1.0, top_p=1.5)


def _model_with_tokenizer(path: str) -> None:
    """A small Llama whose directory has a BPE tokenizer trained on local text (with an
    end-of-text token), saved as from_pretrained and AutoTokenizer read them."""
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read()[:30000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=320,
                                                        special_tokens=["<|endoftext|>"]))
    eos = tok.token_to_id("<|endoftext|>")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    make_model("llama", path, vocab_size=tok.get_vocab_size(), eos_token_id=eos,
               bos_token_id=eos)


def test_the_command_equals_hugging_face_and_says_what_is_wrong(tmp_path):
    """``mpirun -np 2 python -m fastpar.generate --pp 2`` on a batch of two prompts: rank 0's
    JSON holds Hugging Face's greedy tokens and their text, the prompts as the tokenizer makes
    them, the memory; bad flags and a prompt past the context are one line and exit status 2."""
    import json
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.multirank import launch

    path, out = str(tmp_path / "m"), str(tmp_path / "out.json")
    _model_with_tokenizer(path)
    prompts = ["def main(argv", "import os"]
    argv = [sys.executable, "-m", "fastpar.generate", "--hf-model", path, "--pp", "2",
            "--batch", "2", "--max-new-tokens", "8", "--json", out]
    done = launch(argv + [a for p in prompts for a in ("--prompt", p)], nranks=2,
                  launcher="mpirun", timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "M parameters on rank 0 at tp 1 x pp 2, float32" in done.stderr, done.stderr
    record = json.load(open(out))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side, tokenizer.pad_token = "left", tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = hf.generate(**batch, max_new_tokens=8, do_sample=False,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    for row, result in enumerate(record["results"]):
        new = ref[row, batch["input_ids"].shape[1]:].tolist()
        if tokenizer.eos_token_id in new:
            new = new[:new.index(tokenizer.eos_token_id) + 1]
        assert result["prompt"] == prompts[row]
        assert result["prompt_tokens"] == tokenizer(prompts[row])["input_ids"]
        assert result["new_tokens"] == new, (row, result, new)
        assert result["text"] == tokenizer.decode(new, skip_special_tokens=True)
    assert record["memory"]["weights_bytes"] > 0 and record["memory"]["kv_cache_bytes"] > 0
    assert record["tokens_per_s"] > 0 and record["decode_ms_per_token"] > 0
    from transformers import AutoConfig

    other = str(tmp_path / "opt")
    AutoConfig.for_model("opt").save_pretrained(other)
    # errors every rank meets are one line from rank 0 (two ranks: before init and after):
    # one in a launch of its own, the others on warm pools with each rank's standard error
    bad = launch([sys.executable, "-m", "fastpar.generate", "--hf-model", path,
                  "--max-new-tokens", "8", "--prompt", "x", "--batch", "0"], nranks=2,
                 launcher="mpirun", timeout=120)
    lines = [x for x in bad.stderr.splitlines() if "fastpar.generate: error" in x]
    assert bad.returncode == 2 and len(lines) == 1 and "--batch must be at least 1" in lines[0]
    assert "Traceback" not in bad.stderr, bad.stderr
    for ranks, model, extra, words in (
            (2, path, ["--prompt", "x", "--no-such-flag"], "unrecognized arguments"),
            (2, path, ["--prompt-file", str(tmp_path / "none.txt")], "No such file"),
            (1, path, ["--prompt", "x " * 80], "exceed the model's context of 64"),
            (3, path, ["--prompt", "x", "--tp", "3"], "heads 4 is not divisible by tp 3"),
            (1, other, ["--prompt", "x"], "opt")):
        said = run_command(ranks, "fastpar.generate", "--hf-model", model, "--max-new-tokens",
                           "8", *extra)
        errors = [[x for x in err.splitlines() if "fastpar.generate: error" in x]
                  for _, err in said]
        assert [code for code, _ in said] == [2] * ranks, said
        assert len(errors[0]) == 1 and words in errors[0][0] and not any(errors[1:]), said
        assert not any("Traceback" in err for _, err in said), said


def test_a_trainer_checkpoint_runs_at_another_layout(tmp_path):
    """``--resume`` of a checkpoint the trainer saved at tp 2 (the tiny preset, its byte
    vocabulary): one process and pp 2 give the same greedy tokens, and the text is the bytes."""
    import json
    import sys

    from tests.multirank import launch

    ck = str(tmp_path / "ck")
    train = launch([sys.executable, "-m", "fastpar.train", "--preset", "tiny", "--tp", "2",
                    "--steps", "3", "--no-progress", "--plot", "", "--save", ck], nranks=2,
                   launcher="mpirun", timeout=240)
    assert train.returncode == 0, train.stderr[-3000:]
    got = []
    for nranks, extra in ((1, []), (2, ["--pp", "2"])):
        out = str(tmp_path / f"g{nranks}.json")
        run = launch([sys.executable, "-m", "fastpar.generate", "--resume", ck, "--prompt",
                      "def main(", "--max-new-tokens", "6", "--json", out, *extra],
                     nranks=nranks, launcher="mpirun", timeout=240)
        assert run.returncode == 0, run.stderr[-3000:]
        got.append(json.load(open(out))["results"][0])
    assert got[0]["new_tokens"] == got[1]["new_tokens"] and len(got[0]["new_tokens"]) == 6
    assert got[0]["prompt_tokens"] == list(b"def main(")
    assert got[0]["text"] == bytes(got[0]["new_tokens"]).decode("utf-8", errors="replace")
