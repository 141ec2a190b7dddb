"""Set-up of the shm P2P rings (``shm_rings.ShmP2P``): what its constructor does before the first
message and its ``close`` undoes.

    check_arguments(ranks, rank, peers, tags, ring_bytes, timeout, single_copy_min)
    oversubscribed = check_pairing(group, ranks, peers)            # collective over group
    maps, bases = map_pairs(group, rank, peers, tags, ring_bytes)  # collective over group
    single_copy = warm_up(rings, ep, single_copy_min)              # after the kernel's open
    unmap(maps)

One segment per pair of ranks, created by the lower rank in ``/dev/shm`` (mode 0600, a reaper
unlinks it if the creator dies during set-up) and unlinked once both ranks mapped it, so a rank
that dies later leaks nothing (``segments.map_segments``). Kernel protocol and layout:
``csrc/shm/README.md``.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os

import torch
import torch.distributed as dist

from fastpar.comm.engines.segments import map_segments

log = logging.getLogger("fastpar.comm.transport")


def check_arguments(ranks: list[int], rank: int, peers: list[int], tags: int, ring_bytes: int,
                    timeout: float, single_copy_min: int | None) -> None:
    """``ValueError`` naming the value for arguments the rings cannot take."""
    if rank not in ranks:
        raise ValueError(f"fastpar shm p2p: rank {rank} is not in the group {ranks}")
    strangers = [p for p in peers if p not in ranks or p == rank]
    if strangers:
        raise ValueError(f"fastpar shm p2p: rank {rank} lists peers {strangers}, which are "
                         f"itself or outside the group {ranks}")
    if not 1 <= tags <= 64:
        raise ValueError(f"fastpar shm p2p: tags={tags}, expected 1..64")
    if ring_bytes < 8192 or ring_bytes & (ring_bytes - 1):
        raise ValueError(f"fastpar shm p2p: ring_bytes={ring_bytes} must be a power of two, "
                         f"at least 8192")
    if not timeout > 0:
        raise ValueError(f"fastpar shm p2p: timeout={timeout} must be > 0 (math.inf: none)")
    if single_copy_min is not None and single_copy_min < 0:
        raise ValueError(f"fastpar shm p2p: single_copy_min={single_copy_min} must be >= 0 "
                         f"(None: never)")


def check_pairing(group, ranks: list[int], peers: list[int]) -> bool:
    """Checks that pairing is symmetric (b in the peers of a iff a in the peers of b); returns
    whether the group's ranks outnumber the CPUs they may run on together (then waits spin
    little and sleep soon: see the kernel's ``open``; the host's other ranks count too,
    ``shm.host_oversubscribed``). A rank bound to a CPU of its own is not oversubscribed,
    though its own affinity holds fewer CPUs than the group has ranks."""
    table = [None] * len(ranks)
    dist.all_gather_object(table, (peers, sorted(os.sched_getaffinity(0))), group=group)
    lists = {r: their_peers for r, (their_peers, _) in zip(ranks, table)}
    cpus = set().union(*(set(c) for _, c in table))
    for a, peers_of_a in lists.items():
        for b in peers_of_a:
            if a not in lists[b]:
                raise ValueError(f"fastpar shm p2p: pairing is not symmetric: rank {a} lists "
                                 f"rank {b} as a peer but rank {b} lists {lists[b]}")
    return len(ranks) > len(cpus)


def map_pairs(group, rank: int, peers: list[int], tags: int,
              ring_bytes: int) -> tuple[list, list[int]]:
    """``(maps, bases)``: one segment per pair of peers, created by the lower rank (which lays
    it out), mapped prefaulted by both (a fresh ring page would otherwise cost a page fault on
    each side, ~2 us per 4 KiB, until the ring has wrapped once); ``maps`` holds each
    ``(mmap, anchor)`` until ``unmap``, ``bases`` the address of each peer's segment in
    ``peers`` order."""
    ops = torch.ops.fastpar
    nbytes = ops.shm_p2p_segment_bytes(tags, ring_bytes)
    pairs = {(min(rank, p), max(rank, p)): p for p in peers}

    def init(pair, mapping):
        anchor = ctypes.c_char.from_buffer(mapping)
        ops.shm_p2p_init_segment(ctypes.addressof(anchor), pair[0], pair[1], tags, ring_bytes)
        del anchor

    mapped = map_segments(group, rank, {pair: (pair[0], pair) for pair in pairs}, nbytes,
                          f"fastpar shm p2p: setting up the channels of global rank {rank} to "
                          f"{peers}", tag="p2p-", init=init, populate=True)
    maps: list[tuple[mmap.mmap, ctypes.c_char]] = []
    base_of = {}
    for pair, m in mapped.items():
        anchor = ctypes.c_char.from_buffer(m)  # keeps the address valid
        maps.append((m, anchor))
        base_of[pairs[pair]] = ctypes.addressof(anchor)
    return maps, [base_of[p] for p in peers]


def unmap(maps: list) -> None:
    """Closes every mapping of ``map_pairs`` (emptying ``maps``)."""
    while maps:
        m, anchor = maps.pop()
        del anchor  # the buffer export, before the mapping can close
        m.close()


def warm_up(rings, ep: int, single_copy_min: int | None) -> dict[int, bool]:
    """One tiny message each way on every pair and tag of ``rings`` (a ``ShmP2P`` whose kernel
    endpoint ``ep`` is open), twice: both ends attached, every control line touched. Between
    the rounds each rank probes whether it can read its peers' memory; a peer's second message
    comes after its verdict, so both sides know the answer once this returns: per peer, whether
    this rank's sends to it go single-copy."""
    ops, me = torch.ops.fastpar, rings.rank
    for round_ in (0, 1):
        sends = [rings.isend(p, t, torch.tensor([me, p, t, round_]), [])
                 for p in rings.peers for t in range(rings.tags)]
        for p in rings.peers:
            for t in range(rings.tags):
                got = rings.recv_header(p, t).tolist()
                if got != [p, me, t, round_]:
                    raise RuntimeError(f"fastpar shm p2p: rank {me}'s warm-up message from rank "
                                       f"{p} on tag {t} reads {got}, expected "
                                       f"{[p, me, t, round_]}")
        for h in sends:
            h.wait()
        if round_ == 0:
            ops.shm_p2p_probe(ep)
    single_copy = {p: single_copy_min is not None and ops.shm_p2p_single_copy(ep, slot)
                   for slot, p in enumerate(rings.peers)}
    slow = [p for p, ok in single_copy.items() if not ok]
    if slow and single_copy_min is not None:
        log.info("fastpar shm p2p: rank %d sends to ranks %s through the rings only (they "
                 "cannot read its memory: ptrace rules or pid namespaces)", me, slow)
    return single_copy
