"""MPI through mpi4py: the MPI library's own collectives on a sub-communicator of the group
(``make``), on numpy views of CPU tensors. Synchronous: complete on return."""

from __future__ import annotations

import zlib

from fastpar.comm.engines.base import Adapter
from fastpar.comm.engines.torch_dist import row_bytes
from fastpar.comm.views import byte_view, numpy_view as _np


class Mpi(Adapter):
    """The MPI library's own collectives through mpi4py (numpy views of CPU tensors)."""

    name = "mpi"

    @staticmethod
    def make(state, group, ranks, device):
        """An MPI sub-communicator of the group's members (collective over them)."""
        topo = state.topo
        if topo.mpi_comm is None:
            raise ValueError("the mpi engine needs an MPI launch (mpirun), but this job "
                             f"was started by {topo.launcher}")
        world = topo.mpi_comm
        # MPI_Comm_create_group is collective over the members only; the tag (alike on every
        # member: torch names groups in creation order) keeps creations of different groups
        # apart when threads make them at once.
        tag = zlib.crc32(group.group_name.encode()) % 32768
        return world.Create_group(world.group.Incl(list(ranks)), tag)

    @staticmethod
    def close(comm) -> None:
        comm.Free()

    @staticmethod
    def _op(op: str):
        from mpi4py import MPI

        return {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}[op]

    @staticmethod
    def all_reduce(route, t, op, async_op):
        from mpi4py import MPI

        route.comm.Allreduce(MPI.IN_PLACE, _np(t), op=Mpi._op(op))

    @staticmethod
    def all_gather(route, inp, stacked, async_op):
        route.comm.Allgather(_np(inp), _np(stacked))

    @staticmethod
    def all_gather_into(route, block, out, async_op):
        from mpi4py import MPI

        route.comm.Allgather(MPI.IN_PLACE, _np(out))

    @staticmethod
    def reduce_scatter(route, inp, out, op, async_op):
        route.comm.Reduce_scatter_block(_np(inp), _np(out), op=Mpi._op(op))

    @staticmethod
    def broadcast(route, t, src, async_op):
        route.comm.Bcast(_np(t), root=route.ranks.index(src))

    @staticmethod
    def all_to_all(route, inp, send, recv, out, async_op):
        from mpi4py import MPI

        if recv is None:  # the counts first (MPI's small all-to-all of Python ints)
            recv = route.comm.alltoall(list(send))
        if out is None:
            out = inp.new_empty((sum(recv), *inp.shape[1:]))
        row = row_bytes(inp)
        # Bytes, so that any dtype goes (MPI's counts are C ints: under 2 GiB per peer).
        scounts, rcounts = [s * row for s in send], [r * row for r in recv]
        route.comm.Alltoallv([_np(byte_view(inp)), (scounts, _offsets(scounts)), MPI.BYTE],
                             [_np(byte_view(out)), (rcounts, _offsets(rcounts)), MPI.BYTE])
        return out, recv, None


def _offsets(counts: list[int]) -> list[int]:
    offsets, at = [], 0
    for c in counts:
        offsets.append(at)
        at += c
    return offsets
