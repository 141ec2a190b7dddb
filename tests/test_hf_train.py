"""The trainer on Hugging Face models (``--hf-model``, ``--hf-config``, ``--save-hf``): small
Llama and GPT-2 models made locally with transformers (tests/test_hf_models.py's), trained on
the byte-level corpus (their vocabularies hold its 256 ids).

- The round trip: ``--steps 0 --save-hf OUT`` at tp 2 x pp 2 writes every tensor of the source
  bit for bit, a config.json and the tokenizer files; ``from_pretrained(OUT)`` loads it.
- Layouts train alike: tp 2, pp 2, dp 2 with ZeRO-1 and ZeRO-3, cp 2 and tp 2 x pp 2 follow the
  one-process run within the GPT layouts' parity bound (test_train's 1e-3 per step).
- ``python -m fastpar.checkpoint export --hf`` of a run's sharded checkpoint, in files of at most
  a given size (an index), from a source saved in shards itself, loads in ``from_pretrained``.
- The outside reference: the one-process run follows Hugging Face's own model trained by plain
  PyTorch (its forward and loss, AdamW with the trainer's settings, the same batches and
  schedule) within the same bound; after training, ``--save-hf``'s model gives that run's
  logits through ``from_pretrained``.
"""

import contextlib
import copy
import io
import json
import os

import pytest
import torch

from tests.multirank import run_ranks
from tests.test_hf_models import CONFIGS

VOCAB, SEQ = 320, 32
COMMON = ["--steps", "6", "--seq-len", str(SEQ), "--global-batch", "8", "--log-every", "6",
          "--no-progress", "--plot", "", "--timeout", "60", "--val-batches", "1"]
PARITY = 1e-3  # relative, per step: tests/test_train.py's bound for the GPT's layouts
PLAIN = 1e-5  # relative, per step: one process against plain PyTorch (see its test)
TOKENS = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(5))


def make(kind: str, path: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = copy.deepcopy(CONFIGS[kind])  # transformers completes nested dicts in place
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=VOCAB, **fields)
    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    model.save_pretrained(path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)  # a tokenizer file to copy along


def body_train(runs):
    """Each (name, argv) trained; {name: [[step, loss], ...]} or the ValueError's text."""
    import fastpar
    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer

    out = {}
    for name, argv in runs:
        try:
            trainer = Trainer(parse_args(COMMON + argv))
            records = trainer.run()
            out[name] = [[r["step"], r["loss"]] for r in records]
            if trainer.topo.world_size == 1:  # the trained model's logits on fixed tokens
                with torch.no_grad():
                    out[name + ":logits"] = trainer.pipe.chunks[0](TOKENS).tolist()
        except ValueError as exc:
            out[name] = f"ValueError: {exc}"
        finally:
            fastpar.shutdown()
    return out


