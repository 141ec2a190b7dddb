"""Shared-memory point-to-point channels (fastpar/comm/transport/shm_rings.py over csrc/shm/shm_p2p.cpp):
messages of every size (empty to several rings) and dtype arrive bitwise intact, in order, on
both tags and both directions at once; sends never block a schedule (bursts before receives,
crossed sends larger than the ring); a missing sender times out and a killed one is named at
once, with nothing left in /dev/shm. The kernel alone: two endpoints of one process, one thread
each, on a small ring (wrap-around at odd offsets), its hello check and Ctrl-C."""

import contextlib
import math
import re
import threading
import time

import pytest
import torch

from fastpar.comm.engines.native_errors import Kind
from tests.multirank import run_ranks, segments_of

# ---- the message plan (shared by senders and receivers) -------------------------------------

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
          torch.int32, torch.uint8, torch.bool]


def _message(src: int, dst: int, tag: int, i: int, nbytes: int, nparts: int):
    """(header, parts) of message i from src to dst on tag: `nparts` tensors of varied dtypes
    holding about `nbytes` bytes in all (exactly, for one uint8 part), reproducible anywhere."""
    g = torch.Generator().manual_seed(((src * 64 + dst) * 8 + tag) * 1000 + i)
    parts = []
    for k in range(nparts):
        dtype = torch.uint8 if nparts == 1 else DTYPES[(i + k) % len(DTYPES)]
        size = torch.empty((), dtype=dtype).element_size()
        n = nbytes // nparts // size
        raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
        if dtype == torch.bool:
            raw = raw & 1
        parts.append(raw.view(dtype))
    # The header: identity, then per part (dtype index, numel); odd values test the round trip.
    header = [src, dst, tag, i, nparts, -1, 2 ** 62 + 7]
    for t in parts:
        header += [DTYPES.index(t.dtype), t.numel()]
    return torch.tensor(header, dtype=torch.int64), parts


def _receive(p2p, peer: int, tag: int, me: int, i: int, nbytes: int, nparts: int) -> None:
    """Receives message i the way a pipeline stage would (sizes from the header) and checks
    header and payload bitwise."""
    want_header, want_parts = _message(peer, me, tag, i, nbytes, nparts)
    header = p2p.recv_header(peer, tag)
    assert header.dtype == torch.int64 and torch.equal(header, want_header), (header, i)
    spec = header[7:].view(-1, 2).tolist()
    parts = [torch.empty(n, dtype=DTYPES[d]) for d, n in spec]
    p2p.recv_payload(peer, tag, parts)
    for got, want in zip(parts, want_parts):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8),
                                                       want.view(torch.uint8)), (peer, tag, i)


def _plan(ring: int) -> list[tuple[int, int]]:
    """(bytes, parts) of each message: empty, 1 byte, 4 KiB, exactly a ring, 3 rings (streams),
    and multi-part payloads of mixed dtypes."""
    return [(0, 1), (1, 1), (4096, 1), (ring, 1), (3 * ring, 1), (4096 + 24, 8),
            (ring + 4096 + 24, 8), (100_000 + 16, 2), (0, 3)]


# ---- ranks: every size and dtype, bursts on both tags and directions -------------------------

