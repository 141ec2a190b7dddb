"""Pipeline schedules as pure action lists: every layout valid or refused by name, each pass run
exactly once, the bubble theory predicts, the memory bounds, a validator that catches broken
lists, and the ``show`` command (no processes needed)."""

import pytest

from fastpar.pipeline import Action, ScheduleError, compile_schedule, theoretical_bubble, validate
from fastpar.pipeline.__main__ import main
from fastpar.pipeline.schedules import (SCHEDULES, gpipe, interleaved, one_f_one_b, route,
                                        zero_bubble_h1)
from fastpar.pipeline.timeline import render, simulate

pytestmark = pytest.mark.quick  # every test here: the quick tier

LAYOUTS = [(pp, m) for pp in (1, 2, 4) for m in sorted({1, pp - 1, pp, 2 * pp + 1} - {0})]


def refusal(name, pp, m, v):
    """The text of the ValueError that layout must raise, or None when it must compile."""
    if name in ("1f1b", "zb") and v > 1:
        return f"{name} runs one model chunk per rank: virtual_stages={v} needs " \
               f"schedule='interleaved'"
    if name == "interleaved" and v < 2:
        return f"interleaved needs virtual_stages >= 2 (model chunks per rank): got " \
               f"virtual_stages={v}"
    if name == "interleaved" and m % pp:
        return f"interleaved needs microbatches divisible by pp: got microbatches={m}, pp={pp}"
    return None


def check_each_pass_once(lists, pp, m, v, name):
    """Count the passes in the lists directly (independently of ``validate``)."""
    for r, acts in enumerate(lists):
        for chunk in range(v):
            stage = chunk * pp + r
            for mb in range(m):
                at = {k: [i for i, a in enumerate(acts) if (a.kind, a.mb, a.chunk) ==
                          (k, mb, chunk)] for k in ("F", "B", "I", "W", "RF", "SF", "RB", "SB")}
                where = (name, r, chunk, mb)
                assert len(at["F"]) == 1, where
                if name == "zb":  # split backward: one I, then one W
                    assert at["B"] == [] and len(at["I"]) == len(at["W"]) == 1, where
                    assert at["F"][0] < at["I"][0] < at["W"][0], where
                else:
                    assert len(at["B"]) == 1 and at["I"] == at["W"] == [], where
                    assert at["F"][0] < at["B"][0], where
                # stage 0 receives no activation and sends no gradient; the last stage the reverse
                assert len(at["RF"]) == len(at["SB"]) == (stage > 0), where
                assert len(at["SF"]) == len(at["RB"]) == (stage < pp * v - 1), where


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("pp, m", LAYOUTS)
@pytest.mark.parametrize("v", [1, 2])
def test_every_layout_compiles_or_is_refused_by_name(name, pp, m, v):
    why = refusal(name, pp, m, v)
    if why is not None:
        with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
            compile_schedule(name, pp, m, v)
        with pytest.raises(ValueError, match="virtual_stages=|microbatches="):
            theoretical_bubble(name, pp, m, v)
        return
    lists = compile_schedule(name, pp, m, v)  # validates
    check_each_pass_once(lists, pp, m, v, name)
    _, bubble = render(lists)
    theory = theoretical_bubble(name, pp, m, v)
    if name == "zb" and m < pp:  # too few W's to fill the drain: the formula assumes m >= pp
        assert bubble > theory
    else:
        assert bubble == pytest.approx(theory, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("pp", [1, 2, 4])
@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_runs_every_chunk_in_order(pp, v, groups):
    m = groups * pp
    lists = compile_schedule("interleaved", pp, m, v)
    check_each_pass_once(lists, pp, m, v, "interleaved")
    assert render(lists)[1] == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-15)
    # the first virtual microbatches: chunk 0 of microbatches 0..pp-1, then chunk 1 of them
    forwards = [(a.chunk, a.mb) for a in lists[0] if a.kind == "F"]
    assert forwards[:2 * pp] == [(0, mb) for mb in range(pp)] + [(1, mb) for mb in range(pp)]


