"""Activation recomputation (``fastpar.nn.recompute``, ``GPTConfig.recompute``, ``fastpar.train
--recompute``): with recompute the model computes exactly what it computes without.

Full recompute runs the same kernels on the same inputs, so its comparisons are bitwise: the
loss, every gradient, the dropout masks (dropout on everywhere), and the random streams after
the step (recompute draws nothing). Selective recompute with attention dropout on the CPU runs
``fastpar.nn.attention_core.dropout_attention`` (the mask kept as bits, the probabilities
recomputed by its own backward): the same masks as torch's kernel, other kernels, so its loss
and gradients are checked against "none" run in float64 (same masks) within the bound "none"'s
own float32 error gives, and the random streams after the step still bitwise. One 4-rank
launch per part:
- the GPT at tp 1 (dp 4), tp 2 (dp 2, a tp group smaller than the world) and tp 4, with and
  without sequence parallelism, "selective" and "full" against "none"; the masks the recompute
  draws against the first forward's; how many forwards ran (one recompute per region);
- a 2-stage pipeline: tp 2 x pp 2 with sequence parallelism under every schedule (gpipe, 1f1b,
  interleaved, zb), and pp 2 x dp 2 under 1f1b and zb, where the forwards are counted: zb's split backward (I, then W in
  several autograd calls) recomputes each block once, as 1f1b does;
- the trainer (no dropout): ``--recompute selective`` and ``full`` give the loss curve of
  ``none`` bitwise.
"""

import dataclasses

import pytest

import torch
import torch.nn.functional as F

from tests.multirank import run_ranks
from tests.test_train import body_runs

MODES = ("none", "selective", "full")
ALL_SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1))


def _config(sp):
    from fastpar.models import PRESETS

    return dataclasses.replace(PRESETS["tiny"], seq_len=16, hidden=64, heads=8, kv_heads=4,
                               layers=2, dropout=0.1, sequence_parallel=sp)


def _counting(model):
    """Counts of attention forwards and attention-core runs in ``model``'s blocks."""
    from fastpar.models.gpt import GPTBlock

    counts = {"attn": 0, "core": 0}
    for block in model.modules():
        if isinstance(block, GPTBlock):
            block.attn.register_forward_pre_hook(
                lambda *_: counts.__setitem__("attn", counts["attn"] + 1))
            core = block.attn._core

            def counted(*args, core=core):
                counts["core"] += 1
                return core(*args)
            block.attn._core = counted
    return counts


def _after():
    """What the random streams give next: recompute must leave them as it found them."""
    from fastpar.nn import random as tp_random

    return [torch.rand(4).tolist(), tp_random.tracker().states["tp"][0].tolist()[:64]]


def _grads(modules) -> dict:
    return {f"{i}.{k}": p.grad.clone() for i, m in enumerate(modules)
            for k, p in m.named_parameters()}


def _same(tag, got, ref) -> None:
    assert got.keys() == ref.keys(), tag
    bad = [k for k in ref if not torch.equal(got[k], ref[k])]
    assert not bad, f"{tag}: not bitwise equal: {bad[:5]}"


def _near(tag, got, ref, ref64) -> None:
    """``got`` (loss, grads) within the rounding bound of ``ref64`` (float64, same masks) that
    ``ref`` (the same model in float32) sets."""
    from fastpar.testing import assert_close

    assert_close(f"{tag} loss", got[0].reshape(1), ref64[0].reshape(1), ref[0].reshape(1))
    assert got[1].keys() == ref64[1].keys(), tag
    for k in ref64[1]:
        assert_close(f"{tag} {k}", got[1][k], ref64[1][k], ref[1][k])


