"""Which memory is symmetric, and where each rank's copy of it lies: the job's registry of
symmetric segments (``CommState.symmetric``), each routing the tensors inside it to the
symmetric kernels (``SymmetricSegment.place`` -> ``Placement``). Made by
``comm/symmetric.py``; read by the engines (``symmetric.lookup``)."""

from __future__ import annotations

import bisect

import torch

from fastpar.comm.engines import dtypes

_OPS = ("sum", "max")  # the ops the symmetric kernel reduces with


class SymmetricSegment:
    """What routes a symmetric tensor: its group, every rank's slot address (in this process's
    mapping), the slot's bytes and the segment's token (alike on every rank of the group, drawn
    at its collective creation). Holds no reference to the tensor or the mapping.

    ``views`` (CPU segments: the shm kernels take any address): one of ``parts`` may take the
    symmetric path too (``register_parts``: byte ranges the group agreed on, each a promise
    that a collective on it gets the same part from every rank). Other parts (say each rank's
    own block, at offsets that differ by rank) take the copying path, as they must: which path
    a call takes is decided on each rank alone. Without ``views``, only the whole tensor, of
    ``dtype`` and ``numel`` (CUDA IPC: its kernel wants the padded allocation it was made
    from)."""

    __slots__ = ("group", "ranks", "dtype", "numel", "slots", "mine", "nbytes", "token", "views",
                 "parts")

    def __init__(self, rank, group, ranks, dtype, numel, slots, nbytes=None, token=0,
                 views=False):
        self.group, self.ranks, self.dtype, self.numel = group, ranks, dtype, numel
        self.slots = slots  # list of ints: rank p's slot address, p in group order
        self.mine = slots[ranks.index(rank)]  # this rank's (``rank``: its global rank)
        esize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = numel * esize if nbytes is None else nbytes
        self.token, self.views = token, views
        self.parts: set[tuple[int, int]] = set()  # (byte offset, bytes) agreed by the group

    def place(self, t: torch.Tensor, group, op: str = "sum") -> Placement | None:
        """Where a collective on ``t`` over ``group`` with ``op`` runs on the symmetric path:
        every rank's address of ``t``'s bytes and the signature the kernel compares across
        ranks; None when it cannot (another group, an op the kernels do not reduce with, not
        contiguous, not inside this rank's slot, or a part that ranks may not pass alike)."""
        if group is not self.group or op not in _OPS or not t.is_contiguous():
            return None
        offset = t.data_ptr() - self.mine
        if self.views:
            if not (offset == 0 and t.nbytes == self.nbytes) and \
                    (offset, t.nbytes) not in self.parts:
                return None
        elif offset != 0 or t.dtype != self.dtype or t.numel() != self.numel:
            return None
        return Placement([s + offset for s in self.slots], _signature(t, self.token, offset),
                         offset)


class Placement:
    """A tensor on the symmetric path: ``slots[p]`` is rank p's copy of its bytes in this
    process; ``sig`` its signature (dtype, shape, segment and offset), which the kernel
    compares across ranks, so ranks that pass different symmetric memory fail alike."""

    __slots__ = ("slots", "sig", "offset")

    def __init__(self, slots, sig, offset):
        self.slots, self.sig, self.offset = slots, sig, offset

    def describe(self, t: torch.Tensor) -> dict:
        """``{sig: words}`` for an error message (``ShmCommunicator._failed``)."""
        return {self.sig: f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} at byte "
                          f"{self.offset} of a symmetric tensor"}


def _signature(t: torch.Tensor, token: int, offset: int) -> int:
    """``fastpar.comm.engines.shm.signature``'s layout (bits 56-63 the dtype, 48-55 the dims) with the
    low 48 bits hashing the shape, the segment's token and the offset in the slot (ints and
    tuples of ints hash alike in every process)."""
    code = dtypes.CODE.get(t.dtype, 255)
    return (code << 56) | (min(t.dim(), 255) << 48) | (
        hash((tuple(t.shape), token, offset)) & (1 << 48) - 1)


class Registry:
    """This job's symmetric segments by this rank's slot address (``CommState.symmetric``):
    ``get`` the entry of a whole tensor, ``find`` the one whose slot holds an address."""

    def __init__(self):
        self._by_start: dict = {}
        self._starts: list[int] = []  # sorted

    def __len__(self) -> int:
        return len(self._by_start)

    def __contains__(self, start: int) -> bool:
        return start in self._by_start

    def get(self, start: int, default=None):
        return self._by_start.get(start, default)

    def __setitem__(self, start: int, seg) -> None:
        if start not in self._by_start:
            bisect.insort(self._starts, start)
        self._by_start[start] = seg

    def pop(self, start: int, default=None):
        seg = self._by_start.pop(start, None)
        if seg is None:
            return default
        self._starts.pop(bisect.bisect_left(self._starts, start))
        return seg

    def clear(self) -> None:
        self._by_start.clear()
        self._starts.clear()

    def values(self):
        return self._by_start.values()

    def find(self, address: int):
        """The segment whose slot (this rank's) starts at or before ``address`` nearest; the
        caller checks the end (``SymmetricSegment.place``)."""
        i = bisect.bisect_right(self._starts, address) - 1
        return self._by_start[self._starts[i]] if i >= 0 else None
