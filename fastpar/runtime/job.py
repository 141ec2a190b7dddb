"""The ``Job``: what one ``fastpar.init`` made, and the parts the layers above keep per job."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

from fastpar.grid import Topology


@dataclasses.dataclass
class Job:
    """Everything one ``fastpar.init`` made, freed by ``fastpar.shutdown``.

    ``topology``: the immutable grid and groups. The layers above the runtime keep their
    per-job state as named parts, made on first use and gone with the job, so a second ``init``
    starts clean and the runtime knows nothing of them::

        state = job().part("comm", lambda: CommState(job().topology))   # fastpar.comm.state
        tracker = job().part("nn.random", RNGTracker)                    # fastpar.nn.random

    A part with a ``close()`` method is closed by ``shutdown``, the last made first (so a part
    made from another is closed before it); ``on_close(fn)`` adds any other closer to the same
    order.
    """

    topology: Topology
    args: tuple  # (tp, pp, backend, timeout) as init was called
    owns_pg: bool  # init created the default process group (and so destroys it)
    undo_binding: Any = None  # restores the CPU affinity init changed (runtime.binding)
    parts: dict = dataclasses.field(default_factory=dict)
    closers: list = dataclasses.field(default_factory=list)
    closing: bool = False  # set by close(): no part is made any more, shutdown is not re-entered
    _lock: Any = dataclasses.field(default_factory=threading.RLock, repr=False)

    def part(self, name: str, make):
        """The part ``name``, made by ``make()`` on the first call (once, whichever threads
        ask); ``RuntimeError`` once the job is closing."""
        with self._lock:
            if name not in self.parts:
                if self.closing:
                    raise RuntimeError(f"fastpar: the job is shutting down; its part {name!r} "
                                       "cannot be made now")
                value = make()
                self.parts[name] = value
                if callable(getattr(value, "close", None)):
                    self.on_close(value.close)
            return self.parts[name]

    def on_close(self, fn) -> None:
        """Call ``fn()`` at ``shutdown``, before every closer added earlier."""
        with self._lock:
            self.closers.append(fn)

    def close(self) -> None:
        """Run every closer, the last added first, the parts still there for them to use; one
        that fails does not keep the others from running (the first error is raised once all
        ran). Then the parts go."""
        with self._lock:
            self.closing = True
        first = None
        while self.closers:  # a closer may add one (it runs next)
            try:
                self.closers.pop()()
            except Exception as exc:  # noqa: BLE001 - raised below, after the others
                first = first or exc
        self.parts = {}
        if first is not None:
            raise first
