"""Which engine carries a ``Channels``' messages to each of its neighbours, opening them, and
the engine that routes every call by peer.

    routes = choose_routes("auto", ranks, rank, groups, hosts, device)  # pure; alike everywhere
    routes.by_peer      # {1: "shm", 3: "torch"}: the engine of each neighbour of this rank
    routes.name         # "shm+torch" ("shm", "torch" where one engine serves both, "local")
    routes.reason       # "shm with rank 1 (this host), torch with rank 3 (host b)"
    engine = open_routes(routes, group=..., ranks=..., ...)  # PeerEngines; collective (below)

"auto" gives the shm rings (``carriers.ShmEngine``) to the neighbours on this rank's host,
when tensors are on the CPU and the native extension is built, and the torch engine (batched
isend/irecv on clones of the group) to the others: a pipeline with several stages per host
keeps the bytes between them in shared memory and sends only what crosses a host over gloo /
NCCL. A forced engine serves every neighbour: "torch" (asked, or ``gloo``/``nccl`` forced) and
"shm" (asked, or forced), which raises, naming the ranks and hosts, where a neighbour is on
another host.

What is built is decided alike on every rank, from every group of the partition (``groups``)
and every rank's host, so that the collectives of the set-up match:
- the torch engine's clones, collective over the world (every rank makes every group's two
  clones in the partition's order), when some pair of neighbours in some group of the
  partition uses torch;
- then the shm rings, collective over the group, when some pair of neighbours in this group
  uses shm. Every rank of the group takes part, with its peers on its host: a rank with none
  takes part in the set-up's collectives only and keeps no rings.
"""

from __future__ import annotations

import dataclasses
import datetime
import math

import torch
import torch.distributed as dist

from fastpar import _native
from fastpar.comm.transport.base import BACKWARD, FORWARD
from fastpar.comm.transport.carriers import ShmEngine, TorchEngine
from fastpar.runtime import hostid


@dataclasses.dataclass(frozen=True)
class Routes:
    """The choice for one rank: ``by_peer`` (neighbour -> "shm" | "torch"), its ``name`` and
    ``reason``, and what the set-up builds: ``torch`` (the world makes the clones) and ``shm``
    (this rank's group sets up rings)."""

    by_peer: dict
    name: str
    reason: str
    torch: bool
    shm: bool


def neighbours(group) -> list[tuple[int, int]]:
    """The pairs of neighbouring ranks in ``group``'s ring (each pair once)."""
    n = len(group)
    if n < 2:
        return []
    return list(dict.fromkeys(tuple(sorted((group[i], group[(i + 1) % n]))) for i in range(n)))


def choose_routes(engine: str, ranks, rank: int, groups, hosts, device: torch.device,
                  forced: str | None = None, forced_by: str = "") -> Routes:
    """The ``Routes`` of ``rank`` in the group ``ranks`` (global ranks in ring order), one of
    ``groups`` (the partition of the world it belongs to; ``hosts``: each global rank's host
    identity, empty when unknown). ``engine``: "auto", "shm" or "torch"; ``forced``: the job's
    forced collective engine (``CommState.forced``), which "auto" follows where it names a p2p
    engine too (shm; gloo and nccl are torch's)."""
    ranks = list(ranks)
    if len(ranks) == 1:
        return Routes({}, "local", "a group of one rank", False, False)
    why = "forced"
    if engine == "auto" and forced in ("shm", "gloo", "nccl"):
        from fastpar.comm.policy import forcing

        engine = "shm" if forced == "shm" else "torch"
        why = f"forced by {forcing(forced, forced_by)}"
    if engine not in ("auto", "shm", "torch"):
        raise ValueError(f"p2p engine must be 'auto', 'shm' or 'torch', got {engine!r}")
    label = hostid.labels(hosts) if hosts else {}

    def on(r):
        return f"host {label[hosts[r]]}"

    pairs = [p for g in groups for p in neighbours(list(g))]
    across = [(a, b) for a, b in pairs if not hosts or hosts[a] != hosts[b]]
    uniform = None  # the reason when one engine serves every pair of the partition
    if engine == "shm":
        if device.type != "cpu":
            raise ValueError(f"the shm p2p engine ({why}) needs CPU tensors, got {device}")
        if not hosts:
            raise ValueError(f"the shm p2p engine ({why}) carries messages within a host only, "
                             "and the ranks' hosts are unknown")
        if across:  # this rank's own pair first, if it has one
            a, b = min(across, key=lambda p: rank not in p)
            raise ValueError(
                f"the shm p2p engine ({why}) carries messages within a host only, but "
                f"neighbouring stages rank {a} ({on(a)}) and rank {b} ({on(b)}) are on "
                f"different hosts; use 'auto' (shm within a host, torch across) or 'torch'")
        uniform = why
    elif engine == "torch":
        uniform = why
    elif device.type != "cpu":
        engine, uniform = "torch", f"tensors on {device.type}"
    elif not (_native.available() and hasattr(torch.ops.fastpar, "shm_p2p_send")):
        engine, uniform = "torch", "the native extension (with its p2p rings) is not built"
    elif not hosts:
        engine, uniform = "torch", "the ranks' hosts are unknown"

    def engine_of(a, b):
        if engine != "auto":
            return engine
        return "shm" if (a, b) not in across and (b, a) not in across else "torch"

    peers = sorted({ranks[(ranks.index(rank) + d) % len(ranks)] for d in (-1, 1)} - {rank})
    by_peer = {p: engine_of(rank, p) for p in peers}
    used = [e for e in ("shm", "torch") if e in by_peer.values()]
    name = "+".join(used)
    if uniform is not None:
        reason = uniform
    elif all(engine_of(a, b) == "shm" for a, b in neighbours(ranks)):
        reason = "every stage of the group is on this host, tensors on the CPU"
    else:
        reason = ", ".join(
            f"{e} with " + " and ".join(
                f"rank {p} ({'this host' if hosts[p] == hosts[rank] else on(p)})"
                for p in peers if by_peer[p] == e)
            for e in used)
    return Routes(by_peer, name, reason,
                  torch=any(engine_of(a, b) == "torch" for a, b in pairs),
                  shm=any(engine_of(a, b) == "shm" for a, b in neighbours(ranks)))


