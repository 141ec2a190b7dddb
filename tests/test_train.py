"""The main job (``fastpar.train``): every layout trains the same model as one process.

One launch per world size runs several short trainings in turn (``Trainer(...).run()``, then
``fastpar.shutdown()``), tiny preset, 10 steps, the same seed and global batch:
- 4 ranks: tp 2 x pp 2 (saving at steps 5 and 10), its exact resume from step 5, tp 2 x dp 2
  (a tp group smaller than the world), pp 2 x dp 2 with ZeRO-1, and tp 2 x pp 2 interleaved with
  tied embeddings, sequence parallelism and the layers' communication overlapped (--overlap on);
  in bf16: tp 2 x pp 2 (saving), its exact resume, tp 2 x dp 2, pp 2 x dp 2;
- 2 ranks: --layout auto on fixed calibration data (the planner's choice: dp 2, ZeRO-1, 8
  microbatches), pp 2, tp 2, dp 2, and dp 2 resumed from the tp 2 x pp 2 checkpoint (resharding); in
  bf16: dp 2, tp 2 with sequence parallelism, dp 2 resumed from the bf16 tp 2 x pp 2 checkpoint;
- 1 rank: the serial runs (plain, tied, bf16), a resume of the 4-rank checkpoints, and the errors
  for a truncated checkpoint, one of a different model and a batch the layout cannot cut.
Loss curves must agree with the serial one to a relative 1e-3 (the issue's bound; in practice
~1e-7), bf16 layouts the bf16 serial one as closely relative to bf16's roundoff
(``check_bf16_layouts``), and the same-layout resume bitwise in both dtypes. A bf16 run stays
within its derived drift of the float32 run over 100 steps. Then, under mpirun: a killed rank
ends the job quickly, named; SIGINT while checkpoints are being written leaves a loadable one.
"""

import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.multirank import (ROOT, launch, launch_argv, launch_env, mpich_segments_removed,
                             run_ranks)

BASE = ["--preset", "tiny", "--steps", "10", "--log-every", "10", "--no-progress", "--plot", "",
        "--timeout", "60"]
PARITY = 1e-3  # relative, per step (issue 11)
BF16 = ["--dtype", "bfloat16"]
UNIT = {"float32": 2.0**-24, "bfloat16": 2.0**-8}  # unit roundoff u (round to nearest)


def body_runs(runs):
    """Each (name, argv) trained in turn; {name: [[step, loss, val_loss or None], ...]} or
    {name: "ValueError: ..."} for a run that raised ValueError."""
    import fastpar
    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer

    out = {}
    for name, argv in runs:
        try:
            trainer = Trainer(parse_args(BASE + argv))
            records = trainer.run()
            out[name] = [[r["step"], r["loss"], r.get("val_loss")] for r in records]
            a = trainer.args  # the layout it ran (--layout auto: the planner's)
            out[name + ":layout"] = [a.tp, a.pp, a.cp, a.zero, a.recompute, a.schedule,
                                     a.virtual_stages, a.microbatches]
            out[name + ":memory"] = trainer.memory_rows  # every rank's, gathered
            out[name + ":cp_type"] = trainer.args.cp_type  # --cp-type auto: what it chose
        except ValueError as exc:
            out[name] = f"ValueError: {exc}"
        finally:
            fastpar.shutdown()
    return out


def body_serial_format(root):
    """A checkpoint in the serial format of earlier releases (written here the way they wrote
    it) still resumes: 5 steps, saved serially, then resumed to 10."""
    import fastpar
    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer
    from fastpar.checkpoint import serial as checkpoint
    from fastpar.training.save_resume import masters_in_place
    from fastpar.training.serial_optimizer import serial_optimizer_state

    t = Trainer(parse_args(BASE))
    first = [t.train_step(step)[0] for step in range(5)]
    with t.setup.gathered(), masters_in_place(t.opt):
        weights = fastpar.full_state_dict(t.model)
    tensors, scalars = serial_optimizer_state(t.pipe, t.opt)
    checkpoint.save(root, 5, model=weights, optimizer=tensors,
                    meta={**t.checkpoints.meta(), "optimizer_scalars": scalars})
    fastpar.shutdown()
    resumed = Trainer(parse_args(BASE + ["--resume", root])).run()
    fastpar.shutdown()
    return {"first": first, "resumed": [[r["step"], r["loss"]] for r in resumed]}


def body_notes(argv):
    """The notes (``[fastpar.train] note: ...``) one run prints, and its records' rates."""
    import contextlib
    import io

    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        records = Trainer(parse_args(BASE + argv)).run()
    return [[line for line in out.getvalue().splitlines() if "note:" in line],
            {r["step"]: r["lr"] for r in records}]


