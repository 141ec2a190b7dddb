"""Where every rank of the pipeline is: a status board in MPI shared memory.

Each rank writes its step, position, action and state into its own row before and after every
action (a few plain stores). A rank whose wait times out reads every row of its host and names
what each rank is doing in its error, so a stuck pipeline says which rank holds it up, even when
the torch backend itself is what is stuck. The board is an ``MPI.Win.Allocate_shared`` window on
the host's ranks (mpi4py), so it exists only under mpirun; elsewhere ``Board.create`` returns
``None`` and errors say so.
"""

from __future__ import annotations

import numpy as np

from fastpar.pipeline.actions import KINDS

# A row's state: no action yet, inside an action, the step finished, an action raised.
IDLE, RUNNING, DONE, FAILED = 0, 1, 2, 3
_STATES = ("idle", "running", "done", "failed")  # indexed by the states above
_COLS = 7  # step, position, length, kind, mb, chunk, state


class Board:
    """This host's rows of the board (one per rank, ``_COLS`` int64 each) and this rank's row."""

    def __init__(self, win, table: np.ndarray, ranks: list[int], mine: int):
        self._win, self.table, self.ranks, self.mine = win, table, ranks, mine
        self.row = table[ranks.index(mine)]

    @classmethod
    def create(cls, mpi_comm, rank: int) -> Board | None:
        """Collective over ``mpi_comm`` (every rank of the job); ``None`` without MPI."""
        if mpi_comm is None:
            return None
        from mpi4py import MPI

        node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            ranks = node.allgather(rank)
            nbytes = len(ranks) * _COLS * 8 if node.Get_rank() == 0 else 0
            win = MPI.Win.Allocate_shared(nbytes, 8, comm=node)
        finally:
            node.Free()
        buf, _ = win.Shared_query(0)
        table = np.ndarray((len(ranks), _COLS), dtype=np.int64, buffer=buf)
        board = cls(win, table, ranks, rank)
        board.row[:] = (-1, 0, 0, -1, 0, 0, IDLE)
        return board

    def set(self, step: int, pos: int, length: int, action, state: int = RUNNING) -> None:
        """This rank is at ``action``, position ``pos`` of ``length``, in step ``step``."""
        self.row[:] = (step, pos, length, KINDS.index(action.kind), action.mb, action.chunk,
                       state)

    def state(self, state: int) -> None:
        """Change only this rank's state (``DONE``, ``FAILED``)."""
        self.row[6] = state

    def describe(self) -> str:
        lines = []
        for r, (step, pos, length, kind, mb, chunk, state) in zip(self.ranks, self.table.tolist()):
            if step < 0:
                lines.append(f"  rank {r}: no pipeline step yet")
                continue
            act = f"{KINDS[kind]}{mb}" + (f".{chunk}" if chunk else "")
            lines.append(f"  rank {r}: step {step}, action {pos} of {length} ({act}), "
                         f"{_STATES[state]}")
        return "\n".join(lines)

    def close(self) -> None:
        if self._win is not None:
            self.row = self.table = None
            self._win.Free()
            self._win = None
