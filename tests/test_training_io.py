"""Single-process I/O of the training job: corpus, sampler, checkpoints, metrics."""

import json
import os

import numpy as np
import pytest
import torch

from fastpar.checkpoint import serial as checkpoint
from fastpar.training import data, metrics

pytestmark = pytest.mark.quick  # every test here: the quick tier

# ---------------------------------------------------------------------------------------- data


def test_builtin_corpus_is_deterministic_and_described():
    train, val = data.builtin_corpus()
    again = data.builtin_corpus()
    assert train.dtype == torch.uint8 and train.dim() == 1
    assert torch.equal(train, again.train) and torch.equal(val, again.val)
    assert val.numel() > 1000 and train.numel() > 10 * val.numel()
    assert train.numel() + val.numel() <= data.BUILTIN_CAP
    text = data.describe()
    assert "standard library" in text and " files, " in text and "bytes" in text
    train[0] = 0  # callers get private tensors: the cache is not changed through them
    assert data.builtin_corpus().train[0] == again.train[0]


def test_load_corpus_file_and_directory(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "two.txt").write_bytes(b"y" * 500)
    (tmp_path / "a.txt").write_text("x" * 500, encoding="utf-8")
    (tmp_path / ".hidden").write_bytes(b"z" * 500)
    train, val = data.load_corpus(tmp_path, seq_len=16)
    joined = torch.cat([train, val])
    assert bytes(joined.tolist()) == b"x" * 500 + data.SEPARATOR + b"y" * 500  # sorted, no hidden
    assert train.numel() == int(joined.numel() * data.TRAIN_FRACTION)
    single = data.load_corpus(tmp_path / "a.txt")
    assert bytes(torch.cat(list(single)).tolist()) == b"x" * 500
    assert "1 files, 500 bytes" in single.describe()


def test_load_corpus_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        data.load_corpus(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "f").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is empty \(1 files, 0 bytes\)"):
        data.load_corpus(tmp_path / "empty")
    (tmp_path / "small.txt").write_bytes(b"a" * 400)
    with pytest.raises(ValueError, match=r"400 bytes split into train 380 \+ val 20, and seq_len "
                                         r"64 needs at least 65 bytes in each"):
        data.load_corpus(tmp_path / "small.txt", seq_len=64)


def test_sampler_is_pure_and_shards_the_global_batch():
    text = torch.arange(1000, dtype=torch.int64).remainder(256).to(torch.uint8)
    a, b = data.Sampler(text, 32, 8, seed=7), data.Sampler(text, 32, 8, seed=7)
    torch.manual_seed(0)
    x3, y3 = a.batch(3)
    torch.manual_seed(1)  # global RNG state plays no part
    a.batch(0)
    assert torch.equal(x3, b.batch(3)[0]) and torch.equal(y3, b.batch(3)[1])
    assert x3.shape == y3.shape == (8, 32) and x3.dtype == torch.int64
    assert not torch.equal(x3, a.batch(4)[0])
    assert not torch.equal(x3, data.Sampler(text, 32, 8, seed=8).batch(3)[0])
    assert torch.equal(y3[:, :-1], x3[:, 1:])
    assert torch.equal(y3, (x3 + 1) % 256)  # the text counts up, so targets are the next byte
    for dp in (1, 2, 4):
        shards = [a.shard(3, r, dp) for r in range(dp)]
        assert torch.equal(torch.cat([s[0] for s in shards]), x3)
        assert torch.equal(torch.cat([s[1] for s in shards]), y3)
    with pytest.raises(ValueError, match="global_batch 8 is not divisible by dp_size 3"):
        a.shard(0, 0, 3)
    with pytest.raises(ValueError, match="has 10 tokens; seq_len 32 needs at least 33"):
        data.Sampler(text[:10], 32, 8, seed=0)


def test_val_batches_are_fixed():
    val = torch.arange(300, dtype=torch.int64).remainder(256).to(torch.uint8)
    first, second = data.val_batches(val, 3, 16, 4), data.val_batches(val, 3, 16, 4)
    assert len(first) == 3
    for (x, y), (x2, y2) in zip(first, second):
        assert x.shape == y.shape == (4, 16) and torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(y[:, :-1], x[:, 1:])
    assert first[0][0][0, 0] == 0 and first[-1][1][-1, -1] == val[-1]  # spans the whole text


