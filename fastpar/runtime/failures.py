"""A failure every rank of a job sees is said once, by one rank, in one message.

Some failures reach every rank alike: a bad layout (every rank runs the same check on the same
numbers), or rank 0's rendezvous verdict, broadcast over MPI before any store exists (a job
that spans hosts but found only loopback, a store port that is taken). Every rank still raises
it, so that the caller's code sees it wherever it runs, but ``everywhere(exc, rank)`` marks it
on every rank other than ``SPEAKER`` (rank 0, the one that decides) as said elsewhere. What
ends a job asks ``speaks(exc)`` before it prints (the MPI abort hook, ``python -m
fastpar.train``, ``python -m fastpar info``): a marked rank ends with the same status and says
nothing; ``FASTPAR_DEBUG=1`` lets every rank say its own words.

A failure that is not marked is said by the first rank whose failure reaches the job's store
(``speaks(exc, store, key)``, the trainer's end), or, with no store to agree through, by each
rank that has it. Under MPI, ``abort_mpi_job`` ends the job so that a quiet rank never ends it
before the speaking rank's words are out, and never leaves a failure unsaid.
"""

from __future__ import annotations

import os
import time

SPEAKER = 0  # the rank that says a failure every rank sees: rank 0 decides the rendezvous

# The launcher forwards output asynchronously and MPI_Abort ends every rank's output stream: a
# rank that spoke leaves it FORWARD_S to carry the words out first. A quiet rank leaves the
# speaker QUIET_WAIT_S to end the job.
FORWARD_S = 0.5
QUIET_WAIT_S = 5.0


def debug() -> bool:
    """``FASTPAR_DEBUG=1``: every rank says its own failure (and the command lines show the
    traceback)."""
    return os.environ.get("FASTPAR_DEBUG", "0") == "1"


def everywhere(exc: BaseException, rank: int) -> BaseException:
    """Mark ``exc``, which every rank of the job raises alike, as said by ``SPEAKER``: on this
    ``rank``, unless it is the speaker, it ends the job quietly (``exc.fastpar_quiet``).
    Returns ``exc``."""
    exc.fastpar_quiet = rank != SPEAKER
    return exc


def speaks(exc: BaseException, store=None, key: str = "") -> bool:
    """Whether this rank says ``exc`` as the job ends: every rank under ``FASTPAR_DEBUG=1``;
    for a failure every rank sees (``everywhere``), its speaker alone; else, given the job's
    ``store``, the first rank to count a failure at ``key`` (a store that does not answer:
    this rank, its host may be what failed); else this rank."""
    if debug():
        return True
    quiet = getattr(exc, "fastpar_quiet", None)
    if quiet is not None:
        return not quiet
    if store is None:
        return True
    try:
        return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 - the store's host may be what failed: say it here
        return True


def abort_mpi_job(comm, status: int, spoke: bool, words: str) -> None:
    """End every rank of the MPI job with ``status`` (``MPI_Abort``: a peer may be waiting in
    a collective for this rank). A rank that ``spoke`` leaves the launcher ``FORWARD_S`` to
    carry its words out first. A quiet one waits ``QUIET_WAIT_S`` for the speaker's abort to
    end it; should it still be alive then (the speaker caught the failure, or hangs), it says
    its own ``words`` (written to file descriptor 2) and ends the job itself."""
    if not spoke:
        time.sleep(QUIET_WAIT_S)
        os.write(2, words.encode(errors="replace"))
    time.sleep(FORWARD_S)
    comm.Abort(status)
