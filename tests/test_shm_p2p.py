"""Shared-memory point-to-point channels (fastpar/comm/shm_p2p.py over csrc/shm/shm_p2p.cpp):
messages of every size (empty to several rings) and dtype arrive bitwise intact, in order, on
both tags and both directions at once; sends never block a schedule (bursts before receives,
crossed sends larger than the ring); a missing sender times out and a killed one is named at
once, with nothing left in /dev/shm. The kernel alone: two endpoints of one process, one thread
each, on a small ring (wrap-around at odd offsets), its hello check and Ctrl-C."""

import glob
import re
import threading
import time

import pytest
import torch

from tests.multirank import run_ranks

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
    from fastpar.comm.shm_p2p import ShmP2P

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


def _timeout_case(me: int):
    """Rank 0 waits for a message rank 1 never sends (timeout 1 s); then rank 1's channel to
    rank 0 is poisoned with rank 0's error."""
    import torch.distributed as dist

    from fastpar.comm.shm_p2p import ShmP2P

    p2p = ShmP2P(dist.group.WORLD, [0, 1], me, [1 - me], timeout=1.0, ring_bytes=8192)
    start = time.monotonic()
    message = None
    if me == 0:
        try:
            p2p.recv_header(1, 1)
        except RuntimeError as exc:
            message = str(exc)
    dist.barrier()
    if me == 1:
        try:
            p2p.recv_header(0, 0)
        except RuntimeError as exc:
            message = str(exc)
    elapsed = time.monotonic() - start
    p2p.close()
    return [elapsed, message]


@pytest.mark.parametrize("nranks, ring_bytes", [(2, 4 << 20), (4, 1 << 16)])
def test_ring_of_ranks(nranks, ring_bytes):
    values = run_ranks(nranks, body_ring, ring_bytes=ring_bytes, timeout=120).values()
    for v in values:
        assert len(v["misuse"]) == 4 and all("fastpar shm p2p" in m for m in v["misuse"]), v
    if nranks == 2:
        (elapsed0, message0), (_, message1) = values[0]["timeout"], values[1]["timeout"]
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
    from fastpar.comm.shm_p2p import ShmP2P

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
        result = [time.monotonic() - start, str(exc)]
    p2p.close()
    return result


def test_killed_peer_is_named_at_once_and_nothing_leaks():
    before = set(glob.glob("/dev/shm/fastpar-p2p-*"))
    launch = run_ranks(2, body_peer_killed, launcher="torchrun", check=False, timeout=90)
    assert 0 in launch.results and launch.results[0]["ok"], launch.describe()
    elapsed, message = launch.results[0]["value"]
    assert "rank 0 found rank 1 dead" in message and "has exited" in message, message
    assert "tag 0 (activations)" in message, message
    assert elapsed < 5, (elapsed, message)
    assert set(glob.glob("/dev/shm/fastpar-p2p-*")) - before == set()


# ---- the kernel alone: two endpoints in one process ------------------------------------------

def _segment(tags: int, ring: int):
    import ctypes
    import mmap

    import fastpar._C  # noqa: F401

    mem = mmap.mmap(-1, torch.ops.fastpar.shm_p2p_segment_bytes(tags, ring))
    anchor = ctypes.c_char.from_buffer(mem)
    return mem, anchor, ctypes.addressof(anchor)


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
            assert ops.shm_p2p_pending(tx) == 0
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


def test_kernel_hello_and_ctrl_c():
    ops = torch.ops.fastpar
    mem, anchor, base = _segment(2, 8192)
    ops.shm_p2p_init_segment(base, 0, 1, 2, 8192)
    for args, found in (((0, False, [1], [base], 3, 8192, 1.0), "3 tags"),
                        ((0, False, [1], [base], 2, 16384, 1.0), "16384-byte rings"),
                        ((0, False, [2], [base], 2, 8192, 1.0), "ranks {0, 2}")):
        with pytest.raises(RuntimeError) as err:
            ops.shm_p2p_open(*args)
        assert ("expected a segment with version 1, " in str(err.value) and found in
                str(err.value).split(" but found ")[0] and
                "but found version 1, 2 tags, 8192-byte rings, ranks {0, 1}" in str(err.value)), err
    ep = ops.shm_p2p_open(0, False, [1], [base], 2, 8192, 30.0)
    # Ctrl-C while waiting: the kernel takes the SIGINT and ends the wait within ~10 ms.
    timer = threading.Timer(0.3, lambda: __import__("os").kill(__import__("os").getpid(), 2))
    timer.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 0 was interrupted \(SIGINT\) while waiting "
                                           r"for the header of the next message from rank 1"):
        ops.shm_p2p_recv_header(ep, 0, 0)
    assert time.monotonic() - start < 3
    timer.join()
    ops.shm_p2p_close(ep)
    del anchor
    mem.close()
