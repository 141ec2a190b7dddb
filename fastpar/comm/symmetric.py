"""Symmetric tensors: one tensor per rank in a segment that every rank of the group maps.

    x = comm.symmetric_empty(4096, 1024, dtype=torch.float32, group=topo.dp_group)
    x.copy_(grads)              # or compute straight into x
    comm.all_reduce(x, group=topo.dp_group)   # in place, no copy in or out
    symmetric.register_parts(x.view(-1), [(8192, 4096)])   # collective: this part in place too
    comm.all_reduce(x.view(-1)[8192:12288], group=topo.dp_group)   # every rank: that part
    symmetric.release(x)        # x's pages go back to the system (reads zeros, refills on write)

``symmetric_empty`` is collective over the group: every rank calls it with the same size and
dtype, in the same order. The segment holds ``world`` slots of the tensor's bytes rounded up to
a page; rank r's tensor is slot r. An all_reduce of it on its own group takes the symmetric
shm path (``csrc/shm/README.md``, "all_reduce, symmetric"): rank r reduces slice r of every
slot in rank order and writes it into slice r of every slot, so each byte is read and written
once; the result is bitwise that of the copying path. So do all_gather into it, reduce_scatter
and all_to_all of it, an all_gather of it into a plain tensor, and (CPU) the same calls on a
part of it that the group registered (``register_parts``: ZeRO's per-run blocks, master pieces
and staging rows), which every rank then passes alike; the kernel gets every rank's address
of that part. Every rank must then pass the same part of the
same tensor: the call's signature (``Placement.sig``: dtype, shape, the segment's token drawn
at its creation, the offset in the slot) is compared across ranks in the kernel's first round,
and ranks that differ fail alike instead of reading each other's other bytes. Anything else
(other parts, such as each rank's own block; another group, another engine, min/prod, below
the sizes where it pays) takes the ordinary path, correct but copying.

``release`` gives a symmetric tensor's pages back (it reads zeros after, and takes memory again
where written; nothing in the library releases pages per use: bench/zero_gather.py measures
why); ``resident_bytes`` counts what this
rank's slots hold in memory now (``mincore``), for memory reports. Pages given back and taken
again cost a fault each, in every rank that maps them: 2 ranks gathering into an 8 MiB
symmetric buffer released after each call took 8.9 ms against 1.4 ms with its pages kept.

Lifetime: the name in ``/dev/shm`` exists only while the group sets the segment up (a reaper
unlinks it if the creating rank dies meanwhile) and is unlinked once every rank has mapped it,
as for the group's ShmCommunicator; nothing is left behind when a rank dies later. The mapping
lives as long as any tensor viewing it (the tensor's storage holds the mapping); the registry
entry that routes it goes with the mapping, or at ``fastpar.shutdown``, after which the tensor
is an ordinary tensor.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import secrets
import weakref

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm.engines import ipc_exchange
from fastpar.comm.engines.segments import map_segments
from fastpar.comm.state import current
from fastpar.comm.symmetric_registry import Placement, SymmetricSegment

log = logging.getLogger("fastpar.comm")

_PAGE = 4096


def symmetric_available(group, op: str = "all_reduce") -> bool:
    """Whether ``symmetric_empty`` tensors would help ``op`` on ``group`` (CPU tensors): the
    group has several ranks, its CPU ``op`` goes to the shm engine, and ``FASTPAR_SYMMETRIC`` is
    not ``0``. Every rank of the group answers alike (same group, same policy), so callers may
    decide collectively on it."""
    if os.environ.get("FASTPAR_SYMMETRIC", "1") == "0":
        return False
    st = current()
    _, ranks, facts = st.resolve(group)
    if len(ranks) == 1:
        return False
    return st.decide(op, "cpu", facts, 4, torch.float32).engine == "shm"


def lookup(t: torch.Tensor, group, op: str = "sum") -> Placement | None:
    """Where a collective over ``group`` with ``op`` runs on ``t`` in place: a whole symmetric
    tensor, or (CPU) a registered part of one (``register_parts``); None otherwise. Every rank
    of the group must pass the same tensor or part (the kernel checks, and fails on every rank
    where they differ)."""
    if t.numel() == 0:
        return None
    sym = current().symmetric.find(t.data_ptr())
    return sym.place(t, group, op) if sym is not None else None


def register_parts(t: torch.Tensor, parts) -> None:
    """Let parts of the symmetric tensor ``t`` take the symmetric path: ``parts`` is
    ``[(start, numel)]`` in elements of ``t`` (flattened), the same list on every rank of its
    group (collective; a ValueError on every rank, naming each rank's list, where they differ).
    A collective on exactly one of those parts then runs in place like one on the whole tensor;
    registering one promises that every rank passes that same part when one does (ZeRO's
    per-run blocks, master pieces and staging rows), as a collective on a symmetric tensor
    must get that tensor from every rank: ranks that break it fail alike (the kernel compares
    which memory each passed). Nothing for a plain tensor (one rank, across hosts)."""
    st = current()
    sym = st.symmetric.find(t.data_ptr()) if t.numel() else None
    if sym is None or not sym.views:
        return
    parts = [(int(a), int(n)) for a, n in parts]
    if any(a < 0 or n < 0 or a + n > t.numel() for a, n in parts):
        raise ValueError(f"symmetric.register_parts: parts {parts} do not lie in a tensor of "
                         f"{t.numel()} elements")
    everyone = [None] * len(sym.ranks)
    dist.all_gather_object(everyone, parts, group=sym.group)
    if any(e != parts for e in everyone):
        said = "; ".join(f"global rank {r}: {e}" for r, e in zip(sym.ranks, everyone))
        raise ValueError("symmetric.register_parts is collective: every rank of the group "
                         f"must pass the same parts; got {said}")
    base, es = t.data_ptr() - sym.mine, t.element_size()
    sym.parts.update((base + a * es, n * es) for a, n in parts if n)


def room_for(nbytes: int, group=None, what: str = "symmetric buffers") -> bool:
    """Whether ``/dev/shm`` has room for ``nbytes`` of symmetric memory per rank of ``group``
    (CPU, one host): its free bytes now against the group's total, with a tenth to spare.
    Collective: every rank answers what the most constrained rank saw, so they decide alike.
    Pages of a segment are taken when first written, so a full ``/dev/shm`` would otherwise
    show as a SIGBUS in the middle of a step; callers keep ordinary memory instead (logged)."""
    group, ranks, _ = current().resolve(group)
    try:
        fs = os.statvfs("/dev/shm")
        free = fs.f_bavail * fs.f_frsize
    except OSError:
        free = 0
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, free, group=group)
    need = int(nbytes * len(ranks) * 1.1)
    if min(everyone) < need:
        log.warning("%s: /dev/shm has %.1f MiB free, %.1f MiB wanted for global ranks %s: "
                    "ordinary memory instead (the copying collectives)", what,
                    min(everyone) / 2**20, need / 2**20, ranks)
        return False
    return True


def _size_of(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    if not all(isinstance(s, int) and s >= 0 for s in size):
        raise ValueError(f"symmetric_empty: size must be non-negative ints, got {size}")
    return tuple(size)


def _agree(group, ranks, size, dtype, what: str = "symmetric_empty") -> int:
    """ValueError on every rank, naming each rank's size and dtype, unless they all agree;
    else the segment's token, alike on every rank (the group's first rank's draw)."""
    everyone = [None] * len(ranks)
    dist.all_gather_object(everyone, (list(size), str(dtype), secrets.randbits(40)),
                           group=group)
    if any(e[:2] != everyone[0][:2] for e in everyone):
        said = ", ".join(f"global rank {r}: size {tuple(s)} {d}"
                         for r, (s, d, _) in zip(ranks, everyone))
        raise ValueError(f"{what} is collective: every rank of the group must pass the "
                         f"same size and dtype, in the same order; got {said}")
    return everyone[0][2]


def _cpu_segment(st, group, ranks, nbytes: int, token: int, what: str):
    """One registered CPU segment of ``len(ranks)`` slots of ``nbytes`` (rounded up to a page):
    ``(memoryview of the whole mapping, this rank's slot offset in it)``. The registry entry
    goes when the memoryview does (every tensor made from it holds it)."""
    group_rank = ranks.index(st.topo.rank)
    slot = -(-nbytes // _PAGE) * _PAGE
    mapping = map_segments(group, st.topo.rank, {"sym": (ranks[0], ranks)}, slot * len(ranks),
                           f"fastpar {what}: setting up the segment of the group of global "
                           f"ranks {ranks}", tag="sym-")["sym"]
    view = memoryview(mapping)
    anchor = torch.frombuffer(view, dtype=torch.uint8, count=1)  # the mapping's address
    base = anchor.data_ptr()
    del anchor
    key = base + group_rank * slot
    st.symmetric[key] = SymmetricSegment(st.topo.rank, group, ranks, torch.uint8, nbytes,
                                         [base + p * slot for p in range(len(ranks))],
                                         token=token, views=True)
    # Runs when the last tensor goes, before the mapping does (`view` holds it).
    weakref.finalize(view, st.symmetric.pop, key, None)
    return view, group_rank * slot


def symmetric_empty(*size, dtype: torch.dtype = torch.float32, group=None,
                    device=None) -> torch.Tensor:
    """A tensor of ``size`` whose memory every rank of ``group`` (``None``: the world) maps:
    an all_reduce of it on ``group`` needs no copy in or out. Collective over the group; the
    contents start as zeros on the CPU (uninitialised on a GPU). A group of one rank, or one
    spread over hosts, gets a plain ``torch.empty`` (no shared memory to use).

    On the CPU any contiguous part of it takes the symmetric kernels too, when every rank
    passes the same part (``lookup``). ``device``: CPU (default) uses a shared-memory segment;
    a CUDA device uses CUDA IPC: each rank allocates its tensor and maps its peers'
    (``_cuda_symmetric``), and the CUDA IPC engine's all_reduce reduces the whole tensor in
    place (two-shot kernel). A GPU symmetric tensor keeps its memory and its peers' mappings
    until ``fastpar.shutdown``."""
    size = _size_of(size)
    st = current()
    group, ranks, facts = st.resolve(group)
    numel = 1
    for s in size:
        numel *= s
    device = torch.device("cpu") if device is None else torch.device(device)
    if len(ranks) == 1 or not facts.same_host:
        return torch.empty(size, dtype=dtype, device=device)
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device, by number (the ops need one)
            device = torch.device("cuda", torch.cuda.current_device())
        return _cuda_symmetric(st, group, ranks, size, numel, dtype, device)
    if device.type != "cpu":
        raise ValueError(f"symmetric_empty: device must be cpu or cuda, got {device}")
    _native.require("symmetric tensors")
    token = _agree(group, ranks, size, dtype)
    if numel == 0:
        return torch.empty(size, dtype=dtype)
    esize = torch.empty((), dtype=dtype).element_size()
    view, mine = _cpu_segment(st, group, ranks, numel * esize, token, "symmetric_empty")
    # The storage holds `view`, `view` holds the mapping: both live while any tensor does.
    return torch.frombuffer(view, dtype=dtype, count=numel, offset=mine).view(size)


def _libc():
    lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return lib


_LIBC = None


def release(t: torch.Tensor) -> None:
    """Give the pages of ``t`` back to the system: ``t`` is CPU symmetric memory starting on a
    page (a whole ``symmetric_empty`` tensor, or a page-aligned part of one), and every page its
    bytes touch goes, so the bytes after it on its last page too. It reads as zeros afterwards
    and takes memory again where written. Local (no communication): the caller makes sure no
    peer reads it meanwhile (a finished collective has read it). Nothing for an empty ``t``."""
    global _LIBC
    if t.numel() == 0:
        return
    sym = current().symmetric.find(t.data_ptr())
    start = t.data_ptr()
    if sym is None or not sym.views or start % _PAGE or not t.is_contiguous() or \
            start + t.nbytes > sym.mine + sym.nbytes:
        raise ValueError("symmetric.release: the tensor must be contiguous CPU symmetric "
                         f"memory starting on a page; got {t.numel()} elements at "
                         f"0x{start:x}")
    _LIBC = _LIBC or _libc()
    length = -(-t.nbytes // _PAGE) * _PAGE
    if _LIBC.madvise(start, length, mmap.MADV_REMOVE) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"symmetric.release: madvise(MADV_REMOVE) of {length} bytes: "
                           f"{os.strerror(err)}")


def resident_bytes(t: torch.Tensor | None = None) -> int:
    """Bytes of this rank's own slots of its CPU symmetric segments that are in memory now
    (``mincore``): what those segments hold for this rank, pages given back by ``release``
    and never written not counted (a page of a peer's slot that this rank read counts in the
    peer's). ``t``: only the pages that ``t``'s bytes touch."""
    if t is not None:
        lo = t.data_ptr() // _PAGE * _PAGE
        return _resident(lo, -(-(t.data_ptr() + t.nbytes - lo) // _PAGE)) if t.numel() else 0
    return sum(_resident(sym.mine, -(-sym.nbytes // _PAGE))
               for sym in list(current().symmetric.values()) if sym.views)


def _resident(start: int, pages: int) -> int:
    global _LIBC
    _LIBC = _LIBC or _libc()
    vec = (ctypes.c_ubyte * pages)()
    if _LIBC.mincore(start, pages * _PAGE, vec) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"symmetric.resident_bytes: mincore of {pages} pages: "
                           f"{os.strerror(err)}")
    return sum(v & 1 for v in vec) * _PAGE


def symmetric_slots(*size, dtype: torch.dtype = torch.float32, group=None):
    """Every rank's tensor of a new symmetric segment, in group order (CPU, one host): rank p
    of ``group`` writes ``slots[p]``, every rank reads any of them in place. Collective over the
    group like ``symmetric_empty`` (same size and dtype, same order); zeros to start. ``None``
    for a group of one rank or one spread over hosts: the caller moves its bytes another way.
    The slots are not registered for collectives (they are buffers a caller synchronises
    itself); the segment lives while any of them does."""
    size = _size_of(size)
    st = current()
    group, ranks, facts = st.resolve(group)
    if len(ranks) == 1 or not facts.same_host:
        return None
    _agree(group, ranks, size, dtype, "symmetric_slots")
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
    st.symmetric[t.data_ptr()] = SymmetricSegment(st.topo.rank, group, ranks, dtype, numel,
                                                  peers.addresses)
    # At shutdown, on every rank, the exchange's teardown: nobody is in a kernel on these tensors
    # (sync, barrier), unmap the peers', and only after a second barrier let go of ours (a peer
    # must not hold a mapping of memory its owner has freed). The caching allocator takes the
    # memory back once the caller's last view of it goes too.
    held = [base]
    st.closers.append(lambda: peers.teardown(free=held.clear))
    return t
