"""MPI's own collectives (mpi4py) for a fastpar backend group that spans hosts, in a job launched
by MPI, as fastpar.comm's policy uses them (``policy.cross_engine``): the flat calls the
hierarchy does not take (reductions of ``policy.MPI_DTYPES`` below
``policy.HIER_MIN_BYTES_MPI`` or by ops the kernels lack; every broadcast and all-to-all; moves
below it), and the hierarchy's cross-host stage below ``policy.CROSS_ASYNC_MIN_BYTES``. The
extension's backend (``csrc/c10d_mpi.cpp``) calls ``MpiCalls``' methods with contiguous CPU
tensors; moves go as bytes, so any dtype does.

Across hosts every call costs a network round trip (hundreds of microseconds here), so the
Python call in between (a few) does not count; within a host the shm kernels serve instead.
"""

from __future__ import annotations

import zlib

from fastpar.comm.views import byte_view, numpy_view
from fastpar.runtime.launcher import detect


def usable(exchange, env) -> list[int] | None:
    """Every member's MPI world rank, in group order, where all of them can use MPI: the job
    was launched by MPI (``detect``; a launcher it cannot tell counts as no), mpi4py is there,
    and MPI gives threads their own calls (``MPI_THREAD_MULTIPLE``: a group's calls and other
    groups' may run at once). None on every member otherwise: the answer is agreed over
    ``exchange`` (the group's store), so no member takes MPI where another would not."""
    mine = None
    try:
        if detect(env).uses_mpi:
            from mpi4py import MPI

            if MPI.Query_thread() == MPI.THREAD_MULTIPLE:
                mine = (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    except (ValueError, ImportError):  # launchers that disagree; no mpi4py
        mine = None
    everyone = exchange.all_gather_object(mine)
    if any(m is None for m in everyone) or len({size for _, size in everyone}) != 1:
        return None
    ranks = [rank for rank, _ in everyone]
    return ranks if len(set(ranks)) == len(ranks) else None


class MpiCalls:
    """The MPI calls of the ranks ``ranks`` (MPI world ranks, in the group's order). The MPI
    communicator is made at the first call (``MPI_Comm_create_group``: collective over the
    members only); ``name`` (alike on every member) keeps creations of different groups apart
    when threads make them at once."""

    def __init__(self, ranks: list[int], name: str):
        self.ranks = list(ranks)
        self.tag = zlib.crc32(name.encode()) % 32768
        self.comm = None

    def _comm(self):
        if self.comm is None:
            from mpi4py import MPI

            world = MPI.COMM_WORLD
            self.comm = world.Create_group(world.group.Incl(self.ranks), self.tag)
        return self.comm

    def all_reduce(self, t, op: str) -> None:
        from mpi4py import MPI

        ops = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX, "prod": MPI.PROD,
               "band": MPI.BAND, "bor": MPI.BOR, "bxor": MPI.BXOR}
        self._comm().Allreduce(MPI.IN_PLACE, numpy_view(t), op=ops[op])

    def reduce_scatter(self, inp, out, op: str) -> None:
        from mpi4py import MPI

        self._comm().Reduce_scatter_block(numpy_view(inp), numpy_view(out),
                                          op={"sum": MPI.SUM, "max": MPI.MAX}[op])

    def all_gather(self, inp, out) -> None:
        self._comm().Allgather(numpy_view(byte_view(inp)), numpy_view(byte_view(out)))

    def broadcast(self, t, root: int) -> None:
        self._comm().Bcast(numpy_view(byte_view(t)), root=root)

    def all_to_all(self, inp, out, send_bytes: list[int], recv_bytes: list[int]) -> None:
        from mpi4py import MPI

        def at(counts):
            return [sum(counts[:i]) for i in range(len(counts))]

        self._comm().Alltoallv(
            [numpy_view(byte_view(inp)), (send_bytes, at(send_bytes)), MPI.BYTE],
            [numpy_view(byte_view(out)), (recv_bytes, at(recv_bytes)), MPI.BYTE])

    def close(self) -> None:
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
