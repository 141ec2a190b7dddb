"""Collectives served by the best engine for each call (see ``fastpar.comm.policy``).

    from fastpar import comm
    comm.all_reduce(t, group=topo.tp_group)          # in place, returns t
    out = comm.all_gather(t, group=g, dim=-1)         # concatenation along dim
    h = comm.all_reduce(t, async_op=True); ...; h.wait()
    comm.reduce_scatter(g, group=dp, quant="int8", residual=r)   # block-scaled int8 on the wire
    y = comm.all_to_all_v(x, send_counts=[3, 0, 5, 2], group=ep)  # rows to each rank, and back
    x = comm.symmetric_empty(n, group=g)              # every rank maps it: all_reduce(x) in place
    comm.all_gather(x[r*k:(r+1)*k], group=g, out=x)   # x symmetric: gathered where it lies

Each collective exists twice: the raw call above (result or ``Handle``), and an autograd
Function behind a wrapper (``copy_to_tp``, ``reduce_from_tp``, ... in ``autograd.py``) whose
docstring states its forward and backward.

``FASTPAR_COMM_BACKEND=shm|cuda_ipc|nccl|gloo|mpi|nccl_mpi|hier`` (read once per job, at its first
use of ``fastpar.comm``) or ``comm.use_backend(name)`` forces one engine, for the collectives and
the pipeline P2P alike; a forced engine that cannot serve a call raises.
"""

from fastpar.comm.alltoall import all_to_all, all_to_all_v, all_to_all_v_device
from fastpar.comm.autograd import (all_gather_sequence, all_to_all_rows, copy_to_tp,
                                   gather_from_tp, gather_sequence, reduce_from_tp,
                                   reduce_scatter_sequence, scatter_sequence, scatter_to_tp)
from fastpar.comm.collectives import (Handle, all_gather, all_reduce, broadcast, engine_for,
                                      reduce_scatter, use_backend)
from fastpar.comm.quant import Quant
from fastpar.comm.symmetric import symmetric_available, symmetric_empty, symmetric_slots

__all__ = ["Handle", "Quant", "all_gather", "all_gather_sequence", "all_reduce", "all_to_all",
           "all_to_all_rows", "all_to_all_v", "all_to_all_v_device", "broadcast",
           "copy_to_tp", "engine_for", "gather_from_tp", "gather_sequence", "reduce_from_tp",
           "reduce_scatter", "reduce_scatter_sequence", "scatter_sequence", "scatter_to_tp",
           "symmetric_available", "symmetric_empty", "symmetric_slots", "use_backend"]