# ---------------------------------------------------------------------------------- checkpoint


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(16, 8, generator=g)
    model = {"emb.weight": emb, "head.weight": emb, "ln.bias": torch.randn(8, generator=g),
             "half": torch.randn(4, 4, generator=g).to(torch.bfloat16).t()}  # tied, non-contig
    optim = {"exp_avg.emb": torch.randn(16, 8, generator=g), "step": torch.tensor(5)}
    return model, optim


def test_checkpoint_round_trip_and_latest(tmp_path):
    model, optim = _state(0)
    meta = {"step": 1, "config": {"layers": 2, "dropout": 0.1, "bias": False, "kv_heads": None},
            "schedule": ("cosine", 10, [0.5, 1e-3])}  # nested; the tuple comes back a list
    p1 = checkpoint.save(tmp_path, 1, model=model, optimizer=optim, meta=meta)
    model2, optim2 = _state(1)
    p2 = checkpoint.save(tmp_path, 2, model=model2, optimizer=optim2, meta={"step": 2})
    assert (tmp_path / "latest").read_text() == "step_00000002\n"
    ck = checkpoint.load(tmp_path)
    assert (ck.step, ck.path, ck.meta) == (2, p2, {"step": 2})
    for k, v in model2.items():
        assert ck.model[k].dtype == v.dtype and torch.equal(ck.model[k], v), k
    assert set(ck.optimizer) == set(optim2) and torch.equal(ck.optimizer["step"], optim2["step"])
    one = checkpoint.load(p1)
    assert one.step == 1 and all(torch.equal(one.model[k], v) for k, v in model.items())
    assert one.meta == json.loads(json.dumps(meta))
    with pytest.raises(ValueError, match="step_00000002 already exists"):
        checkpoint.save(tmp_path, 2, model=model, optimizer=optim, meta={})
    os.unlink(tmp_path / "latest")  # no latest: the highest step directory
    assert checkpoint.load(tmp_path).step == 2


