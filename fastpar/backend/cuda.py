"""The CUDA IPC all-reduce behind the fastpar backend's ``dist.all_reduce`` of CUDA tensors, for
a group whose ranks share a host (a CUDA build): the maker that the extension's backend
(``csrc/c10d_ipc.cpp``) calls at the group's first all-reduce the kernels could serve.

The communicator is fastpar.comm's (``comm/engines/cuda_ipc.py``: the same set-up protocol,
probe, size limit by link and kernels), set up over the backend's own gloo
(``BackendExchange``): the group cannot run its own collectives from inside one of its calls. A
group whose set-up is refused (``FASTPAR_CUDA_IPC=0``, GPUs without P2P, older than sm80, more
than two over PCIe) gets none and says why once in the log; NCCL serves its all-reduces, as it
serves every call above the size limit and every other operation on CUDA tensors.
"""

from __future__ import annotations

import logging
import os

import torch

from fastpar.comm.engines.cuda_ipc import CudaIpcCommunicator
from fastpar.comm.engines.segments import BackendExchange

log = logging.getLogger("fastpar.backend")

REFUSED = (0, 0, 0, None)


def ipc_maker(cpu, ranks: list[int], rank: int, timeout: float, driver=None,
              device_type: str = "cuda"):
    """``maker(device_index) -> (context, max_bytes, algo, owner)``, collective over the group
    (``cpu``: its gloo backend; ``rank``: this one's index in ``ranks``, the global ranks);
    ``REFUSED`` on every rank alike where the set-up was refused. ``owner.close()`` releases
    the communicator collectively, ``owner.drop()`` on this rank alone. ``driver`` and
    ``device_type``: the native calls and their device (CPU tests drive the protocol with a fake
    driver on "cpu")."""

    def maker(index: int):
        if os.environ.get("FASTPAR_CUDA_IPC", "1") == "0":
            return REFUSED
        comm, why = CudaIpcCommunicator.create(BackendExchange(cpu, len(ranks)), ranks,
                                               ranks[rank], torch.device(device_type, index),
                                               timeout, driver)
        if comm is None:
            log.info("fastpar backend: no CUDA IPC all-reduce for the group of global ranks %s "
                     "(NCCL serves it): %s", ranks, why)
            return REFUSED
        return comm.context, comm.max_bytes, comm.algo, comm

    return maker
