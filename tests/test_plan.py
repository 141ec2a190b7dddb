"""``fastpar plan`` (issue 26): layouts, their reasons, the pipeline's own timeline for the
bubble, plan.memory.predict_memory for memory, the JSON contract and the command line. Fixed
calibration data: nothing here is timed."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from fastpar.models import PRESETS
from fastpar.plan import cli
from fastpar.plan import pipeline_ends
from fastpar.plan import predict as P
from fastpar.plan.cluster import Cluster, Link, TrainerFit, model_signature
from fastpar.plan.layouts import Layout, candidates, parse, why_not
from fastpar.plan.search import search
from fastpar.plan import memory as plan_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLUSTER = Cluster(name="fixed", device="cpu", hosts=1, ranks_per_host=4, peak_flops=1e11,
                  memory_bytes=8e9, membw_Bps=1e10, intra=Link(1e-5, 5e9, "shm"), inter=None,
                  gemm_points=((256, 256, 256, 5e10), (2048, 768, 256, 8e10)),
                  attention_points=((128, 32, 2e10),))
CONTRACT = {"tp", "pp", "dp", "cp", "ep", "zero", "recompute", "schedule", "microbatches",
            "step_time_s", "tokens_per_s", "bubble", "memory", "fits"}


@pytest.mark.quick
def test_layout_names_round_trip_and_bad_tokens_are_named():
    lay = Layout(tp=2, pp=2, dp=1, zero=1, recompute="full", schedule="interleaved",
                 virtual_stages=2, microbatches=8)
    assert lay.name == "tp2.pp2.dp1.zero1.full.interleaved.v2.mb8"
    assert parse(lay.name) == lay
    assert parse("mb8.full.tp2.pp2", ranks=4) == dataclasses.replace(
        lay, schedule="1f1b", virtual_stages=1, zero=0)
    assert parse("pp2", ranks=4).microbatches == 4  # the trainer's default: 2 x pp
    with pytest.raises(ValueError, match="unknown token 'tq2'"):
        parse("tq2.pp2")
    with pytest.raises(ValueError, match="zero4 is out of range"):
        parse("tp1.zero4", ranks=1)
    with pytest.raises(ValueError, match="does not divide the 6 ranks"):
        parse("tp4", ranks=6)


@pytest.mark.quick
def test_infeasible_layouts_say_why_with_the_numbers():
    cfg = PRESETS["small"]  # 4 layers, 8 heads, 4 kv heads, vocab 256
    assert why_not(cfg, parse("tp8.pp1.dp1", 8), 8, 16) == \
        "kv_heads 4 is not divisible by tp 8"
    assert why_not(cfg, parse("tp1.pp8.dp1", 8), 8, 16) == \
        "pp 8 x virtual stages 1 = 8 stages > the 6 layers (embedding, 4 blocks, head)"
    assert why_not(cfg, parse("tp1.pp1.dp4.mb8", 4), 4, 16) == \
        "global batch 16 is not divisible by dp 4 x microbatches 8"
    assert "nothing to shard" in why_not(cfg, parse("tp2.pp2.dp1.zero2", 4), 4, 16)
    assert "interleaved needs microbatches divisible by pp" in why_not(
        cfg, parse("tp1.pp2.dp2.interleaved.mb3", 4), 4, 12)
    assert why_not(cfg, parse("tp2.pp2.dp1.zero0.full.zb.mb8", 4), 4, 16) is None
    names = {lay.name for lay in candidates(cfg, 4, 4, 16)}
    assert "tp2.pp2.dp1.zero0.none.1f1b.mb4" in names and "tp4.pp1.dp1.zero0.none.1f1b.mb2" \
        in names and not any(".pp1." in n and "zb" in n for n in names)


@pytest.mark.quick
def test_search_ranks_feasible_layouts_and_reports_memory_overruns():
    cfg = PRESETS["small"]
    result = search(cfg, CLUSTER, 16, dtype=torch.float32)
    times = [float(f"{p.step_time_s:.9g}") for p in result.ranked]  # ties: by memory
    assert result.ranked and times == sorted(times) and not result.too_big
    assert {r for _, r in result.dropped} >= {
        "pp 4 x virtual stages 2 = 8 stages > the 6 layers (embedding, 4 blocks, head)"}
    tight = dataclasses.replace(CLUSTER, memory_bytes=30 * 2**20)
    small = search(cfg, tight, 16, dtype=torch.float32)
    assert small.ranked and small.too_big
    assert all(p.memory_total <= tight.memory_bytes for p in small.ranked)
    assert all(not p.fits and p.memory_total > tight.memory_bytes for p in small.too_big)


@pytest.mark.quick
def test_memory_is_predict_memory_of_the_worst_rank():
    cfg = dataclasses.replace(PRESETS["small"], recompute="full")
    lay = parse("tp2.pp2.dp1.full.1f1b.mb4", 4)
    pred = P.predict(cfg, lay, CLUSTER, 16, dtype=torch.float32)
    # the cut Pipeline makes: balanced by parameters; every parameter is in one layer
    bounds = P.stage_bounds(cfg, 2, 1, 2)
    per_layer = [sum(plan_memory.layer_tensors(cfg, 1, i)) for i in range(cfg.layers + 2)]
    assert sum(per_layer) == cfg.num_params() and bounds[0] == 0 and bounds[-1] == 6
    want = [plan_memory.predict_memory(plan_memory.MemoryInputs(
        cfg, tp=2, pp=2, dp=1, pp_rank=r, bounds=bounds, schedule="1f1b", microbatches=4,
        rows=16)) for r in range(2)]
    assert pred.terms["memory_by_rank"] == want
    worst = max(range(2), key=lambda r: sum(want[r].values()))
    assert pred.memory == want[worst] and pred.memory_rank == worst


@pytest.mark.quick
def test_bubble_comes_from_the_pipeline_timeline():
    # 1F1B, pp 2, 2 microbatches, stage 1 twice as slow (F 2, B 4) as stage 0 (F 1, B 2):
    # rank 0 F0 [0,1] F1 [1,2]; rank 1 F0 [1,3] B0 [3,7]; rank 0 B0 [7,9]; rank 1 F1 [7,9]
    # B1 [9,13]; rank 0 B1 [13,15]: makespan 15, busy 6 + 12 = 18, bubble 1 - 18/30 = 0.4.
    def cost(rank, a):
        return {"F": 1.0, "B": 2.0}[a.kind] * (1 + rank)
    ends, busy = pipeline_ends.pipeline_ends("1f1b", 2, 2, 1, cost)
    assert ends == [15.0, 13.0] and busy == 18.0
    # equal stages: (p - 1) / (m + p - 1), the schedule's theory
    ends, busy = pipeline_ends.pipeline_ends("1f1b", 4, 8, 1,
                                             lambda r, a: {"F": 1.0, "B": 2.0}[a.kind])
    assert 1 - busy / (4 * max(ends)) == pytest.approx(3 / 11)
    # a prediction's bubble is the simulated one: pp 2 with 2 microbatches idles
    pred = P.predict(PRESETS["small"], parse("tp1.pp2.dp2.mb2", 4), CLUSTER, 16,
                     dtype=torch.float32)
    t = pred.terms
    assert pred.bubble == pytest.approx(1 - t["busy_s"] / (2 * t["makespan_s"]))
    assert 0.2 < pred.bubble < 0.5


@pytest.mark.quick
@pytest.mark.parametrize("schedule,v,exact", [("gpipe", 1, 1e-9), ("1f1b", 1, 1e-9),
                                              ("zb", 1, 1e-2), ("interleaved", 2, 1e-2)])
def test_long_pipelines_are_extended_from_their_steady_state(monkeypatch, schedule, v, exact):
    pp, m = 4, 40
    rng = random.Random(0)
    table = {(r, c, k): rng.uniform(1, 3) for r in range(pp) for c in range(v) for k in "FBIW"}

    def cost(rank, a):
        return table[rank, a.chunk, a.kind]
    full = pipeline_ends.simulated_ends(schedule, pp, m, v, cost)
    monkeypatch.setattr(pipeline_ends, "SIMULATE_MAX", 0)
    ends, busy = pipeline_ends.pipeline_ends(schedule, pp, m, v, cost)
    assert busy == pytest.approx(full[1], rel=1e-12)
    assert max(abs(a - b) / a for a, b in zip(full[0], ends)) < exact


# A trainer fit for the tiny preset in float32 (the shape of training.fit.trainer_fit's answer)
FIT = TrainerFit(model_signature(PRESETS["tiny"], 4), (2e-3, 1e-5), (3e-3, 2e-5), 4e-3,
                 (5e-4, 8e-4), (1.5e-3, 4e-6))


@pytest.mark.quick
def test_cluster_file_round_trips_and_bad_fields_are_named(tmp_path):
    path = tmp_path / "c.json"
    CLUSTER.save(str(path))
    assert Cluster.load(str(path)) == CLUSTER
    fitted = dataclasses.replace(CLUSTER, trainer_fit=FIT)
    fitted.save(str(path))
    assert Cluster.load(str(path)) == fitted
    d = fitted.to_json()
    assert d["trainer"]["recompute_s"] == [1.5e-3, 4e-6]
    del d["trainer"]["zb_s"], d["trainer"]["recompute_s"]  # a file from before them
    assert Cluster.from_json(d).trainer_fit == FIT._replace(zb=(0.0, 0.0), recompute=None)
    assert "recompute_s" not in Cluster.from_json(d).to_json()["trainer"]
    d["trainer"]["recompute_s"] = [1e-3, -2e-6]
    with pytest.raises(ValueError, match=r"trainer: recompute_s must be two numbers >= 0 .*"
                                         r"got \[0.001, -2e-06\]"):
        Cluster.from_json(d)
    d["trainer"]["recompute_s"] = [1e-3, 2e-6]
    d["trainer"]["zb_s"] = [1e-3]
    with pytest.raises(ValueError, match=r"trainer: zb_s must be two numbers >= 0 .*"):
        Cluster.from_json(d)
    d["trainer"]["block_s"] = [1e-3, -1]
    with pytest.raises(ValueError, match=r"trainer: block_s must be two numbers >= 0 .*"
                                         r"got \[0.001, -1\]"):
        Cluster.from_json(d)
    # an earlier calibration's busy peers' waits: refused, naming them (no longer modelled)
    d = CLUSTER.to_json()
    d["intra"]["busy_p2p"] = [5e-4, 0.2]
    with pytest.raises(ValueError, match=r"intra: busy_p2p: busy peers' waits, which the planner "
                                         r"no longer models"):
        Cluster.from_json(d)
    d = dataclasses.replace(CLUSTER, cpus_per_host=2).to_json()
    d["host"].update(sync_s=2e-4, sync_ratio=0.3)
    with pytest.raises(ValueError, match=r"host: sync_s, sync_ratio: busy peers' waits"):
        Cluster.from_json(d)
    assert CLUSTER.with_ranks(2, 2) == dataclasses.replace(CLUSTER, hosts=2, ranks_per_host=2)
    d = CLUSTER.to_json()
    d["peak_flops"] = -1
    with pytest.raises(ValueError, match=r"peak_flops must be a number > 0, got -1"):
        Cluster.from_json(d)
    d = CLUSTER.to_json()
    d["hosts"] = 2
    with pytest.raises(ValueError, match="2 hosts but no 'inter' link"):
        Cluster.from_json(d)


@pytest.mark.quick
def test_json_and_explain_in_process(tmp_path, capsys):
    out = tmp_path / "plan.json"
    cfile = tmp_path / "c.json"
    CLUSTER.save(str(cfile))
    assert cli.main(["--preset", "small", "--ranks", "4", "--cluster", str(cfile),
                     "--json", str(out), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "cannot run (count, reason, e.g.):" in text and " 1 tp" in text
    rows = json.loads(out.read_text())
    assert rows and all(CONTRACT <= set(r) for r in rows)
    assert set(rows[0]["memory"]) == set(plan_memory.CATEGORIES)
    assert rows[0]["step_time_s"] == min(r["step_time_s"] for r in rows if r["fits"])
    assert cli.main(["--preset", "small", "--ranks", "4", "--cluster", str(cfile),
                     "--explain", "tp2.pp2.full.mb4"]) == 0
    text = capsys.readouterr().out
    for needle in ("layout tp2.pp2.dp1.zero0.full.1f1b.mb4", "f:qkv", "i:recompute qkv",
                   "f:tp collectives", "pipeline (pipeline.timeline.simulate", "rank 1:",
                   "<- worst", "fits: True"):
        assert needle in text, needle


def test_command_line_errors_are_one_line_exit_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cfile = tmp_path / "c.json"
    CLUSTER.save(str(cfile))
    r = subprocess.run([sys.executable, "-m", "fastpar", "plan", "--preset", "small", "--ranks",
                        "4", "--cluster", str(cfile), "--explain", "tp8.pp1.dp1"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == (
        "python -m fastpar plan: error: --explain tp8.pp1.dp1: cannot run: tp 8 x cp 1 x pp 1 "
        "x dp 1 = 8, not the 4 ranks (see --help)"), r.stderr


def rate_math(w):
    """The rate model's math in a layer's work: its own terms but the host overhead."""
    return sum(t for k, t in w.terms.items() if not k.split(":")[1].startswith(
        ("tp ", "host overhead")))


def tp_terms(w):
    return {k: t for k, t in w.terms.items() if k.split(":")[1].startswith("tp ")}


@pytest.mark.quick
def test_a_trainer_fit_replaces_the_layers_own_work_and_keeps_their_collectives():
    """A fit measured on this model (tp 1, no recompute) is each layer's own time: its part per
    token scales by the rate model's math (tp 2 shards the GEMMs), its part per microbatch
    does not; tp's collectives stay the rate model's; the step adds the fit's host work. On
    another model (or element size) the fit does not apply."""
    cfg = PRESETS["tiny"]
    cluster = dataclasses.replace(CLUSTER, trainer_fit=FIT)
    rows, n = 4, 4 * cfg.seq_len
    plain = P.Predictor(cfg, CLUSTER, 16, dtype=torch.float32)
    fit = P.Predictor(cfg, cluster, 16, dtype=torch.float32)
    one = fit._layer("none", 1, 1, 1, rows, 1)
    assert set(one.terms) == {"f:measured layer (trainer fit)", "i:measured layer (trainer fit)",
                              "w:measured layer (trainer fit)"}
    assert one.f + one.i + one.w == pytest.approx(2e-3 + 1e-5 * n)
    ends = fit._layer("none", 1, 1, 1, rows, 0), fit._layer("none", 1, 1, 1, rows,
                                                             cfg.layers + 1)
    assert sum(w.f + w.i + w.w for w in ends) == pytest.approx(3e-3 + 2e-5 * n)
    # the head's vocabulary GEMM and loss are most of the ends' math: most of the fit's part
    # per token is the head's
    assert ends[1].f + ends[1].i + ends[1].w > 2 * (ends[0].f + ends[0].i + ends[0].w)
    # one thread's fit: a rank with two cores does the per-token part twice as fast; four
    # ranks on two cores take twice as long for both parts
    for cpus, host, per_token in ((8, 1, 0.5), (2, 2, 2)):
        shared = dataclasses.replace(cluster, rates_per_core=True, cpus_per_host=cpus)
        w = P.Predictor(cfg, shared, 16, dtype=torch.float32)._layer("none", 1, 1, 1, rows, 1)
        assert w.f + w.i + w.w == pytest.approx(host * 2e-3 + per_token * 1e-5 * n)
    two, ref2, ref1 = (fit._layer("none", 2, 1, 1, rows, 1), plain._layer("none", 2, 1, 1, rows, 1),
                       plain._layer("none", 1, 1, 1, rows, 1))
    comm = tp_terms(ref2)
    assert comm and all(two.terms[k] == t for k, t in comm.items())
    own = two.f + two.i + two.w - sum(comm.values())
    assert own == pytest.approx(2e-3 + 1e-5 * n * rate_math(ref2) / rate_math(ref1))
    lay = parse("tp1.pp1.dp4.zero0.none.1f1b.mb2")
    assert fit.predict(lay).terms is not None
    assert fit.rank_terms(lay)[0]["red"]["trainer step host"] == 4e-3
    other = P.Predictor(dataclasses.replace(cfg, hidden=128), cluster, 16, dtype=torch.float32)
    assert "f:measured layer (trainer fit)" not in other._layer("none", 1, 1, 1, rows, 1).terms
    bf16 = P.Predictor(cfg, cluster, 16, dtype=torch.bfloat16)
    assert "f:measured layer (trainer fit)" not in bf16._layer("none", 1, 1, 1, rows, 1).terms


@pytest.mark.quick
def test_full_recompute_takes_the_fits_measured_extra():
    """Under full recompute a block's own work is the fit's block plus its measured recompute
    (a + b n more per microbatch), the recompute on I, the block split as without; the part
    per microbatch is not scaled by the rate model's recomputed host work (measured now); at
    tp 2 the per-token parts scale by the rate model's math (tp 2 over tp 1), and tp's
    collectives are the rate model's under recompute (run again); the ends are not
    recomputed; an MoE block (every block MoE: fitted on that model) takes it too. A fit
    without a measured recompute (a file from before) keeps the rate model's recomputed
    forward, scaled from the fit without."""
    cfg = PRESETS["tiny"]
    rows, n = 4, 4 * cfg.seq_len
    host = dataclasses.replace(CLUSTER, overhead_block_s=1e-3, overhead_end_s=1e-3,
                               cpus_per_host=4)  # the rate model's host work; a core a rank
    plain = P.Predictor(cfg, host, 16, dtype=torch.float32)
    fit = P.Predictor(cfg, dataclasses.replace(host, trainer_fit=FIT), 16, dtype=torch.float32)
    one, without = fit._layer("full", 1, 1, 1, rows, 1), fit._layer("none", 1, 1, 1, rows, 1)
    assert one.f + one.i + one.w == pytest.approx(2e-3 + 1.5e-3 + (1e-5 + 4e-6) * n)
    assert one.terms["i:measured recompute (trainer fit)"] == pytest.approx(1.5e-3 + 4e-6 * n)
    for phase in "fiw":  # the block itself split as without recompute
        assert one.terms[f"{phase}:measured layer (trainer fit)"] == pytest.approx(
            without.terms[f"{phase}:measured layer (trainer fit)"]), phase
    for end in (0, cfg.layers + 1):
        assert fit._layer("full", 1, 1, 1, rows, end).terms == \
            fit._layer("none", 1, 1, 1, rows, end).terms
    two, ref2, ref1 = (fit._layer("full", 2, 1, 1, rows, 1), plain._layer("full", 2, 1, 1, rows, 1),
                       plain._layer("full", 1, 1, 1, rows, 1))
    comm = tp_terms(ref2)  # run again in the recompute: the rate model's under full recompute
    assert comm and comm != tp_terms(plain._layer("none", 2, 1, 1, rows, 1))
    assert set(tp_terms(two)) == set(comm) and all(two.terms[k] == t for k, t in comm.items())
    own = two.f + two.i + two.w - sum(comm.values())
    none1, none2 = plain._layer("none", 1, 1, 1, rows, 1), plain._layer("none", 2, 1, 1, rows, 1)
    assert own == pytest.approx(3.5e-3 + 1.4e-5 * n * rate_math(none2) / rate_math(none1))
    before = P.Predictor(cfg, dataclasses.replace(host, trainer_fit=FIT._replace(
        recompute=None)), 16, dtype=torch.float32)._layer("full", 1, 1, 1, rows, 1)
    again = rate_math(ref1) / rate_math(none1)
    recomputed_host = sum(t for k, t in ref1.terms.items() if "host" in k) / \
        sum(t for k, t in none1.terms.items() if "host" in k)
    assert 1 < again < 2 and recomputed_host == pytest.approx(4 / 3)
    assert before.f + before.i + before.w == pytest.approx(2e-3 * 4 / 3 + 1e-5 * n * again)
    lay = parse("tp1.pp1.dp4.zero0.full.1f1b.mb2")
    assert fit.predict(lay).step_time_s > fit.predict(dataclasses.replace(
        lay, recompute="none")).step_time_s
    moe = dataclasses.replace(cfg, moe_experts=4, moe_top_k=2)
    moe_fit = FIT._replace(model=model_signature(moe, 4))
    block = P.Predictor(moe, dataclasses.replace(host, trainer_fit=moe_fit), 16,
                        dtype=torch.float32)._layer("full", 1, 1, 1, rows, 1)
    assert block.terms["i:measured recompute (trainer fit)"] == pytest.approx(1.5e-3 + 4e-6 * n)


@pytest.mark.quick
def test_zb_weight_passes_carry_the_split_backwards_measured_extra():
    """The trainer fit's zb extra (per block and microbatch, the ends' together) lands on W
    under zb only, each stage its layers' (a block's, half the ends' each), as long as the
    host's shared cores make host work; other schedules' actions are unchanged."""
    cfg = PRESETS["tiny"]
    shared = dataclasses.replace(CLUSTER, rates_per_core=True, cpus_per_host=2)
    plain = P.Predictor(cfg, dataclasses.replace(shared, trainer_fit=FIT._replace(
        zb=(0.0, 0.0))), 16, dtype=torch.float32)
    fit = P.Predictor(cfg, dataclasses.replace(shared, trainer_fit=FIT), 16,
                      dtype=torch.float32)
    for name in ("tp1.pp2.dp2.zero0.none.zb.mb4", "tp1.pp2.dp2.zero0.none.1f1b.mb4"):
        lay = parse(name, 4)
        a, b = plain.action_costs(lay), fit.action_costs(lay)
        bounds = fit.stages(lay)[2]
        for s in range(2):
            layers = range(bounds[s], bounds[s + 1])
            extra = 2 * sum(4e-4 if i in (0, cfg.layers + 1) else 5e-4 for i in layers)
            want = extra if lay.schedule == "zb" else 0.0
            for kind in ("F", "B", "I", "W"):
                assert b[s, 0, kind] - a[s, 0, kind] == pytest.approx(
                    want if kind == "W" else 0.0, abs=1e-15), (name, s, kind)


@pytest.mark.quick
def test_zero_steps_one_flat_shard_not_every_parameter_tensor():
    """The optimizer's host loop (clip + AdamW, ``overhead_tensor_s`` per tensor) runs over the
    rank's parameter tensors without ZeRO and over its one flat shard with it."""
    cfg = PRESETS["tiny"]
    host = dataclasses.replace(CLUSTER, cpus_per_host=4, overhead_tensor_s=1e-4)
    pred = P.Predictor(cfg, host, 16, dtype=torch.float32)
    tensors = pred.tensors(parse("tp1.pp1.dp4.zero0.none.1f1b.mb2"))[0][1]
    assert tensors > 10
    for zero, count in ((0, tensors), (1, 1), (2, 1), (3, 1)):
        lay = parse(f"tp1.pp1.dp4.zero{zero}.none.1f1b.mb2")
        assert pred.rank_terms(lay)[0]["red"]["optimizer host"] == pytest.approx(1e-4 * count)