def plain_pytorch_losses(path: str, steps: int = 6) -> list[float]:
    """Hugging Face's model trained by plain PyTorch as the trainer trains: its own forward and
    mean cross-entropy, AdamW (betas 0.9/0.95, weight decay 0.1) under the trainer's schedule,
    global-norm clipping at 1.0, the trainer's batches."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from fastpar.training.args import lr_lambda, parse_args
    from fastpar.training.data import Sampler, builtin_corpus

    args = parse_args(COMMON + ["--hf-model", path])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args, steps))
    sampler = Sampler(builtin_corpus().train, SEQ, args.global_batch, args.seed)
    losses = []
    for step in range(steps):
        x, y = sampler.batch(step)
        logits = model(x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def worst(got, ref) -> float:
    ref = [r if isinstance(r, float) else r[1] for r in ref]
    return max(abs(loss - r) / abs(r) for (_, loss), r in zip(got, ref))


def assert_parity(name, got, ref):
    assert isinstance(got, list), (name, got)
    assert len(got) == len(ref) and worst(got, ref) < PARITY, (name, worst(got, ref), got, ref)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model_dir(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    make(request.param, path)
    return request.param, path


def test_round_trip_at_tp2_pp2_is_bit_for_bit(model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    kind, path = model_dir
    out = str(tmp_path / "out")
    got = run_ranks(4, body_train, runs=[("trip", ["--hf-model", path, "--tp", "2", "--pp", "2",
                                                   "--steps", "0", "--save-hf", out])],
                    timeout=300).values()
    assert got[0]["trip"] == [], got[0]
    source, written = load_file(f"{path}/model.safetensors"), load_file(f"{out}/model.safetensors")
    source = {k: v for k, v in source.items() if not k.endswith((".attn.bias",
                                                                  ".attn.masked_bias"))}
    tied = kind == "gpt2"  # the head is the embedding: neither side writes it
    assert set(written) == set(source) - ({"lm_head.weight"} if tied else set()), kind
    for name, t in written.items():
        assert torch.equal(t, source[name]), name
    assert os.path.exists(f"{out}/tokenizer_config.json")
    with open(f"{out}/config.json") as f:
        assert json.load(f)["model_type"] == kind
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_layouts_follow_one_process_and_hugging_faces_own_training(model_dir, tmp_path):
    kind, path = model_dir
    hf = ["--hf-model", path]
    out = str(tmp_path / "trained")
    one = run_ranks(1, body_train, runs=[("serial", hf + ["--save-hf", out])],
                    timeout=300).values()[0]
    two = run_ranks(2, body_train, runs=[("tp2", hf + ["--tp", "2"]),
                                         ("pp2", hf + ["--pp", "2"]),
                                         ("dp2.zero1", hf + ["--zero", "1"]),
                                         ("dp2.zero3", hf + ["--zero", "3"]),
                                         ("cp2", hf + ["--cp", "2"])],
                    timeout=600).values()[0]
    four = run_ranks(4, body_train, runs=[("tp2pp2", hf + ["--tp", "2", "--pp", "2"])],
                     timeout=600).values()[0]
    serial = [loss for _, loss in one["serial"]]
    for name, got in (*two.items(), *four.items()):
        assert_parity(f"{kind} {name}", got, serial)
    plain = plain_pytorch_losses(path)
    print(f"{kind}: worst relative loss difference per step:", {
        name: round(worst(got, serial), 9) for name, got in (*two.items(), *four.items())},
        "serial vs plain PyTorch", round(worst(one["serial"], plain), 9))
    # float32 roundoff over 6 AdamW steps: measured <= 2e-7; a tied weight counted twice in
    # the clipped norm (GPT-2) drifted 4e-4
    assert worst(one["serial"], plain) < PLAIN, (kind, worst(one["serial"], plain))
    # the trained model written by --save-hf gives the trainer's logits through from_pretrained
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(TOKENS).logits
        ours = torch.tensor(one["serial:logits"])
        ref64 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)(TOKENS).logits
    own = (theirs.double() - ref64).abs().max().item()  # float32 roundoff on these inputs
    assert (ours.double() - ref64).abs().max().item() <= 8 * own + 1e-6, kind


@pytest.mark.quick
def test_flags_that_shape_the_model_are_refused_with_hf(tmp_path):
    from fastpar.training.args import parse_args

    path = str(tmp_path)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"model_type": "llama"}, f)
    for argv, words in ((["--hf-model", path, "--layers", "4"], "--layers with --hf-model"),
                        (["--hf-model", path, "--hf-config", path], "give one model"),
                        (["--save-hf", path], "--save-hf writes a Hugging Face model"),
                        (["--hf-model", path, "--save-hf", path], "is not an empty directory")):
        err = io.StringIO()
        with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
            parse_args(argv)
        assert words in err.getvalue(), (argv, err.getvalue())


def test_sharded_source_and_export_cli(tmp_path):
    """A source saved in shards (an index) trains at tp 2 (and --hf-config from random weights);
    checkpoint exports through the CLI in files of at most 50 KiB, and from_pretrained loads
    the export with the source's tensors (no step taken: bit for bit)."""
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    src = str(tmp_path / "src")
    make("llama", src)
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(src + "-sharded",
                                                              max_shard_size="200KB")
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    got = run_ranks(2, body_train, runs=[
        ("from-shards", ["--hf-model", src + "-sharded", "--tp", "2", "--steps", "1",
                         "--save", ckpt, "--lr", "1e-30"]),
        ("random", ["--hf-config", src + "/config.json", "--steps", "2"])],
        timeout=300).values()[0]
    assert isinstance(got["from-shards"], list) and isinstance(got["random"], list), got
    run = subprocess.run([sys.executable, "-m", "fastpar.checkpoint", "export", "--hf", out,
                          ckpt, "--shard-mb", "0.05"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert os.path.exists(f"{out}/model.safetensors.index.json"), os.listdir(out)
    ours = AutoModelForCausalLM.from_pretrained(out).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(src).state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():  # lr 1e-30: a step below every weight's last bit
        assert torch.equal(ours[name], t), name


def make_tokenized(path: str, data: str) -> int:
    """A GPT-2 whose tokenizer (a small BPE trained here with the ``tokenizers`` library on
    local text, ``<|endoftext|>`` its end of text) is in ``path``, and ``data``: two text
    files and a JSON lines file. Returns the end-of-text id."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM

    os.makedirs(data)
    text = open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read()  # ~100 KB
    with open(os.path.join(data, "a.txt"), "w") as f:
        f.write(text[:20000])
    with open(os.path.join(data, "b.txt"), "w") as f:
        f.write(text[20000:30000])
    with open(os.path.join(data, "c.jsonl"), "w") as f:
        for line in text[30000:].splitlines():
            f.write(json.dumps({"text": line, "id": 1}) + "\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300,
                                                        special_tokens=["<|endoftext|>"]))
    eos = tok.token_to_id("<|endoftext|>")
    os.makedirs(path)
    tok.save(os.path.join(path, "tokenizer.json"))
    fields = copy.deepcopy(CONFIGS["gpt2"])
    config = AutoConfig.for_model(fields.pop("model_type"), vocab_size=tok.get_vocab_size(),
                                  eos_token_id=eos, bos_token_id=eos, **fields)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return eos


def body_tokenized(path, data):
    import fastpar
    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer

    out = []
    for argv in (["--tp", "2"], ["--tp", "2"], ["--data-field", "id"]):
        try:
            trainer = Trainer(parse_args(COMMON + ["--hf-model", path, "--data", data] + argv))
            out.append([trainer.corpus_info, [r["loss"] for r in trainer.run()]])
        except ValueError as exc:
            out.append(f"ValueError: {exc}")
        finally:
            fastpar.shutdown()
    return out


def test_data_is_tokenized_by_the_models_tokenizer_once(tmp_path):
    from tokenizers import Tokenizer

    from fastpar.training.tokens import tokenized_corpus

    path, data = str(tmp_path / "model"), str(tmp_path / "data")
    eos = make_tokenized(path, data)
    ranks = run_ranks(2, body_tokenized, path=path, data=data, timeout=300).values()
    first, again, bad = ranks[0]
    assert "3 files" in first[0] and "tokenized, cached at" in first[0], first
    assert "cached)" in ranks[1][0][0], ranks[1]  # rank 1 read rank 0's tokens
    assert "cached)" in again[0] and again[1] == first[1], again  # the same tokens, read back
    assert all(loss == loss for loss in first[1]), first  # a finite loss
    assert isinstance(bad, str) and "c.jsonl:1: no text field 'id'" in bad, bad
    # the stream: each document's ids, then the end of text, in file order
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    docs = [open(f"{data}/a.txt").read(), open(f"{data}/b.txt").read()]
    docs += [json.loads(line)["text"] for line in open(f"{data}/c.jsonl") if line.strip()]
    want = [i for d in docs for i in tok.encode(d, add_special_tokens=False).ids + [eos]]
    corpus = tokenized_corpus(data, path, SEQ, tok.get_vocab_size())
    assert torch.cat([corpus.train, corpus.val]).tolist() == want
