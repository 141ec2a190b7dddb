"""The memory prediction's arithmetic, without ranks: parameter counts against the config's own
formula, the microbatches each schedule keeps in flight, ZeRO-2's runs. (Measured against the
trainer in ``tests/test_train.py``.)"""

import dataclasses

import pytest
import torch

from fastpar.models import PRESETS
from fastpar.plan.memory import (ZERO_RUN_BYTES, MemoryInputs, bucket_runs, in_flight_peak,
                                 layer_tensors, predict_memory)

pytestmark = pytest.mark.quick  # every test here: the quick tier

VARIANTS = [{}, {"mlp": "gelu", "norm": "layernorm", "bias": True, "positions": "learned"},
            {"tie_embeddings": True}, {"kv_heads": 1}]


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("change", VARIANTS)
def test_layer_tensors_add_up_to_the_model(preset, change):
    cfg = dataclasses.replace(PRESETS[preset], **change)
    total = sum(sum(layer_tensors(cfg, 1, i)) for i in range(cfg.layers + 2))
    tied = cfg.vocab_size * cfg.hidden if cfg.tie_embeddings else 0  # the head's copy
    assert total == cfg.num_params() + tied


def _inputs(schedule, pp, m, rank, v=1):
    cfg = PRESETS["tiny"]
    stages = pp * v
    bounds = tuple(round(i * (cfg.layers + 2) / stages) for i in range(stages + 1))
    return MemoryInputs(cfg, tp=1, pp=pp, dp=1, pp_rank=rank, bounds=bounds, schedule=schedule,
                  microbatches=m, rows=m, virtual_stages=v)


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8), (4, 2)])
def test_microbatches_in_flight(pp, m):
    for rank in range(pp):
        assert in_flight_peak(_inputs("1f1b", pp, m, rank), [1]) == min(pp - rank, m)
        assert in_flight_peak(_inputs("gpipe", pp, m, rank), [1]) == m
        # zb holds a microbatch until its W: at least what 1F1B holds
        assert in_flight_peak(_inputs("zb", pp, m, rank), [1]) >= min(pp - rank, m)


def test_runs_cut_as_the_optimizer_cuts_them():
    """``bucket_runs`` against ``zero_shards.run_cuts`` itself on the same tensor sizes: a new
    run before a tensor that would pass the cap, and around an isolated one."""
    from fastpar.optim.zero_shards import run_cuts

    big = ZERO_RUN_BYTES // 4  # one run's worth of float32 elements
    for sizes, alone in (([10, 20], ()), ([big, 1, big - 1, 5], ()), ([2 * big, 3], ()),
                         ([7, big // 2, 9, 11], (1,)), ([5, 6, 7], (2,)), ([5, 6, 7], (0,))):
        ps = [torch.empty(n) for n in sizes]
        cuts = run_cuts(ps, 2, None, ZERO_RUN_BYTES / 2**20, {id(ps[i]) for i in alone})
        want = [sum(sizes[a:b]) for a, b in zip(cuts, [*cuts[1:], len(sizes)])]
        assert bucket_runs(sizes, alone=alone) == want, (sizes, alone, cuts)
    assert bucket_runs([10, 20]) == [30]
    assert bucket_runs([2 * big, 3]) == [2 * big, 3]  # a parameter larger than a run is one


def test_predict_model_state_by_layout():
    inputs = _inputs("1f1b", 1, 2, 0)
    p = sum(sum(layer_tensors(inputs.cfg, 1, i)) for i in range(inputs.cfg.layers + 2))
    assert predict_memory(inputs)["params"] == 4 * p
    assert predict_memory(inputs)["optimizer"] == 8 * p
    bf16 = dataclasses.replace(inputs, dtype=torch.bfloat16)
    assert predict_memory(bf16)["params"] == 2 * p and predict_memory(bf16)["optimizer"] == 12 * p
    for zero in (1, 2, 3):  # one rank: no padding, the shard is the model
        z = predict_memory(dataclasses.replace(inputs, zero=zero, zero_granularity="step"))
        assert z["params"] == 4 * p and z["optimizer"] == (8 if zero == 1 else 12) * p
    # ZeRO-3 per unit (pp 1's default): two consecutive layers gathered at most (one without
    # prefetch, all with keep_gathered); gradients: the shards and one run's .grad
    layers = [sum(layer_tensors(inputs.cfg, 1, i)) for i in range(inputs.cfg.layers + 2)]
    unit = dataclasses.replace(inputs, zero=3)
    assert unit.granularity == "unit"
    assert predict_memory(unit)["params"] == 4 * max(a + b for a, b in zip(layers, layers[1:]))
    assert predict_memory(dataclasses.replace(unit, prefetch=False))["params"] == 4 * max(layers)
    assert predict_memory(dataclasses.replace(unit, keep_gathered=True))["params"] == 4 * p
    assert 4 * p < predict_memory(unit)["grads"] <= 4 * p + ZERO_RUN_BYTES
    assert dataclasses.replace(unit, schedule="zb").granularity == "step"
