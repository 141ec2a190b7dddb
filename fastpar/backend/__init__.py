"""The torch.distributed backend ``"fastpar"``: any torch.distributed program runs its calls on
fastpar's engines by changing one string.

    import fastpar                                   # registers the backend
    dist.init_process_group("fastpar")               # or "cpu:fastpar,cuda:nccl"
    dist.all_reduce(t)                               # a group within a host: the shm kernels
    g = dist.new_group([0, 1], backend="fastpar")

Each group is a ``c10d::Backend`` of the extension (``csrc/c10d_backend.cpp``) that runs a call
on fastpar's shared-memory kernels where they serve it (a group whose ranks share a host; dense
contiguous CPU tensors; the reductions and dtypes of ``docs/backend.md``) and on a gloo backend
made beside it on the same store for the rest (NCCL for CUDA tensors). ``served(group)`` says
what ran each call so far. Registered at ``import fastpar``; ``create.py`` makes a group's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NAME = "fastpar"

# What serves each operation of a group whose ranks share a host, CPU tensors (the rule of
# csrc/c10d_backend.cpp; a group across hosts all-reduces floats from 4 KiB through each host's
# kernels and across on gloo where its hosts hold as many ranks each, and passes the rest to
# gloo; CUDA tensors go to NCCL). ``fastpar info`` prints it; docs/backend.md explains it.
OPERATIONS = (
    ("all_reduce", "shm: float32/64, bf16, fp16 (complex as real): SUM, AVG, MIN, MAX, PREMUL_SUM",
     "gloo: integers, bool, PRODUCT, bitwise (int16 as int32; AVG/PREMUL_SUM made from SUM)"),
    ("all_reduce_coalesced", "shm: one fused call when all share a dtype the kernels reduce",
     "one all_reduce per tensor"),
    ("reduce", "shm: as all_reduce (the root's tensor takes the result)", "gloo"),
    ("reduce_scatter (tensor, list, coalesced)", "shm: as all_reduce's floats",
     "an all_reduce (above), then this rank's block"),
    ("broadcast", "shm: every dtype", "gloo"),
    ("all_gather (tensor, list, into-tensor coalesced)", "shm: every dtype", "gloo"),
    ("all_to_all_single (equal and uneven splits)", "shm: every dtype", "gloo"),
    ("all_to_all (lists), allgather_coalesced, gather, scatter", "-", "gloo"),
    ("send, recv, recv any source, batch_isend_irecv", "-", "gloo"),
    ("barrier, monitored_barrier", "-", "gloo (waits for the group's calls in flight)"),
    ("a group across hosts (as many ranks on each)", "hier: all_reduce, "
     "all_gather_into_tensor, reduce_scatter_tensor from 4 KiB (MPI-launched: from 64 KiB for "
     "MPI's dtypes, across on MPI); MPI-launched: mpi for the flat calls it carries (all_reduce "
     "of float32/64, int8/32/64, uint8; all_gather_into_tensor, broadcast, all_to_all_single)",
     "gloo"),
    ("all_reduce of CUDA tensors", "cuda_ipc (a CUDA build, a group on one host): float32, "
     "fp16, bf16; SUM, AVG; multiples of 16 bytes up to policy.ipc_limit", "NCCL"),
    ("every other call on CUDA tensors", "-", "NCCL"),
)


def _create(options, backend_options):
    from fastpar.backend.create import create

    return create(options, backend_options)


def register() -> bool:
    """Register ``"fastpar"`` with torch.distributed (once; False where torch.distributed is
    not built in)."""
    if not dist.is_available():
        return False
    if NAME.upper() not in dist.Backend._plugins:
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=devices)
    return True


def registered() -> bool:
    """Whether torch.distributed knows the backend (``import fastpar`` registers it)."""
    return dist.is_available() and NAME.upper() in dist.Backend._plugins


def served(group=None, device: str = "cpu") -> dict:
    """``{op: {engine: calls}}``: what ran each call of ``group``'s fastpar backend for
    ``device`` so far ("shm", "gloo", "nccl"); ``{}`` for a group of another backend."""
    from fastpar.backend.create import served as _served

    return _served(group, device)