def test_routing_wraps_around_and_sends_to_self_with_one_rank():
    assert route("SF", 3, 0, 4) == (0, 1)  # last rank's chunk 0 -> first rank's chunk 1
    assert route("RF", 0, 1, 4) == (3, 0)
    assert route("SB", 0, 1, 4) == (3, 0)
    assert route("RB", 3, 0, 4) == (0, 1)
    assert route("SF", 1, 1, 4) == (2, 1)
    assert route("SF", 0, 0, 1) == (0, 1) and route("SB", 0, 1, 1) == (0, 0)
    assert route("RF", 0, 0, 4) == (3, -1)  # before stage 0: no such chunk
    # pp = 1, v = 2: chunk 0 hands its activation to chunk 1 through the rank's own FIFO
    lists = compile_schedule("gpipe", 1, 2, 2)
    assert " ".join(map(str, lists[0])) == ("F0 SF0 F1 SF1 RF0.1 F0.1 RF1.1 F1.1 B1.1 SB1.1 "
                                            "B0.1 SB0.1 RB1 B1 RB0 B0")
    assert render(lists)[1] == 0.0


@pytest.mark.parametrize("pp", [2, 4])
def test_zb_and_interleaved_beat_1f1b(pp):
    for m in sorted({1, pp - 1, pp, 2 * pp + 1, 8}):
        one_f_one_b_bubble = render(compile_schedule("1f1b", pp, m))[1]
        zb = render(compile_schedule("zb", pp, m))[1]
        assert zb < one_f_one_b_bubble if m >= 2 else zb <= one_f_one_b_bubble, (m, zb)
        if m >= pp and m % pp == 0:
            for v in (2, 3):
                assert render(compile_schedule("interleaved", pp, m, v))[1] < one_f_one_b_bubble
    # ZB-H1 reaches a third of 1F1B's idle time: 3m + p - 1 units instead of 3(m + p - 1)
    assert render(compile_schedule("zb", pp, 8))[1] == pytest.approx((pp - 1) / (24 + pp - 1))


def peak_in_flight(acts):
    """Most microbatches with the forward done but the backward (B, or W after I) not yet."""
    alive = most = 0
    for a in acts:
        alive += (a.kind == "F") - (a.kind in ("B", "W"))
        most = max(most, alive)
    return most


@pytest.mark.parametrize("pp, m", LAYOUTS)
def test_activations_in_flight(pp, m):
    for r in range(pp):
        assert peak_in_flight(one_f_one_b(pp, m, r)) == min(pp - r, m), r
        assert peak_in_flight(gpipe(pp, m, r)) == m, r  # GPipe keeps every microbatch's
        assert peak_in_flight(gpipe(pp, m, r, 2)) == 2 * m, r
        # ZB-H1 defers W's so that every rank holds what 1F1B holds on rank 0, never more
        assert peak_in_flight(zero_bubble_h1(pp, m, r)) == min(pp, m), r
        if m % pp == 0:
            assert peak_in_flight(interleaved(pp, m, r, 2)) <= 2 * m, r


def test_validator_catches_broken_lists():
    good = compile_schedule("1f1b", 2, 3)
    # Rank 1 receives (and runs) microbatch 1 first: it would get microbatch 0's activation.
    g = compile_schedule("gpipe", 2, 3)
    swapped = [list(g[0]), list(g[1])]
    assert swapped[1][:4] == [Action("RF", 0), Action("F", 0), Action("RF", 1), Action("F", 1)]
    swapped[1][:4] = [Action("RF", 1), Action("F", 1), Action("RF", 0), Action("F", 0)]
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(RF1\): expects microbatch 1 "
                                            r"\(chunk 0\) from rank 0, but the next message on "
                                            r"that channel is microbatch 0 \(chunk 0\)"):
        validate(swapped)
    # Rank 0 never sends microbatch 2's activation: rank 1 waits for it, rank 0 for its gradient.
    missing = [[a for a in good[0] if a != Action("SF", 2)], good[1]]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits forever at action 9 "
                                            r"\(RB2\); every waiting rank: \[\(0, 9, 'RB2'\), "
                                            r"\(1, 8, 'RF2'\)\]"):
        validate(missing)
    # Both ranks receive before they send: each waits for the other forever.
    cycle = [[Action("RB", 0), Action("F", 0), Action("SF", 0), Action("B", 0)],
             [Action("RF", 0), Action("F", 0), Action("B", 0), Action("SB", 0)]]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits forever at action 0 "
                                            r"\(RB0\); every waiting rank: \[\(0, 0, 'RB0'\), "
                                            r"\(1, 0, 'RF0'\)\]"):
        validate(cycle)
    # A backward before its forward; past the last stage.
    with pytest.raises(ScheduleError, match="backward of microbatch 0 before its forward"):
        validate([[Action("B", 0), Action("F", 0)]])
    with pytest.raises(ScheduleError, match=r"rank 0, action 1 \(SF0\): no stage 1 to send to"):
        validate([[Action("F", 0), Action("SF", 0), Action("B", 0)]])
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(RF0\): no stage -1 to receive"):
        validate([[Action("RF", 0), Action("F", 0), Action("B", 0)]])


