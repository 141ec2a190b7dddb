"""Collectives served by the best engine for each call (see ``fastpar.comm.policy``).

    from fastpar import comm
    comm.all_reduce(t, group=topo.tp_group)          # in place, returns t
    out = comm.all_gather(t, group=g, dim=-1)         # concatenation along dim
    h = comm.all_reduce(t, async_op=True); ...; h.wait()

``FASTPAR_COMM_BACKEND=shm|cuda_ipc|nccl|gloo|mpi`` forces one engine.
"""

from fastpar.comm.collectives import Handle, all_gather, all_reduce, broadcast, reduce_scatter

__all__ = ["Handle", "all_gather", "all_reduce", "broadcast", "reduce_scatter"]
from fastpar.comm.autograd import (all_gather_sequence, copy_to_tp, gather_from_tp,  # noqa: E402
                                   gather_sequence, reduce_from_tp, reduce_scatter_sequence,
                                   scatter_sequence, scatter_to_tp)
