"""The schedule validator: proves per-rank action lists run, or names the first action at fault.

Two passes, neither touching a process group. ``_check_passes`` reads each rank's list alone:
known kinds, chunks and stages that exist, every (chunk, microbatch) run forward once and
backward once after it, every compute after the message it needs and every send after the
compute that makes it. ``validate`` then simulates all ranks together the way the executor and
``fastpar.pipeline.channels`` run them: sends are asynchronous (buffered) and receives block; messages
from one rank to another arrive in the order they were sent, one FIFO channel per (src, dst,
direction), activations ("F") and gradients ("B") on separate channels, as P2P without tags on
two groups. ``compile_schedule`` runs it on every schedule before a step.
"""

from __future__ import annotations

import collections

from fastpar.pipeline.actions import COMPUTE, KINDS, Action, route


class ScheduleError(ValueError):
    """Action lists that cannot run; the message names the first (rank, position, action) at
    fault and why."""


def _check_passes(lists: list[list[Action]], v: int, microbatches: int) -> None:
    """Per rank, without running anything: known kinds, chunks and stages that exist, and every
    (chunk, mb) run forward exactly once and backward exactly once (one B, or one I and a later
    W), each backward after its forward; each compute after the message it needs, each send
    after the compute that makes it, and no message sent or received twice."""
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
