"""How each engine runs each collective: one adapter class per engine, the same methods.

The raw collectives (``collectives.py``) check arguments, route the call (``Route``: group,
ranks, engine, communicator) and shape the result; what is left is the transfer itself, which
is what differs between engines:

    all_reduce(route, t, op, async_op)                  # t in place
    all_gather(route, inp, stacked, async_op)           # stacked = n blocks of inp, rank order
    all_gather_into(route, block, out, async_op)        # block is this rank's block of out
    reduce_scatter(route, inp, out, op, async_op)       # out = this rank's block of op(inp)
    broadcast(route, t, src, async_op)                  # src: a global rank of route.ranks
    all_to_all(route, inp, send, recv, out, async_op)   # -> (out, recv, work); see below

``all_to_all``: ``send[p]`` rows of ``inp`` (dim 0) go to group rank p; ``recv`` (rows from each
rank) may be None, and the engine learns it (shm from its segment, the others by a small
all-to-all of the counts first); ``out`` (``sum(recv)`` rows) may be None, and the engine makes it.
It returns the output and ``recv`` with the work.

Each returns the torch.distributed work of a call still in flight (``async_op`` on gloo or
NCCL), else ``None``: our engines (shm, CUDA IPC, MPI, NCCL through MPI) complete for the host
before they return. Inputs are contiguous; ``op`` is a name ("sum", ...).
"""

from __future__ import annotations

from fastpar.comm import symmetric
from fastpar.comm.flat import Mpi, Torch

# Below these sizes the copying shm kernels' single round beats the symmetric kernels' entry and
# exit signals (measured: 2 and 4 ranks on 2 cores, bench/collectives.py --symmetric; the
# signals cost most when ranks share cores), so symmetric tensors that small take the copying
# kernels, which work on any memory. Bytes of the tensor passed (all_gather: per rank).
SYMMETRIC_ALL_REDUCE_MIN = 16 << 10
SYMMETRIC_GATHER_MIN = 64 << 10
SYMMETRIC_SCATTER_MIN = 256 << 10
SYMMETRIC_ALL_TO_ALL_MIN = 64 << 10  # the input's bytes (alltoall.py); the copying kernel's
# single copy (process_vm_readv) starts at 64 KiB per pair too

class Native:
    """A fastpar communicator with the collectives' own names and arguments (in place, group
    ranks for roots): the shm kernels' and NCCL-through-MPI's. They complete for the host
    before they return (NCCL: enqueued on the current stream, as torch's own collectives are
    complete for a stream-ordered reader)."""

    @staticmethod
    def all_reduce(route, t, op, async_op):
        route.comm.all_reduce(t, op)

    @staticmethod
    def all_gather(route, inp, stacked, async_op):
        route.comm.all_gather(inp, stacked)

    @staticmethod
    def all_gather_into(route, block, out, async_op):
        route.comm.all_gather(block, out)  # block is out's rank block: in place

    @staticmethod
    def reduce_scatter(route, inp, out, op, async_op):
        route.comm.reduce_scatter(inp, out, op)

    @staticmethod
    def broadcast(route, t, src, async_op):
        route.comm.broadcast(t, route.ranks.index(src))

    @staticmethod
    def all_to_all(route, inp, send, recv, out, async_op):
        out, recv = route.comm.all_to_all(inp, send, recv, out)
        return out, recv, None


class NcclMpi(Native):
    """NCCL through CuPy, bootstrapped over MPI."""


class Shm(Native):
    """fastpar's shared-memory kernels; a symmetric tensor of the group, or a contiguous part
    of one (above the sizes where it pays), is worked on where it lies, no copy in or out."""

    @staticmethod
    def all_reduce(route, t, op, async_op):
        at = symmetric.lookup(t, route.group, op) if t.nbytes >= SYMMETRIC_ALL_REDUCE_MIN \
            else None
        if at is None:
            return Native.all_reduce(route, t, op, async_op)
        route.comm.all_reduce_symmetric(t, at, op)

    @staticmethod
    def all_gather_into(route, block, out, async_op):
        at = symmetric.lookup(out, route.group) if block.nbytes >= SYMMETRIC_GATHER_MIN else None
        if at is None:
            return Native.all_gather_into(route, block, out, async_op)
        route.comm.all_gather_symmetric(out, at)

    @staticmethod
    def gather_from(route, t, out) -> bool:
        """``all_gather(t, out=out)`` with ``t`` (not ``out``'s block) in symmetric memory: every
        rank copies each rank's ``t`` into ``out`` where it lies. False (nothing done) when
        ``t`` is not symmetric memory of the group, or too small to pay."""
        at = symmetric.lookup(t, route.group) if t.nbytes >= SYMMETRIC_GATHER_MIN else None
        if at is None or symmetric.lookup(out, route.group) is not None:
            return False  # (a symmetric out: the in-place kernel, after the copy in)
        route.comm.all_gather_from_symmetric(t, at, out)
        return True

    @staticmethod
    def reduce_scatter(route, inp, out, op, async_op):
        at = symmetric.lookup(inp, route.group, op) if inp.nbytes >= SYMMETRIC_SCATTER_MIN \
            else None
        if at is None:
            return Native.reduce_scatter(route, inp, out, op, async_op)
        route.comm.reduce_scatter_symmetric(inp, at, out, op)


class CudaIpc:
    """The CUDA IPC all-reduce (the policy sends it nothing else); a CUDA symmetric tensor of
    the group is reduced in place."""

    @staticmethod
    def all_reduce(route, t, op, async_op):
        sym = symmetric.lookup(t, route.group, op)
        if sym is not None:
            route.comm.all_reduce_symmetric(t, sym.slots)
        else:
            route.comm.all_reduce(t)


class Hier(Native):
    """Hierarchical across hosts (``comm/hierarchical.py``): shm within a host, a flat engine
    between hosts."""


ADAPTERS = {"shm": Shm, "cuda_ipc": CudaIpc, "nccl_mpi": NcclMpi, "mpi": Mpi, "gloo": Torch,
            "nccl": Torch, "hier": Hier}


def adapter(engine: str):
    """The adapter of ``engine`` (any torch.distributed backend name is torch's)."""
    return ADAPTERS.get(engine, Torch)