@pytest.mark.quick
def test_accuracy_bench_splits_this_machine_into_namespaced_hosts():
    """bench/plan_accuracy.py --hosts 2: this machine's calibration of 4 ranks becomes 2 hosts
    of 2 ranks, each with half the cores (the namespaced hosts share them: a rank's share is
    unchanged), joined by the measured link; a cross-host dp group then pays the link."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plan_accuracy", os.path.join(ROOT, "bench", "plan_accuracy.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    one = dataclasses.replace(CLUSTER, cpus_per_host=2, rates_per_core=True)
    link = Link(5e-4, 1e8, "gloo")
    two = bench.across(one, argparse.Namespace(hosts=2, ranks=4), link)
    assert (two.hosts, two.ranks_per_host, two.cpus_per_host, two.inter) == (2, 2, 1, link)
    assert two.share == one.share == 0.5
    cfg, lay = PRESETS["tiny"], parse("tp1.pp1.dp4.zero0.none.1f1b.mb2")
    red = [P.Predictor(cfg, c, 16, dtype=torch.float32).rank_terms(lay)[0]["red"]
           for c in (one, two)]
    assert red[1]["dp all-reduce"] > red[0]["dp all-reduce"] + 2 * 5e-4, red


@pytest.mark.quick
def test_accuracy_bench_reports_its_own_spread():
    """bench/plan_accuracy.py's summary says how far each layout's rounds lie apart (slowest
    over fastest - 1: median and max over the layouts), failed rounds left out, one round
    saying nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plan_accuracy", os.path.join(ROOT, "bench", "plan_accuracy.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = [{"rounds_s": [0.050, 0.040, 0.060]}, {"rounds_s": [0.100, None, 0.110]},
            {"rounds_s": [0.020, 0.030, 0.021]}, {"rounds_s": [0.070, None, None]}]
    got = bench.round_spread(rows)
    assert got["rounds_spread_median"] == pytest.approx(0.5)  # 0.1, 0.5, 0.5
    assert got["rounds_spread_max"] == pytest.approx(0.5)
    assert bench.round_spread(rows[1:2]) == {"rounds_spread_median": pytest.approx(0.1),
                                             "rounds_spread_max": pytest.approx(0.1)}
    assert bench.round_spread([{"rounds_s": [0.05]}]) == {"rounds_spread_median": None,
                                                          "rounds_spread_max": None}


