"""``python -m fastpar.evaluate``: a trainer checkpoint's loss is the val_loss its run logged, at
any layout; quantized weights score close to it and the same at tp 1 and tp 2; a Hugging Face
directory's loss is Hugging Face's own on the same tokens; bad input is one line, exit 2."""

import json
import math
import sys

import pytest
import torch

from tests.multirank import launch, run_command

EVALUATE = [sys.executable, "-m", "fastpar.evaluate"]


def _refused(module: str, argv: list, words: str, nranks: int = 1, status: int = 2) -> None:
    """``module`` refuses ``argv``: exit ``status`` on every rank, one line naming ``words``
    from rank 0 and no error from the others."""
    said = run_command(nranks, module, *argv)
    errors = [[line for line in err.splitlines() if "error" in line] for _, err in said]
    assert [code for code, _ in said] == [status] * nranks, (argv, said)
    assert len(errors[0]) == 1 and words in errors[0][0], (argv, said)
    assert not any(errors[1:]), (argv, said)


def _command(module: str, argv: list, nranks: int = 1) -> None:
    said = run_command(nranks, module, *argv)
    assert [code for code, _ in said] == [0] * nranks, (module, argv, said)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny preset trained 6 steps (one process), saved, and its last logged val_loss."""
    where = tmp_path_factory.mktemp("evaluate")
    ckpt, metrics = str(where / "ckpt"), str(where / "m.jsonl")
    done = launch([sys.executable, "-m", "fastpar.train", "--preset", "tiny", "--steps", "6",
                   "--val-every", "6", "--log-every", "6", "--no-progress", "--plot", "",
                   "--save", ckpt, "--metrics", metrics], timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    val = [json.loads(line)["val_loss"] for line in open(metrics) if "val_loss" in line]
    return ckpt, val[-1], where


def _evaluate(argv, nranks=1, out=None):
    """``(launch, JSON)`` of ``python -m fastpar.evaluate argv`` as its own job (the tests of
    exit statuses and messages)."""
    done = launch(EVALUATE + argv + (["--json", out] if out else []), nranks=nranks,
                  launcher="mpirun" if nranks > 1 else "plain", timeout=240)
    return done, (json.load(open(out)) if out and done.returncode == 0 else None)


def _scored(argv, out, nranks=1) -> dict:
    """rank 0's JSON of ``fastpar.evaluate`` run on a warm pool."""
    _command("fastpar.evaluate", argv + ["--json", out], nranks)
    with open(out) as f:
        return json.load(f)


def test_trainer_checkpoint_at_every_layout(trained):
    ckpt, logged, where = trained
    out = str(where / "e.json")
    one = _scored(["--resume", ckpt], out)
    assert set(one) >= {"loss", "perplexity", "tokens"}
    # the trainer's validation: 4 batches of 16 sequences of 64 tokens (the tiny preset's)
    assert one["tokens"] == 4 * 16 * 64 and one["perplexity"] == pytest.approx(
        math.exp(one["loss"]))
    assert one["loss"] == pytest.approx(logged, rel=1e-5), (one, logged)
    quantized = {fmt: _scored(["--resume", ckpt, "--weights", fmt], out)["loss"]
                 for fmt in ("int8", "int4")}
    # 6 steps leave the weights near their initial draw: the bounds of a trained model
    # (int8 0.5%, int4 3%: docs/quantization.md measures them) hold here too
    assert abs(quantized["int8"] / one["loss"] - 1) < 0.005, quantized
    assert abs(quantized["int4"] / one["loss"] - 1) < 0.03, quantized
    tp2 = _scored(["--resume", ckpt, "--tp", "2", "--weights", "int4"], out, nranks=2)
    assert tp2["loss"] == pytest.approx(quantized["int4"], rel=1e-5)
    assert tp2["layout"] == {"tp": 2, "pp": 1, "dp": 1}
    pp2 = _scored(["--resume", ckpt, "--pp", "2"], out, nranks=2)
    assert pp2["loss"] == pytest.approx(one["loss"], rel=1e-5)


def test_quantized_checkpoint_loads_at_any_tp(trained):
    """python -m fastpar.quantize --save: evaluated at tp 1 and 2 it scores what --weights int4
    scores on the float checkpoint, and generates the same tokens at tp 2 as --weights int4
    does in one process."""
    ckpt, _, where = trained
    q4, out = str(where / "q4"), str(where / "q.json")
    _command("fastpar.quantize", ["--resume", ckpt, "--weights", "int4", "--save", q4])
    direct = _scored(["--resume", ckpt, "--weights", "int4"], out)
    for nranks in (1, 2):
        got = _scored(["--resume", q4, "--tp", str(nranks)], out, nranks)
        assert got["weights"] == "int4" and got["loss"] == pytest.approx(direct["loss"],
                                                                         rel=1e-6)
    texts, weights = [], []
    for argv, nranks in ((["--resume", ckpt], 1), (["--resume", ckpt, "--weights", "int4"], 1),
                         (["--resume", q4, "--tp", "2"], 2)):
        _command("fastpar.generate", ["--prompt", "def main(", "--max-new-tokens", "12",
                                      "--json", out] + argv, nranks)
        record = json.load(open(out))
        weights.append(record["memory"]["weights_bytes"])
        texts.append(record["results"][0]["new_tokens"])
    assert texts[1] == texts[2]
    # the linears at 0.16x of float32; the embedding and norms (a sixth of the tiny model)
    # stay float32: 0.29x in all; tp 2 holds half of each shard
    assert weights[1] < 0.3 * weights[0] and weights[2] < 0.6 * weights[1], weights
    _refused("fastpar.quantize", ["--resume", q4, "--weights", "int8", "--save",
                                  str(where / "again")], "quantized already (int4)")
    _refused("fastpar.train", ["--preset", "tiny", "--steps", "8", "--resume", q4,
                               "--no-progress", "--plot", ""],
             "holds int4 weights (python -m fastpar.quantize): quantized models run (generate, "
             "evaluate) but do not train", status=1)


