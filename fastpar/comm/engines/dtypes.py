"""The one numbering of dtypes that fastpar writes into shared memory and messages: the shm
kernels' call signatures (``shm.signature``) and the P2P headers (``fastpar.pipeline.messages``). Code 0
means none; a dtype outside the table has no code (the caller says what to do)."""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
CODE = {dtype: i + 1 for i, dtype in enumerate(DTYPES)}


def dtype_of(code: int) -> torch.dtype:
    """The dtype of ``code`` (``CODE``'s inverse); ``KeyError`` for one outside the table."""
    if not 1 <= code <= len(DTYPES):
        raise KeyError(code)
    return DTYPES[code - 1]