@pytest.mark.quick
def test_link_fit_keeps_the_latency_of_a_slow_link():
    """fitting.fit: an exact alpha-beta curve comes back; on a slow link (1 Gbit/s, 0.4 ms a
    step) whose 16 MiB point is 170x its 4 KiB one, with 5% noise, the latency is still found
    (in seconds the large sizes would decide alone and zero it)."""
    from fastpar.plan.calibrate import LINK_SIZES
    from fastpar.plan.fitting import fit

    for alpha, bw in ((4e-4, 1.2e8), (6e-5, 2.5e9)):
        exact = [(s, 2 * alpha + s / bw) for s in LINK_SIZES]  # 2 ranks: 2 steps, factor 1
        assert fit(2, exact) == pytest.approx((alpha, bw), rel=1e-9)
        rng = random.Random(7)
        noisy = [(s, t * (1 + rng.uniform(-0.05, 0.05))) for s, t in exact]
        got = fit(2, noisy)
        assert got[0] == pytest.approx(alpha, rel=0.2) and got[1] == pytest.approx(bw, rel=0.1)
    assert fit(2, [(s, s / 1e9) for s in LINK_SIZES]) == pytest.approx((0.0, 1e9))


def body_trainer_fit():
    """training.fit.trainer_fit on a one-rank job's process (its own Trainers, as --calibrate):
    the fit and what it said on standard error."""
    import contextlib
    import io

    import torch

    from fastpar.models import PRESETS
    from fastpar.training.fit import trainer_fit

    torch.set_num_threads(1)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        fit = trainer_fit(PRESETS["tiny"], membw=5e9, tensor_s=1e-5, rows=2, steps=5, warmup=2)
    return list(fit), err.getvalue()


