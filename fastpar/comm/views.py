"""A tensor's memory seen as another type, without a copy: as bytes (a uint8 tensor) and as a
numpy array (what mpi4py and Python's buffer protocol take).

The MPI engine (``engines/mpi.py``), the all-to-alls (``alltoall.py``) and the checkpoint writer
(``fastpar.checkpoint.files``) use them.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (any dtype, bool included)."""
    return t.reshape(-1).view(torch.uint8)


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A numpy array over a contiguous CPU tensor's memory, made from its address: unlike
    ``t.numpy()``, which marks the storage not resizable for good (torch 2.13), so that a
    buffer once passed to MPI could no longer be released (ZeRO-3 resizes its gather buffers
    to nothing between uses). Valid while ``t`` is alive."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"numpy_view needs a contiguous CPU tensor, got {t.device} "
                         f"contiguous={t.is_contiguous()}")
    dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
    if t.numel() == 0:
        return np.empty(tuple(t.shape), dtype=dtype)
    raw = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(t.shape))