def test_validator_checks_each_message_against_its_compute():
    """Orders the simulation alone would accept but the executor cannot run: a compute before
    the message it needs, a send before the compute that makes it, a message sent twice."""
    good = compile_schedule("1f1b", 2, 3)

    def moved(r, kind, mb, to):
        acts = [list(good[0]), list(good[1])]
        a = Action(kind, mb)
        acts[r].remove(a)
        acts[r].insert(to, a)
        return acts

    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(F0\): runs before its RF "
                                            r"\(the activation of microbatch 0"):
        validate(moved(1, "RF", 0, 1))
    with pytest.raises(ScheduleError, match=r"rank 0, action 0 \(SF0\): sends microbatch 0 "
                                            r"before computing it \(F of chunk 0"):
        validate(moved(0, "SF", 0, 0))
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ \(B0\): runs before its RB "
                                            r"\(the gradient of microbatch 0"):
        acts = [list(good[0]), list(good[1])]
        i = acts[0].index(Action("RB", 0))
        acts[0][i], acts[0][i + 1] = acts[0][i + 1], acts[0][i]
        validate(acts)
    with pytest.raises(ScheduleError, match=r"rank 1, action \d+ \(SB0\): sends microbatch 0 "
                                            r"before computing it \(B or I"):
        acts = [list(good[0]), list(good[1])]
        i = acts[1].index(Action("SB", 0))
        acts[1].insert(acts[1].index(Action("B", 0)), acts[1].pop(i))
        validate(acts)
    with pytest.raises(ScheduleError, match=r"SF of this microbatch runs twice"):
        validate([good[0] + [Action("SF", 0)], good[1]])


def test_validator_checks_each_pass_once_with_chunks_and_split_backwards():
    zb = compile_schedule("zb", 2, 3)
    # W before its I on the same rank.
    early_w = [list(zb[0]), zb[1]]
    i, w = early_w[0].index(Action("I", 0)), early_w[0].index(Action("W", 0))
    early_w[0][i], early_w[0][w] = early_w[0][w], early_w[0][i]
    with pytest.raises(ScheduleError, match=r"rank 0, action \d+ \(W0\): weight gradient \(W\) "
                                            r"of microbatch 0 before its input gradient \(I\)"):
        validate(early_w)
    with pytest.raises(ScheduleError, match=r"rank 1, chunk 0, microbatch 2: input gradient "
                                            r"\(I\) without its weight gradient \(W\)"):
        validate([zb[0], [a for a in zb[1] if a != Action("W", 2)]])
    with pytest.raises(ScheduleError, match="rank 1, chunk 0, microbatch 1: runs backward twice"):
        validate([zb[0], zb[1] + [Action("B", 1)]])
    # A duplicated forward, on chunk 1 of an interleaved schedule (names rank, chunk, mb).
    inter = compile_schedule("interleaved", 2, 2, 2)
    dup = [inter[0] + [Action("F", 1, 1)], inter[1]]
    with pytest.raises(ScheduleError, match=r"rank 0, chunk 1, microbatch 1: F runs twice "
                                            r"\(actions \d+ and \d+\)"):
        validate(dup, 2)
    # A forward that never runs: microbatch 1 of chunk 1 on rank 1.
    gone = [inter[0], [a for a in inter[1] if (a.mb, a.chunk) != (1, 1)]]
    with pytest.raises(ScheduleError, match="rank 1, chunk 1, microbatch 1: never runs forward"):
        validate(gone, 2, 2)
    # Rank 1 (chunk 0) never sends microbatch 0 across the wrap to rank 0's chunk 1.
    no_wrap = [inter[0], [a for a in inter[1] if a != Action("SF", 0, 0)]]
    with pytest.raises(ScheduleError, match=r"rank 0, action 4 \(RF0\.1\): expects microbatch 0 "
                                            r"\(chunk 1\) from rank 1, but the next message on "
                                            r"that channel is microbatch 1 \(chunk 1\)"):
        validate(no_wrap, 2)
    # Chunk 1 with one chunk per rank, microbatch 2 of two: neither exists.
    with pytest.raises(ScheduleError, match=r"rank 0, action 4 \(RF0\.1\): no chunk 1 with "
                                            r"virtual_stages=1"):
        validate(inter, 1)
    with pytest.raises(ScheduleError, match=r"rank 0, action 2 \(F2\): no microbatch 2 with "
                                            r"microbatches=2"):
        validate(compile_schedule("gpipe", 1, 3), 1, 2)