def test_keep_prunes_old_checkpoints(tmp_path):
    model, optim = _state(0)
    for step in range(5):
        checkpoint.save(tmp_path, step, model=model, optimizer=optim, meta={}, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000003", "step_00000004"]


def test_truncated_file_is_named(tmp_path):
    model, optim = _state(0)
    path = checkpoint.save(tmp_path, 3, model=model, optimizer=optim, meta={})
    target = os.path.join(path, "model.safetensors")
    with open(target, "rb") as f:
        good = f.read()
    size = len(good)
    with open(target, "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(ValueError, match=f"checkpoint .*step_00000003 is incomplete or corrupt: "
                                         f"model.safetensors has {size - 10} bytes, meta.json "
                                         f"says {size}"):
        checkpoint.load(tmp_path)
    with open(target, "wb") as f:  # same size, one byte flipped
        f.write(good[:-1] + bytes([good[-1] ^ 0xFF]))
    with pytest.raises(ValueError, match="model.safetensors has sha256"):
        checkpoint.load(path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no checkpoint in .*empty.*: no step_"):
        checkpoint.load(tmp_path / "empty")
    with pytest.raises(ValueError, match="missing.* does not exist"):
        checkpoint.load(tmp_path / "missing")


@pytest.mark.parametrize("where", ["write", "rename", "latest"])
def test_interrupted_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, where):
    model, optim = _state(0)
    checkpoint.save(tmp_path, 1, model=model, optimizer=optim, meta={"good": True})
    calls = []

    def interrupt(*args, **kwargs):
        calls.append(args)
        raise KeyboardInterrupt

    if where == "rename":
        monkeypatch.setattr(checkpoint.os, "rename", interrupt)
    elif where == "latest":  # step_00000002 is in place, `latest` not yet replaced
        monkeypatch.setattr(checkpoint.os, "replace", interrupt)
    else:  # the second file of the save: the tmp dir holds a partial checkpoint
        real = checkpoint.store.write_file
        monkeypatch.setattr(checkpoint.store, "write_file",
                            lambda p, b: interrupt() if p.endswith("optimizer.safetensors")
                            else real(p, b))
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(tmp_path, 2, model=model, optimizer=optim, meta={})
    monkeypatch.undo()
    assert calls
    ck = checkpoint.load(tmp_path)
    if where == "latest":  # step_00000002 is complete and in place: the newest checkpoint
        assert ck.step == 2 and (tmp_path / "latest").read_text() == "step_00000001\n"
    else:
        assert ck.step == 1 and ck.meta == {"good": True}
    left = sorted(os.listdir(tmp_path))
    if where == "latest":
        assert left == [f".latest.tmp-{os.getpid()}", "latest", "step_00000001", "step_00000002"]
        checkpoint.save(tmp_path, 3, model=model, optimizer=optim, meta={})
        assert ".latest.tmp-" not in "".join(os.listdir(tmp_path))
        assert checkpoint.load(tmp_path).step == 3
    else:
        assert left == ["latest", "step_00000001"]


def test_stale_tmp_dirs_of_a_crashed_save_are_removed(tmp_path):
    model, optim = _state(0)
    checkpoint.save(tmp_path, 1, model=model, optimizer=optim, meta={})
    crashed = tmp_path / ".tmp-step_00000002-99999"  # what a kill -9 mid-save leaves
    crashed.mkdir()
    (crashed / "model.safetensors").write_bytes(b"partial")
    (tmp_path / ".latest.tmp-99999").write_text("step_00000002\n")
    assert checkpoint.load(tmp_path).step == 1
    checkpoint.save(tmp_path, 2, model=model, optimizer=optim, meta={})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000001", "step_00000002"]


def test_check_model_shapes_names_every_difference():
    expected = {"a": (2, 3), "b": torch.Size([4]), "c": (1,)}
    checkpoint.check_model_shapes(expected, {k: torch.zeros(v) for k, v in expected.items()}, "x")
    got = {"a": torch.zeros(3, 2), "b": torch.zeros(4), "z": torch.zeros(1)}
    with pytest.raises(ValueError) as err:
        checkpoint.check_model_shapes(expected, got, "runs/x/step_00000001")
    assert str(err.value) == (
        "checkpoint runs/x/step_00000001 was saved from a different model: 1 missing keys: c; "
        "1 unexpected keys: z; 1 shape mismatches: a (model (2, 3), checkpoint (3, 2))")
    many = {f"k{i:02d}": (1,) for i in range(25)}
    with pytest.raises(ValueError, match=r"25 missing keys: k00, .*k09, \.\.\. and 15 more$"):
        checkpoint.check_model_shapes(many, {}, "y")


def test_meta_must_be_json(tmp_path):
    model, optim = _state(0)
    with pytest.raises(ValueError, match=r"meta\['rng'\]\[0\] \(Tensor\) is not"):
        checkpoint.save(tmp_path, 1, model=model, optimizer=optim, meta={"rng": [torch.ones(1)]})
    assert not os.path.exists(tmp_path / "step_00000001")


# ------------------------------------------------------------------------------------- metrics


def test_metrics_writer_lines_and_resume(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    with metrics.MetricsWriter(path) as w:
        for step in (1, 2, 3):
            w.write({"step": step, "loss": torch.tensor(3.0 - step * 0.5)})
        w.write({"step": 3, "val_loss": np.float32(2.0)})
    records = metrics.read_records(path)
    assert [r["step"] for r in records] == [1, 2, 3, 3] and records[3]["val_loss"] == 2.0
    with open(path, "ab") as f:
        f.write(b'{"step": 4, "lo')  # a torn last line from a crash
    with metrics.MetricsWriter(path, resume=True, resume_step=2) as w:
        w.write({"step": 3, "loss": 1.25})
    assert [(r["step"], r.get("loss")) for r in metrics.read_records(path)] == [
        (1, 2.5), (2, 2.0), (3, 1.25)]
    with metrics.MetricsWriter(path) as w:  # a fresh run truncates
        w.write({"step": 1})
    assert metrics.read_records(path) == [{"step": 1}]
    metrics.MetricsWriter(None).write({"step": 1})  # other ranks: nothing happens


def test_format_line_and_plot(tmp_path):
    rec = {"step": 10, "loss": 2.31, "tokens_per_s": 51000.0, "step_time_s": 0.08, "lr": 3e-4,
           "grad_norm": 0.9}
    assert metrics.format_line(rec) == ("step 10 | loss 2.3100 | 51,000 tok/s | 80.0 ms | "
                                        "lr 3.00e-04 | grad norm 0.900")
    assert metrics.format_line({"step": 10, "val_loss": 2.5}) == "step 10 | val loss 2.5000"
    records = [{"step": s, "loss": 5.0 / s} for s in range(1, 20)]
    records += [{"step": s, "val_loss": 5.5 / s} for s in (5, 10, 15)]
    out = metrics.plot_losses(records, tmp_path / "loss.png")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["loss.png"]  # no temporary file left
