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

import logging
import os
import weakref

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm import ipc_exchange
from fastpar.comm.segments import map_segments
from fastpar.comm.state import current

log = logging.getLogger("fastpar.comm")

_PAGE = 4096
_OPS = ("sum", "max")  # the ops the symmetric kernel reduces with


class SymmetricSegment:
    """What routes a symmetric tensor: its group, dtype, size and every rank's slot address
    (in this process's mapping). Holds no reference to the tensor or the mapping."""

    __slots__ = ("group", "ranks", "dtype", "numel", "slots")

    def __init__(self, group, ranks, dtype, numel, slots):
        self.group, self.ranks, self.dtype, self.numel = group, ranks, dtype, numel
        self.slots = slots  # list of ints: rank p's slot address, p in group order

    def serves(self, t: torch.Tensor, group, op: str = "sum") -> bool:
        """Whether a collective on ``t`` (contiguous, starting at a slot) over ``group`` with
        ``op`` can take the symmetric path: the whole tensor, its own group, a kernel op."""
        return (group is self.group and op in _OPS and t.dtype == self.dtype
                and t.numel() == self.numel)


def symmetric_available(group, op: str = "all_reduce") -> bool:
    """Whether ``symmetric_empty`` tensors would help ``op`` on ``group`` (CPU tensors): the
    group has several ranks, its CPU ``op`` goes to the shm engine, and ``FASTPAR_SYMMETRIC`` is
    not ``0``. Every rank of the group answers alike (same group, same policy), so callers may
    decide collectively on it."""
    if os.environ.get("FASTPAR_SYMMETRIC", "1") == "0":
        return False
    st = current()
    _, ranks, _ = st.resolve(group)
    if len(ranks) == 1:
        return False
    _, _, choice = st.choose(op, torch.empty(1), group)
    return choice.engine == "shm"


def lookup(t: torch.Tensor, group, op: str = "sum") -> SymmetricSegment | None:
    """The segment of ``t`` if ``t`` is a whole symmetric tensor that a collective over
    ``group`` with ``op`` can run in place on; else None."""
    sym = current().symmetric.get(t.data_ptr())
    return sym if sym is not None and sym.serves(t, group, op) else None


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