def _masks_body(topo) -> int:
    """A region drawing from the default and the "tp" stream: the recompute's masks equal the
    first forward's, and the streams afterwards equal a run without recompute's."""
    from fastpar.nn import random as tp_random
    from fastpar.nn import recompute

    masks = []

    def region(x):
        a = F.dropout(x, 0.5)
        with tp_random.fork("tp"):
            b = F.dropout(a * 2, 0.5)
        masks.append(((a != 0) & (b != 0)).clone())
        return (b * x).sum()

    outs = []
    for use in (False, True):
        tp_random.seed(11)
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
        loss = recompute(region, x) if use else region(x)
        loss.backward()
        outs.append((x.grad, _after()))
    assert len(masks) == 3, len(masks)  # plain, then recompute's forward and its recompute
    assert torch.equal(masks[1], masks[2]) and torch.equal(masks[0], masks[1])
    assert 0 < masks[0].float().mean() < 0.5
    assert torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1]
    with torch.no_grad():  # without grad mode: a plain call
        recompute(region, torch.ones(2, 2))
    assert len(masks) == 4
    return topo.tp_size


def body_gpt(seed):
    """The GPT at tp 1, 2, 4 (SP off and on): full against none bitwise, selective within the
    float64-derived bound (module docstring)."""
    import fastpar
    from fastpar.models import GPT, gpt_loss
    from fastpar.nn import random as tp_random

    done = []
    for tp in (1, 2, 4):
        topo = fastpar.init(tp=tp, timeout=60)
        _masks_body(topo)
        gen = torch.Generator().manual_seed(seed + 101 * topo.dp_rank)  # per dp replica
        tokens = torch.randint(256, (4, 17), generator=gen)
        for sp in (False, True) if tp > 1 else (False,):
            results = {}
            for mode, dtype in [(m, torch.float32) for m in MODES] + [("none", torch.float64)]:
                cfg = dataclasses.replace(_config(sp), recompute=mode)
                model = GPT(cfg, seed=seed).to(dtype)
                counts = _counting(model)
                tp_random.seed(seed)
                loss = gpt_loss(model(tokens[:, :-1]), tokens[:, 1:])
                loss.backward()
                results[mode if dtype == torch.float32 else "none64"] = (
                    loss.detach(), _grads([model]), _after(), counts)
            ref = results["none"]
            assert ref[3] == {"attn": 2, "core": 2}, ref[3]
            for mode in ("selective", "full"):
                tag = f"tp {tp} sp {sp} {mode}"
                got = results[mode]
                if mode == "full":
                    assert torch.equal(got[0], ref[0]), (tag, got[0], ref[0])
                    _same(tag, got[1], ref[1])
                else:  # dropout_attention: torch's masks, its own kernels
                    _near(tag, got, ref, results["none64"])
                assert got[2] == ref[2], f"{tag}: the random streams moved"
            # selective: each core once, recomputed inside its backward; full: each block
            # (attention and its core) once more
            assert results["selective"][3] == {"attn": 2, "core": 2}, results["selective"][3]
            assert results["full"][3] == {"attn": 4, "core": 4}, results["full"][3]
            done.append(f"tp{tp} sp{sp}")
        fastpar.shutdown()
    return done


