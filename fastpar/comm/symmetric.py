"""Symmetric tensors: one tensor per rank in a segment that every rank of the group maps.

    x = comm.symmetric_empty(4096, 1024, dtype=torch.float32, group=topo.dp_group)
    x.copy_(grads)              # or compute straight into x
    comm.all_reduce(x, group=topo.dp_group)   # in place, no copy in or out

``symmetric_empty`` is collective over the group: every rank calls it with the same size and
dtype, in the same order. The segment holds ``world`` slots of the tensor's bytes rounded up to
a page; rank r's tensor is slot r. An all_reduce of the whole tensor on its own group takes the
symmetric shm path (``csrc/shm/README.md``, "all_reduce, symmetric"): rank r reduces slice r of
every slot in rank order and writes it into slice r of every slot, so each byte is read and
written once; the result is bitwise that of the copying path. Anything else (a view of part of
it, another group, another engine, min/prod) takes the ordinary path, correct but copying.

Lifetime: the name in ``/dev/shm`` exists only while the group sets the segment up (a reaper
unlinks it if the creating rank dies meanwhile) and is unlinked once every rank has mapped it,
as for the group's ShmCommunicator; nothing is left behind when a rank dies later. The mapping
lives as long as any tensor viewing it (the tensor's storage holds the mapping); the registry
entry that routes it goes with the mapping, or at ``fastpar.shutdown``, after which the tensor
is an ordinary tensor.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import weakref

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm.shm import _posixshmem, _reaper
from fastpar.comm.state import current

_PAGE = 4096
_OPS = ("sum", "max")  # the ops the symmetric kernel reduces with


class SymmetricSegment:
    """What routes a symmetric tensor: its group, dtype, size and every rank's slot address
    (in this process's mapping). Holds no reference to the tensor or the mapping."""

    __slots__ = ("group", "ranks", "dtype", "numel", "slots")

    def __init__(self, group, ranks, dtype, numel, slots):
        self.group, self.ranks, self.dtype, self.numel = group, ranks, dtype, numel
        self.slots = slots  # list of ints: rank p's slot address, p in group order

    def serves(self, t: torch.Tensor, group, op: str) -> bool:
        """Whether an all_reduce of ``t`` (contiguous, starting at a slot) on ``group`` with
        ``op`` can take the symmetric path."""
        return (group is self.group and op in _OPS and t.dtype == self.dtype
                and t.numel() == self.numel)


def _size_of(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and s >= 0 for s in size):
        raise ValueError(f"symmetric_empty: size must be non-negative ints, got {size}")
    return tuple(size)


def _agree(group, ranks, size, dtype) -> None:
    """ValueError on every rank, naming each rank's size and dtype, unless they all agree."""
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, (list(size), str(dtype)), group=group)
    if any(e != everyone[0] for e in everyone):
        said = ", ".join(f"global rank {r}: size {tuple(s)} {d}"
                         for r, (s, d) in zip(ranks, everyone))
        raise ValueError("symmetric_empty is collective: every rank of the group must pass the "
                         f"same size and dtype, in the same order; got {said}")


def _map_segment(group, ranks, group_rank: int, nbytes: int) -> mmap.mmap:
    """Group rank 0 creates the segment (a reaper unlinks it if this process dies before the
    others mapped it), the name goes over ``group``, every rank maps it, a barrier, unlink."""
    shm = _posixshmem()
    name = [None]
    fd, reaper, failed = -1, None, False
    try:
        if group_rank == 0:
            name[0] = f"/fastpar-{os.getpid()}-sym-{secrets.token_hex(8)}"
            reaper = _reaper(name[0])
            fd = shm.shm_open(name[0], os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
            os.ftruncate(fd, nbytes)
        dist.broadcast_object_list(name, src=ranks[0], group=group)
        if group_rank != 0:
            fd = shm.shm_open(name[0], os.O_RDWR, mode=0o600)
        mapping = mmap.mmap(fd, nbytes)
        dist.barrier(group=group)  # every rank has mapped it: the name may go
    except Exception as exc:
        failed = True
        raise RuntimeError(f"fastpar symmetric_empty: setting up the segment of the group of "
                           f"global ranks {ranks} failed on group rank {group_rank} (a peer "
                           f"died or did not call symmetric_empty, or /dev/shm refused "
                           f"{nbytes} bytes): {exc}") from exc
    finally:
        if fd >= 0:
            os.close(fd)
        if name[0] is not None and (group_rank == 0 or failed):
            with contextlib.suppress(FileNotFoundError):
                shm.shm_unlink(name[0])
        if reaper is not None:
            with contextlib.suppress(OSError):
                reaper.stdin.close()
            reaper.wait()
    return mapping


def symmetric_empty(*size, dtype: torch.dtype = torch.float32, group=None) -> torch.Tensor:
    """A CPU tensor of ``size`` whose memory every rank of ``group`` (``None``: the world) maps:
    an all_reduce of it on ``group`` needs no copy in or out. Collective over the group; the
    contents start as zeros. A group of one rank, or one spread over hosts, gets a plain
    ``torch.empty`` (no shared memory to use)."""
    size = _size_of(size)
    st = current()
    group, ranks, layout = st.resolve(group)
    numel = 1
    for s in size:
        numel *= s
    if len(ranks) == 1 or not layout.same_host:
        return torch.empty(size, dtype=dtype)
    _native.require("symmetric tensors")
    _agree(group, ranks, size, dtype)
    if numel == 0:
        return torch.empty(size, dtype=dtype)
    group_rank = ranks.index(st.topo.rank)
    esize = torch.empty((), dtype=dtype).element_size()
    slot = -(-numel * esize // _PAGE) * _PAGE  # (bytes rounded up to a page)
    view = memoryview(_map_segment(group, ranks, group_rank, slot * len(ranks)))
    # The storage holds `view`, `view` holds the mapping: both live while any tensor does.
    t = torch.frombuffer(view, dtype=dtype, count=numel, offset=group_rank * slot).view(size)
    base = t.data_ptr() - group_rank * slot
    key = t.data_ptr()
    st.symmetric[key] = SymmetricSegment(group, ranks, dtype, numel,
                                         [base + p * slot for p in range(len(ranks))])
    # Runs when the last tensor goes, before the mapping does (`view` holds it).
    weakref.finalize(view, st.symmetric.pop, key, None)
    return t
