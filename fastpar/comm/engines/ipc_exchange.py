"""The one CUDA IPC setup protocol, for every buffer that a group's peers map: the CUDA IPC
communicator's region (``cuda_ipc.py``) and CUDA symmetric tensors (``symmetric.py``).

    peers = PeerMaps(group, ranks, me, device, driver)
    why = peers.exchange(export, "exporting the buffer")  # None, or why every rank falls back
    peers.addresses           # every rank's buffer in this process, in group order
    ...
    err = peers.teardown(free=...)   # at shutdown; on a failed setup: peers.release(free=...)

Setup: each rank exports its buffer's IPC handle, the handles are gathered, each rank opens every
peer's (never its own) on its device. Each of the two steps ends in one agreement over the group
(``agreed_step``: every rank's result or error), so all ranks go on or all fall back together,
the reason naming the global ranks that failed.

Teardown (collective): synchronise; agree that every rank is healthy (also the first barrier:
nobody is in a kernel on these buffers now); the owner disposes what uses them; close every
opened handle on the device it was opened on; a second barrier (every importer has unmapped this
rank's buffer); free. If a rank is unhealthy or the group does not answer, nobody frees: a peer
may still map the buffer.

``group`` is a torch.distributed group or a ``segments.Exchange`` (the torch.distributed backend's
own gloo: ``fastpar/backend/cuda.py``).

Every native call goes through ``Driver``, so CPU-only tests drive the whole protocol over real
processes with a fake one (tests/test_cuda_ipc_setup.py).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm.engines.segments import Exchange

log = logging.getLogger("fastpar.comm")


class Driver:
    """Every CUDA call of the CUDA IPC engine (``torch.ops.fastpar.ipc_*`` and torch.cuda)."""

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
        """The IPC handle of a region ``alloc`` returned (the handle maps its start)."""
        return self.ops.ipc_export(ptr, device.index).tolist()

    def export_tensor(self, t: torch.Tensor) -> tuple[list[int], int]:
        """``(handle, offset)``: the IPC handle of the caching allocator's segment holding ``t``,
        and ``t``'s offset in it (an expandable segment cannot be exported: it raises)."""
        if not _native.status()["cuda"]:
            raise Refused("fastpar._C was built without CUDA")
        handle, offset = self.ops.ipc_get_handle(t)
        return handle.tolist(), int(offset)

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
    """A step's reason for not using CUDA IPC on this rank (not a bug: reported, not raised)."""


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
    if isinstance(group, Exchange):
        everyone = group.all_gather_object(mine)
    else:
        everyone = [None] * len(ranks)
        dist.all_gather_object(everyone, mine, group=group)
    failed = [f"global rank {r}: {why}" for r, (_, why) in zip(ranks, everyone) if why]
    reason = f"{what} failed ({'; '.join(failed)})" if failed else None
    return [value for value, _ in everyone], reason


def all_agree(ok: bool, group, device) -> bool:
    """Whether ``ok`` on every rank (a collective: ``all_agree(True, ...)`` is a barrier)."""
    if isinstance(group, Exchange):
        return all(group.all_gather_object(bool(ok)))
    flag = torch.tensor([0.0 if ok else 1.0],
                        device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(flag, group=group)
    return flag.item() == 0


def check_not_capturing(ranks, what: str) -> None:
    """RuntimeError before a setup step that a CUDA graph capture cannot hold."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fastpar: {what} for the group of global ranks {ranks} is set up at the group's "
            "first call that needs it, which allocates, synchronises and talks to the peers: "
            "that cannot happen inside a CUDA graph capture. Make one such call (e.g. a "
            "comm.all_reduce of a CUDA tensor over this group) before capturing.")


class PeerMaps:
    """This rank's buffer shared with the group: every peer's buffer mapped here, and the
    teardown that never lets a buffer go while a peer still maps it. ``me``: this rank's index
    in ``ranks``; ``what``: the buffer, for the log (``"the IPC region"``)."""

    def __init__(self, group, ranks, me, device, driver, what: str = "the IPC buffer"):
        self.group, self.ranks, self.me, self.device = group, ranks, me, device
        self.driver, self.what = driver, what
        self.opened: list[tuple[int, int]] = []  # (group rank, base) of each handle opened here
        self.addresses: list[int] | None = None  # every rank's buffer here, once exchanged

    def exchange(self, export, exporting: str,
                 opening: str = "opening the peers' IPC handles") -> str | None:
        """Collective: ``export()`` -> ``(address, handle, offset)`` of this rank's buffer (its
        address here, the IPC handle of the allocation holding it, its offset in that); gather
        every rank's, open each peer's. ``None`` and ``addresses`` set on every rank, or the
        reason (naming the ranks that failed) on every rank; the caller then ``release``s."""
        own = None

        def export_step():
            nonlocal own
            own, handle, offset = export()
            return list(handle), int(offset)

        shared, why = agreed_step(self.group, self.ranks, exporting, export_step)
        if why:
            return why

        def open_step():
            for p, (handle, _) in enumerate(shared):
                if p != self.me:
                    self.opened.append((p, self.driver.open(handle, self.device)))

        _, why = agreed_step(self.group, self.ranks, opening, open_step)
        if why:
            return why
        bases = dict(self.opened)
        self.addresses = [own if p == self.me else bases[p] + offset
                          for p, (_, offset) in enumerate(shared)]
        return None

    def teardown(self, error=lambda: "", dispose=None, free=None) -> str:
        """Collective, at shutdown: synchronise, agree that no rank has an ``error()`` (the
        first barrier: nobody is in a kernel now), then ``release``. Returns this rank's
        error ("" when none) for the caller to raise once all is released."""
        synced = False
        try:
            self.driver.synchronize(self.device)  # first: a launch may time out meanwhile
            synced = True
            err = error()
            healthy = all_agree(not err, self.group, self.device)
        except Exception as exc:  # noqa: BLE001 - a dead peer: release what is safe, say so
            log.warning("cuda_ipc teardown of global ranks %s: the group did not answer (%s)",
                        self.ranks, exc)
            err, healthy = error(), False
        self.release(healthy, synced, dispose, free)
        return err

    def release(self, healthy: bool = True, synced: bool = False, dispose=None,
                free=None) -> None:
        """Wait for this rank's launches (unless ``synced``), ``dispose()`` what uses the
        buffers, unmap the peers' on the device they were opened on, then (``healthy``: after
        a barrier, so every importer has unmapped ours) ``free()`` this rank's buffer. An
        unhealthy group may still have peers reading it: it is left to the process's end.
        ``healthy`` must be alike on every rank (agreed): the barrier is collective."""
        try:
            if not synced:
                self.driver.synchronize(self.device)  # no kernel of ours still uses them
        except Exception as exc:  # noqa: BLE001 - a broken context: release what we can
            log.warning("cuda_ipc: synchronising before release failed: %s", exc)
        if dispose is not None:
            dispose()
        for _, base in self.opened:
            self.driver.close(base, self.device)
        self.opened = []
        self.addresses = None
        if healthy:
            all_agree(True, self.group, self.device)
            if free is not None:
                free()
        elif free is not None:
            log.warning("cuda_ipc: left %s of global rank %s allocated (a peer may still map "
                        "it)", self.what, self.ranks[self.me])