def body_ring(ring_bytes: int):
    """Each rank pairs with (r +- 1) % n (one pair at 2 ranks) and, on both tags to every peer,
    sends a burst of the whole plan before receiving anything; then crossed sends larger than
    the ring; misuse errors; at 2 ranks, a receive with no sender times out."""
    import torch.distributed as dist

    import fastpar
    from fastpar.comm.transport.shm_rings import ShmP2P

    topo = fastpar.init(timeout=60)
    me, n = topo.rank, topo.world_size
    peers = [(me - 1) % n, (me + 1) % n]
    p2p = ShmP2P(dist.group.WORLD, list(range(n)), me, peers, timeout=30, ring_bytes=ring_bytes)
    assert p2p.peers == sorted(set(peers))
    plan = _plan(ring_bytes)
    # 1. Bursts: every message to every peer on both tags is queued before any receive.
    handles = [p2p.isend(peer, tag, *_message(me, peer, tag, i, nbytes, nparts))
               for tag in (0, 1) for i, (nbytes, nparts) in enumerate(plan)
               for peer in p2p.peers]
    for peer in p2p.peers:
        for tag in (1, 0):  # the other tag first: tags are independent channels
            for i, (nbytes, nparts) in enumerate(plan):
                _receive(p2p, peer, tag, me, i, nbytes, nparts)
    for h in handles:
        h.wait()
        assert h.is_completed()
    # 2. Crossed sends larger than the ring, then receives: the waits of recv_payload keep
    #    streaming this rank's own send.
    big = 3 * ring_bytes + 13
    crossed = [p2p.isend(peer, 0, *_message(me, peer, 0, 99, big, 1)) for peer in p2p.peers]
    for peer in p2p.peers:
        _receive(p2p, peer, 0, me, 99, big, 1)
    for h in crossed:
        h.wait()
    # 3. Misuse is a ValueError that leaves the channel usable.
    misuse = []
    for call in (lambda: p2p.isend(me, 0, torch.zeros(1, dtype=torch.int64), []),
                 lambda: p2p.recv_header(peers[1], 2),
                 lambda: p2p.isend(peers[1], 0, torch.zeros(1), []),
                 lambda: p2p.isend(peers[1], 0, torch.zeros(1, dtype=torch.int64),
                                   [torch.zeros(4, 4).t()])):
        with pytest.raises(ValueError) as err:
            call()
        misuse.append(str(err.value))
    h = p2p.isend(peers[1], 1, torch.tensor([5, 64]), [torch.arange(16, dtype=torch.int32)])
    header = p2p.recv_header(peers[0], 1)
    with pytest.raises(ValueError, match="the parts hold 60 bytes but the message has 64"):
        p2p.recv_payload(peers[0], 1, [torch.empty(15, dtype=torch.int32)])
    out = torch.empty(16, dtype=torch.int32)
    p2p.recv_payload(peers[0], 1, [out])
    assert header.tolist() == [5, 64] and torch.equal(out, torch.arange(16, dtype=torch.int32))
    h.wait()
    dist.barrier()
    p2p.close()
    p2p.close()  # idempotent
    result = {"misuse": misuse}
    if n == 2:
        result["timeout"] = _timeout_case(me)
    return result


def _kind(exc: RuntimeError) -> list:
    return [exc.kind.name, exc.cause.name, isinstance(exc, TimeoutError)]


def _timeout_case(me: int):
    """Rank 0 waits for a message rank 1 never sends (timeout 1 s); then rank 1's channel to
    rank 0 is poisoned with rank 0's error."""
    import torch.distributed as dist

    from fastpar.comm.transport.shm_rings import ShmP2P

    p2p = ShmP2P(dist.group.WORLD, [0, 1], me, [1 - me], timeout=1.0, ring_bytes=8192)
    start = time.monotonic()
    message = None
    if me == 0:
        try:
            p2p.recv_header(1, 1)
        except RuntimeError as exc:
            message, kind = str(exc), _kind(exc)
    dist.barrier()
    if me == 1:
        try:
            p2p.recv_header(0, 0)
        except RuntimeError as exc:
            message, kind = str(exc), _kind(exc)
    elapsed = time.monotonic() - start
    p2p.close()
    return [elapsed, message, kind]


@pytest.mark.parametrize("nranks, ring_bytes", [(2, 4 << 20), (4, 1 << 16)])
def test_ring_of_ranks(nranks, ring_bytes):
    values = run_ranks(nranks, body_ring, ring_bytes=ring_bytes, timeout=120).values()
    for v in values:
        assert len(v["misuse"]) == 4 and all("fastpar shm p2p" in m for m in v["misuse"]), v
    if nranks == 2:
        (elapsed0, message0, kind0), (_, message1, kind1) = (values[0]["timeout"],
                                                              values[1]["timeout"])
        assert kind0 == ["TIMEOUT", "TIMEOUT", True], kind0  # the code, whatever the wording
        assert kind1 == ["POISONED", "TIMEOUT", True], kind1
        want = (r"fastpar shm p2p: rank 0 waited 1\.\d s for the header of the next message "
                r"from rank 1 on tag 1 \(gradients\)")
        assert re.fullmatch(want, message0) and 0.9 < elapsed0 < 5, (elapsed0, message0)
        assert "poisoned by an earlier error: " + message0 in message1, message1