def test_simulate_returns_spans_per_rank():
    spans = simulate(compile_schedule("zb", 2, 2))
    assert [[(s, e, str(a)) for s, e, a in row] for row in spans] == [
        [(0, 1, "F0"), (1, 2, "F1"), (3, 4, "I0"), (4, 5, "W0"), (5, 6, "I1"), (6, 7, "W1")],
        [(1, 2, "F0"), (2, 3, "I0"), (3, 4, "F1"), (4, 5, "I1"), (5, 6, "W0"), (6, 7, "W1")]]
    with pytest.raises(ValueError, match="deadlock"):
        simulate([[Action("RB", 0), Action("F", 0)], [Action("RF", 0)]])


def test_bad_configurations_name_the_numbers():
    with pytest.raises(ValueError, match="microbatches must be a positive integer, got 0"):
        compile_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="pp must be a positive integer, got -1"):
        compile_schedule("gpipe", -1, 4)
    with pytest.raises(ValueError, match="virtual_stages must be a positive integer, got 0"):
        compile_schedule("gpipe", 2, 4, 0)
    with pytest.raises(ValueError, match="unknown schedule 'zz'"):
        compile_schedule("zz", 2, 2)
    with pytest.raises(ValueError, match="rank 2 is outside the pipeline of 2 stages"):
        one_f_one_b(2, 4, 2)
    with pytest.raises(ValueError, match="interleaved needs virtual_stages >= 2"):
        interleaved(2, 4, 0)  # the default of every schedule is one chunk


def show(capsys, *args):
    try:
        code = main(["show", *args])
    except SystemExit as exc:  # a bad configuration: argparse-style, exit status 2
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_show_command(capsys):
    code, out, _ = show(capsys, "--pp", "4", "--microbatches", "8", "--schedule", "1f1b",
                        "--actions")
    assert code == 0
    assert "rank 3: ...0aa1bb2cc3dd4ee5ff6gg7hh......" in out, out
    assert "bubble: 0.273 in this timeline, 0.273 in theory ((p-1)/(m+p-1)" in out
    assert "rank 1: RF0 F0 SF0 RF1 F1 SF1 RF2 F2 SF2 RB0 B0 SB0" in out
    assert "legend: 0-9 F (forward)" in out
    code, out, _ = show(capsys, "--pp", "4", "--microbatches", "8", "--schedule", "gpipe")
    assert code == 0 and "bubble: 0.273 in this timeline, 0.273 in theory" in out
    code, out, _ = show(capsys, "--pp", "4", "--microbatches", "8", "--schedule", "zb")
    assert code == 0 and "rank 0: 0123...Aw4Bw5Cw6Dw7EwFwGwHw\n" in out, out
    assert "rank 3: ...0A1B2C3Dw4Ew5Fw6Gw7Hwwww\n" in out
    assert "bubble: 0.111 in this timeline, 0.111 in theory ((p-1)/(3m+p-1)" in out
    code, out, _ = show(capsys, "--pp", "4", "--microbatches", "8", "--schedule", "interleaved",
                        "--virtual-stages", "2")
    assert code == 0 and "rank 3: ...01230aa1bb2cc3dd4aa5bb6cc7dd4ee5ff6gg7hheeffgghh......" \
                         "\n chunk:    0000111111111111000000000000111111111111" in out, out
    assert "bubble: 0.158 in this timeline, 0.158 in theory ((p-1)/(vm+p-1)" in out


@pytest.mark.parametrize("args, why", [
    (["--pp", "2", "--microbatches", "0"], "microbatches must be a positive integer, got 0"),
    (["--pp", "2", "--microbatches", "5", "--schedule", "interleaved", "--virtual-stages", "2"],
     "interleaved needs microbatches divisible by pp: got microbatches=5, pp=2"),
    (["--pp", "2", "--microbatches", "4", "--schedule", "zb", "--virtual-stages", "2"],
     "zb runs one model chunk per rank: virtual_stages=2 needs schedule='interleaved'"),
])
def test_show_refuses_bad_configurations(capsys, args, why):
    code, out, err = show(capsys, *args)
    assert code == 2 and out == "" and \
        err == f"python -m fastpar.pipeline show: error: {why} (see --help)\n"