def test_trainer_fit_trains_the_plans_model_and_fits_nonnegative_terms():
    from tests.multirank import run_ranks

    fit, said = run_ranks(1, body_trainer_fit, timeout=120).values()[0]
    sig, block, end, step, zb, full = fit
    assert sig == model_signature(PRESETS["tiny"], 4)
    assert all(x >= 0 for x in (*block, *end, step, *zb))
    # the full-recompute points trained (their failure would say "no recompute fit"); their
    # extra is positive, or None where this machine's noise hid it (three differences of
    # fastest steps: test_recompute_fit_recovers_the_extra checks the fit itself)
    assert "note" not in said, said
    assert full is None or (min(full) >= 0 and full[0] + full[1] > 0), full
    # a step of the tiny model on 2 blocks of 2 rows takes milliseconds here, not nothing
    assert 1e-4 < block[0] + end[0] + 2 * 64 * (block[1] + end[1]) + step < 1.0


@pytest.mark.quick
def test_recompute_fit_recovers_the_extra(capsys):
    """training.fit.recompute_fit on steps that follow a + b n per block and microbatch exactly
    (the points' own steps without recompute beside them): (a, b) times the scale; None when
    the recompute finds nothing extra, and None, said, when a point cannot train."""
    from fastpar.training.fit import recompute_fit

    rows, T, a, b = 8, 64, 1.5e-3, 4e-6
    points = [(layers, r, m) for layers in (1, 3) for r in (1, rows // 2, rows) for m in (1, 2)]
    lows = [0.01 + 0.002 * layers * m + 1e-6 * r * T for layers, r, m in points]

    def step_s(layers, batch, microbatches, recompute="none"):
        assert recompute == "full" and microbatches == 2
        r = batch // microbatches
        base = lows[points.index((layers, r, microbatches))]
        return base + microbatches * layers * (a + b * r * T), base

    got = recompute_fit(step_s, points, lows, T, rows, 1.25)
    assert got == pytest.approx((1.25 * a, 1.25 * b), rel=1e-9)

    def no_extra(layers, batch, microbatches, recompute="none"):
        return lows[points.index((layers, batch // microbatches, microbatches))] - 1e-4, 0.0

    assert recompute_fit(no_extra, points, lows, T, rows, 1.0) is None

    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")

    assert recompute_fit(fails, points, lows, T, rows, 1.0) is None
    assert "no recompute fit (RuntimeError: out of memory)" in capsys.readouterr().err


@pytest.mark.quick
@pytest.mark.parametrize("preset,change", [
    ("small", {}), ("small", {"memory_bytes": 30 * 2**20}),
    ("tiny", {"trainer_fit": FIT}),
    ("tiny", {"cpus_per_host": 2, "rates_per_core": True}),
    ("tiny", {"hosts": 2, "ranks_per_host": 2, "inter": Link(5e-5, 1e8)}),
    ("small", {"ranks_per_host": 8, "memory_bytes": 60 * 2**20})])
def test_pruned_search_is_the_exhaustive_one(preset, change):
    cfg, cluster = PRESETS[preset], dataclasses.replace(CLUSTER, **change)
    full = search(cfg, cluster, 16, dtype=torch.float32)
    pred = P.Predictor(cfg, cluster, 16, dtype=torch.float32)
    for p in full.all():  # the bound the search prunes with is a bound
        assert pred.lower_bound(p.layout) <= p.step_time_s * (1 + 1e-12), p.layout.name
    for k in (1, 3, 10):
        pruned = search(cfg, cluster, 16, dtype=torch.float32, top=k)
        assert [(p.layout, p.step_time_s, p.memory) for p in pruned.ranked] == \
            [(p.layout, p.step_time_s, p.memory) for p in full.ranked[:k]]
        assert pruned.dropped == full.dropped
        assert pruned.predicted < len(full.all()) or len(full.ranked) <= k


def test_layout_auto_refuses_layout_flags_and_chooses_deterministically(tmp_path):
    from fastpar.training import auto_layout
    from fastpar.training.args import model_config, parse_args

    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "fastpar.train", "--layout", "auto", "--tp", "2",
                        "--zero", "--recomp", "full"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (
        "python -m fastpar.train: error: --layout auto chooses the layout: drop --tp, --zero, "
        "--recompute (see --help)"), r.stderr
    with pytest.raises(ValueError, match="not 2 hosts of equal, consecutive ranks"):
        auto_layout.job_shape(("a", "b", "a", "b"), 4)
    assert auto_layout.job_shape(("a", "a", "b", "b"), 4) == (2, 2)
    args = parse_args(["--preset", "tiny", "--layout", "auto"])
    cfg = model_config(args)
    cluster = CLUSTER.with_ranks(1, 2)
    best = auto_layout.best_layouts(args, cfg, cluster, torch.float32)
    assert [p.layout.name for p in best] == [p.layout.name for p in search(
        cfg, cluster, 16, dtype=torch.float32).ranked[:2]]
    assert best[0].layout.name == "tp1.pp1.dp2.zero1.none.1f1b.mb8"
    line = auto_layout.say(best[0], 0)
    assert line.startswith("chose tp1.pp1.dp2.zero1.none.1f1b.mb8 (tp 1 x pp 1 x dp 2, ZeRO-1")