# ---- a killed peer ---------------------------------------------------------------------------

def body_peer_killed():
    """Rank 1 is SIGKILLed after set-up while rank 0 waits for its message: rank 0 names it
    within a fraction of a second (the timeout is 60 s)."""
    import os
    import signal

    import torch.distributed as dist

    import fastpar
    from fastpar.comm.transport.shm_rings import ShmP2P

    topo = fastpar.init(timeout=60)
    me = topo.rank
    p2p = ShmP2P(dist.group.WORLD, [0, 1], me, [1 - me], timeout=60)
    dist.barrier()
    if me == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    # torchrun stops the other workers with SIGTERM when one dies: finish the report first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    start = time.monotonic()
    try:
        p2p.recv_header(1, 0)
        raise AssertionError("a receive from a killed peer returned")
    except RuntimeError as exc:
        result = [time.monotonic() - start, str(exc), exc.kind.name]
    p2p.close()
    return result


def test_killed_peer_is_named_at_once_and_nothing_leaks():
    launch = run_ranks(2, body_peer_killed, launcher="torchrun", check=False, timeout=90)
    assert 0 in launch.results and launch.results[0]["ok"], launch.describe()
    elapsed, message, kind = launch.results[0]["value"]
    assert kind == "PEER_DEAD", kind
    assert "rank 0 found rank 1 dead" in message and "has exited" in message, message
    assert "tag 0 (activations)" in message, message
    assert elapsed < 5, (elapsed, message)
    assert len(launch.pids) == 2 and not segments_of(launch.pids.values()), launch.describe()


# ---- the kernel alone: two endpoints in one process ------------------------------------------

def _segment(tags: int, ring: int):
    import ctypes
    import mmap

    import fastpar._C  # noqa: F401

    mem = mmap.mmap(-1, torch.ops.fastpar.shm_p2p_segment_bytes(tags, ring))
    anchor = ctypes.c_char.from_buffer(mem)
    return mem, anchor, ctypes.addressof(anchor)


@pytest.mark.quick
def test_kernel_wraps_at_odd_offsets_between_threads():
    """An 8 KiB ring: messages of odd sizes and part splits, both tags interleaved, wrap at every
    offset; the receiver (main thread) checks each byte while the sender (a thread) streams."""
    ops = torch.ops.fastpar
    ring = 8192
    mem, anchor, base = _segment(2, ring)
    ops.shm_p2p_init_segment(base, 3, 5, 2, ring)
    tx = ops.shm_p2p_open(3, False, [5], [base], 2, ring, 20.0)
    rx = ops.shm_p2p_open(5, False, [3], [base], 2, ring, 20.0)
    g = torch.Generator().manual_seed(1)
    sizes = [0, 1, 3, 4093, 8191, 8192, 8193, 12289, 3 * 8192 + 5, 77, 65537]
    msgs = [torch.randint(0, 256, (s,), dtype=torch.uint8, generator=g) for s in sizes * 3]
    errors = []

    def sender():
        try:
            ids = []
            for i, t in enumerate(msgs):
                cut = (t.numel() * (i % 5)) // 7
                header = torch.arange(i % 9, dtype=torch.int64) * -3 + i
                ids.append(ops.shm_p2p_send(tx, 0, i % 2, header, [t[:cut], t[cut:]]))
            for send_id in ids:
                ops.shm_p2p_wait_send(tx, send_id)
            assert ops.shm_p2p_pending(tx) == (0, 0)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        for i, t in enumerate(msgs):
            header = ops.shm_p2p_recv_header(rx, 0, i % 2)
            assert torch.equal(header, torch.arange(i % 9, dtype=torch.int64) * -3 + i), i
            out = torch.empty(t.numel(), dtype=torch.uint8)
            ops.shm_p2p_recv_payload(rx, 0, i % 2, [out])
            assert torch.equal(out, t), i
    finally:
        thread.join()
        ops.shm_p2p_close(tx)
        ops.shm_p2p_close(rx)
    assert not errors, errors
    del anchor
    mem.close()


