"""Which engine serves a collective: a plain function of (op, device, group layout, bytes, dtype).

No devices, processes or globals are touched here, so every decision is unit-tested as a table.

Engines:
  ``local``     group of one rank: no communication, no copy
  ``shm``       our C++ shared-memory collectives (CPU tensors, every member on one host)
  ``cuda_ipc``  our CUDA IPC all-reduce (CUDA tensors, one node, small/medium messages)
  ``nccl``/``gloo``  torch.distributed's engine for the device
  ``mpi``       the MPI library's own collective through mpi4py (CPU; only when forced)

``FASTPAR_COMM_BACKEND=<engine>`` forces one; a forced engine that cannot serve a call is an
error naming why, never a silent substitute.
"""

from __future__ import annotations

import dataclasses

import torch

ENGINES = ("shm", "cuda_ipc", "nccl", "gloo", "mpi")
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
REDUCE_OPS = ("all_reduce", "reduce_scatter")
SHM_REDUCE_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
IPC_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MPI_DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the policy needs to know about a group and the machine."""

    size: int  # ranks in the group
    same_host: bool  # every member on one host
    native: bool = True  # fastpar._C loaded (shm)
    ipc_ready: bool = False  # a CUDA IPC communicator exists for this group (probed)
    ipc_max_bytes: int = 0  # its registered buffer size
    pg_backend: str = "gloo"  # torch.distributed's backend for the group


@dataclasses.dataclass(frozen=True)
class Choice:
    engine: str
    reason: str


def _shm_refusal(op: str, device: str, layout: Layout, dtype: torch.dtype,
                 reduce_op: str) -> str | None:
    if device != "cpu":
        return f"the tensor is on {device}, shm serves CPU tensors"
    if not layout.native:
        return "the native extension fastpar._C is not loaded"
    if not layout.same_host:
        return "the group spans hosts"
    if op in REDUCE_OPS and dtype not in SHM_REDUCE_DTYPES:
        return f"shm reduces float32/float64/bfloat16/float16, not {dtype}"
    if op in REDUCE_OPS and reduce_op not in ("sum", "max"):
        return f"shm reduces with sum or max, not {reduce_op}"
    return None


def _ipc_refusal(op: str, device: str, layout: Layout, nbytes: int,
                 dtype: torch.dtype) -> str | None:
    if device != "cuda":
        return f"the tensor is on {device}, cuda_ipc serves CUDA tensors"
    if op != "all_reduce":
        return f"cuda_ipc implements all_reduce only, not {op}"
    if not layout.same_host:
        return "the group spans nodes"
    if not layout.ipc_ready:
        return "no CUDA IPC communicator for this group (peers lack P2P or the probe failed)"
    if dtype not in IPC_DTYPES:
        return f"cuda_ipc reduces float32/float16/bfloat16, not {dtype}"
    if nbytes % 16:
        return f"{nbytes} bytes is not a multiple of 16"
    if nbytes > layout.ipc_max_bytes:
        return f"{nbytes} bytes exceeds the {layout.ipc_max_bytes}-byte IPC buffer"
    return None


def _refusal(engine: str, op: str, device: str, layout: Layout, nbytes: int,
             dtype: torch.dtype, reduce_op: str) -> str | None:
    if engine == "shm":
        return _shm_refusal(op, device, layout, dtype, reduce_op)
    if engine == "cuda_ipc":
        if reduce_op != "sum":
            return f"cuda_ipc reduces with sum only, not {reduce_op}"
        return _ipc_refusal(op, device, layout, nbytes, dtype)
    if engine == "nccl":
        return None if device == "cuda" else f"nccl needs CUDA tensors, got {device}"
    if engine == "gloo":
        return None if layout.pg_backend == "gloo" else (
            f"the group's torch.distributed backend is {layout.pg_backend}, not gloo")
    if engine == "mpi":
        if device != "cpu":
            return f"mpi serves CPU tensors, got {device}"
        if dtype not in MPI_DTYPES:
            return f"mpi (through numpy) cannot carry {dtype}"
        return None
    raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")


def choose(op: str, device: str, layout: Layout, nbytes: int, dtype: torch.dtype, *,
           reduce_op: str = "sum", forced: str | None = None) -> Choice:
    """The engine for one call. ``device`` is a device type ("cpu", "cuda")."""
    if op not in OPS:
        raise ValueError(f"unknown collective {op!r}; expected one of {', '.join(OPS)}")
    if layout.size == 1:
        return Choice("local", "group of one rank")
    if forced:
        why = _refusal(forced, op, device, layout, nbytes, dtype, reduce_op)
        if why is not None:
            raise ValueError(f"FASTPAR_COMM_BACKEND={forced} cannot serve {op} of {nbytes} "
                             f"bytes of {dtype} on {device}: {why}")
        return Choice(forced, "forced by FASTPAR_COMM_BACKEND")
    if device == "cpu":
        why = _shm_refusal(op, device, layout, dtype, reduce_op)
        if why is None:
            return Choice("shm", "CPU tensors on one host")
        return Choice(layout.pg_backend, f"not shm: {why}")
    if device == "cuda":
        why = _refusal("cuda_ipc", op, device, layout, nbytes, dtype, reduce_op)
        if why is None:
            return Choice("cuda_ipc", "small CUDA all_reduce within one node")
        return Choice("nccl" if layout.pg_backend == "nccl" else layout.pg_backend,
                      f"not cuda_ipc: {why}")
    return Choice(layout.pg_backend, f"device type {device}")
