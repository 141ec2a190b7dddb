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


def served(group=None, device: str = "cpu") -> dict:
    """``{op: {engine: calls}}``: what ran each call of ``group``'s fastpar backend for
    ``device`` so far ("shm", "gloo", "nccl"); ``{}`` for a group of another backend."""
    from fastpar.backend.create import served as _served

    return _served(group, device)