@pytest.mark.quick
def test_kernel_hello_and_ctrl_c():
    ops = torch.ops.fastpar
    mem, anchor, base = _segment(2, 8192)
    ops.shm_p2p_init_segment(base, 0, 1, 2, 8192)
    for args, found in (((0, False, [1], [base], 3, 8192, 1.0), "3 tags"),
                        ((0, False, [1], [base], 2, 16384, 1.0), "16384-byte rings"),
                        ((0, False, [2], [base], 2, 8192, 1.0), "ranks {0, 2}")):
        with pytest.raises(RuntimeError) as err:
            ops.shm_p2p_open(*args)
        assert ops.shm_last_error() == (Kind.OTHER, Kind.OTHER)
        assert ops.shm_last_error() == (Kind.NONE, Kind.NONE)  # reading clears it
        assert ("expected a segment with version 3, " in str(err.value) and found in
                str(err.value).split(" but found ")[0] and
                "but found version 3, 2 tags, 8192-byte rings, ranks {0, 1}" in str(err.value)), err
    ep = ops.shm_p2p_open(0, False, [1], [base], 2, 8192, 30.0)
    # Ctrl-C while waiting: the kernel takes the SIGINT and ends the wait within ~10 ms.
    timer = threading.Timer(0.3, lambda: __import__("os").kill(__import__("os").getpid(), 2))
    timer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 was interrupted \(SIGINT\) while waiting "
                                           r"for the header of the next message from rank 1"):
        ops.shm_p2p_recv_header(ep, 0, 0)
    assert ops.shm_last_error() == (Kind.INTERRUPTED, Kind.INTERRUPTED)
    assert time.monotonic() - start < 3
    timer.join()
    with pytest.raises(RuntimeError, match="poisoned by an earlier error"):
        ops.shm_p2p_recv_header(ep, 0, 1)
    assert ops.shm_last_error() == (Kind.POISONED, Kind.INTERRUPTED)
    ops.shm_p2p_close(ep)
    del anchor
    mem.close()


# ---- one call per receive, sends that complete at once, single copy --------------------------

