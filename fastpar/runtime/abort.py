"""Under MPI, an exception nobody catches on one rank ends the whole job at once (installed by
``fastpar.init``, removed by ``fastpar.shutdown``)."""

from __future__ import annotations

import os
import sys
import traceback

from fastpar.runtime import failures

_HOOK: list = []  # the installed hook, while a job is up (init installs, shutdown removes)


def install(comm, rank: int) -> None:
    """Under MPI, an exception nobody catches on one rank ends the whole job at once, with its
    traceback, instead of leaving the other ranks waiting in a collective until the timeout (as
    ``python -m mpi4py`` does). The main thread's exceptions only (a background thread's may
    be meant to end that thread alone); removed again by ``shutdown``. A failure every rank
    sees is said once (``runtime.failures``).

    The traceback goes straight to file descriptor 2: torch.distributed's own excepthook, which
    init_process_group stacks on top of this one, captures ``sys.stderr`` while it calls the
    hook below it, and the abort would lose that capture."""
    if _HOOK:
        return
    previous = sys.excepthook

    def abort(exc_type, exc, tb):
        if abort not in _HOOK:  # removed by shutdown, but still in torch's chain
            return previous(exc_type, exc, tb)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        words = (f"fastpar: uncaught exception on rank {rank}; aborting the MPI job so that no "
                 f"rank waits for it:\n{text}")
        # A failure every rank sees (a bad layout, rank 0's rendezvous verdict) is said by
        # rank 0 alone; the others abort quietly (runtime.failures).
        spoke = failures.speaks(exc)
        if spoke:
            os.write(2, words.encode(errors="replace"))
        failures.abort_mpi_job(comm, 1, spoke, words)

    abort.previous = previous
    _HOOK.append(abort)
    sys.excepthook = abort


def remove() -> None:
    hook = _HOOK.pop() if _HOOK else None
    if hook is not None and sys.excepthook is hook:
        sys.excepthook = hook.previous
