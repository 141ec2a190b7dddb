"""What every engine's adapter is: the same methods for each collective, what the engine can do
(asked by the raw and the quantized collectives instead of comparing engine names), and how its
communicator for a group is made and closed (``CommState.communicator``: one table of
(engine, group) -> communicator).

The raw collectives (``comm/collectives.py``) check arguments, route the call (``Route``:
group, ranks, adapter, communicator) and shape the result; what is left is the transfer itself,
which is what differs between engines:

    all_reduce(route, t, op, async_op)                  # t in place
    all_gather(route, inp, stacked, async_op)           # stacked = n blocks of inp, rank order
    all_gather_into(route, block, out, async_op)        # block is this rank's block of out
    reduce_scatter(route, inp, out, op, async_op)       # out = this rank's block of op(inp)
    broadcast(route, t, src, async_op)                  # src: a global rank of route.ranks
    all_to_all(route, inp, send, recv, out, async_op)   # -> (out, recv, work)

``all_to_all``: ``send[p]`` rows of ``inp`` (dim 0) go to group rank p; ``recv`` (rows from each
rank) may be None, and the engine learns it (shm from its segment, the others by a small
all-to-all of the counts first); ``out`` (``sum(recv)`` rows) may be None, and the engine makes
it. It returns the output and ``recv`` with the work.

Each returns the torch.distributed work of a call still in flight (``async_op`` on gloo or
NCCL), else ``None``: our engines (shm, CUDA IPC, MPI, NCCL through MPI) complete for the host
before they return. Inputs are contiguous; ``op`` is a name ("sum", ...).
"""

from __future__ import annotations

from fastpar.comm import quantized


class Adapter:
    """The defaults every engine shares: it moves bytes (``local`` False), has no communicator
    of its own (torch.distributed's process group is the route's group), runs quantized calls
    through ``comm.quantized`` over its own byte collectives, and reads no symmetric memory."""

    name = ""
    local = False  # True: a group of one rank, where nothing moves

    @staticmethod
    def make(state, group, ranks, device):
        """This engine's communicator for ``group`` (collective over it where it builds
        anything); None where the route's process group is all it needs."""
        return None

    @staticmethod
    def close(comm) -> None:
        """Release what ``make`` built (at ``fastpar.shutdown``)."""

    # -- what it can do ---------------------------------------------------------------------
    @classmethod
    def byte_mover(cls):
        """The adapter whose ``all_gather`` and ``all_to_all`` carry a quantized call's int8
        bytes on this engine's routes (an engine without byte collectives names torch's)."""
        return cls

    @staticmethod
    def native_quant(route, spec) -> bool:
        """Whether the engine's own kernels run a quantized call of block ``spec.block``
        (``route.comm.quantized_*``) rather than ``comm.quantized`` over its byte moves."""
        return False

    @staticmethod
    def gather_from(route, t, out) -> bool:
        """``all_gather(t, out=out)`` with ``t`` read where it lies (symmetric memory); False:
        not done here, the caller copies ``t`` into ``out``'s block and gathers."""
        return False

    @staticmethod
    def all_to_all_symmetric(route, inp, out):
        """An equal-split all-to-all of ``inp`` (symmetric memory) into ``out`` (or a new
        tensor), read where it lies; returns the output, None when not done here."""
        return None

    @staticmethod
    def quantized_all_reduce(route, t, spec, residual) -> None:
        quantized.all_reduce(route, t, spec, residual)

    @staticmethod
    def quantized_reduce_scatter(route, inp, out, spec, residual, async_op):
        """Returns what is still in flight (``quantized.Pending``) or None."""
        return quantized.reduce_scatter(route, inp, out, spec, residual, async_op)

    @staticmethod
    def quantized_all_gather(route, t, out, spec, async_op):
        """Returns what is still in flight (``quantized.Pending``) or None."""
        return quantized.all_gather(route, t, out, spec, async_op)


class Native(Adapter):
    """A fastpar communicator with the collectives' own names and arguments (in place, group
    ranks for roots): the shm kernels', NCCL-through-MPI's and the hierarchical engine's. They
    complete for the host before they return (NCCL: enqueued on the current stream, as torch's
    own collectives are complete for a stream-ordered reader)."""

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


class Local(Adapter):
    """A group of one rank: the collectives return their input (or a copy) at once."""

    name = "local"
    local = True
