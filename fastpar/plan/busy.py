"""The planner's model of ranks that share cores ("busy" peers), in one place: measured by the
calibration, charged by the cost model. On a CPU host whose ranks outnumber its cores a rank
that meets a peer (a tp all-reduce, a pipeline message, a cp ring exchange) often waits for
that peer to get a core back; the alpha-beta link never sees it. Three measurements, each
fitted as ``extra = s0 + k x compute`` (``fit_busy``):

- ``busy_points``: pairs of ranks all-reducing 32 KiB after a segment of compute, as tp's ranks
  (the host's ``busy_sync``; charged by ``peer_waits``);
- ``busy_p2p_points``: pairs as pipeline neighbours through the pipeline's own ``Channels``
  (a link's ``busy_p2p``; charged by ``p2p_wait``);
- ``busy_ring_points``: pairs as a cp ring's neighbours through its exchange (a link's
  ``busy_ring``; charged by ``costs.cp_ring`` through ``terms``).

One switch: ``FASTPAR_PLAN_BUSY=0`` makes ``terms`` (0, 0) everywhere, so the planner predicts
as if every rank had its own core (the measurements stay in the cluster file). Whether each
term earns its place is ``bench/plan_accuracy.py``'s to say (docs/planner.md).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import torch
import torch.distributed as dist

from fastpar.nn.context_ring import TAG_KV, Ring
from fastpar.pipeline.channels import Channels
from fastpar.plan.cluster import BUSY_BYTES, Link
from fastpar.plan.fitting import nnls

SWITCH = "FASTPAR_PLAN_BUSY"


def terms(pair) -> tuple[float, float]:
    """A measured ``(s0, k)`` as the cost model charges it: itself, or (0, 0) when the switch
    (``FASTPAR_PLAN_BUSY=0``) is off."""
    return (0.0, 0.0) if os.environ.get(SWITCH, "1") == "0" else tuple(pair)


TERMS = ("busy_sync", "busy_p2p", "busy_ring")  # the host's, and each link's two


def without(cluster, *names: str):
    """``cluster`` with the busy terms ``names`` (of ``TERMS``; none named: all of them) at
    (0, 0): what the planner predicts without them (``bench/plan_accuracy.py``'s ablation)."""
    names = names or TERMS
    unknown = sorted(set(names) - set(TERMS))
    if unknown:
        raise ValueError(f"busy terms {unknown}: expected some of {', '.join(TERMS)}")
    zero = (0.0, 0.0)
    links = {side: dataclasses.replace(link, **{n: zero for n in names if n != "busy_sync"})
             for side, link in (("intra", cluster.intra), ("inter", cluster.inter))
             if link is not None}
    return dataclasses.replace(cluster, **links,
                               **({"busy_sync": zero} if "busy_sync" in names else {}))


def peer_waits(work, cluster):
    """``work`` (a ``costs.Work``) plus what its mid-layer collectives wait for busy peers
    (``cluster.busy_sync`` (s0, k), measured by ``busy_points``): a phase with s of them, each
    after a share of the phase's own compute, waits s s0 + k x that compute. On a host whose
    ranks outnumber its cores this is what tp costs beyond its bytes: the partner is often off
    the core when a rank arrives (4 ranks on 2 cores: ~1 ms per all-reduce after 1.4 ms of
    compute, against 0.04 ms for the all-reduce alone)."""
    s0, k = terms(cluster.busy_sync)
    if not (s0 or k):
        return work
    own = work.own(math_only=False)
    for phase, n in work.syncs.items():
        if n:
            work.add("peer waits (ranks share cores)", phase, n * s0 + k * own[phase])
    return work


def p2p_wait(link, compute_s: float) -> float:
    """What a pipeline message on ``link`` waits for busy neighbours after ``compute_s`` of
    the sender's compute: ``link.busy_p2p`` (s0, k), s0 + k x compute (0 where not
    measured, and for ``link`` None: pp 1)."""
    if link is None:  # no other rank: a chunk's output to the same rank's next chunk
        return 0.0
    s0, k = terms(link.busy_p2p)
    return s0 + k * compute_s


def fit_busy(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``extra = s0 + k segment`` with s0, k >= 0 (``nnls``) over ``busy_points``' (segment
    seconds, extra seconds per collective); (0, 0) without points."""
    if not points:
        return 0.0, 0.0
    s0, k = nnls([[1.0, c] for c, _ in points], [e for _, e in points])
    return s0, k


def with_busy_p2p(link: Link, points: list, share: float = 1.0) -> Link:
    """``link`` with ``busy_p2p`` fitted (``fit_busy``) to ``busy_p2p_points``' extras less
    the message's own alpha-beta time on ``link`` at ``share`` of its bandwidth (the planner
    charges that apart; ``share``: 1 / the pairs that crossed it at once)."""
    own = link.time("sendrecv", 2, BUSY_BYTES, share=share)
    return dataclasses.replace(link, busy_p2p=fit_busy(
        [(c, max(0.0, e - own)) for c, e in points]))


def with_busy_ring(link: Link, points: list) -> Link:
    """``link`` with ``busy_ring`` fitted (``fit_busy``) to ``busy_ring_points``' extras,
    whole: the exchange's own transfer is the ring's engine's, which the link does not
    describe."""
    return dataclasses.replace(link, busy_ring=fit_busy([tuple(p) for p in points]))


BUSY_SEGMENTS = (2, 8, 24)  # compute between two collectives, in 160 x 160 matmuls
BUSY_ROUNDS = 5


def paired(loop, rounds: int, slowest) -> tuple[float, float]:
    """``(segment, extra)``: ``loop(False)`` (compute alone) and ``loop(True)`` (with the
    communication) back to back ``rounds`` times, each on the slowest rank (``slowest``
    all-reduces a tensor's max in place); the median plain time and the median of the
    rounds' differences (at least 0). Pairs taken back to back keep the machine's drift out
    of the difference; the median keeps one round that lost a time slice out of the fit."""
    times = [t for _ in range(rounds) for t in (loop(False), loop(True))]
    t = torch.tensor(times, dtype=torch.float64)
    slowest(t)
    plain, comm = t[0::2].tolist(), t[1::2].tolist()
    return (statistics.median(plain),
            max(0.0, statistics.median(c - p for p, c in zip(plain, comm))))


def segment_points(comm, meet, segments, rounds: int, drain=None) -> list[tuple]:
    """``[(segment s, extra s)]`` (``paired``) per segment of ``segments[j]`` 160 x 160
    matmuls: a loop of the segment then ``meet()`` (the communication with the pair; a
    ``drain()`` after the loop's last, timed with it) against the same loop without them, on
    every rank (collective over the world)."""
    a = torch.randn(160, 160)
    points = []
    for mm in segments:
        iters = max(10, 240 // mm)

        def loop(meeting: bool) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                for _ in range(mm):
                    torch.mm(a, a)
                if meeting:
                    meet()
            if meeting and drain is not None:
                drain()
            return (time.perf_counter() - t0) / iters

        points.append(paired(loop, rounds, lambda t: comm.all_reduce(t, op="max")))
    return points


def busy_points(topo, comm, segments=BUSY_SEGMENTS,
                rounds: int = BUSY_ROUNDS) -> list[tuple]:
    """Every rank (collective over the world): the ranks in pairs (0, 1), (2, 3), ... as tp's
    groups of 2 are, each computing a segment of ``segments[j]`` small matmuls and then
    all-reducing 32 KiB with its pair, as a tp layer's ranks do, against the same loop without
    the all-reduce (a last odd rank computes alone). ``[(segment s, extra s per all-reduce)]``
    (``paired``: medians over ``rounds`` back-to-back pairs on the slowest rank; the extra
    includes the all-reduce itself: ``measure_link`` takes its alpha-beta time off before
    ``fit_busy``). What a pair waits for beyond the all-reduce itself is the peer being off
    the core: on a CPU host with more ranks than cores it grows with the segment."""
    pairs = [dist.new_group(p) for p in rank_pairs(topo.world_size, False)]
    mine = pairs[topo.rank // 2] if topo.rank // 2 < len(pairs) else None
    x = torch.ones(BUSY_BYTES // 4)
    points = segment_points(comm, (lambda: comm.all_reduce(x, mine)) if mine is not None
                             else (lambda: None), segments, rounds)
    for g in pairs:
        dist.destroy_process_group(g)
    return points


def check_pairs(what: str, pairs: list[list[int]], world: int) -> None:
    """``ValueError`` unless ``pairs`` cover ranks 0..world-1 two by two."""
    if any(len(p) != 2 for p in pairs) or sorted(r for p in pairs for r in p) != \
            list(range(world)):
        raise ValueError(f"{what}: pairs {pairs} must cover the world of {world} two by two")


def busy_p2p_points(topo, comm, pairs: list[list[int]], segments=BUSY_SEGMENTS,
                    rounds: int = BUSY_ROUNDS) -> tuple[list[tuple], str]:
    """Every rank (collective over the world; ``pairs`` cover it, two ranks each): each pair
    as two pipeline neighbours in their steady state, through the pipeline's own
    ``Channels`` (the engine a pipeline between them would get: shm rings in a host, gloo
    across hosts): both compute a segment of ``segments[j]`` small matmuls, then each sends
    the other 32 KiB and receives the other's, against the same loop without the messages.
    ``([(segment s, extra s per message)], engine)`` (``paired``, as ``busy_points``; the
    extra includes the message itself: ``with_busy_p2p`` takes its alpha-beta time off). On a
    CPU host with more ranks than cores the extra is the partner being off the core, and a
    receive's wake-up."""
    check_pairs("busy_p2p_points", pairs, topo.world_size)
    groups = [dist.new_group(p) for p in pairs]
    ch = Channels(next(g for g, p in zip(groups, pairs) if topo.rank in p), all_groups=pairs)
    x = torch.ones(BUSY_BYTES // 4)

    def exchange():
        if ch.index == 0:
            ch.send_forward(x, mb=0, stage=1)
            ch.recv_backward(mb=0, stage=1)
        else:
            ch.send_backward(x, mb=0, stage=1)
            ch.recv_forward(mb=0, stage=1)
        ch.finish_step()

    points = segment_points(comm, exchange, segments, rounds)
    engine = ch.engine_name
    ch.close()
    for g in groups:
        dist.destroy_process_group(g)
    return points, engine


def busy_ring_points(topo, comm, pairs: list[list[int]], segments=BUSY_SEGMENTS,
                     rounds: int = BUSY_ROUNDS) -> list[tuple]:
    """Every rank (collective over the world; ``pairs`` cover it, two ranks each): each pair as
    a cp group of 2 running ring attention, through the ring's own exchange
    (``nn.context_ring.Ring.shift``: torch isend/irecv of a block to the next rank and from
    the previous one), posted before a segment of ``segments[j]`` small matmuls and waited
    for after it, as the ring posts a block before its attention, against the same loop
    without them. ``[(segment s, extra s per exchange)]`` (``paired``, as ``busy_points``),
    the 32 KiB transfer included (the ring's engine is not the link's: nothing else charges
    it). On a CPU host whose ranks outnumber its cores each exchange waits for gloo's threads
    and the peer to get a core: 2-4 ms on 4 ranks of 2 cores, whatever the segment.
    ``RuntimeError`` when a received block is not the peer's."""
    check_pairs("busy_ring_points", pairs, topo.world_size)
    groups = [dist.new_group(p) for p in pairs]
    pair = next(p for p in pairs if topo.rank in p)
    ring = Ring(groups[pairs.index(pair)], positions=None)
    x = torch.full((BUSY_BYTES // 4,), float(topo.rank))
    peer = float(pair[1] if pair[0] == topo.rank else pair[0])
    pending = []  # the exchange in flight during the segment: (buffer, handle)

    def drain():
        buf, handle = pending.pop()
        handle.wait()
        if buf[0].item() != peer or buf[-1].item() != peer:
            raise RuntimeError(f"busy_ring_points: rank {topo.rank} received {buf[0].item()} "
                               f"from its ring neighbour, rank {peer:g}")

    def exchange():
        if pending:
            drain()
        pending.append(ring.shift(x, TAG_KV))

    points = segment_points(comm, exchange, segments, rounds, drain=drain)
    for g in groups:
        dist.destroy_process_group(g)
    return points


def rank_pairs(world: int, across: bool) -> list[list[int]]:
    """Pairs of ranks: (0, 1), (2, 3), .. (in a host; a last odd rank left out), or with
    ``across`` (r, r + world / 2) (on two hosts of world / 2 ranks each; world even)."""
    if across:
        half = world // 2
        return [[r, r + half] for r in range(half)]
    return [[r, r + 1] for r in range(0, world - 1, 2)]