def test_hugging_face_directory_scores_as_hugging_face(tmp_path):
    """--hf-model with --data: the loss of Hugging Face's own forward on the same windows of
    the same tokens (the trainer's tokenizer cache and validation batches)."""
    from transformers import AutoModelForCausalLM

    from fastpar.training.data import val_batches
    from fastpar.training.tokens import tokenized_corpus
    from tests.test_generate import _model_with_tokenizer

    model, text = str(tmp_path / "m"), tmp_path / "text.txt"
    _model_with_tokenizer(model)
    text.write_text(open(json.__file__.replace("__init__.py", "decoder.py")).read() * 4)
    out = str(tmp_path / "e.json")
    argv = ["--hf-model", model, "--data", str(text), "--seq-len", "32", "--batches", "2",
            "--batch-size", "4"]
    got = _scored(argv + ["--tp", "2"], out, nranks=2)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float64)
    corpus = tokenized_corpus(str(text), model, 32, hf.config.vocab_size, lead=False,
                              progress=False)
    losses = []
    with torch.no_grad():
        for x, y in val_batches(corpus.val, 2, 32, 4):
            logits = hf(input_ids=x).logits
            losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                            y.flatten()).item())
    assert got["loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert got["tokens"] == 2 * 4 * 32


def test_quantized_hugging_face_directory(tmp_path):
    """python -m fastpar.quantize --save-hf: config.json carries the format, the directory
    scores at tp 2 what --weights int8 scores on the float one, and exporting its checkpoint
    again gives the same tensors bit for bit; another quantization method is refused."""
    from safetensors.torch import load_file

    from tests.test_generate import _model_with_tokenizer

    model, text = str(tmp_path / "m"), tmp_path / "text.txt"
    _model_with_tokenizer(model)
    text.write_text(open(json.__file__.replace("__init__.py", "decoder.py")).read() * 4)
    q, ckpt, again = str(tmp_path / "q"), str(tmp_path / "c"), str(tmp_path / "again")
    _command("fastpar.quantize", ["--hf-model", model, "--weights", "int8", "--group-size",
                                  "32", "--save-hf", q, "--save", ckpt])
    config = json.load(open(f"{q}/config.json"))["quantization_config"]
    assert (config["quant_method"], config["format"], config["group_size"]) == \
        ("fastpar", "int8", 32)
    out = str(tmp_path / "e.json")
    data = ["--data", str(text), "--seq-len", "32", "--batches", "2", "--batch-size", "4"]
    direct = _scored(["--hf-model", model, "--weights", "int8", "--group-size", "32"] + data,
                     out)
    stored = _scored(["--hf-model", q, "--tp", "2"] + data, out, nranks=2)
    assert stored["weights"] == "int8" and direct["weights"] == "int8"
    _refused("fastpar.evaluate", ["--hf-model", q, "--weights", "int4"] + data,
             "holds int8 weights already")
    assert stored["loss"] == pytest.approx(direct["loss"], rel=1e-6)
    done = launch([sys.executable, "-m", "fastpar.checkpoint", "export", "--hf", again, ckpt])
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = load_file(f"{q}/model.safetensors"), load_file(f"{again}/model.safetensors")
    assert first.keys() == second.keys() and any(k.endswith(".qweight") for k in first)
    assert all(torch.equal(first[k], second[k]) for k in first)
    _refused("fastpar.train", ["--hf-model", q, "--data", str(text), "--seq-len", "32",
                               "--steps", "1", "--no-progress", "--plot", ""],
             "holds int8 weights (fastpar's quantized format)", status=1)
    config = json.load(open(f"{model}/config.json"))
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    json.dump(config, open(f"{model}/config.json", "w"))
    _refused("fastpar.evaluate", ["--hf-model", model] + data,
             "quantization method 'gptq' is not fastpar's")


def test_bad_input_is_one_line(trained):
    """Bad flags and inputs: one line from rank 0, exit 2 (on warm pools, each rank's standard
    error captured; and one case in a launch of its own, as a user meets it)."""
    ckpt, _, where = trained
    for argv, said in ((["--resume", ckpt, "--group-size", "64"], "--group-size applies"),
                       (["--resume", ckpt, "--weights", "int3"], "invalid choice"),
                       (["--resume", ckpt, "--weights", "int8", "--group-size", "24"],
                        "multiple of 16"),
                       (["--resume", str(where)], "checkpoint")):
        _refused("fastpar.evaluate", argv, said)
    done, _ = _evaluate(["--resume", ckpt, "--batch-size", "3"], nranks=2)  # 3 rows, dp 2
    lines = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(lines) == 1 and "multiple of dp" in lines[0], \
        done.stderr[-2000:]
