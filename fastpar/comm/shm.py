"""Policy class of the shared-memory collectives: owns one segment per group, calls the kernel.

The segment lives in ``/dev/shm`` under a name unique to the job (a random token chosen by the
group's first rank and broadcast over the group), mode 0600. It is unlinked as soon as every
member has mapped it, so a crash of any rank afterwards leaks nothing: the memory goes when the
last mapping does. Kernel protocol: ``csrc/shm/README.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import secrets
import threading

import torch
import torch.distributed as dist

from fastpar import _native

SLOT_BYTES = 4 << 20  # per rank; larger messages are chunked by the kernel


def _posixshmem():
    import _posixshmem  # CPython's shm_open/shm_unlink, without multiprocessing's tracker

    return _posixshmem


class ShmCommunicator:
    """Collectives of one group whose members share a host.

    Construction is collective over ``group`` (``ranks`` are its global ranks, in group order).
    One call at a time: the ranks of a group must issue its collectives in the same order, which
    two threads of one rank cannot promise, so a call made while another thread is inside one
    on the same communicator raises at once (different groups may run in different threads).
    """

    def __init__(self, group, ranks: list[int], rank: int, timeout: float,
                 slot_bytes: int = SLOT_BYTES):
        _native.require("the shm backend")
        self.ranks = list(ranks)
        self.world = len(ranks)
        self.group_rank = self.ranks.index(rank)
        self.slot_bytes = slot_bytes
        self._ops = torch.ops.fastpar
        nbytes = self._ops.shm_segment_bytes(self.world, slot_bytes)
        shm = _posixshmem()
        name = [None]
        fd = -1
        try:
            if self.group_rank == 0:
                name[0] = f"/fastpar-{os.getpid()}-{secrets.token_hex(8)}"
                fd = shm.shm_open(name[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
                os.ftruncate(fd, nbytes)
            dist.broadcast_object_list(name, src=self.ranks[0], group=group)
            if self.group_rank != 0:
                fd = shm.shm_open(name[0], os.O_RDWR, mode=0o600)
            self._mmap = mmap.mmap(fd, nbytes)
            self._anchor = ctypes.c_char.from_buffer(self._mmap)  # keeps the address valid
            base = ctypes.addressof(self._anchor)
            if self.group_rank == 0:
                self._ops.shm_init_segment(base, self.world, slot_bytes)
            # Everyone has mapped the segment once this barrier passes: unlink the name now.
            dist.barrier(group=group)
        except Exception as exc:
            anchor = getattr(self, "_anchor", None)
            self._anchor = None
            del anchor  # the buffer export, before the mapping can close
            if getattr(self, "_mmap", None) is not None:
                self._mmap.close()
            raise RuntimeError(f"fastpar shm: setting up the shared segment of the group of global "
                               f"ranks {self.ranks} failed on global rank {rank} (a peer died, "
                               f"or did not reach this collective in time): {exc}") from exc
        finally:
            if fd >= 0:
                os.close(fd)
            if self.group_rank == 0 and name[0] is not None:
                # After the barrier, or on failure (also when shm_open itself failed): nothing
                # leaks, and a missing name does not hide the error above.
                with contextlib.suppress(FileNotFoundError):
                    shm.shm_unlink(name[0])
        self._comm = self._ops.shm_attach(base, self.group_rank, self.world, slot_bytes,
                                          float(timeout))
        self._busy = threading.Lock()
        # Bound overloads: skips the op-packet lookup on every call (~1 us of a ~3 us call).
        self._all_reduce = self._ops.shm_all_reduce.default
        self._all_gather = self._ops.shm_all_gather.default
        self._reduce_scatter = self._ops.shm_reduce_scatter.default
        self._broadcast = self._ops.shm_broadcast.default

    def _failed(self, exc: RuntimeError) -> RuntimeError:
        """The kernel numbers ranks within the group; name the global ranks where they differ."""
        def globalise(m):
            k = int(m.group(1))
            if k >= self.world or self.ranks[k] == k:
                return m.group(0)
            return f"rank {k} (global rank {self.ranks[k]})"

        text = re.sub(r"\brank (\d+)", globalise, str(exc))
        return RuntimeError(f"{text} [shm group of global ranks {self.ranks}; after an error "
                            "the group's segment is unusable and later calls on it fail too]")

    def _call(self, name: str, kernel, *args) -> None:
        if not self._busy.acquire(blocking=False):
            raise RuntimeError(
                f"fastpar shm: {name} on the group of global ranks {self.ranks} was called "
                f"while another thread of this rank is inside a collective on the same group; "
                f"a group's collectives must be issued one at a time, in the same order on "
                f"every rank (use one thread per group, or a group per thread)")
        try:
            kernel(self._comm, *args)
        except RuntimeError as exc:
            raise self._failed(exc) from None
        finally:
            self._busy.release()

    def all_reduce(self, t: torch.Tensor, op: str) -> None:
        self._call("all_reduce", self._all_reduce, t, op)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor) -> None:
        self._call("all_gather", self._all_gather, inp, out)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: str) -> None:
        self._call("reduce_scatter", self._reduce_scatter, inp, out, op)

    def broadcast(self, t: torch.Tensor, root: int) -> None:
        self._call("broadcast", self._broadcast, t, root)

    def close(self) -> None:
        if self._comm is None:
            return
        with self._busy:  # a collective in flight on another thread ends first (or times out)
            self._ops.shm_detach(self._comm)
        self._comm = None
        del self._anchor
        self._mmap.close()
