"""A schedule's action lists as a text timeline: forward 1 unit, full backward 2, its halves
(input gradient I, weight gradient W) 1 each, messages free."""

from __future__ import annotations

from fastpar.pipeline.actions import COMPUTE, Action, route

COST = {"F": 1, "B": 2, "I": 1, "W": 1}
LEGEND = ("0-9 F (forward) of microbatch mb % 10, a-j B (full backward, 2 units), A-J I (input "
          "gradient), w W (weight gradient), . idle")


def simulate(lists: list[list[Action]], cost=None) -> list[list[tuple]]:
    """``[(start, end, action)]`` of every compute action per rank: each rank runs its list in
    order; a receive waits for the matching send, which leaves when the compute before it ends.
    Messages follow ``actions.route`` (wrapping from the last rank to the first, and to the
    rank itself when pp == 1). The lists must be valid (``validator.validate``). ``cost(rank,
    action)``: each compute action's duration (default ``COST``), e.g. measured ones, giving the
    timeline that compute alone implies with free messages."""
    pp = len(lists)
    ready: dict[tuple, int] = {}  # (dst rank, "F"/"B", mb, dst chunk) -> time the message is there
    clock, pos = [0.0 if cost else 0] * pp, [0] * pp
    spans: list[list] = [[] for _ in range(pp)]
    while any(pos[r] < len(lists[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                if a.kind in ("RF", "RB"):
                    key = (r, a.kind[1], a.mb, a.chunk)
                    if key not in ready:
                        break
                    clock[r] = max(clock[r], ready.pop(key))
                elif a.kind in ("SF", "SB"):
                    dst, dst_chunk = route(a.kind, r, a.chunk, pp)
                    ready[(dst, a.kind[1], a.mb, dst_chunk)] = clock[r]
                else:
                    took = COST[a.kind] if cost is None else cost(r, a)
                    spans[r].append((clock[r], clock[r] + took, a))
                    clock[r] += took
                pos[r] += 1
                progressed = True
        if not progressed:
            raise ValueError("the action lists deadlock; schedules.validate names where")
    return spans


def _mark(a: Action) -> str:
    digit = a.mb % 10
    return {"F": str(digit), "B": "abcdefghij"[digit], "I": "ABCDEFGHIJ"[digit], "W": "w"}[a.kind]


def render(lists: list[list[Action]]) -> tuple[str, float]:
    """The timeline (one row per rank, one column per unit, marks as in ``LEGEND``; with more
    than one chunk per rank a ``chunk`` row under each rank gives the local chunk of every
    busy unit), a legend line, and the bubble: the idle fraction of ranks x makespan."""
    spans = simulate(lists)
    end = max((s[-1][1] for s in spans if s), default=0)
    chunked = any(a.chunk for acts in lists for a in acts if a.kind in COMPUTE)
    width = len(f"rank {len(spans) - 1}")
    rows, busy = [], 0
    for r, row in enumerate(spans):
        line, chunks = ["."] * end, [" "] * end
        for start, stop, a in row:
            for t in range(start, stop):
                line[t], chunks[t] = _mark(a), str(a.chunk % 10)
            busy += stop - start
        rows.append(f"{f'rank {r}':<{width}}: {''.join(line)}")
        if chunked:
            rows.append(f"{'chunk':>{width}}: {''.join(chunks).rstrip()}")
    rows.append(f"legend: {LEGEND}" + ("; chunk rows: local chunk" if chunked else ""))
    bubble = 1 - busy / (end * len(spans)) if end else 0.0
    return "\n".join(rows), bubble
