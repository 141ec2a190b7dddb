"""Pipeline schedules compiled to per-rank action lists, and the validator that proves them.

A schedule is a pure function ``(pp, microbatches, rank, virtual_stages) -> [Action]``; nothing
here touches a process group, so every schedule is checked on the host for every rank before a
step runs (``validate``), and ``python -m fastpar.pipeline show`` prints it.

Actions, for microbatch ``mb`` of model chunk ``chunk`` (chunk = virtual stage index on this
rank; stage = chunk * pp + rank)::

    F   forward               B   backward (input and weight gradients)
    SF  send activation to the next stage       RF  receive activation from the previous
    SB  send gradient to the previous stage     RB  receive gradient from the next

Sends are asynchronous (buffered) and receives block; messages between two ranks arrive in the
order they were sent (one FIFO channel per direction and kind, as P2P without tags). The
validator simulates exactly that.
"""

from __future__ import annotations

import dataclasses

KINDS = ("F", "B", "SF", "RF", "SB", "RB")


@dataclasses.dataclass(frozen=True)
class Action:
    kind: str  # one of KINDS
    mb: int  # microbatch
    chunk: int = 0  # virtual stage index on this rank

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def _check(pp: int, microbatches: int, rank: int) -> None:
    for name, value in (("pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not 0 <= rank < pp:
        raise ValueError(f"rank {rank} is outside the pipeline of {pp} stages")


def _forward(rank: int, pp: int, mb: int) -> list[Action]:
    acts = [] if rank == 0 else [Action("RF", mb)]
    acts.append(Action("F", mb))
    if rank < pp - 1:
        acts.append(Action("SF", mb))
    return acts


def _backward(rank: int, pp: int, mb: int) -> list[Action]:
    acts = [] if rank == pp - 1 else [Action("RB", mb)]
    acts.append(Action("B", mb))
    if rank > 0:
        acts.append(Action("SB", mb))
    return acts


def gpipe(pp: int, microbatches: int, rank: int) -> list[Action]:
    """Every forward, then every backward (in reverse order): the simplest schedule; it keeps
    all ``microbatches`` activations alive at once."""
    _check(pp, microbatches, rank)
    acts = []
    for mb in range(microbatches):
        acts += _forward(rank, pp, mb)
    for mb in reversed(range(microbatches)):
        acts += _backward(rank, pp, mb)
    return acts


def one_f_one_b(pp: int, microbatches: int, rank: int) -> list[Action]:
    """1F1B (PipeDream-flush): ``pp - rank - 1`` warm-up forwards, then one forward and one
    backward in turn, then the remaining backwards. The same bubble as GPipe, but at most
    ``pp - rank`` activations alive."""
    _check(pp, microbatches, rank)
    warmup = min(pp - rank - 1, microbatches)
    acts = []
    for mb in range(warmup):
        acts += _forward(rank, pp, mb)
    for i in range(microbatches - warmup):
        acts += _forward(rank, pp, warmup + i)
        acts += _backward(rank, pp, i)
    for mb in range(microbatches - warmup, microbatches):
        acts += _backward(rank, pp, mb)
    return acts


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def compile_schedule(name: str, pp: int, microbatches: int) -> list[list[Action]]:
    """Every rank's action list for schedule ``name``, validated."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    _check(pp, microbatches, 0)
    lists = [SCHEDULES[name](pp, microbatches, r) for r in range(pp)]
    validate(lists)
    return lists


class ScheduleError(ValueError):
    pass


def validate(lists: list[list[Action]]) -> None:
    """Simulate every rank's list (buffered sends, blocking receives, FIFO channels) and prove
    that every receive meets its own send, every send is received, each microbatch is run
    forward before backward on every stage, and no rank waits forever; else ``ScheduleError``
    naming the first (rank, position, action) that cannot proceed."""
    pp = len(lists)
    channel: dict[tuple, list] = {}  # (src, dst, "F"/"B") -> [(mb, chunk)] in flight, in order
    pos = [0] * pp
    done_f = [set() for _ in range(pp)]
    while True:
        progressed = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if a.kind in ("RF", "RB"):
                    src = r - 1 if a.kind == "RF" else r + 1
                    if not 0 <= src < pp:
                        raise ScheduleError(f"rank {r}, action {pos[r]} ({a}): no stage "
                                            f"{src} to receive from")
                    queue = channel.get((src, r, a.kind[1]), [])
                    if not queue:
                        break  # blocked: try the other ranks
                    if queue[0] != (a.mb, a.chunk):
                        raise ScheduleError(
                            f"rank {r}, action {pos[r]} ({a}): expects microbatch {a.mb} "
                            f"(chunk {a.chunk}) from rank {src}, but the next message on that "
                            f"channel is microbatch {queue[0][0]} (chunk {queue[0][1]})")
                    queue.pop(0)
                elif a.kind in ("SF", "SB"):
                    dst = r + 1 if a.kind == "SF" else r - 1
                    if not 0 <= dst < pp:
                        raise ScheduleError(f"rank {r}, action {pos[r]} ({a}): no stage "
                                            f"{dst} to send to")
                    channel.setdefault((r, dst, a.kind[1]), []).append((a.mb, a.chunk))
                elif a.kind == "F":
                    done_f[r].add((a.mb, a.chunk))
                elif a.kind == "B":
                    if (a.mb, a.chunk) not in done_f[r]:
                        raise ScheduleError(f"rank {r}, action {pos[r]} ({a}): backward of "
                                            f"microbatch {a.mb} before its forward")
                else:
                    raise ScheduleError(f"rank {r}, action {pos[r]}: unknown kind {a.kind!r}")
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
    unreceived = {k: v for k, v in channel.items() if v}
    if unreceived:
        (src, dst, kind), queue = next(iter(unreceived.items()))
        mb, chunk = queue[0]
        raise ScheduleError(f"rank {src} sends {'activation' if kind == 'F' else 'gradient'} "
                            f"of microbatch {mb} (chunk {chunk}) to rank {dst}, which never "
                            f"receives it")


def theoretical_bubble(name: str, pp: int, microbatches: int) -> float:
    """Idle fraction with equal stage times and backward = 2 x forward: ``(p-1)/(m+p-1)`` for
    GPipe and 1F1B."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULES)}")
    return (pp - 1) / (microbatches + pp - 1)
