"""Pipeline schedules as pure action lists: valid for every layout, the bubble theory predicts,
1F1B's memory bound, and a validator that catches broken lists (no processes needed)."""

import os
import subprocess
import sys

import pytest

from fastpar.pipeline import Action, ScheduleError, compile_schedule, theoretical_bubble, validate
from fastpar.pipeline.schedules import gpipe, one_f_one_b
from fastpar.pipeline.timeline import render
from tests.multirank import ROOT

LAYOUTS = [(pp, m) for pp in (2, 4) for m in sorted({1, pp - 1, pp, 2 * pp + 1})]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", LAYOUTS)
def test_schedules_are_valid_and_complete(name, pp, m):
    lists = compile_schedule(name, pp, m)  # validates
    for r, acts in enumerate(lists):
        for kind in ("F", "B"):
            assert sorted(a.mb for a in acts if a.kind == kind) == list(range(m)), (r, kind)
        assert all(a.kind != "RF" for a in acts) if r == 0 else True
        assert all(a.kind != "SF" for a in acts) if r == pp - 1 else True
    _, bubble = render(lists)
    assert bubble == pytest.approx(theoretical_bubble(name, pp, m))


@pytest.mark.parametrize("pp, m", LAYOUTS)
def test_1f1b_keeps_at_most_pp_minus_rank_activations(pp, m):
    def peak(acts):
        alive = most = 0
        for a in acts:
            alive += (a.kind == "F") - (a.kind == "B")
            most = max(most, alive)
        return most

    for r in range(pp):
        assert peak(one_f_one_b(pp, m, r)) == min(pp - r, m), r
        assert peak(gpipe(pp, m, r)) == m, r  # GPipe keeps every microbatch's activations


def test_validator_catches_broken_lists():
    good = compile_schedule("1f1b", 2, 3)
    # Rank 1 receives microbatch 1 first: it would get microbatch 0's activation.
    swapped = [list(good[0]), list(good[1])]
    i, j = swapped[1].index(Action("RF", 0)), swapped[1].index(Action("RF", 1))
    swapped[1][i], swapped[1][j] = swapped[1][j], swapped[1][i]
    with pytest.raises(ScheduleError, match=r"rank 1, action 0 \(RF1\): expects microbatch 1 "
                                            r"\(chunk 0\) from rank 0, but the next message on "
                                            r"that channel is microbatch 0"):
        validate(swapped)
    # Both ranks receive before they send: each waits for the other forever.
    cycle = [[Action("RB", 0), Action("F", 0), Action("SF", 0)],
             [Action("RF", 0), Action("F", 0), Action("B", 0), Action("SB", 0)]]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits forever at action 0 "
                                            r"\(RB0\)"):
        validate(cycle)
    # A send nobody receives.
    extra = [good[0] + [Action("SF", 7)], good[1]]
    with pytest.raises(ScheduleError, match="rank 0 sends activation of microbatch 7 .* to rank "
                                            "1, which never receives it"):
        validate(extra)
    # A backward before its forward.
    early = [[Action("B", 0), Action("F", 0)]]
    with pytest.raises(ScheduleError, match="backward of microbatch 0 before its forward"):
        validate(early)
    # Sending past the last stage.
    with pytest.raises(ScheduleError, match="no stage 1 to send to"):
        validate([[Action("F", 0), Action("SF", 0)]])


def test_bad_configurations_name_the_numbers():
    with pytest.raises(ValueError, match="microbatches must be a positive integer, got 0"):
        compile_schedule("1f1b", 2, 0)
    with pytest.raises(ValueError, match="pp must be a positive integer, got -1"):
        compile_schedule("gpipe", -1, 4)
    with pytest.raises(ValueError, match="unknown schedule 'zz'"):
        compile_schedule("zz", 2, 2)


def test_show_command():
    proc = subprocess.run([sys.executable, "-m", "fastpar.pipeline", "show", "--pp", "4",
                           "--microbatches", "8", "--schedule", "1f1b", "--actions"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rank 3: ...0aa1bb2cc3dd4ee5ff6gg7hh......" in proc.stdout, proc.stdout
    assert "bubble: 0.273 in this timeline, 0.273 in theory" in proc.stdout
    assert "rank 1: RF0 F0 SF0 RF1 F1 SF1 RF2 F2 SF2 RB0 B0 SB0" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "fastpar.pipeline", "show", "--pp", "2",
                          "--microbatches", "0"], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "microbatches must be a positive integer, got 0" in bad.stderr
