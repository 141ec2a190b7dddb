"""The CUDA IPC all-reduce's communicator: owns the buffers and handles, sets them up and probes
them, and carries out the all-reduces that the engine policy (``policy.py``) sends it. A group
whose set-up fails gets no communicator, and the policy sends its calls to the group's
torch.distributed engine instead.

One communicator per group whose members share a node. Each rank ``cudaMalloc``s one region
(its signal block, then its staging buffer; not from torch's caching allocator, so any
``PYTORCH_CUDA_ALLOC_CONF`` can export it), exports a CUDA IPC handle for it and maps every
peer's; the kernels (``csrc/cuda/``) then read peers' buffers directly.

Setup is six steps, each ending in one agreement over the group (an ``all_gather_object`` of
every rank's result or error): (1) the GPUs (native CUDA build, world, compute capability);
(2) the link between them and from it the size limit (``policy.ipc_limit``); (3) allocate and
export; (4) open every peer's handle; (5) build the context; (6) probe it (with a short kernel
timeout; the job's is set after). A failure anywhere,
on any rank, makes every rank release what it holds and return ``(None, reason)`` together (the
reason names the global ranks that failed and why), and the caller falls back to the group's
torch.distributed engine; no rank is left waiting in a kernel for one that gave up.

The exchange of handles (steps 3 and 4) and the two-barrier teardown are the one protocol of
``ipc_exchange.py``, shared with CUDA symmetric tensors. Every native call goes through
``Driver``, so CPU-only tests can drive the agreement and the teardown over real processes with
a fake one.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm import policy, symmetric
from fastpar.comm.engines.base import Adapter
from fastpar.comm.engines.ipc_exchange import (Driver, PeerMaps, Refused, agreed_step,
                                               all_agree, check_not_capturing)
from fastpar.comm.engines.torch_dist import Torch

__all__ = ["ALGOS", "PROBE_TIMEOUT", "CudaIpc", "CudaIpcCommunicator", "Driver", "Refused",
           "agreed_step", "all_agree", "check_not_capturing", "describe", "link_kind",
           "size_limit"]

log = logging.getLogger("fastpar.comm")


ALGOS = {"auto": 0, "one_shot": 1, "two_shot": 2}
# The probe's barrier timeout (seconds; at most a quarter of the job's): a probe launch that
# hangs on one rank makes its peers give up soon, well before the agreement after the probe
# (bounded by the job's timeout) gives up on them.
PROBE_TIMEOUT = 10.0


def link_kind(facts: list[dict], driver) -> tuple[str, str]:
    """``(link, how it was found)`` between the GPUs of a group, from every rank's ``facts``:
    "same_gpu", "nvlink" (native P2P atomics between every pair of distinct GPUs: NVLink has
    them, PCIe does not), "pcie", or "none"."""
    uuids = [f["uuid"] for f in facts]
    if len(set(uuids)) == 1:
        return "same_gpu", "every rank on one GPU"
    if any(f["visible"] != facts[0]["visible"] for f in facts):
        return "none", ("the ranks see different GPUs (CUDA_VISIBLE_DEVICES differs per rank), "
                        "so P2P between them cannot be checked")
    index = {u: i for i, u in enumerate(facts[0]["visible"])}
    devices = sorted({index[u] for u in uuids})
    kinds = set()
    for a in devices:
        for b in devices:
            if a != b:
                access, atomics = driver.link(a, b)
                kinds.add("none" if not access else "nvlink" if atomics else "pcie")
    kind = "none" if "none" in kinds else "pcie" if "pcie" in kinds else "nvlink"
    how = {"none": "some pair has no P2P access", "pcie": "P2P without native atomics",
           "nvlink": "P2P with native atomics"}[kind]
    return kind, f"GPUs {devices}: {how}"


def size_limit(facts: list[dict], driver) -> tuple[int, str]:
    """``(max_bytes, reason)`` of a group from every rank's ``facts``: the link between its GPUs
    and their compute capability, through ``policy.ipc_limit``; alike on every rank (0: off)."""
    link, how = link_kind(facts, driver)
    capability = min(tuple(f["capability"]) for f in facts)
    limit, reason = policy.ipc_limit(capability, len(facts), link)
    return limit, f"{reason} [{how}]"


def _algo_from_env() -> int:
    name = os.environ.get("FASTPAR_CUDA_IPC_ALGO", "auto")
    if name not in ALGOS:
        raise ValueError(f"FASTPAR_CUDA_IPC_ALGO must be one of {', '.join(ALGOS)}, got {name!r}")
    return ALGOS[name]


class CudaIpcCommunicator:
    def __init__(self, group, ranks, device, driver, max_bytes, reason, group_rank):
        self.group, self.ranks, self.device, self._driver = group, ranks, device, driver
        self._ptr = None  # own region (signal block, then staging buffer)
        # the peers' regions, mapped here, and the protocol that releases them and ours
        self._peers = PeerMaps(group, ranks, group_rank, device, driver,
                               f"the IPC region ({max_bytes} bytes of buffer)")
        self._ctx = None
        self.max_bytes = max_bytes
        self.reason = reason  # why this size: policy.ipc_limit's words
        self.group_rank = group_rank
        # 0 auto, 1 one-shot, 2 two-shot (tests and benchmarks force one)
        self.algo = _algo_from_env()

    @classmethod
    def create(cls, group, ranks, rank, device, timeout: float = 300.0, driver=None):
        """Collective over ``group``: ``(communicator, None)`` or ``(None, reason)`` on every
        rank alike."""
        world, me = len(ranks), ranks.index(rank)
        driver = driver or Driver()

        facts, why = agreed_step(group, ranks, "checking the GPUs", lambda: driver.facts(device))
        if why:
            return None, why
        # Every rank computes the limit from the same facts; it is still agreed (a P2P query
        # could fail on one rank), and a disagreement is a reason to fall back too.
        limits, why = agreed_step(group, ranks, "choosing the size",
                                  lambda: size_limit(facts, driver))
        if why:
            return None, why
        limit, reason = limits[0]
        if any(tuple(p) != (limit, reason) for p in limits):
            return None, f"the ranks chose different cuda_ipc limits: {limits}"
        if not limit:
            return None, reason
        comm = cls(group, ranks, device, driver, limit, reason, me)
        meta = None

        def export():
            nonlocal meta
            meta = driver.meta_size()
            comm._ptr = driver.alloc(meta + limit, device)
            return comm._ptr, driver.export(comm._ptr, device), 0

        why = comm._peers.exchange(export, "allocating and exporting the IPC buffer")
        if not why:
            def build():
                ptrs = comm._peers.addresses
                comm._ctx = driver.init(ptrs, [p + meta for p in ptrs], me, world, limit,
                                        list(ranks), min(PROBE_TIMEOUT, timeout / 4), device)
            _, why = agreed_step(group, ranks, "building the IPC context", build)
        if not why:
            _, why = agreed_step(group, ranks, "the probe all-reduce", lambda: comm._probe(world))
        if why:
            comm._release()
            return None, why
        driver.set_timeout(comm._ctx, float(timeout))
        return comm, None

    def _probe(self, world) -> None:
        """One-shot and two-shot (algo 1, 2), float32 and bfloat16: a sum whose exact result is
        known. Every launch runs whatever an earlier one gave (a rank that stopped early would
        leave its peers waiting in their next launch); then raises ``Refused`` with the first
        wrong result or the timeout a barrier reported."""
        expect, wrong = world * (world + 1) / 2, None
        for dtype in (torch.float32, torch.bfloat16):
            for algo in (1, 2):
                x = torch.full((1024,), float(self.group_rank + 1), dtype=dtype,
                               device=self.device)
                self._driver.all_reduce(self._ctx, x, algo)
                got = x.float().unique().tolist()
                if got != [expect] and wrong is None:
                    wrong = (f"probe all-reduce ({dtype}, algo {algo}) gave {got}, "
                             f"expected {expect}")
        err = self._driver.error(self._ctx)
        if err or wrong:
            raise Refused(err or wrong)

    def all_reduce(self, t: torch.Tensor) -> None:
        # The kernel loads 16 bytes at a time. A view at an odd offset (a slice of a flat
        # gradient bucket) goes through an aligned copy: a rank-local choice, so every rank
        # still runs the same kernel.
        if t.data_ptr() % 16:
            aligned = t.clone()
            self._driver.all_reduce(self._ctx, aligned, self.algo)
            t.copy_(aligned)
            return
        self._driver.all_reduce(self._ctx, t, self.algo)

    def all_reduce_symmetric(self, t: torch.Tensor, slots: list[int]) -> None:
        """``t``: this rank's CUDA symmetric tensor (``comm.symmetric_empty(device=...)``),
        ``slots`` every rank's as mapped here: reduced in place, no copy into the buffer."""
        self._driver.all_reduce_symmetric(self._ctx, t, slots)

    def staging(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """This rank's staging buffer as a (rows, cols) tensor, once no launch of the group
        still reads it (the current stream waits for the last one): a producer writes the
        message straight into it for ``all_reduce_flagged``."""
        self._driver.wait_idle(self._ctx)
        return self._driver.staging(self._ctx, dtype, rows * cols).view(rows, cols)

    def all_reduce_flagged(self, out: torch.Tensor, flags: torch.Tensor, block_rows: int,
                           expected: int) -> None:
        """``out`` = the sum over ranks of their staging buffers (``staging``), row block by
        row block as each rank's producer publishes ``flags[b] == expected``."""
        self._driver.all_reduce_flagged(self._ctx, out, flags, block_rows, expected)

    def error(self) -> str:
        """"" while usable; else why not (a barrier timed out: names the global ranks)."""
        return self._driver.error(self._ctx) if self._ctx is not None else ""

    def close(self) -> None:
        """Collective over the group (``fastpar.shutdown`` calls it): release everything, in
        an order that never frees memory a peer still maps (``PeerMaps.teardown``). Raises the
        timeout error, if a launch timed out, once the rest is released."""
        if self._ptr is None and self._ctx is None:
            return
        err = self._peers.teardown(self.error, self._dispose, self._free_region())
        self._ptr = None  # freed, or left to the process's end (a peer may still map it)
        if err:
            raise RuntimeError(err)

    @property
    def context(self) -> int:
        """The native context (``csrc/cuda/ipc_allreduce.h``); 0 once closed."""
        return self._ctx or 0

    def drop(self) -> None:
        """This rank alone (an abort; a torch.distributed group freed without its shutdown):
        no launch uses the region any more and the peers' are unmapped; this rank's own region
        stays allocated until the process ends, since a peer may still map it."""
        if self._ptr is None and self._ctx is None:
            return
        self._peers.release(healthy=False, dispose=self._dispose, free=self._free_region())
        self._ptr = None

    def _release(self) -> None:
        """After a failed setup (every rank alike): dispose, unmap the peers, a barrier, free."""
        self._peers.release(dispose=self._dispose, free=self._free_region())
        self._ptr = None

    def _dispose(self) -> None:
        if self._ctx is not None:
            self._driver.dispose(self._ctx)
            self._ctx = None

    def _free_region(self):
        """What frees this rank's region (None: it has none)."""
        if self._ptr is None:
            return None

        ptr = self._ptr
        return lambda: self._driver.free(ptr, self.device)


class CudaIpc(Adapter):
    """The CUDA IPC all-reduce (the policy sends it nothing else); a CUDA symmetric tensor of
    the group is reduced in place. Its communicator is None where the set-up failed or
    ``FASTPAR_CUDA_IPC=0`` (the policy then sends the calls to the group's torch engine)."""

    name = "cuda_ipc"

    @staticmethod
    def make(state, group, ranks, device):
        if os.environ.get("FASTPAR_CUDA_IPC", "1") == "0":
            return None
        check_not_capturing(ranks, "the CUDA IPC communicator")
        comm, why = CudaIpcCommunicator.create(group, ranks, state.topo.rank, device,
                                               state.topo.timeout)
        if comm is None:
            log.info("cuda_ipc off for group %s, falling back to %s: %s", ranks,
                     dist.get_backend(group), why)
        return comm

    @staticmethod
    def close(comm) -> None:
        if comm is not None:
            comm.close()

    @staticmethod
    def byte_mover():
        return Torch  # no byte collectives of its own: a quantized call's bytes go on torch's

    @staticmethod
    def all_reduce(route, t, op, async_op):
        sym = symmetric.lookup(t, route.group, op)
        if sym is not None:
            route.comm.all_reduce_symmetric(t, sym.slots)
        else:
            route.comm.all_reduce(t)


def describe(world_sizes=(2, 4, 8), driver=None) -> list[str]:
    """What cuda_ipc would do on this machine for groups of ``world_sizes`` ranks on GPUs
    0..n-1 (one GPU shared when FASTPAR_SHARED_GPU=1 and fewer GPUs): lines for
    ``python -m fastpar info``. Creates nothing."""
    if os.environ.get("FASTPAR_CUDA_IPC", "1") == "0":
        return ["off: FASTPAR_CUDA_IPC=0"]
    if not _native.status()["cuda"]:
        return ["off: fastpar._C was built without CUDA"]
    if not torch.cuda.is_available():
        return ["off: no CUDA device"]
    driver = driver or Driver()
    count = torch.cuda.device_count()
    shared = os.environ.get("FASTPAR_SHARED_GPU") == "1"
    lines = []
    for world in world_sizes:
        if world > count and not shared:
            lines.append(f"{world} ranks: not on this machine ({count} GPUs)")
            continue
        facts = [driver.facts(torch.device("cuda", r % count)) for r in range(world)]
        limit, reason = size_limit(facts, driver)
        lines.append(f"{world} ranks: " + (f"on, {reason}" if limit else f"off, {reason}"))
    return lines