class PeerEngines:
    """The engines of one ``Channels``, each call routed to the engine of its peer."""

    def __init__(self, by_peer: dict):
        self.by_peer = by_peer  # peer -> ShmEngine | TorchEngine

    def of(self, peer: int):
        return self.by_peer[peer]

    def isend(self, peer, direction, header, parts):
        return self.by_peer[peer].isend(peer, direction, header, parts)

    def recv_header(self, peer, direction, device):
        return self.by_peer[peer].recv_header(peer, direction, device)

    def recv_payload(self, peer, direction, parts):
        self.by_peer[peer].recv_payload(peer, direction, parts)

    def recv(self, peer, direction, stage):  # the shm rings' header-and-payload receive
        return self.by_peer[peer].recv(peer, direction, stage)

    def remember(self, peer, direction, stage, layout) -> None:
        self.by_peer[peer].remember(peer, direction, stage, layout)

    def close(self) -> None:
        """Closes every engine (each once, even when one fails); then raises the first error."""
        error = None
        for engine in dict.fromkeys(self.by_peer.values()):
            try:
                engine.close()
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others
                error = error or exc
        if error is not None:
            raise error


def open_routes(routes: Routes, *, group, ranks, rank, groups, timeout,
                device) -> PeerEngines | None:
    """The engines of ``routes`` for ``rank`` in ``group`` (global ``ranks``); ``None`` for a
    group of one. Collective: first the torch clones over the world (when ``routes.torch``,
    every group of ``groups``, one clone per direction), then the shm rings over ``group``
    (when ``routes.shm``; this rank's rings to its peers that use them, maybe none)."""
    if routes.name == "local":
        return None
    engines: dict = {}
    if routes.torch:
        if sum(len(g) for g in groups) != dist.get_world_size():
            raise ValueError(f"all_groups must partition the world's "
                             f"{dist.get_world_size()} ranks, got {groups}")
        clones = {}
        tdelta = None if math.isinf(timeout) else datetime.timedelta(seconds=timeout)
        for members in groups:
            pair = [dist.new_group(list(members), timeout=tdelta) for _ in (0, 1)]
            if rank in members:
                clones = {FORWARD: pair[0], BACKWARD: pair[1]}
        engines["torch"] = TorchEngine(clones, timeout, device)
    if routes.shm:
        from fastpar.comm.transport.shm_rings import ShmP2P

        mine = [p for p, e in routes.by_peer.items() if e == "shm"]
        rings = ShmP2P(group, list(ranks), rank, mine, timeout)
        if mine:
            engines["shm"] = ShmEngine(rings)
        else:  # took part in the group's set-up only
            rings.close()
    return PeerEngines({p: engines[e] for p, e in routes.by_peer.items()})