def body_single_copy(single_copy: bool):
    """Both ranks at once: bursts of large messages (single-copy where the pair allows it, else
    the ring) interleaved with small ones on one channel, multi-part payloads of mixed dtypes
    with empty parts, more parts than a descriptor holds; `recv` takes header and payload in one
    call when the parts fit and leaves the payload to `recv_payload` when not; a small send
    completes inside `isend`; a single-copy send completes only once the peer has read it."""
    import torch.distributed as dist

    import fastpar
    from fastpar.comm.transport.shm_rings import MAX_HEADER_ELEMENTS, ShmP2P

    topo = fastpar.init(timeout=60)
    me, peer = topo.rank, 1 - topo.rank
    p2p = ShmP2P(dist.group.WORLD, [0, 1], me, [peer], timeout=30, ring_bytes=1 << 16,
                 single_copy_min=(64 << 10) if single_copy else None)
    result = {"single_copy": p2p.single_copy[peer]}
    # Sizes straddle the threshold and the 64 KiB ring; 70 parts exceed a descriptor's 64.
    plan = [(1 << 20, 1), (4096, 1), (3 << 20, 8), (64 << 10, 1), (0, 2), (200_000 + 8, 8),
            (70 * 4096, 70), (5 << 20, 3)]
    handles = [p2p.isend(peer, 0, *_message(me, peer, 0, i, nbytes, nparts))
               for i, (nbytes, nparts) in enumerate(plan)]
    hbuf = torch.empty(MAX_HEADER_ELEMENTS, dtype=torch.int64)
    filled_flags = []
    for i, (nbytes, nparts) in enumerate(plan):
        want_header, want_parts = _message(peer, me, 0, i, nbytes, nparts)
        # Odd messages: parts one element short, so they do not fit and recv_payload follows.
        parts = [torch.empty(t.numel() - (i % 2 and k == 0 and t.numel() > 0), dtype=t.dtype)
                 for k, t in enumerate(want_parts)]
        n, filled = p2p.recv(peer, 0, hbuf, parts)
        assert torch.equal(hbuf[:n], want_header), (i, hbuf[:n])
        filled_flags.append(filled)
        if not filled:
            parts = [torch.empty_like(t) for t in want_parts]
            p2p.recv_payload(peer, 0, parts)
        for got, want in zip(parts, want_parts):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (i, me)
    for h in handles:
        h.wait()
    result["filled"] = filled_flags
    # A small send is complete when isend returns; a large single-copy one only once read.
    small = p2p.isend(peer, 1, torch.tensor([1, 2, 3]), [torch.ones(10)])
    result["small_done_at_once"] = small._refs is None and small.is_completed()
    big = torch.arange(1 << 20, dtype=torch.float32)
    h = p2p.isend(peer, 1, torch.tensor([4]), [big])
    result["big_done_before_read"] = h.is_completed()
    dist.barrier()
    n, filled = p2p.recv(peer, 1, hbuf, [torch.empty(10)])
    assert filled and hbuf[:n].tolist() == [1, 2, 3]
    out = torch.empty(1 << 20)
    n, filled = p2p.recv(peer, 1, hbuf, [out])
    assert filled and hbuf[:n].tolist() == [4] and torch.equal(out, big)
    h.wait()
    # A header buffer too short is misuse: nothing consumed, the message still arrives whole.
    h = p2p.isend(peer, 0, torch.arange(8), [torch.ones(3)])
    with pytest.raises(ValueError, match="the header has 64 bytes but the buffer holds 56"):
        p2p.recv(peer, 0, torch.empty(7, dtype=torch.int64), [torch.empty(3)])
    n, filled = p2p.recv(peer, 0, hbuf, [out[:3]])
    assert filled and n == 8 and torch.equal(out[:3], torch.ones(3))
    h.wait()
    dist.barrier()
    p2p.close()
    return result


@pytest.mark.parametrize("single_copy", [True, False], ids=["single_copy", "ring_only"])
def test_large_messages_both_ways_single_copy_and_combined_receive(single_copy):
    for v in run_ranks(2, body_single_copy, single_copy=single_copy).values():
        if single_copy:  # process_vm_readv between the ranks: allowed unless ptrace forbids it
            assert isinstance(v["single_copy"], bool), v
        else:
            assert v["single_copy"] is False, v
        assert v["filled"] == [True, False] * 4, v
        assert v["small_done_at_once"] is True, v
        if v["single_copy"]:  # (through the 64 KiB ring, 4 MiB cannot be done either)
            assert v["big_done_before_read"] is False, v


def body_single_copy_peer_killed(victim_sends: bool):
    """Rank 1 is SIGKILLed while a single-copy message is in flight: either rank 0 waits for its
    own 8 MiB send to be read (victim_sends False), or rank 1 had sent it and rank 0 reads it
    (True). Rank 0 names the dead rank within a fraction of a second (timeout: 60 s)."""
    import os
    import signal

    import torch.distributed as dist

    import fastpar
    from fastpar.comm.transport.shm_rings import ShmP2P

    topo = fastpar.init(timeout=60)
    me = topo.rank
    p2p = ShmP2P(dist.group.WORLD, [0, 1], me, [1 - me], timeout=60)
    payload = torch.ones(2 << 20)
    if victim_sends and me == 1:
        p2p.isend(0, 1, torch.tensor([7]), [payload])
    handle = p2p.isend(1, 0, torch.tensor([7]), [payload]) if me == 0 and not victim_sends \
        else None
    dist.barrier()
    if me == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(0.5)  # rank 1 is gone: its message, if any, is in the ring, its memory is not
    start = time.monotonic()
    try:
        if handle is not None:
            handle.wait()
        else:
            p2p.recv(1, 1, torch.empty(8, dtype=torch.int64), [torch.empty(2 << 20)])
        raise AssertionError("a single copy with a killed peer returned")
    except RuntimeError as exc:
        result = [time.monotonic() - start, str(exc), p2p.single_copy[1]]
    with contextlib.suppress(RuntimeError):
        p2p.close()
    return result


