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

On any failure, on any rank (a peer that died or never came, /dev/shm full, an interrupt),
this rank closes what it mapped and unlinks every name of its segments it knows (the owner
may be the one that died), so nothing is left behind; an ``Exception`` is raised again as a
``RuntimeError`` naming the rank and ``what``, anything else (KeyboardInterrupt) as it was.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import subprocess

import torch.distributed as dist


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
        table = [None] * dist.get_world_size(group)
        dist.all_gather_object(table, created, group=group)
        for part in table:
            names.update(part)
        for key, (owner, members) in segments.items():
            if owner != me and me in members:
                maps[key] = _open_map(shm, names[key], nbytes, False, populate)
        dist.barrier(group=group)  # every member has mapped its segments: the names may go
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
