"""The memory prediction's arithmetic, without ranks: parameter counts against the config's own
formula, the microbatches each schedule keeps in flight, ZeRO-2's runs. (Measured against the
trainer in ``tests/test_train.py``.)"""

import dataclasses

import pytest
import torch

from fastpar.models import PRESETS
from fastpar.plan.memory import (ZERO2_RUN_BYTES, MemoryInputs, in_flight_peak,
                                 layer_tensors, predict_memory, zero2_runs)

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


def test_zero2_runs_cut_as_the_optimizer_does():
    big = ZERO2_RUN_BYTES // 4  # one run's worth of float32 elements
    assert zero2_runs([10, 20]) == [30]
    assert zero2_runs([big, 1, big - 1, 5]) == [big, big, 5]
    assert zero2_runs([2 * big, 3]) == [2 * big, 3]  # a parameter larger than a run is one


def test_predict_model_state_by_layout():
    inputs = _inputs("1f1b", 1, 2, 0)
    p = sum(sum(layer_tensors(inputs.cfg, 1, i)) for i in range(inputs.cfg.layers + 2))
    assert predict_memory(inputs)["params"] == 4 * p
    assert predict_memory(inputs)["optimizer"] == 8 * p
    bf16 = dataclasses.replace(inputs, dtype=torch.bfloat16)
    assert predict_memory(bf16)["params"] == 2 * p and predict_memory(bf16)["optimizer"] == 12 * p
    for zero in (1, 2, 3):  # one rank: no padding, the shard is the model
        z = predict_memory(dataclasses.replace(inputs, zero=zero))
        assert z["params"] == 4 * p and z["optimizer"] == (8 if zero == 1 else 12) * p