def symmetric_empty(*size, dtype: torch.dtype = torch.float32, group=None,
                    device=None) -> torch.Tensor:
    """A tensor of ``size`` whose memory every rank of ``group`` (``None``: the world) maps:
    an all_reduce of it on ``group`` needs no copy in or out. Collective over the group; the
    contents start as zeros on the CPU (uninitialised on a GPU). A group of one rank, or one
    spread over hosts, gets a plain ``torch.empty`` (no shared memory to use).

    ``device``: CPU (default) uses a shared-memory segment; a CUDA device uses CUDA IPC: each
    rank allocates its tensor and maps its peers' (``_cuda_symmetric``), and the CUDA IPC
    engine's all_reduce reduces it in place (two-shot kernel). A GPU symmetric tensor keeps its
    memory and its peers' mappings until ``fastpar.shutdown``."""
    size = _size_of(size)
    st = current()
    group, ranks, layout = st.resolve(group)
    numel = 1
    for s in size:
        numel *= s
    device = torch.device("cpu") if device is None else torch.device(device)
    if len(ranks) == 1 or not layout.same_host:
        return torch.empty(size, dtype=dtype, device=device)
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device, by number (the ops need one)
            device = torch.device("cuda", torch.cuda.current_device())
        return _cuda_symmetric(st, group, ranks, size, numel, dtype, device)
    if device.type != "cpu":
        raise ValueError(f"symmetric_empty: device must be cpu or cuda, got {device}")
    _native.require("symmetric tensors")
    _agree(group, ranks, size, dtype)
    if numel == 0:
        return torch.empty(size, dtype=dtype)
    group_rank = ranks.index(st.topo.rank)
    esize = torch.empty((), dtype=dtype).element_size()
    slot = -(-numel * esize // _PAGE) * _PAGE  # (bytes rounded up to a page)
    mapping = map_segments(group, st.topo.rank, {"sym": (ranks[0], ranks)}, slot * len(ranks),
                           f"fastpar symmetric_empty: setting up the segment of the group of "
                           f"global ranks {ranks}", tag="sym-")["sym"]
    view = memoryview(mapping)
    # The storage holds `view`, `view` holds the mapping: both live while any tensor does.
    t = torch.frombuffer(view, dtype=dtype, count=numel, offset=group_rank * slot).view(size)
    base = t.data_ptr() - group_rank * slot
    key = t.data_ptr()
    st.symmetric[key] = SymmetricSegment(group, ranks, dtype, numel,
                                         [base + p * slot for p in range(len(ranks))])
    # Runs when the last tensor goes, before the mapping does (`view` holds it).
    weakref.finalize(view, st.symmetric.pop, key, None)
    return t


def symmetric_slots(*size, dtype: torch.dtype = torch.float32, group=None):
    """Every rank's tensor of a new symmetric segment, in group order (CPU, one host): rank p
    of ``group`` writes ``slots[p]``, every rank reads any of them in place. Collective over the
    group like ``symmetric_empty`` (same size and dtype, same order); zeros to start. ``None``
    for a group of one rank or one spread over hosts: the caller moves its bytes another way.
    The slots are not registered for collectives (they are buffers a caller synchronises
    itself); the segment lives while any of them does."""
    size = _size_of(size)
    st = current()
    group, ranks, layout = st.resolve(group)
    if len(ranks) == 1 or not layout.same_host:
        return None
    _agree(group, ranks, size, dtype)
    numel = 1
    for s in size:
        numel *= s
    esize = torch.empty((), dtype=dtype).element_size()
    slot = max(1, -(-numel * esize // _PAGE)) * _PAGE
    mapping = map_segments(group, st.topo.rank, {"sym": (ranks[0], ranks)}, slot * len(ranks),
                           f"fastpar symmetric_slots: setting up the segment of the group of "
                           f"global ranks {ranks}", tag="slots-")["sym"]
    whole = torch.frombuffer(memoryview(mapping), dtype=torch.uint8)  # holds the mapping
    return [whole[p * slot:p * slot + numel * esize].view(dtype).view(size)
            for p in range(len(ranks))]


def _cuda_symmetric(st, group, ranks, size, numel, dtype, device, driver=None) -> torch.Tensor:
    """CUDA IPC symmetric tensor: allocate (16-byte padded, as the kernel loads 16 bytes at a
    time) and share it with the group by the one CUDA IPC exchange (``ipc_exchange.PeerMaps``:
    export the allocation's handle, map every peer's, each step agreed over the group). If any
    rank cannot (no CUDA build, an expandable segment or cudaMallocAsync, a handle that does not
    open), every rank returns a plain tensor instead and the all_reduce copies as usual; the
    reason is logged. ``driver``: the native calls (``ipc_exchange.Driver``; tests pass a fake
    one and a CPU ``device``)."""
    ipc_exchange.check_not_capturing(ranks, "a CUDA symmetric tensor")
    _agree(group, ranks, size, dtype)
    driver = driver or ipc_exchange.Driver()
    esize = torch.empty((), dtype=dtype).element_size()
    base = torch.empty(-(-max(numel, 1) * esize // 16) * 16, dtype=torch.uint8, device=device)
    t = base[:numel * esize].view(dtype).view(size)
    peers = ipc_exchange.PeerMaps(group, ranks, ranks.index(st.topo.rank), device, driver,
                                  f"a symmetric tensor's {base.numel()} bytes")

    def export():
        handle, offset = driver.export_tensor(base)
        return t.data_ptr(), handle, offset

    why = peers.exchange(export, "exporting the tensor's IPC handle")
    if why is not None:
        peers.release()  # nothing to free: t stays, a plain tensor
        log.info("symmetric_empty on %s for global ranks %s: a plain tensor (%s)", device, ranks,
                 why)
        return t
    st.symmetric[t.data_ptr()] = SymmetricSegment(group, ranks, dtype, numel, peers.addresses)
    # At shutdown, on every rank, the exchange's teardown: nobody is in a kernel on these tensors
    # (sync, barrier), unmap the peers', and only after a second barrier let go of ours (a peer
    # must not hold a mapping of memory its owner has freed). The caching allocator takes the
    # memory back once the caller's last view of it goes too.
    held = [base]
    st.closers.append(lambda: peers.teardown(free=held.clear))
    return t
