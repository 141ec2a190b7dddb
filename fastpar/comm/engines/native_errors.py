"""What a failed call of fastpar's shm kernels (collectives and p2p) reports, as a code.

The kernel throws typed errors (``csrc/shm/shm_errors.h``); the torch glue turns each into a
RuntimeError with the kernel's message and records its kind per thread, which ``caught`` reads
right after the RuntimeError was caught. A caller then decides by ``ShmError.kind`` (or by the
class: ``ShmTimeout`` is a ``TimeoutError``), never by the message's wording.
"""

from __future__ import annotations

import enum

import torch


class Kind(enum.IntEnum):
    """``shm::ErrorKind``: keep the numbers in step with ``csrc/shm/shm_errors.h``."""

    NONE = 0  # no error recorded (one raised by the glue's argument checks)
    OTHER = 1
    TIMEOUT = 2  # a wait ran past the timeout
    INTERRUPTED = 3  # SIGINT ended a wait
    PEER_DEAD = 4  # the awaited peer's process is gone
    POISONED = 5  # an earlier error poisoned the segment (``cause``: that error's kind)
    MISMATCH = 6  # ranks passed calls that disagree


class ShmError(RuntimeError):
    """A failed shm kernel call: the kernel's message (as the caller words it), ``kind`` and
    ``cause`` (for ``POISONED`` the kind of the error that poisoned the segment, else ``kind``)."""

    def __init__(self, message: str, kind: Kind, cause: Kind):
        super().__init__(message)
        self.kind, self.cause = kind, cause


class ShmTimeout(ShmError, TimeoutError):
    """A wait that ran past the timeout, here or (poisoned) on the peer that gave up first."""


def caught() -> tuple[Kind, Kind]:
    """``(kind, cause)`` of the RuntimeError this thread's last shm op raised; call it right
    after catching it (reading clears the record)."""
    kind, cause = torch.ops.fastpar.shm_last_error()
    return Kind(kind), Kind(cause)


def shm_error(message: str) -> ShmError:
    """The error just caught from an shm op, typed by its recorded kind, with ``message``."""
    kind, cause = caught()
    cls = ShmTimeout if cause == Kind.TIMEOUT else ShmError
    return cls(message, kind, cause)
