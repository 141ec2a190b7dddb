"""Bound a blocking call that holds the GIL and has no timeout of its own.

``MPI_Init`` waits forever for a rank that never started, and holds the GIL while it waits, so no
Python thread can time it out. The native watchdog (a C++ thread) can: unless disarmed in time, it
prints the message and ends the process with status ``EXIT_CODE`` (124). Without the extension,
``faulthandler`` ends it: a traceback instead of the message, exit status 1.
"""

from __future__ import annotations

import contextlib
import faulthandler

from fastpar import _native

EXIT_CODE = 124


@contextlib.contextmanager
def deadline(seconds: float | None, message: str, unlink_prefix: str = ""):
    """Run the ``with`` body; if it takes over ``seconds``, print ``message`` and exit with
    ``EXIT_CODE`` (without the native extension: a traceback, exit status 1). ``None``: no
    limit. ``unlink_prefix``: before it exits, the native watchdog removes the name of every
    file this process maps under it (``MPI_Init``'s shared memory, ``runtime.mpich_shm``)."""
    if seconds is None:
        yield
    elif _native.available():
        import torch

        dog = torch.ops.fastpar.watchdog_arm(float(seconds), message, EXIT_CODE, unlink_prefix)
        try:
            yield
        finally:
            torch.ops.fastpar.watchdog_disarm(dog)
    else:
        faulthandler.dump_traceback_later(seconds, exit=True)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
