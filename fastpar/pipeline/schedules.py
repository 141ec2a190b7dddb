"""Pipeline schedules compiled to per-rank action lists, and the validator that proves them.

A schedule is a pure function ``(pp, microbatches, rank, virtual_stages=1) -> [Action]``; nothing
here touches a process group, so every schedule is checked on the host for every rank before a
step runs (``validate``), and ``python -m fastpar.pipeline show`` prints it.

Each rank holds ``virtual_stages`` (v) model chunks; local chunk ``c`` of rank ``r`` is model
stage ``c * pp + r`` of ``pp * v``. Actions, for microbatch ``mb`` of the acting rank's local
chunk ``chunk``::

    F   forward                               B   full backward (input and weight gradients)
    I   input gradient only (then SB)         W   weight gradient of an earlier I, same rank
    SF  send activation to stage + 1          RF  receive activation from stage - 1
    SB  send gradient to stage - 1            RB  receive gradient from stage + 1

Routing (``route``): stage + 1 of (r, c) is rank (r + 1) % pp, chunk c + 1 if r == pp - 1 else c;
stage - 1 mirrors it. Stage 0 has no RF or SB, the last stage computes the loss and has no SF or
RB. With pp == 1 every message goes to the rank itself (the executor keeps a local FIFO).

Sends are asynchronous (buffered) and receives block; messages from one rank to another arrive
in the order they were sent, one FIFO channel per (src, dst, direction): activations ("F") and
gradients ("B") travel on separate channels, as P2P without tags on two groups. The validator
simulates exactly that.
"""

from __future__ import annotations

import collections
import dataclasses

KINDS = ("F", "B", "SF", "RF", "SB", "RB", "I", "W")  # order is stable: board.py indexes it
COMPUTE = ("F", "B", "I", "W")


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # one of KINDS
    mb: int  # microbatch
    chunk: int = 0  # the acting rank's local chunk: model stage chunk * pp + rank

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


class ScheduleError(ValueError):
    pass


def route(kind: str, rank: int, chunk: int, pp: int) -> tuple[int, int]:
    """``(rank, chunk)`` at the other end of send or receive ``kind`` on ``(rank, chunk)``: SF and
    RB talk to model stage + 1, RF and SB to stage - 1. The chunk is negative or ``>= v`` when
    that stage does not exist (``stage // pp``, e.g. stage -1 -> (pp - 1, -1))."""
    stage = chunk * pp + rank + (1 if kind in ("SF", "RB") else -1)
    return stage % pp, stage // pp


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


def _check_passes(lists: list[list[Action]], v: int, microbatches: int) -> None:
    """Per rank, without running anything: known kinds, chunks and stages that exist, and every
    (chunk, mb) run forward exactly once and backward exactly once (one B, or one I and a later
    W), each backward after its forward."""
    pp = len(lists)
    for r, acts in enumerate(lists):
        seen: dict[tuple[str, int, int], int] = {}  # (kind, chunk, mb) -> position
        for p, a in enumerate(acts):
            where = f"rank {r}, action {p} ({a})"
            if a.kind not in KINDS:
                raise ScheduleError(f"rank {r}, action {p}: unknown kind {a.kind!r}")
            if not 0 <= a.chunk < v:
                raise ScheduleError(f"{where}: no chunk {a.chunk} with virtual_stages={v}")
            if not 0 <= a.mb < microbatches:
                raise ScheduleError(f"{where}: no microbatch {a.mb} with "
                                    f"microbatches={microbatches}")
            if a.kind not in COMPUTE:
                peer, peer_chunk = route(a.kind, r, a.chunk, pp)
                if not 0 <= peer_chunk < v:
                    verb = "send to" if a.kind[0] == "S" else "receive from"
                    raise ScheduleError(f"{where}: no stage {peer_chunk * pp + peer} to {verb}")
                if (a.kind, a.chunk, a.mb) in seen:
                    raise ScheduleError(f"{where}: {a.kind} of this microbatch runs twice "
                                        f"(actions {seen[a.kind, a.chunk, a.mb]} and {p})")
                # a send needs what it sends: the forward's output, the backward's input grad
                needs = {"SF": ("F",), "SB": ("B", "I")}.get(a.kind, ())
                if needs and not any((k, a.chunk, a.mb) in seen for k in needs):
                    raise ScheduleError(f"{where}: sends microbatch {a.mb} before computing it "
                                        f"({' or '.join(needs)} of chunk {a.chunk} comes later)")
                seen[a.kind, a.chunk, a.mb] = p
                continue
            name = f"rank {r}, chunk {a.chunk}, microbatch {a.mb}"
            if (a.kind, a.chunk, a.mb) in seen:
                raise ScheduleError(f"{name}: {a.kind} runs twice (actions "
                                    f"{seen[a.kind, a.chunk, a.mb]} and {p})")
            if a.kind in ("B", "I") and ("F", a.chunk, a.mb) not in seen:
                raise ScheduleError(f"{where}: backward of microbatch {a.mb} before its forward "
                                    f"(chunk {a.chunk})")
            # a compute action needs its message first: F its activation (but on stage 0),
            # B / I its output's gradient (but on the last stage)
            stage = a.chunk * pp + r
            need = "RF" if a.kind == "F" and stage > 0 else \
                "RB" if a.kind in ("B", "I") and stage < pp * v - 1 else None
            if need and (need, a.chunk, a.mb) not in seen:
                raise ScheduleError(f"{where}: runs before its {need} (the "
                                    f"{'activation' if need == 'RF' else 'gradient'} of "
                                    f"microbatch {a.mb} for chunk {a.chunk} is received later "
                                    f"or never)")
            if a.kind in ("B", "I") and ("I" if a.kind == "B" else "B", a.chunk, a.mb) in seen:
                raise ScheduleError(f"{name}: runs backward twice (both B and I)")
            if a.kind == "W" and ("I", a.chunk, a.mb) not in seen:
                raise ScheduleError(f"{where}: weight gradient (W) of microbatch {a.mb} before "
                                    f"its input gradient (I)")
            seen[a.kind, a.chunk, a.mb] = p
        for chunk in range(v):
            for mb in range(microbatches):
                name = f"rank {r}, chunk {chunk}, microbatch {mb}"
                if ("F", chunk, mb) not in seen:
                    raise ScheduleError(f"{name}: never runs forward")
                if ("B", chunk, mb) not in seen and ("I", chunk, mb) not in seen:
                    raise ScheduleError(f"{name}: never runs backward")
                if ("I", chunk, mb) in seen and ("W", chunk, mb) not in seen:
                    raise ScheduleError(f"{name}: input gradient (I) without its weight "
                                        f"gradient (W)")