@pytest.mark.parametrize("victim_sends", [False, True], ids=["sender_waits", "receiver_reads"])
def test_killed_peer_during_single_copy_is_named(victim_sends):
    launch = run_ranks(2, body_single_copy_peer_killed, victim_sends=victim_sends,
                       launcher="torchrun", check=False, timeout=90)
    assert 0 in launch.results and launch.results[0]["ok"], launch.describe()
    elapsed, message, single_copy = launch.results[0]["value"]
    assert "rank 0 found rank 1 dead" in message and "has exited" in message, message
    if victim_sends:
        assert "payload of the message from rank 1 on tag 1 (gradients)" in message, message
    else:
        assert "rank 1 to take the messages sent to it on tag 0 (activations)" in message, message
    assert elapsed < 5, (elapsed, message)
    assert isinstance(single_copy, bool)


@pytest.mark.quick
def test_kernel_single_copy_between_threads():
    """Two endpoints of one process (it can read itself): after the probe, payloads from 64 KiB
    go single-copy, the rest through an 8 KiB ring; `recv` returns -1 - n when the parts do not
    fit; sends that fit the ring return id 0 (complete), single-copy ones an id to wait for."""
    ops = torch.ops.fastpar
    ring = 8192
    mem, anchor, base = _segment(2, ring)
    ops.shm_p2p_init_segment(base, 3, 5, 2, ring)
    tx = ops.shm_p2p_open(3, False, [5], [base], 2, ring, 20.0, 64 << 10)
    rx = ops.shm_p2p_open(5, False, [3], [base], 2, ring, 20.0, 64 << 10)
    assert not ops.shm_p2p_single_copy(tx, 0)
    ops.shm_p2p_probe(tx)
    ops.shm_p2p_probe(rx)
    can = ops.shm_p2p_single_copy(tx, 0)
    g = torch.Generator().manual_seed(2)
    sizes = [100, (64 << 10) - 1, 64 << 10, (1 << 20) + 3, 5, 3 << 20]
    msgs = [torch.randint(0, 256, (s,), dtype=torch.uint8, generator=g) for s in sizes]
    ids, errors = [], []

    def sender():
        try:
            for i, t in enumerate(msgs):
                cut = t.numel() // 3
                ids.append(ops.shm_p2p_send(tx, 0, 0, torch.tensor([i]), [t[:cut], t[cut:]]))
            for send_id in ids:
                ops.shm_p2p_wait_send(tx, send_id)
            assert ops.shm_p2p_pending(tx) == (0, 0)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    thread = threading.Thread(target=sender)
    thread.start()
    try:
        header = torch.empty(4, dtype=torch.int64)
        for i, t in enumerate(msgs):
            out = torch.empty(t.numel() + (i == 3), dtype=torch.uint8)  # message 3 misfits
            n = ops.shm_p2p_recv(rx, 0, 0, header, [out])
            if i == 3:
                assert n == -2 and header[0] == i
                out = out[:-1]
                ops.shm_p2p_recv_payload(rx, 0, 0, [out])
            else:
                assert n == 1 and header[0] == i
            assert torch.equal(out, t), i
    finally:
        thread.join()
        ops.shm_p2p_close(tx)
        ops.shm_p2p_close(rx)
    assert not errors, errors
    # The first send fits the empty ring at once; the second (below 64 KiB but larger than the
    # ring) and the ones from 64 KiB go single-copy, where the pair allows it.
    assert ids[0] == 0, ids
    if can:
        assert all(ids[i] > 0 for i in (1, 2, 3, 5)), ids
    del anchor
    mem.close()


# ---- the pipeline's receive path over the rings ----------------------------------------------

