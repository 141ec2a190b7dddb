"""The words of a pipeline schedule: an ``Action``, its kinds, and where each message goes.

A schedule is one list of actions per pipeline rank. Each rank holds ``virtual_stages`` (v)
model chunks; local chunk ``c`` of rank ``r`` is model stage ``c * pp + r`` of ``pp * v``.
Actions, for microbatch ``mb`` of the acting rank's local chunk ``chunk``::

    F   forward                               B   full backward (input and weight gradients)
    I   input gradient only (then SB)         W   weight gradient of an earlier I, same rank
    SF  send activation to stage + 1          RF  receive activation from stage - 1
    SB  send gradient to stage - 1            RB  receive gradient from stage + 1

Routing (``route``): stage + 1 of (r, c) is rank (r + 1) % pp, chunk c + 1 if r == pp - 1 else c;
stage - 1 mirrors it. Stage 0 has no RF or SB, the last stage computes the loss and has no SF or
RB. With pp == 1 every message goes to the rank itself (the executor keeps a local FIFO).

Schedules (``schedules.py``), their validator (``validator.py``), the executor, the status board,
the text timeline and the trace all speak these words; this module imports nothing of fastpar.
"""

from __future__ import annotations

import dataclasses

KINDS = ("F", "B", "SF", "RF", "SB", "RB", "I", "W")  # order is stable: board.py indexes it
COMPUTE = ("F", "B", "I", "W")  # the kinds that compute; the others are messages (P2P)


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of one rank's list: ``kind`` (one of ``KINDS``) on microbatch ``mb`` of the
    acting rank's local ``chunk`` (model stage ``chunk * pp + rank``). Prints as ``F3`` or,
    on a chunk other than 0, ``F3.1``."""

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if self.chunk else "")


def route(kind: str, rank: int, chunk: int, pp: int) -> tuple[int, int]:
    """``(rank, chunk)`` at the other end of send or receive ``kind`` on ``(rank, chunk)``: SF and
    RB talk to model stage + 1, RF and SB to stage - 1. The chunk is negative or ``>= v`` when
    that stage does not exist (``stage // pp``, e.g. stage -1 -> (pp - 1, -1))."""
    stage = chunk * pp + rank + (1 if kind in ("SF", "RB") else -1)
    return stage % pp, stage // pp
