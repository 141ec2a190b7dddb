"""Shared-memory segments among the ranks of a group: the one setup protocol that the shm
collectives (``shm.py``), symmetric tensors (``symmetric.py``) and the P2P rings
(``transport/shm_rings.py``) share.

    maps = map_segments(group, me, {"all": (owner, members)}, nbytes, "fastpar shm: ...")
    maps["all"]   # an mmap.mmap of nbytes, mapped by every member

For each segment this rank is a member of:

1. its owner creates it in ``/dev/shm`` under a name unique to the job (``/fastpar-[tag]<pid>-
   <random>``, mode 0600), sizes and maps it, and fills it (``init``); a reaper child of the
   owner removes the name if the owner dies before step 4, by any signal;
2. every rank of the group gathers every owner's names (one ``all_gather_object``);
3. the other members map it;
4. a barrier over the group: every member has mapped it, so the owner unlinks the name (the
   memory goes with the last mapping, whoever dies later), and the reaper goes.

``group`` is a torch.distributed group, or an ``Exchange`` of the same two steps over something
else: ``StoreExchange`` runs them over a c10d store, ``BackendExchange`` over a c10d backend
that is no registered group: the torch.distributed backend's (``fastpar/backend/``), whose group
cannot run collectives while it is being made, nor from inside one of its own calls.

On any failure, on any rank (a peer that died or never came, /dev/shm full, an interrupt),
this rank closes what it mapped and unlinks every name of its segments it knows (the owner
may be the one that died), so nothing is left behind; an ``Exception`` is raised again as a
``RuntimeError`` naming the rank and ``what``, anything else (KeyboardInterrupt) as it was.
"""

from __future__ import annotations

import contextlib
import datetime
import mmap
import os
import pickle
import secrets
import subprocess

import torch
import torch.distributed as dist


class Exchange:
    """The two collective steps of the protocol over a torch.distributed group."""

    def __init__(self, group):
        self.group = group

    def all_gather_object(self, obj) -> list:
        table = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(table, obj, group=self.group)
        return table

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class StoreExchange(Exchange):
    """The same steps over a c10d ``store`` shared by ``size`` ranks (this one ``rank``): each
    call writes this rank's key of a round and reads the others', waiting for each up to
    ``timeout`` seconds (then the store raises)."""

    def __init__(self, store, rank: int, size: int, timeout: float):
        self.store, self.rank, self.size, self.round = store, rank, size, 0
        self.timeout = datetime.timedelta(seconds=timeout)

    def all_gather_object(self, obj) -> list:
        self.round += 1
        keys = [f"x{self.round}/{r}" for r in range(self.size)]
        self.store.set(keys[self.rank], pickle.dumps(obj))
        self.store.wait(keys, self.timeout)
        return [pickle.loads(self.store.get(k)) for k in keys]

    def barrier(self) -> None:
        self.all_gather_object(None)


class BackendExchange(Exchange):
    """The same steps over a c10d ``Backend`` of ``size`` ranks that is not a registered group
    (the fastpar backend's own gloo, made beside it): its calls directly."""

    def __init__(self, backend, size: int):
        self.backend, self.size = backend, size

    def _gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.backend.allgather([out], [t]).wait()
        return out

    def all_gather_object(self, obj) -> list:
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [int(n) for n in self._gather(torch.tensor([data.numel()]))]
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[:data.numel()] = data
        return [pickle.loads(t[:n].numpy().tobytes())
                for t, n in zip(self._gather(padded), sizes)]

    def barrier(self) -> None:
        self._gather(torch.zeros(1))


def _posixshmem():
    import _posixshmem  # CPython's shm_open/shm_unlink, without multiprocessing's tracker

    return _posixshmem


def _reaper(name: str) -> subprocess.Popen:
    """A shell in its own session that removes ``/dev/shm<name>`` unless told otherwise: it
    reads its stdin, whose only writer is this process, and removes the name if the read ends
    without a line (this process died, by any signal). Closing stdin without writing is the
    same as dying, so the caller closes it after unlinking the name itself; a posix_spawn-like
    start (no fork of this process's memory, no atfork handlers)."""
    return subprocess.Popen(["/bin/sh", "-c", 'read -r _ || rm -f "$0"', f"/dev/shm{name}"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def _open_map(shm, name: str, nbytes: int, create: bool, populate: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = shm.shm_open(name, flags, mode=0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        extra = getattr(mmap, "MAP_POPULATE", 0) if populate else 0
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | extra)
    finally:
        os.close(fd)


def map_segments(group, me: int, segments: dict, nbytes: int, what: str, *, tag: str = "",
                 init=None, populate: bool = False) -> dict:
    """Collective over ``group``: ``{key: mmap}`` of every segment in ``segments``
    (``{key: (owner global rank, member global ranks)}``, the ones this rank ``me`` is a member
    of; keys alike on the ranks that share a segment), each ``nbytes``. ``init(key, mapping)``
    runs on the owner before any other member maps it. ``populate``: prefault the pages
    (MAP_POPULATE). See the module docstring for the protocol and what a failure leaves."""
    shm = _posixshmem()
    exchange = group if isinstance(group, Exchange) else Exchange(group)
    maps, created, names, reapers, failed = {}, {}, {}, [], False
    try:
        for key, (owner, _) in segments.items():
            if owner == me:
                name = f"/fastpar-{tag}{os.getpid()}-{secrets.token_hex(8)}"
                reapers.append(_reaper(name))  # until the names go (step 4) or this dies
                created[key] = name
                maps[key] = _open_map(shm, name, nbytes, True, populate)
                if init is not None:
                    init(key, maps[key])
        for part in exchange.all_gather_object(created):
            names.update(part)
        for key, (owner, members) in segments.items():
            if owner != me and me in members:
                maps[key] = _open_map(shm, names[key], nbytes, False, populate)
        exchange.barrier()  # every member has mapped its segments: the names may go
    except BaseException as exc:
        failed = True
        for m in maps.values():
            with contextlib.suppress(BufferError):  # an export the caller never got: none
                m.close()
        if not isinstance(exc, Exception):  # KeyboardInterrupt & co.: cleaned up, re-raised
            raise
        raise RuntimeError(f"{what} failed on global rank {me} (a peer died or did not reach "
                           f"this collective in time, or /dev/shm refused {nbytes} bytes): "
                           f"{exc}") from exc
    finally:
        # After the barrier, or on failure on any rank (an owner may be the one that died):
        # nothing leaks, and a missing name does not hide the error above.
        mine = set(created.values())
        theirs = {names[k] for k in segments if k in names} if failed else set()
        for name in mine | theirs:
            with contextlib.suppress(FileNotFoundError):
                shm.shm_unlink(name)
        for reaper in reapers:  # the names are gone: the reapers may go
            with contextlib.suppress(OSError):
                reaper.stdin.close()
            reaper.wait()
    return maps