def body_channels_layouts():
    """Channels over the rings: a receive takes the payload in the buffers of the last layout
    of its stage; the next step's layout may differ (same bytes, another split; another size)."""
    import fastpar
    from fastpar.pipeline.channels import Channels

    fastpar.init(timeout=60)
    ch = Channels(None, engine="shm")
    steps = [[(4,), (4,)], [(4,), (4,)], [(2,), (6,)], [(3, 3)], [(2,), (6,)]]
    for k, shapes in enumerate(steps):
        for mb in range(2):
            values = tuple(torch.arange(math.prod(s), dtype=torch.float32).view(s) + 10 * k + mb
                           for s in shapes)
            if ch.rank == 0:
                ch.send_forward(values, mb=mb, stage=1)
            else:
                got = ch.recv_forward(mb=mb, stage=1)
                assert isinstance(got, tuple) and len(got) == len(values), got
                for a, b in zip(got, values):
                    assert a.shape == b.shape and torch.equal(a, b), (k, mb, a, b)
        ch.finish_step()
    ch.close()
    return True


def test_channels_receive_in_one_call_across_layouts():
    assert all(run_ranks(2, body_channels_layouts).values())


def body_sendrecv():
    """A ring step in one call: `sendrecv` (tensors passed) and a persistent `sendrecv_init`
    plan (tensors bound once) both deliver fresh bytes every iteration, small (ring) and large
    (single-copy where allowed); the returned handle is complete when the payload was taken."""
    import torch.distributed as dist

    import fastpar
    from bench.shm_rings import ShmRings
    from fastpar.comm.transport.shm_rings import MAX_HEADER_ELEMENTS

    topo = fastpar.init(timeout=60)
    me, peer = topo.rank, 1 - topo.rank
    p2p = ShmRings(dist.group.WORLD, [0, 1], me, [peer], timeout=30)
    hbuf = torch.empty(MAX_HEADER_ELEMENTS, dtype=torch.int64)
    for numel in (1024, 1 << 20):
        x, out = torch.empty(numel), torch.empty(numel)
        step = p2p.sendrecv_init(peer, 0, torch.tensor([numel, me]), [x], peer, 0, hbuf, [out])
        for i in range(5):
            x.fill_(100 * me + i)
            if i % 2:
                h, n, filled = step.start()
            else:
                h, n, filled = p2p.sendrecv(peer, 0, torch.tensor([numel, me]), [x], peer, 0,
                                            hbuf, [out])
            assert filled and n == 2 and hbuf[:2].tolist() == [numel, peer], (n, hbuf[:2])
            assert h.is_completed() and torch.all(out == 100 * peer + i), (numel, i)
        step.free()
        step.free()  # idempotent
    # Parts that do not fit: the payload waits for recv_payload, the send may still be pending.
    h, n, filled = p2p.sendrecv(peer, 1, torch.tensor([9]), [torch.ones(8)], peer, 1, hbuf,
                                [torch.empty(7)])
    assert not filled and n == 1 and hbuf[0] == 9
    out = torch.empty(8)
    p2p.recv_payload(peer, 1, [out])
    h.wait()
    assert torch.equal(out, torch.ones(8))
    dist.barrier()
    p2p.close()
    return True


@pytest.mark.quick
def test_sendrecv_and_persistent_plan():
    assert all(run_ranks(2, body_sendrecv).values())


def body_close_with_untaken_sends():
    """Both ranks send a single-copy-sized message the other never takes, then close: both
    return at once (each flush sees the other's). Then rank 0 waits for a send that rank 1 will
    never take, closed: it fails at once naming that, with no poison and no timeout."""
    import torch.distributed as dist

    import fastpar
    from fastpar.comm.transport.shm_rings import ShmP2P

    topo = fastpar.init(timeout=60)
    me, peer = topo.rank, 1 - topo.rank
    p2p = ShmP2P(dist.group.WORLD, [0, 1], me, [peer], timeout=30)
    keep = torch.ones(1 << 20)
    h = p2p.isend(peer, 0, torch.tensor([1]), [keep])
    dist.barrier()
    start = time.monotonic()
    p2p.close()
    closed_in = time.monotonic() - start
    assert h.is_completed()
    p2p = ShmP2P(dist.group.WORLD, [0, 1], me, [peer], timeout=30)
    message = None
    if me == 0:
        h = p2p.isend(peer, 1, torch.tensor([2]), [keep])
        dist.barrier()
        dist.barrier()  # rank 1 has closed
        start = time.monotonic()
        try:
            h.wait()
        except RuntimeError as exc:
            message = [time.monotonic() - start, str(exc)]
        p2p.close()
    else:
        dist.barrier()
        p2p.close()
        dist.barrier()
    return [closed_in, message]


