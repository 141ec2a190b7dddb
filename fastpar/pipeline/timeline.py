"""A schedule's action lists as a text timeline (forward 1 unit, backward 2, messages free)."""

from __future__ import annotations

from fastpar.pipeline.schedules import Action

COST = {"F": 1, "B": 2}


def simulate(lists: list[list[Action]]) -> list[list[tuple[int, int, Action]]]:
    """``[(start, end, action)]`` of every compute action per rank: each rank runs its list
    in order; a receive waits for the matching send's compute to end."""
    pp = len(lists)
    ready: dict[tuple, int] = {}  # (dst, kind, mb, chunk) -> time the message is there
    clock, pos = [0] * pp, [0] * pp
    spans: list[list] = [[] for _ in range(pp)]
    while any(pos[r] < len(lists[r]) for r in range(pp)):
        for r in range(pp):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if a.kind in ("RF", "RB"):
                    key = (r, a.kind[1], a.mb, a.chunk)
                    if key not in ready:
                        break
                    clock[r] = max(clock[r], ready.pop(key))
                elif a.kind in ("SF", "SB"):
                    dst = r + 1 if a.kind == "SF" else r - 1
                    ready[(dst, a.kind[1], a.mb, a.chunk)] = clock[r]
                else:
                    spans[r].append((clock[r], clock[r] + COST[a.kind], a))
                    clock[r] += COST[a.kind]
                pos[r] += 1
    return spans


def render(lists: list[list[Action]]) -> tuple[str, float]:
    """The timeline (one row per rank, one column per unit; ``.`` idle) and its bubble: the
    idle fraction of ranks x makespan."""
    spans = simulate(lists)
    end = max((s[-1][1] for s in spans if s), default=0)
    rows, busy = [], 0
    for r, row in enumerate(spans):
        line = ["."] * end
        for start, stop, a in row:
            mark = str(a.mb % 10) if a.kind == "F" else "abcdefghij"[a.mb % 10]
            for t in range(start, stop):
                line[t] = mark
            busy += stop - start
        rows.append(f"rank {r}: {''.join(line)}")
    bubble = 1 - busy / (end * len(spans)) if end else 0.0
    return "\n".join(rows), bubble
