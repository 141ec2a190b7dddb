"""Pipeline schedules compiled to per-rank action lists (``actions.py`` defines the words).

A schedule is a pure function ``(pp, microbatches, rank, virtual_stages=1) -> [Action]``; nothing
here touches a process group, so every schedule is checked on the host for every rank before a
step runs (``compile_schedule`` calls ``validator.validate``), and ``python -m fastpar.pipeline
show`` prints it. Also here: the bubble each schedule has in theory (``theoretical_bubble``).

The vocabulary (``Action``, ``KINDS``, ``COMPUTE``, ``route``) and the validator
(``validate``, ``ScheduleError``) live in their own modules and are importable from here too.
"""

from __future__ import annotations

import collections

from fastpar.pipeline.actions import COMPUTE, KINDS, Action, route
from fastpar.pipeline.validator import ScheduleError, validate

__all__ = ["COMPUTE", "KINDS", "SCHEDULES", "Action", "ScheduleError", "bubble_formula",
           "compile_schedule", "gpipe", "interleaved", "one_f_one_b", "route",
           "theoretical_bubble", "validate", "zero_bubble_h1"]


def _check_layout(name: str, pp: int, microbatches: int, virtual_stages: int) -> None:
    for label, value in (("pp", pp), ("microbatches", microbatches),
                         ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if name in ("1f1b", "zb") and virtual_stages != 1:
        raise ValueError(f"{name} runs one model chunk per rank: virtual_stages={virtual_stages} "
                         f"needs schedule='interleaved'")
    if name == "interleaved":
        if virtual_stages < 2:
            raise ValueError(f"interleaved needs virtual_stages >= 2 (model chunks per rank): got "
                             f"virtual_stages={virtual_stages}; use '1f1b' for one chunk")
        if microbatches % pp:
            raise ValueError(f"interleaved needs microbatches divisible by pp: got "
                             f"microbatches={microbatches}, pp={pp}")


def _check(name: str, pp: int, microbatches: int, rank: int, virtual_stages: int) -> None:
    _check_layout(name, pp, microbatches, virtual_stages)
    if not 0 <= rank < pp:
        raise ValueError(f"rank {rank} is outside the pipeline of {pp} stages")


def _forward(pp: int, v: int, rank: int, chunk: int, mb: int) -> list[Action]:
    stage = chunk * pp + rank
    acts = [Action("RF", mb, chunk)] if stage > 0 else []
    acts.append(Action("F", mb, chunk))
    if stage < pp * v - 1:
        acts.append(Action("SF", mb, chunk))
    return acts


def _backward(pp: int, v: int, rank: int, chunk: int, mb: int, kind: str = "B") -> list[Action]:
    """``kind`` "B" (full backward) or "I" (input gradient; its W is scheduled separately)."""
    stage = chunk * pp + rank
    acts = [Action("RB", mb, chunk)] if stage < pp * v - 1 else []
    acts.append(Action(kind, mb, chunk))
    if stage > 0:
        acts.append(Action("SB", mb, chunk))
    return acts


def gpipe(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """Every forward in model-stage order (chunk ascending, then microbatch), then every backward
    in reverse: the simplest schedule; it keeps all ``v * microbatches`` activations alive."""
    _check("gpipe", pp, microbatches, rank, virtual_stages)
    v = virtual_stages
    passes = [(chunk, mb) for chunk in range(v) for mb in range(microbatches)]
    acts = []
    for chunk, mb in passes:
        acts += _forward(pp, v, rank, chunk, mb)
    for chunk, mb in reversed(passes):
        acts += _backward(pp, v, rank, chunk, mb)
    return acts


def one_f_one_b(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """1F1B (PipeDream-flush): ``pp - rank - 1`` warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards. The same bubble as GPipe, but at most
    ``pp - rank`` activations alive."""
    _check("1f1b", pp, microbatches, rank, virtual_stages)
    warmup = min(pp - rank - 1, microbatches)
    acts = []
    for mb in range(warmup):
        acts += _forward(pp, 1, rank, 0, mb)
    for i in range(microbatches - warmup):
        acts += _forward(pp, 1, rank, 0, warmup + i)
        acts += _backward(pp, 1, rank, 0, i)
    for mb in range(microbatches - warmup, microbatches):
        acts += _backward(pp, 1, rank, 0, mb)
    return acts


def interleaved(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """Megatron's interleaved 1F1B over ``v`` chunks per rank. Virtual microbatch ``k`` (of
    ``m * v``) runs forward on chunk ``(k // pp) % v`` and backward on ``v - 1 - (k // pp) % v``,
    both for microbatch ``(k // (pp * v)) * pp + k % pp``: groups of ``pp`` microbatches sweep
    the chunks, so a chunk's output reaches the next rank just as that rank needs it.
    ``2 * (pp - rank - 1) + (v - 1) * pp`` warm-up forwards, then one forward and one backward
    in turn, then the remaining backwards.

    Megatron posts its receives early (batched isend/irecv); here receives block, yet the order
    needs no change: ``validate`` accepts it for every layout the tests try (pp 1, 2, 4; v 2, 3;
    microbatches pp, 2pp, 3pp), and for pp up to 8, v up to 4, microbatches up to 4pp."""
    _check("interleaved", pp, microbatches, rank, virtual_stages)
    v, total = virtual_stages, microbatches * virtual_stages

    def unit(k: int, forward: bool) -> tuple[int, int]:  # virtual microbatch -> (chunk, mb)
        chunk = (k // pp) % v
        return (chunk if forward else v - 1 - chunk), (k // (pp * v)) * pp + k % pp

    warmup = min(2 * (pp - rank - 1) + (v - 1) * pp, total)
    acts = []
    for k in range(warmup):
        acts += _forward(pp, v, rank, *unit(k, True))
    for k in range(total - warmup):
        acts += _forward(pp, v, rank, *unit(warmup + k, True))
        acts += _backward(pp, v, rank, *unit(k, False))
    for k in range(total - warmup, total):
        acts += _backward(pp, v, rank, *unit(k, False))
    return acts


def zero_bubble_h1(pp: int, microbatches: int, rank: int, virtual_stages: int = 1) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split
    into I (input gradient, sent on at once) and W (weight gradient, needed only by the
    optimizer). Only the I's lie on the critical path back to rank 0, so W's are deferred into
    what would be idle time: rank ``r`` keeps up to ``r`` W's pending in the steady state (rank 0
    runs F I W, the last rank lets ``pp - 1`` pile up), which makes every rank hold ``pp``
    microbatches in flight, 1F1B's peak on rank 0. In the cool-down each I is followed by one
    pending W, and the W's still pending run at the end.

    (The opposite deferral, ``pp - 1 - r`` W's so that the last stage runs F I W, leaves
    1F1B's bubble unchanged in ``timeline.py`` for m >= pp: rank 0's last I comes ``pp - 1``
    I's after the last stage's, and the last stage has no W left to run meanwhile.)"""
    _check("zb", pp, microbatches, rank, virtual_stages)
    warmup = min(pp - rank - 1, microbatches)
    pending: collections.deque[int] = collections.deque()  # microbatches whose W is owed
    acts = []
    for mb in range(warmup):
        acts += _forward(pp, 1, rank, 0, mb)
    for i in range(microbatches - warmup):
        acts += _forward(pp, 1, rank, 0, warmup + i)
        acts += _backward(pp, 1, rank, 0, i, kind="I")
        pending.append(i)
        if len(pending) > rank:
            acts.append(Action("W", pending.popleft()))
    for mb in range(microbatches - warmup, microbatches):
        acts += _backward(pp, 1, rank, 0, mb, kind="I")
        pending.append(mb)
        acts.append(Action("W", pending.popleft()))
    acts += [Action("W", mb) for mb in pending]
    return acts


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved,
             "zb": zero_bubble_h1}


def _known(name: str) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")


def compile_schedule(name: str, pp: int, microbatches: int,
                     virtual_stages: int = 1) -> list[list[Action]]:
    """Every rank's action list for schedule ``name``, validated."""
    _known(name)
    _check_layout(name, pp, microbatches, virtual_stages)
    lists = [SCHEDULES[name](pp, microbatches, r, virtual_stages) for r in range(pp)]
    validate(lists, virtual_stages, microbatches)
    return lists


def theoretical_bubble(name: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of ranks x makespan, assuming equal stage times, a chunk's backward B = 2F
    and its halves I = W = F, and free messages (``timeline.py``'s costs). p = pp, m =
    microbatches, v = virtual_stages; ``bubble_formula`` spells each one out.

    * gpipe and 1f1b: ``(p-1)/(m+p-1)``: p - 1 stage times of ramp-up and of drain.
    * gpipe with v chunks: the ramp is paid once, ``(p-1)/(vm+p-1)``, when m >= p; with m < p
      each later chunk pass also waits ``p - m`` for its first input: idle
      ``d = p-1 + (v-1)(p-m)``, bubble ``d/(vm+d)``. (Exact in the timeline.)
    * interleaved: ``(p-1)/(vm+p-1)``: the ramp is one chunk, 1/v of a stage (Megatron's
      ``(p-1)/(vm)`` of the ideal time, as a fraction of the total).
    * zb (ZB-H1): ``(p-1)/(3m+p-1)``: only F's ramp remains, the I's drain is filled with
      deferred W's (a third of 1F1B's idle time). Exact in the timeline when m >= p; with
      fewer microbatches there are too few W's to fill the drain and the timeline's idle is
      ``p-1 + (p-m)`` units, not ``p-1``.
    """
    _known(name)
    _check_layout(name, pp, microbatches, virtual_stages)
    p, m, v = pp, microbatches, virtual_stages
    if name == "gpipe":
        idle = p - 1 + (v - 1) * max(p - m, 0)
        return idle / (v * m + idle)
    work = {"1f1b": m, "interleaved": v * m, "zb": 3 * m}[name]
    return (p - 1) / (work + p - 1)


def bubble_formula(name: str, virtual_stages: int = 1) -> str:
    """``theoretical_bubble``'s formula for ``name`` as text (p = pp, m = microbatches)."""
    _known(name)
    if name == "gpipe" and virtual_stages > 1:
        return "d/(vm+d), d = p-1+(v-1)max(p-m,0)"
    return {"gpipe": "(p-1)/(m+p-1)", "1f1b": "(p-1)/(m+p-1)", "interleaved": "(p-1)/(vm+p-1)",
            "zb": "(p-1)/(3m+p-1)"}[name]
