"""The ``nccl_mpi`` engine: a raw NCCL communicator per group, through CuPy, bootstrapped by MPI.

    FASTPAR_COMM_BACKEND=nccl_mpi mpirun -np 8 python train.py     (pip install 'fastpar[gpu]')

The classic NCCL + MPI pattern: group rank 0 creates the NCCL unique id, MPI broadcasts it over
the group's MPI communicator, every rank creates its ``cupy.cuda.nccl.NcclCommunicator`` on its
GPU. The communicator is independent of torch's ProcessGroupNCCL (no work objects, no watchdog):
each call is enqueued on torch's *current* stream with the tensors' ``data_ptr()``, so it is
ordered like any kernel, captured by a CUDA graph like any kernel, and free for the overlap
kernels to schedule on their own streams. The policy never picks it on its own; it is forced
(``FASTPAR_COMM_BACKEND=nccl_mpi`` or ``comm.use_backend("nccl_mpi")``), and ``unavailable()``
says why it cannot run (no CuPy, no GPU, not an MPI launch).
"""

from __future__ import annotations

import contextlib

import torch

from fastpar.comm import policy
from fastpar.comm.engines.base import Native
from fastpar.comm.engines.ipc_exchange import check_not_capturing
from fastpar.comm.engines.mpi import Mpi
from fastpar.comm.engines.torch_dist import Torch

# NCCL's ncclDataType_t / ncclRedOp_t values (nccl.h; stable across NCCL 2.x), used where the
# installed CuPy lacks a name (NCCL_BFLOAT16 came late).
_NCCL_DTYPES = {torch.int8: ("NCCL_INT8", 0), torch.uint8: ("NCCL_UINT8", 1),
                torch.int32: ("NCCL_INT32", 2), torch.int64: ("NCCL_INT64", 4),
                torch.float16: ("NCCL_FLOAT16", 6), torch.float32: ("NCCL_FLOAT32", 7),
                torch.float64: ("NCCL_FLOAT64", 8), torch.bfloat16: ("NCCL_BFLOAT16", 9)}
_NCCL_OPS = {"sum": ("NCCL_SUM", 0), "prod": ("NCCL_PROD", 1), "max": ("NCCL_MAX", 2),
             "min": ("NCCL_MIN", 3)}
assert set(_NCCL_DTYPES) == set(policy.NCCL_MPI_DTYPES)


def _cupy_nccl():
    from cupy.cuda import nccl  # noqa: PLC0415 - optional dependency

    return nccl


def unavailable(mpi_launched: bool | None = None) -> str | None:
    """Why this process cannot use nccl_mpi, or None. ``mpi_launched``: whether the job was
    started by mpirun (None: not asked)."""
    if mpi_launched is False:
        return "nccl_mpi is bootstrapped by MPI: launch with mpirun (this job was not)"
    try:
        _cupy_nccl()
    except Exception as exc:  # noqa: BLE001 - ImportError, or CuPy's own load errors
        return (f"CuPy with NCCL is not importable ({type(exc).__name__}: {exc}); install "
                "fastpar[gpu] (cupy-cuda12x) or cupy-cuda13x to match your CUDA")
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def _stream_of(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream


class NcclMpiCommunicator:
    """One NCCL communicator over the ranks of ``mpi_comm`` (the group's MPI communicator, in
    group order), on ``device``. ``nccl``: the ``cupy.cuda.nccl`` module (tests pass a fake
    one); ``stream_of(t)``: the stream handle a call on ``t`` is enqueued on."""

    def __init__(self, mpi_comm, device: torch.device, nccl=None, stream_of=_stream_of):
        self._nccl = nccl or _cupy_nccl()
        self._stream_of = stream_of
        self.size, self.rank = mpi_comm.Get_size(), mpi_comm.Get_rank()
        uid = self._nccl.get_unique_id() if self.rank == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self._comm = self._nccl.NcclCommunicator(self.size, uid, self.rank)
        self.device = device

    def _dtype(self, t: torch.Tensor) -> int:
        name, value = _NCCL_DTYPES[t.dtype]
        return getattr(self._nccl, name, value)

    def _op(self, op: str) -> int:
        name, value = _NCCL_OPS[op]
        return getattr(self._nccl, name, value)

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> None:
        """In place; ``t`` contiguous."""
        self._comm.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), self._dtype(t),
                             self._op(op), self._stream_of(t))

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (contiguous, ``size`` blocks of ``inp``) = every rank's ``inp`` in rank
        order; ``inp`` may be this rank's block of ``out``."""
        self._comm.allGather(inp.data_ptr(), out.data_ptr(), inp.numel(), self._dtype(inp),
                             self._stream_of(inp))

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: str = "sum") -> None:
        """``out`` = this rank's block of ``op`` over every rank's ``inp`` (contiguous)."""
        self._comm.reduceScatter(inp.data_ptr(), out.data_ptr(), out.numel(), self._dtype(inp),
                                 self._op(op), self._stream_of(inp))

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        """In place: group rank ``root``'s ``t`` everywhere."""
        self._comm.bcast(t.data_ptr(), t.numel(), self._dtype(t), root, self._stream_of(t))

    def close(self) -> None:
        if self._comm is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no call of ours still in flight
        self._comm.destroy()
        self._comm = None


class NcclMpi(Native):
    """NCCL through CuPy, bootstrapped over the group's MPI sub-communicator."""

    name = "nccl_mpi"

    @staticmethod
    def make(state, group, ranks, device):
        check_not_capturing(ranks, "the nccl_mpi communicator")
        return NcclMpiCommunicator(state.communicator(Mpi, group, ranks, device), device)

    @staticmethod
    def close(comm) -> None:
        comm.close()

    @staticmethod
    def byte_mover():
        return Torch  # no byte collectives of its own: a quantized call's bytes go on torch's