def validate(lists: list[list[Action]], virtual_stages: int = 1,
             microbatches: int | None = None) -> None:
    """Prove a set of per-rank lists (``virtual_stages`` chunks per rank, ``microbatches``
    microbatches; default one more than the largest seen) runs: each (rank, chunk, mb) forward
    exactly once and backward exactly once after it (``_check_passes``); then simulate every
    rank (buffered sends, blocking receives, FIFO channels) and prove every receive meets its
    own send, every send is received and no rank waits forever. Else ``ScheduleError`` naming
    the first (rank, position, action) at fault."""
    pp, v = len(lists), virtual_stages
    if microbatches is None:
        microbatches = 1 + max((a.mb for acts in lists for a in acts), default=-1)
    _check_passes(lists, v, microbatches)
    channel: dict[tuple, collections.deque] = {}  # (src, dst, "F"/"B") -> [(mb, dst chunk)]
    pos = [0] * pp
    while True:
        progressed = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if a.kind in ("SF", "SB"):
                    dst, dst_chunk = route(a.kind, r, a.chunk, pp)
                    channel.setdefault((r, dst, a.kind[1]), collections.deque()).append(
                        (a.mb, dst_chunk))
                elif a.kind in ("RF", "RB"):
                    src, _ = route(a.kind, r, a.chunk, pp)
                    queue = channel.get((src, r, a.kind[1]))
                    if not queue:
                        break  # blocked: try the other ranks
                    if queue[0] != (a.mb, a.chunk):
                        raise ScheduleError(
                            f"rank {r}, action {pos[r]} ({a}): expects microbatch {a.mb} "
                            f"(chunk {a.chunk}) from rank {src}, but the next message on that "
                            f"channel is microbatch {queue[0][0]} (chunk {queue[0][1]})")
                    queue.popleft()
                pos[r] += 1
                progressed = True
        if all(pos[r] == len(lists[r]) for r in range(pp)):
            break
        if not progressed:
            stuck = [(r, pos[r], str(lists[r][pos[r]])) for r in range(pp)
                     if pos[r] < len(lists[r])]
            r, p, a = stuck[0]
            raise ScheduleError(f"deadlock: rank {r} waits forever at action {p} ({a}); every "
                                f"waiting rank: {stuck}")
    unreceived = {k: q for k, q in channel.items() if q}
    if unreceived:
        (src, dst, kind), queue = next(iter(unreceived.items()))
        mb, chunk = queue[0]
        raise ScheduleError(f"rank {src} sends {'activation' if kind == 'F' else 'gradient'} "
                            f"of microbatch {mb} (chunk {chunk}) to rank {dst}, which never "
                            f"receives it")


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