def test_close_with_untaken_sends_returns_at_once():
    (closed0, message), (closed1, _) = run_ranks(2, body_close_with_untaken_sends).values()
    assert closed0 < 5 and closed1 < 5, (closed0, closed1)
    elapsed, text = message
    assert elapsed < 5 and re.fullmatch(
        r"fastpar shm p2p: rank 0 waited for rank 1 to take the messages sent to it on tag 1 "
        r"\(gradients\), but it closed its channels with \d+ bytes of them not taken", text), text


# ---- sends complete while the sender sits in a collective ------------------------------------

def body_burst_then_collective(single_copy: bool):
    """Rank 0 sends 40 x 16 KiB (2.5 rings) to rank 1, which receives nothing until rank 0 has
    left the channels for a shm all-reduce of the world (a tensor-parallel collective inside a
    pipeline stage). With single copy the messages that do not fit go by address, nothing stays
    queued, and rank 1 receives them all while rank 0 waits in the all-reduce, no P2P call
    made. Without it the sends stay queued, and rank 0 waits for them in P2P before the
    all-reduce (the documented rule)."""
    import torch.distributed as dist

    import fastpar
    from fastpar import comm
    from bench.shm_rings import ShmRings  # ShmP2P with the queue counters
    from fastpar.comm.transport.shm_rings import RING_BYTES

    topo = fastpar.init(timeout=60)
    me, peer = topo.rank, 1 - topo.rank
    p2p = ShmRings(dist.group.WORLD, [0, 1], me, [peer], timeout=15,
                 single_copy_min=(64 << 10) if single_copy else None)
    by_address = p2p.single_copy[peer]
    comm.use_backend("shm")
    count, nbytes = 40, 16 << 10
    assert count * nbytes > 2 * RING_BYTES and nbytes < 64 << 10
    result = {"single_copy": by_address}
    total = torch.full((1,), float(me + 1))
    if me == 0:
        handles = [p2p.isend(1, 0, *_message(0, 1, 0, i, nbytes, 1)) for i in range(count)]
        result["queued"], result["unread"] = p2p.pending(), p2p.unread()
        result["done_at_once"] = sum(h._refs is None for h in handles)
        dist.barrier()  # rank 1 starts receiving
        if not by_address:  # queued bytes move only inside this rank's P2P calls
            for h in handles:
                h.wait()
        comm.all_reduce(total)  # no P2P call from here until rank 1 has received everything
        result["all_done_after"] = all(h.is_completed() for h in handles)
    else:
        dist.barrier()  # rank 0 has sent everything and holds only handles
        for i in range(count):
            _receive(p2p, 0, 0, 1, i, nbytes, 1)
        comm.all_reduce(total)
    result["total"] = total.item()
    comm.use_backend(None)
    dist.barrier()
    p2p.close()
    return result


@pytest.mark.parametrize("single_copy", [True, False], ids=["single_copy", "ring_only"])
def test_burst_completes_while_sender_is_in_a_collective(single_copy):
    values = run_ranks(2, body_burst_then_collective, single_copy=single_copy).values()
    sender = values[0]
    assert all(v["total"] == 3.0 for v in values), values
    assert sender["all_done_after"] is True, sender
    if not single_copy:
        assert sender["single_copy"] is False, sender
    if sender["single_copy"]:
        # The first messages fill the ring (complete at once), the rest go by address: none
        # queued, the by-address ones unread until rank 1 takes them.
        assert sender["queued"] == 0 and 0 < sender["done_at_once"] < 40, sender
        assert sender["unread"] == 40 - sender["done_at_once"], sender
    else:
        assert sender["queued"] > 0 and sender["unread"] == 0, sender
