"""Policy class of the CUDA IPC all-reduce: owns the buffers and handles, probes, falls back.

One communicator per group whose members share a node. Each rank allocates one device tensor
holding its signal block (``ipc_meta_size()`` bytes) followed by its buffer, exports a CUDA IPC
handle for it, and maps every peer's; the kernels (``csrc/cuda/``) then read peers' buffers
directly. ``create`` returns ``(None, reason)`` instead of a communicator when IPC cannot work
(no native CUDA build, world outside 2..8, a handle that does not open, a probe that gives a
wrong sum), and the caller falls back to the group's torch.distributed engine (NCCL, or gloo
under ``FASTPAR_SHARED_GPU``), logging the reason. The decision is taken on
every rank together (an all-reduce of the local verdicts), so no rank uses IPC alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastpar import _native

BUFFER_BYTES = 8 << 20  # messages above this go to the group's torch.distributed engine (NCCL)


class CudaIpcCommunicator:
    def __init__(self, ops, ctx, tensor, opened, max_bytes, group_rank):
        self._ops, self._ctx, self._tensor, self._opened = ops, ctx, tensor, opened
        self.max_bytes = max_bytes
        self.group_rank = group_rank

    @classmethod
    def create(cls, group, ranks, rank, device, buffer_bytes=BUFFER_BYTES):
        """Collective over ``group``: ``(communicator, None)`` or ``(None, reason)``."""
        world = len(ranks)
        me = ranks.index(rank)
        ops = torch.ops.fastpar
        why = None
        if not _native.status()["cuda"]:
            why = "fastpar._C was built without CUDA"
        elif not 2 <= world <= ops.ipc_max_world():
            why = f"group of {world} ranks is outside 2..{ops.ipc_max_world()}"
        # Everyone must agree before anyone allocates: the native-build check may differ by rank.
        if not _agree(why is None, group, device):
            return None, why or "a peer cannot use CUDA IPC"
        meta = ops.ipc_meta_size()
        tensor = torch.zeros(meta + buffer_bytes, dtype=torch.uint8, device=device)
        torch.cuda.synchronize(device)
        handle, offset = ops.ipc_get_handle(tensor)
        shared = [None] * world
        dist.all_gather_object(shared, (handle.tolist(), offset), group=group)
        opened, ptrs, why = [], [], None
        for peer, (h, off) in enumerate(shared):
            if peer == me:
                ptrs.append(tensor.data_ptr())
                continue
            try:
                base = ops.ipc_open_handle(torch.tensor(h, dtype=torch.uint8), device.index)
            except RuntimeError as exc:  # P2P not possible: probe failed, not trusted blindly
                why = f"opening rank {ranks[peer]}'s IPC handle failed: {exc}"
                break
            opened.append(base)
            ptrs.append(base + off)
        comm = None
        if why is None:
            ctx = ops.ipc_init(ptrs, [p + meta for p in ptrs], me, world, buffer_bytes)
            comm = cls(ops, ctx, tensor, opened, buffer_bytes, me)
            why = comm._probe(world, device)
        if not _agree(why is None, group, device):
            if comm is not None:
                comm.close()
            else:
                for base in opened:
                    ops.ipc_close_handle(base)
            return None, why or "the CUDA IPC probe failed on a peer"
        return comm, None

    def _probe(self, world, device) -> str | None:
        """One-shot and two-shot (algo 1, 2), float32 and bfloat16: a sum whose exact result is
        known."""
        expect = world * (world + 1) / 2
        for dtype in (torch.float32, torch.bfloat16):
            for algo in (1, 2):
                x = torch.full((1024,), float(self.group_rank + 1), dtype=dtype, device=device)
                self._ops.ipc_all_reduce(self._ctx, x, algo)
                got = x.float().unique().tolist()
                if got != [expect]:
                    return f"probe all-reduce ({dtype}, algo {algo}) gave {got}, expected {expect}"
        return None

    def all_reduce(self, t: torch.Tensor) -> None:
        # The kernel loads 16 bytes at a time. A view at an odd offset (a slice of a flat
        # gradient bucket) goes through an aligned copy: a rank-local choice, so every rank
        # still runs the same kernel.
        if t.data_ptr() % 16:
            aligned = t.clone()
            self._ops.ipc_all_reduce(self._ctx, aligned, 0)
            t.copy_(aligned)
            return
        self._ops.ipc_all_reduce(self._ctx, t, 0)

    def all_reduce_symmetric(self, t: torch.Tensor, slots: list[int]) -> None:
        """``t``: this rank's CUDA symmetric tensor (``comm.symmetric_empty(device=...)``),
        ``slots`` every rank's as mapped here: reduced in place, no copy into the buffer."""
        self._ops.ipc_all_reduce_symmetric(self._ctx, t, slots)

    def close(self) -> None:
        if self._ctx is None:
            return
        torch.cuda.synchronize(self._tensor.device)
        self._ops.ipc_dispose(self._ctx)
        for base in self._opened:
            self._ops.ipc_close_handle(base)
        self._ctx, self._opened = None, []


def _agree(ok: bool, group, device) -> bool:
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32,
                        device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(flag, group=group)
    return flag.item() == 0
