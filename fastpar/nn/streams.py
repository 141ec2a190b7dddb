"""The side stream on which the overlapped layers (``fastpar.nn.overlap``, ``overlap_signal``)
run their collectives on CUDA: one per device, a part of the job (``fastpar.shutdown`` drops it,
so a re-init starts clean)."""

from __future__ import annotations

import torch

from fastpar.runtime import job


def comm_stream(device: torch.device) -> torch.cuda.Stream:
    """The job's communication stream on CUDA ``device``, made at its first use."""
    streams = job().part("nn.comm_streams", dict)  # CUDA device index -> stream
    stream = streams.get(device.index)
    if stream is None:
        stream = streams[device.index] = torch.cuda.Stream(device)
    return stream