def cosine_rate(step, steps, warmup, lr=2e-3, floor=0.1):
    """The trainer's schedule, written out: linear warm-up, cosine decay to floor x lr."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, steps - warmup))
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def curve(result):
    return {int(step): loss for step, loss, _ in result}


def assert_parity(name, got, ref, bound=PARITY):
    assert isinstance(got, list), (name, got)
    g, r = curve(got), curve(ref)
    assert set(g) <= set(r) and g, (name, sorted(g), sorted(r))
    worst = max(abs(g[s] - r[s]) / abs(r[s]) for s in g)
    assert worst < bound, (name, worst, g, r)
    return worst


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    ck, ck16 = str(tmp_path_factory.mktemp("ckpt")), str(tmp_path_factory.mktemp("ckpt16"))
    ckz16 = str(tmp_path_factory.mktemp("ckptz16"))
    ckz1, ckz3 = str(tmp_path_factory.mktemp("ckptz1")), str(tmp_path_factory.mktemp("ckptz3"))
    memory_metrics = str(tmp_path_factory.mktemp("metrics") / "m.jsonl")
    runs = [("tp2pp2", ["--tp", "2", "--pp", "2", "--save", ck, "--save-every", "5"]),
            ("tp2pp2.resume", ["--tp", "2", "--pp", "2", "--resume",
                               os.path.join(ck, "step_00000005")]),
            ("tp2dp2", ["--tp", "2"]),
            ("pp2dp2.zero", ["--pp", "2", "--zero", "--save", ckz1, "--save-every", "5"]),
            ("tp2dp2.zero2", ["--tp", "2", "--zero", "2"]),
            # saved at tp 2 x pp 2 without ZeRO, resumed at pp 2 x dp 2 under ZeRO-3
            ("pp2dp2.zero3.resume", ["--pp", "2", "--zero", "3", "--resume",
                                     os.path.join(ck, "step_00000005")]),
            ("dp4.zero3.tied", ["--zero", "3", "--tie-embeddings", "--save", ckz3,
                                "--save-every", "5"]),
            # saved at dp 4 under ZeRO-3 (flat ranges), resumed at tp 2 x pp 2 without ZeRO
            ("tp2pp2.tied.resume.z3", ["--tp", "2", "--pp", "2", "--tie-embeddings", "--resume",
                                       os.path.join(ckz3, "step_00000005")]),
            ("tp2pp2.interleaved.tied.sp", ["--tp", "2", "--pp", "2", "--virtual-stages", "2",
                                            "--schedule", "interleaved", "--tie-embeddings",
                                            "--sequence-parallel", "--overlap", "on"]),
            ("tp2pp2.bf16", ["--tp", "2", "--pp", "2", *BF16, "--save", ck16,
                             "--save-every", "5"]),
            ("tp2pp2.bf16.resume", ["--tp", "2", "--pp", "2", *BF16, "--resume",
                                    os.path.join(ck16, "step_00000005")]),
            ("tp2dp2.bf16", ["--tp", "2", *BF16]),
            ("pp2dp2.bf16", ["--pp", "2", *BF16]),
            # ZeRO's float32 masters start from the float32 initial weights, are saved as the
            # weights with float32 state, and resume bitwise
            ("pp2dp2.zero.bf16", ["--pp", "2", "--zero", *BF16, "--save", ckz16,
                                  "--save-every", "5"]),
            ("pp2dp2.zero.bf16.resume", ["--pp", "2", "--zero", *BF16, "--resume",
                                         os.path.join(ckz16, "step_00000005")]),
            # int8 reductions (with error feedback) and ZeRO-3's int8 weight gathers
            ("dp4.quant", ["--quantize-grads", "int8", "--error-feedback"]),
            ("dp4.zero3.quant", ["--zero", "3", "--quantize-weights", "int8",
                                 "--quantize-grads", "int8", "--error-feedback"]),
            # ZeRO-3 per unit at pp 1 (the default there) kept gathered across microbatches,
            # with full recompute; per unit under a pipeline (the option), selective recompute;
            # ZeRO-2 per unit in bfloat16
            ("dp4.zero3.keep.full", ["--zero", "3", "--zero-keep-gathered", "--recompute",
                                     "full"]),
            ("pp2dp2.zero3.unit.sel", ["--pp", "2", "--zero", "3", "--zero-granularity", "unit",
                                       "--recompute", "selective"]),
            ("dp4.zero2.bf16", ["--zero", "2", *BF16]),
            # memory only (test_memory_is_measured_beside_its_prediction): 2 steps; ZeRO-3 per
            # unit under 1F1B with 3 units a stage (a unit's gradients counted per backward,
            # not per forward: two forwards run before their backwards)
            ("pp2dp2.zero3.unit.l4", ["--pp", "2", "--zero", "3", "--zero-granularity", "unit",
                                      "--layers", "4", "--steps", "2"]),
            ("pp2dp2.zero2.full", ["--pp", "2", "--zero", "2", "--recompute", "full",
                                   "--steps", "2", "--metrics", memory_metrics])]
    values = run_ranks(4, body_runs, runs=runs, timeout=360).values()
    assert all(v == values[0] for v in values), "ranks disagree on the losses"
    return values[0], ck, ck16, memory_metrics, ckz1, ckz3


def test_layouts_train_alike_and_checkpoints_reshard(four_ranks, tmp_path):
    four, ck, ck16, _, ckz1, ckz3 = four_ranks
    step5 = os.path.join(ck, "step_00000005")
    step5b = os.path.join(ck16, "step_00000005")
    from tests.test_plan import CLUSTER  # fixed speeds: the planner's choice is deterministic

    fixed = str(tmp_path / "cluster.json")
    CLUSTER.save(fixed)
    two = run_ranks(2, body_runs, runs=[
        ("auto", ["--layout", "auto", "--cluster", fixed]),
        ("pp2", ["--pp", "2"]), ("tp2", ["--tp", "2"]), ("dp2", []),
        ("dp2.resume", ["--resume", step5]),
        ("dp2.zero3", ["--zero", "3"]), ("dp2.zero2.sel", ["--zero", "2", "--recompute",
                                                            "selective"]),
        ("dp2.bf16", BF16), ("tp2.sp.bf16", ["--tp", "2", "--sequence-parallel", *BF16]),
        ("dp2.bf16.resume", [*BF16, "--resume", step5b])], timeout=240).values()
    assert two[0] == two[1]
    two = two[0]
    truncated = str(tmp_path / "truncated")
    shutil.copytree(step5, truncated)
    with open(os.path.join(truncated, "rank_00001.safetensors"), "r+b") as f:
        f.truncate(100)
    one = run_ranks(1, body_runs, runs=[
        ("serial", []), ("serial.tied", ["--tie-embeddings"]),
        ("serial.resume", ["--resume", ck]),  # the parent dir: its latest, step 10 -> nothing
        ("serial.resume10", ["--resume", step5]),
        ("truncated", ["--resume", truncated]),
        ("other-model", ["--layers", "3", "--resume", step5]),
        ("other-seed", ["--seed", "1", "--resume", step5]),
        ("save-over", ["--save", ck]),
        ("serial.bf16", BF16), ("serial.bf16.resume10", [*BF16, "--resume", step5b]),
        # from ZeRO-1 over pp 2 x dp 2 and ZeRO-3 over dp 4 to one rank
        ("serial.resume.z1", ["--resume", os.path.join(ckz1, "step_00000005")]),
        ("serial.tied.resume.z3", ["--tie-embeddings", "--resume",
                                   os.path.join(ckz3, "step_00000005")])],
        timeout=240).values()[0]
    serial = one["serial"]
    assert len(serial) == 10 and serial[-1][1] < serial[0][1] - 0.5, serial  # it learns
    for name in ("tp2pp2", "tp2dp2", "pp2dp2.zero", "tp2dp2.zero2", "dp4.zero3.keep.full",
                 "pp2dp2.zero3.unit.sel"):
        assert_parity(name, four[name], serial)
    assert_parity("pp2dp2.zero3.resume", four["pp2dp2.zero3.resume"], serial)
    # --quantize-*: on one host the tiny model's calls are under policy.QUANT_SHM_MIN_BYTES,
    # so they stay full precision (the flags' wiring and memory are what runs here; int8
    # across hosts trains in test_cluster_jobs; the reductions' bounds, and int8 with error
    # feedback over several steps through DataParallel and ZeRO-2 on one host, forced, are
    # test_quantized's body_training)
    for name in ("dp4.quant", "dp4.zero3.quant"):
        assert_parity(name, four[name], serial, bound=1e-3)
    assert_parity("dp4.zero3.tied", four["dp4.zero3.tied"], one["serial.tied"])
    assert_parity("interleaved.tied.sp", four["tp2pp2.interleaved.tied.sp"], one["serial.tied"])
    for name in ("pp2", "tp2", "dp2", "auto", "dp2.zero3", "dp2.zero2.sel"):
        assert_parity(name, two[name], serial)
    # --layout auto ran the planner's best layout of 2 ranks on the fixed cluster
    assert two["auto:layout"] == [1, 1, 1, 1, "none", "1f1b", 1, 8], two["auto:layout"]
    # Resume: the same layout continues bitwise; other layouts continue the same curve.
    resumed = curve(four["tp2pp2.resume"])
    assert sorted(resumed) == list(range(6, 11))
    assert all(resumed[s] == curve(four["tp2pp2"])[s] for s in resumed), resumed
    assert_parity("dp2.resume", two["dp2.resume"], serial)
    assert_parity("serial.resume.z1", one["serial.resume.z1"], serial)
    assert_parity("serial.tied.resume.z3", one["serial.tied.resume.z3"], one["serial.tied"])
    assert_parity("tp2pp2.tied.resume.z3", four["tp2pp2.tied.resume.z3"], one["serial.tied"])
    assert_parity("serial.resume10", one["serial.resume10"], serial)
    assert one["serial.resume"] == [], one["serial.resume"]  # step 10 of 10: nothing to do
    check_bf16_layouts(four, two, one)
    for runs, nranks in ((two, 2), (one, 1)):  # the memory report at 2 ranks and serially
        for name in runs:
            if name.endswith(":memory") and name != "serial.resume:memory":
                check_memory_rows(name, runs[name], nranks)
    assert one["serial.resume:memory"] == []  # no step ran: nothing measured, no report
    # Validation loss (same tokens under every layout) at step 10.
    vals = {n: r[-1][2] for n, r in (("serial", serial), ("tp2pp2", four["tp2pp2"]),
                                      ("dp2", two["dp2"]))}
    assert max(vals.values()) - min(vals.values()) < PARITY * vals["serial"], vals
    # Errors name what is wrong.
    assert "incomplete or corrupt" in one["truncated"] and "rank_00001.safetensors (rank 1's " \
        "part) has 100 bytes" in one["truncated"], one["truncated"]
    assert "different model" in one["other-model"] and "layers: checkpoint 2, this run 3" in \
        one["other-model"], one["other-model"]
    assert "another data stream: seed: checkpoint 0, this run 1" in one["other-seed"], \
        one["other-seed"]
    assert "already holds checkpoints past step 0 (step_00000005, step_00000010)" in \
        one["save-over"], one["save-over"]
    # Another --steps changes the learning-rate schedule: the run says so, with the rates,
    # and runs at the new schedule's rates from the resumed step on.
    # The serial format of earlier releases resumes exactly (the same layout: bitwise).
    old_format = run_ranks(1, body_serial_format, root=str(tmp_path / "v1")).values()[0]
    assert [s for s, _ in old_format["resumed"]] == list(range(6, 11)), old_format
    assert all(loss == curve(serial)[s] for s, loss in old_format["resumed"]), old_format
    assert old_format["first"] == [curve(serial)[s] for s in range(1, 6)]
    notes, rates = run_ranks(1, body_notes, argv=["--steps", "20", "--resume", step5]).values()[0]
    old, new = cosine_rate(5, 10, 1), cosine_rate(5, 20, 2)
    assert notes == [f"[fastpar.train] note: the learning-rate schedule changes (steps "
                     f"10 -> 20, warmup 1 -> 2): at step 5 the rate goes from {old:.3g} to "
                     f"{new:.3g}"], notes
    # a record's lr is the rate the next step will run at (the scheduler has stepped)
    assert all(abs(r - cosine_rate(int(s), 20, 2)) < 1e-12 for s, r in rates.items()), rates
    notes, rates = run_ranks(1, body_notes, argv=["--steps", "10", "--resume", step5]).values()[0]
    assert notes == [] and all(abs(r - cosine_rate(int(s), 10, 1)) < 1e-12
                               for s, r in rates.items())


MOE = ["--moe-experts", "4", "--moe-top-k", "2"]


def test_moe_layouts_train_alike_and_experts_reshard(tmp_path):
    """The GPT with MoE blocks (4 experts, top-2, every block) trains the same curve as one
    process at ep 2 x pp 2, ep 2 x tp 2 and ep 2 inside dp 4 (edp 2: expert gradients over the
    edp group, divided by dp), its router losses (balanced per sequence: layout-free) and
    expert load too; a checkpoint saved at ep 2 x pp 2 resumes at ep 4 and on one rank (experts
    regathered and resharded), continuing the curve; every other block MoE at ep 2 x pp 2, and
    full recompute under the zero-bubble schedule (the statistics counted once)."""
    ck = str(tmp_path / "moe")
    step5 = os.path.join(ck, "step_00000005")
    every = ["--moe-every", "2", "--layers", "3", "--steps", "6"]
    four = run_ranks(4, body_runs_full, runs=[
        ("ep2pp2", [*MOE, "--ep", "2", "--pp", "2", "--save", ck, "--save-every", "5"]),
        ("ep2tp2", [*MOE, "--ep", "2", "--tp", "2"]),
        ("ep2dp4", [*MOE, "--ep", "2"]),
        ("ep4.resume", [*MOE, "--ep", "4", "--resume", step5]),
        ("every2.ep2pp2", [*MOE, *every, "--ep", "2", "--pp", "2"]),
        # full recompute under zero-bubble: the MoE forward (its all-to-alls) runs again in
        # the input-gradient pass, its statistics not counted twice
        ("rc.zb.ep2pp2", [*MOE, "--ep", "2", "--pp", "2", "--recompute", "full", "--schedule",
                          "zb", "--steps", "6"])], timeout=300).values()
    assert all(v == four[0] for v in four), "ranks disagree"
    four = four[0]
    one = run_ranks(1, body_runs_full, runs=[
        ("serial", MOE), ("serial.resume", [*MOE, "--resume", step5]),
        ("every2", [*MOE, *every]), ("six", [*MOE, "--steps", "6"])], timeout=240).values()[0]
    serial = one["serial"]
    assert serial[-1]["loss"] < serial[0]["loss"] - 0.5, serial  # it learns
    assert all(r["moe_dropped"] == 0 and r["moe_aux_loss"] > 0.9 for r in serial), serial
    for name in ("ep2pp2", "ep2tp2", "ep2dp4", "ep4.resume", "serial.resume"):
        got, ref = {r["step"]: r for r in four.get(name) or one[name]}, \
            {r["step"]: r for r in serial}
        assert sorted(got) == (list(range(6, 11)) if "resume" in name else
                               list(range(1, 11))), (name, sorted(got))
        for key in ("loss", "moe_aux_loss", "moe_z_loss"):
            worst = max(abs(got[s][key] - ref[s][key]) / abs(ref[s][key]) for s in got)
            assert worst < PARITY, (name, key, worst)
        for key in ("expert_load_min", "expert_load_max"):  # tokens per expert: the same routes
            # (a token whose two best experts tie to float32 rounding may take the other one
            # under another summation order: each such flip moves a load by one; none seen)
            assert all(abs(got[s][key] - ref[s][key]) <= 2 for s in got), (name, key)
    for name, serial_name in (("every2.ep2pp2", "every2"), ("rc.zb.ep2pp2", "six")):
        ref = {r["step"]: r for r in one[serial_name]}
        got = {r["step"]: r for r in four[name]}
        assert sorted(got) == sorted(ref) == list(range(1, 7)), (name, sorted(got))
        for key in ("loss", "moe_aux_loss"):
            assert max(abs(got[s][key] - ref[s][key]) / ref[s][key] for s in ref) < PARITY, \
                (name, key)
        # counted twice under recompute, the load would double; a routing flip moves it by one
        assert all(abs(got[s]["expert_load_max"] - ref[s]["expert_load_max"]) <= 2
                   for s in ref), name


def test_context_parallel_layouts_train_alike_and_reshard(tmp_path):
    """--cp 2 trains the serial curve: ring attention beside dp 2, Ulysses (chosen by --cp-type
    auto) and the ring under pp 2 (the pipeline carries (B, T/cp, H)), ring under tp 2 (each tp
    rank's heads over the cp ring) with ZeRO-1 sharding over dp x cp (here the cp pair);
    a checkpoint saved at cp 2 resumes on one process (cp shards no parameter) and continues
    the curve. The memory prediction (T/cp tokens per rank) stays within its 10%."""
    ck = str(tmp_path / "cp")
    step5 = os.path.join(ck, "step_00000005")
    four = run_ranks(4, body_runs, runs=[
        ("cp2dp2.ring", ["--cp", "2", "--save", ck, "--save-every", "5"]),
        # --cp-type auto: the tiny model's 4 heads divide by cp 2 in one host: Ulysses
        ("cp2pp2.ulysses", ["--cp", "2", "--cp-type", "auto", "--pp", "2"]),
        ("cp2pp2.ring", ["--cp", "2", "--pp", "2"]),  # the ring inside the pipeline too
        ("cp2tp2.ring.zero", ["--cp", "2", "--tp", "2", "--zero"])], timeout=240).values()
    assert all(v == four[0] for v in four), "ranks disagree"
    four = four[0]
    one = run_ranks(1, body_runs, runs=[("serial", []), ("serial.resume.cp2", [
        "--resume", step5])], timeout=120).values()[0]
    serial = one["serial"]
    assert len(serial) == 10 and serial[-1][1] < serial[0][1] - 0.5, serial  # it learns
    for name in ("cp2dp2.ring", "cp2pp2.ulysses", "cp2tp2.ring.zero", "cp2pp2.ring"):
        assert [s for s, _, _ in four[name]] == list(range(1, 11)), name
        assert_parity(name, four[name], serial)
        assert four[name][-1][2] is not None  # the validation loss, averaged over dp x cp
        assert abs(four[name][-1][2] - serial[-1][2]) < PARITY * serial[-1][2], name
        check_memory_rows(name, four[name + ":memory"], 4)  # T/cp tokens, dp x cp for ZeRO
    assert [s for s, _, _ in one["serial.resume.cp2"]] == list(range(6, 11))
    chosen = [four[n + ":cp_type"] for n in ("cp2dp2.ring", "cp2pp2.ulysses")]
    assert chosen == ["ring", "ulysses"], chosen
    assert_parity("serial.resume.cp2", one["serial.resume.cp2"], serial)


def body_runs_full(runs):
    """Each (name, argv) trained in turn: {name: its records, without the timings}."""
    import fastpar
    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer

    out = {}
    for name, argv in runs:
        try:
            out[name] = [{k: v for k, v in r.items() if k not in ("step_time_s", "tokens_per_s")}
                         for r in Trainer(parse_args(BASE + argv)).run()]
        finally:
            fastpar.shutdown()
    return out


def check_memory_rows(name, rows, nranks):
    """One run's memory rows (see ``test_memory_is_measured_beside_its_prediction``); returns
    the worst relative error of the activations."""
    from fastpar.plan.memory import CATEGORIES

    assert [row["memory"]["rank"] for row in rows] == list(range(nranks)), (name, rows)
    worst = 0.0
    for row in rows:
        r = row["memory"]
        assert set(row) == {"memory"} and set(r) == {"rank", "measured", "predicted",
                                                     "peak_rss"}, (name, row)
        assert list(r["measured"]) == list(r["predicted"]) == list(CATEGORIES), (name, r)
        for c in ("params", "grads", "optimizer", "buffers"):
            assert r["measured"][c] == r["predicted"][c], (name, c, r)
        got, want = r["measured"]["activations"], r["predicted"]["activations"]
        assert want > 0 and abs(got - want) <= 0.1 * want, (name, r)
        worst = max(worst, abs(got - want) / want)
        assert 0 < sum(r["measured"].values()) < r["peak_rss"], (name, r)
    return worst


def test_memory_is_measured_beside_its_prediction(four_ranks):
    """Every run's memory rows (one per rank, the same on every rank) have the contract's shape;
    parameters, gradients, optimizer state and buffers are measured exactly as predicted (each
    is a sum of tensor sizes the layout fixes), activations within 10% (the formula counts what
    autograd saves; dropout is 0 here); both fit inside the process's peak RSS. ``--metrics``
    gets exactly one contract record per rank."""
    from fastpar.training.metrics import read_records

    four, _, _, metrics, _, _ = four_ranks
    names = sorted(n for n in four if n.endswith(":memory"))
    assert len(names) == 22, names
    print("activations, worst relative error per run:",
          {name: check_memory_rows(name, four[name], 4) for name in names})
    records = [r for r in read_records(metrics) if "memory" in r]
    assert [r["memory"]["rank"] for r in records] == [0, 1, 2, 3], records
    assert records == [{"memory": {k: row["memory"][k] for k in ("rank", "measured", "predicted",
                                                                  "peak_rss")}}
                       for row in four["pp2dp2.zero2.full:memory"]], records


def check_bf16_layouts(four, two, one):
    """bf16 (float32 masters, float32 reductions): every layout follows 1-rank bf16 as closely,
    in units of bf16's roundoff 2^-8, as the float32 layouts follow 1-rank float32 in units of
    2^-24 (the worst float32 layout's distance, with a floor of 1 unit, times 4: the layouts
    round in other orders, and each rounding is 2^16 times coarser in bf16, as the unit is).
    The bf16 resume under the same layout is bitwise (float32 masters and AdamW state are in
    the checkpoint); under other layouts (dp 2, serial) it follows the same curve."""
    serial16 = one["serial.bf16"]
    assert len(serial16) == 10 and serial16[-1][1] < serial16[0][1] - 0.5, serial16
    units = {name: assert_parity(name, got, ref) / UNIT["float32"] for name, got, ref in (
        ("tp2pp2", four["tp2pp2"], one["serial"]), ("tp2dp2", four["tp2dp2"], one["serial"]),
        ("pp2dp2", four["pp2dp2.zero"], one["serial"]), ("dp2", two["dp2"], one["serial"]),
        ("tp2", two["tp2"], one["serial"]))}
    allowed = 4 * max(1.0, *units.values())
    for name, got in (("tp2pp2.bf16", four["tp2pp2.bf16"]), ("tp2dp2.bf16", four["tp2dp2.bf16"]),
                      ("pp2dp2.bf16", four["pp2dp2.bf16"]), ("dp2.bf16", two["dp2.bf16"]),
                      ("pp2dp2.zero.bf16", four["pp2dp2.zero.bf16"]),
                      ("dp4.zero2.bf16", four["dp4.zero2.bf16"]),
                      ("tp2.sp.bf16", two["tp2.sp.bf16"]),
                      ("dp2.bf16.resume", two["dp2.bf16.resume"]),
                      ("serial.bf16.resume10", one["serial.bf16.resume10"])):
        worst = assert_parity(name, got, serial16, bound=allowed * UNIT["bfloat16"])
        units[name] = worst / UNIT["bfloat16"]
    print("parity in units of each dtype's roundoff:", {k: round(v, 3) for k, v in units.items()})
    for run in ("tp2pp2.bf16", "pp2dp2.zero.bf16"):
        resumed = curve(four[f"{run}.resume"])
        assert sorted(resumed) == list(range(6, 11))
        assert all(resumed[s] == curve(four[run])[s] for s in resumed), (run, resumed)


def body_drift(steps):
    """The same seed trained ``steps`` steps in float32, in bfloat16, and in bfloat16 with the
    masters in bf16 too (AdamW on the bf16 weights and bf16 state, as fastpar.train did before
    MasterWeights): the three loss curves."""
    import functools

    import torch

    from fastpar.training import optimizer  # the trainer's set-up builds its MasterWeights

    def run(dtype):
        return (dtype, ["--steps", str(steps), "--global-batch", "8", "--dtype", dtype,
                        "--log-every", str(steps)])

    out = body_runs([run("float32"), run("bfloat16")])
    real = optimizer.MasterWeights
    optimizer.MasterWeights = functools.partial(real, master_dtype=torch.bfloat16)
    try:
        out["no-masters"] = body_runs([run("bfloat16")])["bfloat16"]
    finally:
        optimizer.MasterWeights = real
    return out


def test_bf16_follows_float32_within_its_drift():
    """100 steps of the tiny preset (global batch 8), one rank: the bf16 run's loss (float32
    masters and AdamW state, bf16 compute, float32 reductions) stays within 4 u = 2^-6 of the
    float32 run's, relative, at every step, u = 2^-8 being bf16's unit roundoff.

    Where 4 u comes from. At equal weights the bf16 forward's loss is off by much less than u:
    the rounding errors of the logits (relative <= u each) are independent over the 512 tokens'
    mean. What remains is the trajectory: with float32 masters the weights differ from the
    float32 run's only through each step's gradient, which bf16 computes with a relative error
    of a few u per element (every op on the path rounds its output once, <= u); AdamW's update
    m / sqrt(v) carries that relative error and no more, and the masters accumulate it as the
    float32 run accumulates its own rounding. The loss, a smooth function of the weights along
    a descending trajectory, then differs by a few u: 4 u, as ``fastpar.testing`` allows a few
    units per rounding step. Measured here: 1.8 u with masters; 5.9 u without them (AdamW on
    bf16 weights loses the updates below 2^-8 |w|, more of them as the rate decays), so the
    bound tells the two apart, and the no-master run must drift more than the master run."""
    got = run_ranks(1, body_drift, steps=100, timeout=300).values()[0]
    f32, b16, bare = curve(got["float32"]), curve(got["bfloat16"]), curve(got["no-masters"])
    assert sorted(f32) == sorted(b16) == sorted(bare) == list(range(1, 101))
    worst = max(abs(b16[s] - f32[s]) / f32[s] for s in f32)
    without = max(abs(bare[s] - f32[s]) / f32[s] for s in f32)
    u = UNIT["bfloat16"]
    print(f"bf16 vs float32 over 100 steps: worst relative loss drift {worst:.2e} = "
          f"{worst / u:.2f} u (bound 4 u = {4 * u:.2e}); without masters {without / u:.2f} u")
    assert worst < 4 * u, (worst, f32, b16)
    assert without > worst, (without, worst)


@pytest.fixture
def mpich_cleanup():
    """A job killed on purpose leaves MPICH's segment in /dev/shm: removed after the test."""
    with mpich_segments_removed():
        yield


