"""Policy class of the CUDA IPC all-reduce: owns the buffers and handles, probes, falls back.

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

Every native call goes through ``Driver``, so CPU-only tests can drive the agreement and the
teardown over real processes with a fake one.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm import policy

log = logging.getLogger("fastpar.comm")

ALGOS = {"auto": 0, "one_shot": 1, "two_shot": 2}
# The probe's barrier timeout (seconds; at most a quarter of the job's): a probe launch that
# hangs on one rank makes its peers give up soon, well before the agreement after the probe
# (bounded by the job's timeout) gives up on them.
PROBE_TIMEOUT = 10.0


class Driver:
    """Every CUDA call the communicator makes (``torch.ops.fastpar.ipc_*`` and torch.cuda)."""

    def __init__(self):
        self.ops = torch.ops.fastpar

    def facts(self, device: torch.device) -> dict:
        if not _native.status()["cuda"]:
            raise Refused("fastpar._C was built without CUDA")
        props = torch.cuda.get_device_properties(device)
        visible = [str(torch.cuda.get_device_properties(d).uuid)
                   for d in range(torch.cuda.device_count())]
        return {"index": device.index, "uuid": str(props.uuid), "visible": visible,
                "capability": (props.major, props.minor), "name": props.name}

    def link(self, a: int, b: int) -> tuple[bool, bool]:
        """(P2P access, native atomics) from device a to b."""
        return tuple(self.ops.ipc_p2p_link(a, b))

    def meta_size(self) -> int:
        return self.ops.ipc_meta_size()

    def alloc(self, nbytes: int, device: torch.device) -> int:
        return self.ops.ipc_alloc(nbytes, device.index)

    def free(self, ptr: int, device: torch.device) -> None:
        self.ops.ipc_free(ptr, device.index)

    def export(self, ptr: int, device: torch.device) -> list[int]:
        return self.ops.ipc_export(ptr, device.index).tolist()

    def open(self, handle: list[int], device: torch.device) -> int:
        return self.ops.ipc_open_handle(torch.tensor(handle, dtype=torch.uint8), device.index)

    def close(self, base: int, device: torch.device) -> None:
        self.ops.ipc_close_handle(base, device.index)

    def init(self, signals, buffers, rank, world, nbytes, global_ranks, timeout,
             device: torch.device) -> int:
        return self.ops.ipc_init(signals, buffers, rank, world, nbytes, global_ranks, timeout,
                                 device.index)

    def set_timeout(self, ctx: int, timeout: float) -> None:
        self.ops.ipc_set_timeout(ctx, timeout)

    def all_reduce(self, ctx: int, t: torch.Tensor, algo: int) -> None:
        self.ops.ipc_all_reduce(ctx, t, algo)

    def all_reduce_symmetric(self, ctx: int, t: torch.Tensor, slots: list[int]) -> None:
        self.ops.ipc_all_reduce_symmetric(ctx, t, slots)

    def error(self, ctx: int) -> str:
        return self.ops.ipc_error(ctx)

    def staging(self, ctx: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self.ops.ipc_staging(ctx, dtype, numel)

    def wait_idle(self, ctx: int) -> None:
        self.ops.ipc_wait_idle(ctx)

    def all_reduce_flagged(self, ctx, out, flags, block_rows, expected) -> None:
        self.ops.ipc_all_reduce_flagged(ctx, out, flags, block_rows, expected)

    def dispose(self, ctx: int) -> None:
        self.ops.ipc_dispose(ctx)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)


class Refused(Exception):
    """A step's reason for not using cuda_ipc on this rank (not a bug: reported, not raised)."""


def agreed_step(group, ranks, what: str, fn):
    """Run ``fn`` on this rank and agree on the outcome: ``(every rank's result, None)`` or
    ``(..., reason)`` naming each global rank that failed. Every exception becomes a reason:
    the all_gather below must run on every rank whatever happened here."""
    try:
        mine = (fn(), None)
    except Refused as exc:
        mine = (None, str(exc))
    except Exception as exc:  # noqa: BLE001 - reported to every rank, then the group falls back
        mine = (None, f"{type(exc).__name__}: {exc}")
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, mine, group=group)
    failed = [f"global rank {r}: {why}" for r, (_, why) in zip(ranks, everyone) if why]
    reason = f"{what} failed ({'; '.join(failed)})" if failed else None
    return [value for value, _ in everyone], reason


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


def plan(facts: list[dict], driver) -> tuple[int, str]:
    """``(max_bytes, reason)`` of a group from every rank's ``facts``: alike on every rank."""
    link, how = link_kind(facts, driver)
    capability = min(tuple(f["capability"]) for f in facts)
    limit, reason = policy.ipc_limit(capability, len(facts), link)
    return limit, f"{reason} [{how}]"


def _algo_from_env() -> int:
    name = os.environ.get("FASTPAR_CUDA_IPC_ALGO", "auto")
    if name not in ALGOS:
        raise ValueError(f"FASTPAR_CUDA_IPC_ALGO must be one of {', '.join(ALGOS)}, got {name!r}")
    return ALGOS[name]