def body_pipeline(seed):
    """A 2-stage pipeline under every schedule: full against none bitwise, selective within
    the float64-derived bound; forwards counted (zb's split backward recomputes each block once)."""
    import fastpar
    from fastpar.models import gpt_layers, gpt_loss
    from fastpar.nn import random as tp_random
    from fastpar.pipeline import Pipeline

    done = []
    for tp, sp in ((1, False), (2, True)):
        topo = fastpar.init(tp=tp, pp=2, timeout=60)
        gen = torch.Generator().manual_seed(seed + 101 * topo.dp_rank)
        tokens = torch.randint(256, (8, 17), generator=gen)
        schedules = ALL_SCHEDULES if tp > 1 else (("1f1b", 1), ("zb", 1))
        for schedule, v in schedules:
            results = {}
            for mode, dtype in [(m, torch.float32) for m in MODES] + [("none", torch.float64)]:
                cfg = dataclasses.replace(_config(sp), recompute=mode, layers=4)
                layers = [lambda f=f: f().to(dtype) for f in gpt_layers(cfg, seed=seed)]
                pipe = Pipeline(layers, loss_fn=gpt_loss, schedule=schedule,
                                microbatches=4, virtual_stages=v)
                counts = [_counting(c) for c in pipe.chunks]
                tp_random.seed(seed)
                loss = pipe.step(tokens[:, :-1], tokens[:, 1:])
                results[mode if dtype == torch.float32 else "none64"] = (
                    torch.tensor(loss, dtype=dtype), _grads(pipe.chunks), _after(),
                    {k: sum(c[k] for c in counts) for k in ("attn", "core")},
                    pipe.stats["peak_activation_bytes"])
                pipe.close()
            ref = results["none"]
            n = ref[3]["attn"]  # block forwards on this rank: its blocks x 4 microbatches
            assert n % 4 == 0 and ref[3] == {"attn": n, "core": n}, ref[3]
            assert results["selective"][3] == {"attn": n, "core": n}, results["selective"]
            assert results["full"][3] == {"attn": 2 * n, "core": 2 * n}, results["full"][3]
            for mode in ("selective", "full"):
                tag = f"tp {tp} pp 2 {schedule} {mode}"
                got = results[mode]
                if mode == "full":
                    assert got[0] == ref[0], (tag, got[0], ref[0])
                    _same(tag, got[1], ref[1])
                else:
                    _near(tag, got, ref, results["none64"])
                assert got[2] == ref[2], f"{tag}: the random streams moved"
            if n:  # a stage with blocks keeps less with recompute
                assert results["full"][4] < results["selective"][4] < ref[4], \
                    (schedule, [results[m][4] for m in MODES])
            done.append(f"tp{tp} {schedule}")
        fastpar.shutdown()
    return done


def test_gpt_recompute_is_bitwise_at_tp_1_2_4():
    launch = run_ranks(4, body_gpt, seed=5, timeout=240)
    assert launch.values()[0] == ["tp1 spFalse", "tp2 spFalse", "tp2 spTrue", "tp4 spFalse",
                                  "tp4 spTrue"]


def test_recompute_in_every_pipeline_schedule():
    launch = run_ranks(4, body_pipeline, seed=3, timeout=300)
    assert len(launch.values()[0]) == 6


def test_trainer_recompute_keeps_the_loss_curve():
    layout = ["--tp", "2", "--pp", "2", "--schedule", "zb", "--sequence-parallel",
              "--steps", "8"]
    runs = [(mode, layout + ["--recompute", mode]) for mode in MODES]
    values = run_ranks(4, body_runs, runs=runs, timeout=240).values()
    curves = values[0]
    assert len(curves["none"]) == 8, curves
    for mode in ("selective", "full"):  # the same kernels on the same values: bitwise
        assert [r[1] for r in curves[mode]] == [r[1] for r in curves["none"]], (mode, curves)


@pytest.mark.quick
def test_a_stream_first_made_inside_recompute_draws_the_same_masks():
    """The "tp" stream made lazily by the first fork, inside a recompute region: the
    recompute starts without it and makes it again from the same seed, so its dropout masks
    equal the forward's (it used to find the forward's advanced stream)."""
    import fastpar
    from fastpar import nn as pnn
    from fastpar.nn import random as tp_random

    def block(x):
        with tp_random.fork():
            return torch.nn.functional.dropout(x, 0.5, training=True) * 3.0

    fastpar.init()
    try:
        grads = []
        for wrap in (False, True):
            tp_random.tracker().states.clear()  # no stream yet: the first fork makes it
            torch.manual_seed(7)
            x = torch.randn(64, 32, requires_grad=True)
            y = pnn.recompute(block, x) if wrap else block(x)
            y.sum().backward()
            grads.append(x.grad)
        assert torch.equal(grads[0], grads[1])
        assert 0 < int((grads[0] == 0).sum()) < grads[0].numel()  # it did drop
    finally:
        fastpar.shutdown()