def _mpirun_train(args):
    return subprocess.Popen(launch_argv("mpirun", 2, [
        sys.executable, "-m", "fastpar.train", *BASE[:2], "--steps", "100000", "--no-progress",
        "--plot", "", *args]), env=launch_env(2), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def _wait_lines(path, n, proc, deadline=90):
    end = time.monotonic() + deadline
    while time.monotonic() < end and proc.poll() is None:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {n} metrics lines in {deadline} s (exit {proc.poll()})")


def _rank_pids(marker):
    """{rank: pid} of the processes whose command line holds ``marker`` (MPICH's PMI_RANK)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
            if marker not in cmd or "fastpar.train" not in cmd:
                continue
            env = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace")
        except OSError:
            continue
        for item in env.split("\0"):
            if item.startswith("PMI_RANK="):
                found[int(item.split("=")[1])] = int(pid)
    return found


def test_killed_rank_ends_the_job_named(tmp_path, mpich_cleanup):
    """SIGKILL to rank 1 mid-training: the job ends well within --timeout (20 s of 60: a detection
    that fell back to the timeout could not pass) and the output names
    the dead process (MPICH names its pid; the banner maps pids to ranks)."""
    metrics = str(tmp_path / "m.jsonl")
    proc = _mpirun_train(["--pp", "2", "--timeout", "60", "--metrics", metrics])
    try:
        _wait_lines(metrics, 3, proc)
        pids = _rank_pids(metrics)
        assert set(pids) == {0, 1}, pids
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        out = proc.communicate(timeout=60)[0]
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert elapsed < 20, (elapsed, out[-2000:])
    assert f"1: pid {pids[1]}" in out, out[-2000:]  # the banner's map
    assert f"PID {pids[1]}" in out or "rank 1" in out, out[-2000:]


@pytest.mark.parametrize("how", ["sigint", "sigkill-rank1"])
def test_interrupted_saving_leaves_a_loadable_checkpoint(tmp_path, mpich_cleanup, how):
    """Ctrl-C (SIGINT to the job's process group, as a terminal sends it), or SIGKILL of one
    rank, while a checkpoint is written in the background every step: the latest complete one
    loads, training resumes from it, and its next save leaves no temporary files behind."""
    from fastpar.checkpoint import loading

    ck, metrics = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    proc = _mpirun_train(["--pp", "2", "--save", ck, "--save-every", "1", "--timeout", "20",
                          "--metrics", metrics])
    try:
        _wait_lines(metrics, 4, proc)
        if how == "sigint":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(_rank_pids(metrics)[1], signal.SIGKILL)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0, out[-2000:]
    _, index = loading.read_index(ck)
    step = index["step"]
    assert step >= 2, step  # step 4's save waited for step 3's commit; 2 at the latest
    resumed = run_ranks(1, body_runs, runs=[("resume", ["--resume", ck, "--steps",
                                                        str(step + 2), "--save", ck])],
                        timeout=120).values()[0]["resume"]
    assert [s for s, _, _ in resumed] == [step + 1, step + 2], resumed
    assert not [n for n in os.listdir(ck) if n.startswith(".")], os.listdir(ck)
    assert loading.read_index(ck)[1]["step"] == step + 2


BAD_FLAGS = [  # (argv, the one line each must print)
    (["--steps", "-3"], "--steps must be at least 1, got -3"),
    (["--tp", "0"], "--tp must be at least 1, got 0"),
    (["--global-batch", "0"], "--global-batch must be at least 1, got 0"),
    (["--lr", "nan"], "--lr must be a number > 0, got nan"),
    (["--clip", "-1"], "--clip must be a number >= 0, got -1.0"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio must be between 0 and 1, got 2.0"),
    (["--warmup", "-1"], "--warmup must be at least 0, got -1"),
    (["--timeout", "0"], "--timeout must be > 0 seconds"),
    (["--data", "/no/such/corpus"], "--data /no/such/corpus: no such file or directory"),
    (["--resume", "/no/such/ckpt"], "--resume /no/such/ckpt: no such file or directory"),
    (["--virtual-stages", "2"], "1f1b runs one model chunk per rank"),
    (["--schedule", "interleaved"], "interleaved needs virtual_stages >= 2"),
    (["--tp", "3"], "--tp 3 x --pp 1 = 3 does not divide the 2 launched ranks"),
    (["--global-batch", "10", "--microbatches", "4"],
     "global batch 10 is not divisible by dp 2 x microbatches 4 (world 2 = tp 1 x pp 1 x dp 2)"),
    (["--tp", "2", "--heads", "3"], "heads 3 is not divisible by tp 2"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--quantize-weights", "int8", "--zero", "2"],
     "--quantize-weights int8 quantizes ZeRO-3's parameter all-gather; add --zero 3 (this "
     "run: --zero 2)"),
    (["--error-feedback"], "--error-feedback carries the rounding of --quantize-grads"),
    (["--quantize-grads", "int4"], "argument --quantize-grads: invalid choice: 'int4'"),
    (["--ep", "2"], "--ep 2 shards experts: add --moe-experts N"),
    (["--moe-experts", "4", "--zero", "1"], "--zero 1 with --moe-experts: ZeRO does not shard"),
    (["--moe-experts", "4", "--ep", "4"], "--ep 4 does not divide dp 2 (world 2 / (tp 1 x pp 1))"),
    (["--moe-experts", "3", "--ep", "2"], "moe_experts 3 is not divisible by ep 2"),
    (["--moe-experts", "2", "--moe-top-k", "3"], "moe_top_k 3 is larger than moe_experts 2"),
    (["--moe-experts", "2", "--moe-capacity", "0"], "--moe-capacity must be a number > 0"),
    (["--cp", "0"], "--cp must be at least 1, got 0"),
    (["--cp", "4"], "--cp 4 does not divide world 2 / (tp 1 x pp 1) = 2"),
    (["--cp", "2", "--cp-type", "star"], "argument --cp-type: invalid choice: 'star'"),
    (["--cp", "2", "--sequence-parallel"], "--sequence-parallel with --cp 2: both split"),
    (["--cp", "2", "--moe-experts", "4"], "--moe-experts with --cp 2: not supported yet"),
    (["--cp", "2", "--seq-len", "30"], "seq_len 30 is not divisible by 2 x cp = 4"),
    (["--cp", "2", "--cp-type", "ulysses", "--heads", "1", "--hidden", "64"],
     "heads 1 / tp 1 = 1 per tp rank are not divisible by cp 2"),
]


def body_bad_flags(cases):
    """Each argv through the trainer's parser: (exit status, what it wrote to stderr)."""
    import contextlib
    import io

    from fastpar.training.args import parse_args

    out = []
    for argv, _ in cases:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                parse_args(argv)
                code = 0
            except SystemExit as exc:
                code = exc.code
        out.append([code, err.getvalue()])
    return out


@pytest.mark.quick
def test_bad_flags_are_one_line_and_exit_2_from_one_rank():
    rank0, rank1 = run_ranks(2, body_bad_flags, cases=BAD_FLAGS).values()
    for (argv, want), (code, text), (code1, text1) in zip(BAD_FLAGS, rank0, rank1):
        assert code == code1 == 2, (argv, code, code1)
        assert text == f"python -m fastpar.train: error: {text.split('error: ', 1)[1]}", text
        assert want in text and text.count("\n") == 1 and text.endswith("(see --help)\n"), \
            (argv, text)
        assert text1 == "", (argv, text1)  # rank 1 exits as quietly: one line per job
    # The whole command line under mpirun: one line for the job, status 2, nothing trained.
    proc = launch([sys.executable, "-m", "fastpar.train", "--steps", "-3"], nranks=2,
                  launcher="mpirun", timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if "fastpar.train" in line]
    assert lines == ["python -m fastpar.train: error: --steps must be at least 1, got -3 "
                     "(0 with --save-hf: a conversion) (see --help)"], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and "[fastpar.train]" not in proc.stdout


def test_a_failed_run_says_so_once_and_ends_the_job(tmp_path):
    """A runtime error (here a damaged checkpoint, found by every rank) is one line from the
    first rank that sees it, no traceback, and the whole job ends with status 1; with
    FASTPAR_DEBUG=1 the traceback is there."""
    ck = str(tmp_path / "ck")
    run_ranks(1, body_runs, runs=[("save", ["--steps", "2", "--save", ck])])
    step = os.path.join(ck, "step_00000002")
    with open(os.path.join(step, "rank_00000.safetensors"), "r+b") as f:
        f.truncate(100)
    argv = [sys.executable, "-m", "fastpar.train", *BASE, "--steps", "4", "--resume", step]
    proc = launch(argv, nranks=2, launcher="mpirun", timeout=120)
    assert proc.returncode != 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "fastpar.train: error" in line]
    assert len(said) == 1 and said[0].startswith("python -m fastpar.train: error on rank ") \
        and "incomplete or corrupt" in said[0] and said[0].endswith(
            "(FASTPAR_DEBUG=1 shows the traceback)"), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    # FASTPAR_DEBUG=1: the exception itself goes on (its traceback, MPI's abort hook)
    raised = run_ranks(1, body_main, argv=argv[3:], env={"FASTPAR_DEBUG": "1"}).values()[0]
    assert raised.startswith("ValueError: ") and "incomplete or corrupt" in raised, raised


def body_main(argv):
    from fastpar.train import main

    try:
        main(argv)
    except Exception as exc:  # noqa: BLE001 - what main let through is the result
        return f"{type(exc).__name__}: {exc}"
    return None