def all_agree(ok: bool, group, device) -> bool:
    """Whether ``ok`` on every rank (a collective: ``all_agree(True, ...)`` is a barrier)."""
    flag = torch.tensor([0.0 if ok else 1.0],
                        device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(flag, group=group)
    return flag.item() == 0


class CudaIpcCommunicator:
    def __init__(self, group, ranks, device, driver, ptr, opened, max_bytes, reason):
        self.group, self.ranks, self.device, self._driver = group, ranks, device, driver
        self._ptr, self._opened = ptr, opened  # own region; peers' bases (opened on `device`)
        self._ctx = None
        self.max_bytes = max_bytes
        self.reason = reason  # why this size: policy.ipc_limit's words
        self.group_rank = None
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
        # Every rank computes the plan from the same facts; it is still agreed (a P2P query
        # could fail on one rank), and a disagreement is a reason to fall back too.
        plans, why = agreed_step(group, ranks, "choosing the size", lambda: plan(facts, driver))
        if why:
            return None, why
        limit, reason = plans[0]
        if any(tuple(p) != (limit, reason) for p in plans):
            return None, f"the ranks chose different cuda_ipc limits: {plans}"
        if not limit:
            return None, reason
        comm = cls(group, ranks, device, driver, None, [], limit, reason)
        comm.group_rank = me
        meta = None

        def export():
            nonlocal meta
            meta = driver.meta_size()
            comm._ptr = driver.alloc(meta + limit, device)
            return driver.export(comm._ptr, device)

        handles, why = agreed_step(group, ranks, "allocating and exporting the IPC buffer", export)
        if not why:
            def open_peers():
                for p, handle in enumerate(handles):
                    if p != me:
                        comm._opened.append((p, driver.open(handle, device)))
            _, why = agreed_step(group, ranks, "opening the peers' IPC handles", open_peers)
        if not why:
            def build():
                bases = dict(comm._opened)
                ptrs = [comm._ptr if p == me else bases[p] for p in range(world)]
                comm._ctx = driver.init(ptrs, [p + meta for p in ptrs], me, world, limit,
                                        list(ranks), min(PROBE_TIMEOUT, timeout / 4), device)
            _, why = agreed_step(group, ranks, "building the IPC context", build)
        if not why:
            _, why = agreed_step(group, ranks, "the probe all-reduce", lambda: comm._probe(world))
        if why:
            comm._release(healthy=True)
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
        an order that never frees memory a peer still maps. Raises the timeout error, if a
        launch timed out, once the rest is released."""
        if self._ptr is None and self._ctx is None:
            return
        synced = False
        try:
            self._driver.synchronize(self.device)  # first: a launch may time out meanwhile
            synced = True
            err = self.error()
            healthy = all_agree(not err, self.group, self.device)  # nobody is in a kernel now
        except Exception as exc:  # noqa: BLE001 - a dead peer: release what is safe, say so
            log.warning("cuda_ipc teardown of global ranks %s: the group did not answer (%s)",
                        self.ranks, exc)
            err, healthy = self.error(), False
        self._release(healthy, synced)
        if err:
            raise RuntimeError(err)

    def _release(self, healthy: bool, synced: bool = False) -> None:
        """Wait for this rank's launches (unless ``synced``), dispose, unmap the peers on the device they were
        opened on, then (``healthy``: after a barrier, so every importer has unmapped ours)
        free this rank's region. An unhealthy group may still have peers reading it: that
        memory is left to the process's end."""
        d = self._driver
        try:
            if not synced:
                d.synchronize(self.device)  # no kernel of ours still writes the status record
        except Exception as exc:  # noqa: BLE001 - a broken context: release what we can
            log.warning("cuda_ipc: synchronising before release failed: %s", exc)
        if self._ctx is not None:
            d.dispose(self._ctx)
            self._ctx = None
        for _, base in self._opened:
            d.close(base, self.device)
        self._opened = []
        if healthy:  # every rank of the group takes this branch alike (its argument agreed)
            all_agree(True, self.group, self.device)
            if self._ptr is not None:
                d.free(self._ptr, self.device)
        elif self._ptr is not None:
            log.warning("cuda_ipc: left %d bytes of global rank %s's IPC region allocated (a "
                        "peer may still map it)", self.max_bytes, self.ranks[self.group_rank])
        self._ptr = None


def check_not_capturing(ranks, what: str) -> None:
    """RuntimeError before a setup step that a CUDA graph capture cannot hold."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fastpar: {what} for the group of global ranks {ranks} is set up at the group's "
            "first call that needs it, which allocates, synchronises and talks to the peers: "
            "that cannot happen inside a CUDA graph capture. Make one such call (e.g. a "
            "comm.all_reduce of a CUDA tensor over this group) before capturing.")


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
        limit, reason = plan(facts, driver)
        lines.append(f"{world} ranks: " + (f"on, {reason}" if limit else f"off, {reason}"))
    return lines
