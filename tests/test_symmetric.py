"""Symmetric tensors (fastpar/comm/symmetric.py over csrc/shm/shm_symmetric.cpp): an all_reduce
of a ``comm.symmetric_empty`` tensor, an all_gather into one and a reduce_scatter of one are
bitwise the copying shm path's, on every rank, for every dtype, sum and max, odd sizes on both
sides of the small-message limit, at world 2, 3 and 4; a contiguous part of one takes the
symmetric path too, bitwise the same; an all_gather from symmetric pieces into a plain output
reads them in place; ``release`` gives a symmetric tensor's pages back (``resident_bytes``
counts them);
ranks that disagree on the size get a ValueError naming both, ranks that pass different parts
(or different symmetric tensors) get the kernel's mismatch error on every rank instead of each
other's bytes; a killed peer is named at once and no segment is left in /dev/shm, also when
the creator dies while the others have not mapped it."""

import os
import signal
import time

import pytest

from tests.multirank import count_calls, cut_short_during_setup, run_ranks, segments_of

# Elements: 1 and 7 (ranks with an empty slice), 1001 (the copying path's one-round small
# all_reduce), 20011 and 300007 (several 16 KiB blocks per slice; the copying path's 1 MiB chunks
# for the largest).
COUNTS = [1, 7, 1001, 20011, 300007]


def body_bitwise():
    """Every (dtype, op, size): the symmetric result against the copying path's on a copy of the
    same input; returns a digest of every result so the test compares ranks."""
    import gc
    import hashlib

    import torch

    import fastpar
    from fastpar import comm
    from fastpar.comm import symmetric
    from fastpar.comm.engines.shm import SYMMETRIC_ALL_REDUCE_MIN
    from fastpar.comm.engines.shm import ShmCommunicator
    from fastpar.comm.state import current

    topo = fastpar.init(timeout=60)
    comm.use_backend("shm")
    me, n = topo.rank, topo.world_size
    calls = count_calls(ShmCommunicator, "all_reduce_symmetric")

    def taken():
        return calls["all_reduce_symmetric"]
    digests, bad, cases = [], [], 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for op in ("sum", "max"):
            for count in COUNTS:
                g = torch.Generator().manual_seed(1000 * me + count)
                data = (torch.randn(count, generator=g) * 100).to(dtype)
                if op == "max" and count > 7:  # NaN propagates, inf wins, alike on both paths
                    data[me * 5] = float("nan")
                    data[-1 - me] = float("inf")
                shape = (count,) if count % 2 else (2, count // 2)
                x = comm.symmetric_empty(*shape, dtype=dtype)
                x.copy_(data.view(shape))
                ref = data.clone().view(shape)
                comm.all_reduce(ref, op=op)  # not symmetric: the copying path
                comm.all_reduce(x, op=op)
                cases += 1
                if not torch.equal(x.reshape(-1).view(torch.uint8),
                                   ref.reshape(-1).view(torch.uint8)):
                    bad.append(f"{dtype} {op} {count}")
                digests.append(hashlib.sha1(x.reshape(-1).view(torch.uint8).numpy()).hexdigest())
                if count == 20011:  # a registered part: the symmetric path too; another
                    # (ranks could pass different ones): the copying path. Both bitwise the
                    # copying path's on a copy, the rest untouched.
                    flat = x.reshape(-1)
                    symmetric.register_parts(flat, [(0, count - 1)])
                    for view, symmetric_path in ((flat[:-1], True), (flat[1:], False)):
                        part, want = view.clone(), view.clone()
                        before, edge = taken(), flat[-1:] if symmetric_path else flat[:1]
                        kept = edge.clone()
                        comm.all_reduce(view, op=op)
                        comm.all_reduce(want, op=op)
                        assert taken() == before + symmetric_path, (symmetric_path, taken())
                        assert torch.equal(view.view(torch.uint8), want.view(torch.uint8)), part
                        assert torch.equal(edge.view(torch.uint8), kept.view(torch.uint8))
    # The symmetric kernel from SYMMETRIC_ALL_REDUCE_MIN bytes (below, the copying kernel's one
    # round is faster and works on the same memory); the parts of 20011 elements as well.
    big = sum(c * torch.empty((), dtype=d).element_size() >= SYMMETRIC_ALL_REDUCE_MIN
              for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
              for c in COUNTS) * 2 + 4 * 2  # sum and max; the parts from the start
    assert taken() == big and 0 < big < cases, (taken(), big, cases)
    bad += gather_and_scatter_cases(me, n, digests)
    # Ranks that disagree: a ValueError on every rank naming each rank's size, no segment made.
    try:
        comm.symmetric_empty(5 + (me == n - 1), dtype=torch.float32)
        raise AssertionError("mismatched symmetric_empty returned")
    except ValueError as exc:
        mismatch = str(exc)
    x = comm.symmetric_empty(3, dtype=torch.float32).fill_(me + 1)
    assert comm.all_reduce(x).tolist() == [n * (n + 1) / 2] * 3
    del x, view, part, flat, want, edge, kept
    gc.collect()
    left = len(current().symmetric)  # every tensor gone: no registry entry left
    fastpar.shutdown()
    return {"digests": digests, "bad": bad, "mismatch": mismatch, "left": left}


def gather_and_scatter_cases(me, n, digests):
    """all_gather into a symmetric ``out`` and reduce_scatter of a symmetric input, against the
    copying path, every dtype and size (per-rank part), sum and max; also ``out=`` a plain
    tensor. Returns the failed cases; adds the gathered results' digests (alike on all ranks)."""
    import hashlib

    import torch

    from fastpar import comm
    from fastpar.comm.engines.shm import ShmCommunicator

    calls = count_calls(ShmCommunicator, "all_gather_symmetric", "reduce_scatter_symmetric")
    bad, cases = [], 0
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for count in COUNTS:
            g = torch.Generator().manual_seed(7 * me + count)
            part = (torch.randn(count, generator=g) * 100).to(dtype)
            out = comm.symmetric_empty(n * count, dtype=dtype)
            out[me * count:(me + 1) * count].copy_(part)
            got = comm.all_gather(out[me * count:(me + 1) * count], out=out)  # in place
            plain = comm.all_gather(part, out=torch.full((n * count,), -1.0).to(dtype))
            ref = comm.all_gather(part)  # the copying path
            if got.data_ptr() != out.data_ptr() or not (
                    torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
                    and torch.equal(plain.view(torch.uint8), ref.view(torch.uint8))):
                bad.append(f"all_gather {dtype} {count}")
            digests.append(hashlib.sha1(got.view(torch.uint8).numpy()).hexdigest())  # same everywhere
            for op in ("sum", "max"):
                whole = (torch.randn(n * count, generator=g) * 100).to(dtype)
                x = comm.symmetric_empty(n * count, dtype=dtype)
                x.copy_(whole)
                ref = comm.reduce_scatter(whole, op=op)
                got = comm.reduce_scatter(x, op=op)
                # out=: a view in the middle of a larger tensor, from symmetric and plain input
                host = torch.full((count + 2,), -1.0).to(dtype)
                into = comm.reduce_scatter(x, op=op, out=host[1:count + 1])
                plain = comm.reduce_scatter(whole, op=op, out=torch.empty(count, dtype=dtype))
                cases += 1
                if not (torch.equal(got.view(torch.uint8), ref.view(torch.uint8)) and
                        into.data_ptr() == host[1:].data_ptr() and
                        torch.equal(into.view(torch.uint8), ref.view(torch.uint8)) and
                        torch.equal(plain.view(torch.uint8), ref.view(torch.uint8)) and
                        host[0].item() == host[-1].item() == -1):
                    bad.append(f"reduce_scatter {dtype} {op} {count}")
    # A symmetric out of the wrong shape: ValueError before any communication.
    try:
        comm.all_gather(torch.ones(3), out=torch.ones(3 * n + 1))
        bad.append("all_gather accepted a wrong out")
    except ValueError as exc:
        assert f"shape ({3 * n},)" in str(exc), exc
    try:
        comm.reduce_scatter(torch.ones(2 * n), out=torch.ones(3))
        bad.append("reduce_scatter accepted a wrong out")
    except ValueError as exc:
        assert "shape (2,)" in str(exc) and "got torch.float32 (3,)" in str(exc), exc
    # all_gather takes the symmetric kernel from SYMMETRIC_GATHER_MIN bytes per rank (below it
    # the copying kernel's single round is faster), ...
    # reduce_scatter from SYMMETRIC_SCATTER_MIN bytes of input.
    from fastpar.comm.engines.shm import SYMMETRIC_GATHER_MIN, SYMMETRIC_SCATTER_MIN

    def over(limit, ranks):
        return sum(count * ranks * torch.empty((), dtype=d).element_size() >= limit
                   for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
                   for count in COUNTS)
    want = {"all_gather_symmetric": over(SYMMETRIC_GATHER_MIN, 1),
            "reduce_scatter_symmetric": 4 * over(SYMMETRIC_SCATTER_MIN, n)}  # got, into
    if calls != want or not 0 < want["all_gather_symmetric"] < 4 * len(COUNTS) or \
            not 0 < want["reduce_scatter_symmetric"] < 2 * cases:
        bad.append(f"symmetric paths taken {calls}, expected {want} of {cases}")
    return bad + all_to_all_cases(me, n)


def all_to_all_cases(me, n):
    """all_to_all (equal splits) of a symmetric input, into a new tensor and into ``out=``,
    bitwise the copying path's, the input left as it was; all_to_all_v of the same input takes
    the copying kernel (counts could be equal on one rank and not another), still right;
    ``out=`` the input itself, plain or symmetric, still right. ``count`` rows of 3 per destination."""
    import torch

    from fastpar import comm
    from fastpar.comm.engines.shm import SYMMETRIC_ALL_TO_ALL_MIN
    from fastpar.comm.engines.shm import ShmCommunicator

    calls = count_calls(ShmCommunicator, "all_to_all_symmetric")
    bad, want = [], 0
    for dtype in (torch.float32, torch.bfloat16):  # a copy: the element size is what matters
        for count in (7, 20011, 300007):  # under SYMMETRIC_ALL_TO_ALL_MIN, then over
            g = torch.Generator().manual_seed(11 * me + count)
            whole = (torch.randn(n * count, 3, generator=g) * 100).to(dtype)
            x = comm.symmetric_empty(n * count, 3, dtype=dtype).copy_(whole)
            ref = comm.all_to_all(whole)  # the copying path
            got = comm.all_to_all(x)
            into = comm.all_to_all(x, out=torch.full_like(whole, -1))
            v = comm.all_to_all_v(x, [count] * n)
            want += 3 * (whole.nbytes >= SYMMETRIC_ALL_TO_ALL_MIN)  # got, into, out=x
            if not torch.equal(x, whole):
                bad.append(f"all_to_all {dtype} {count}: the input changed")
            # out= the input itself (peers read it while it would be written): through a new
            # tensor, plain and symmetric alike
            plain = whole.clone()
            same = [comm.all_to_all(plain, out=plain), comm.all_to_all(x, out=x)]
            if not all(torch.equal(t.view(torch.uint8), ref.view(torch.uint8))
                       for t in (got, into, v, *same)) or same[1].data_ptr() != x.data_ptr():
                bad.append(f"all_to_all {dtype} {count}")
    if calls["all_to_all_symmetric"] != want or not 0 < want < 18:
        bad.append(f"symmetric all_to_all taken {calls}, expected {want}")
    return bad


@pytest.mark.parametrize("nranks", [2, 3, 4])
def test_symmetric_all_reduce_is_bitwise_the_copying_path(nranks):
    values = run_ranks(nranks, body_bitwise, timeout=300).values()
    for v in values:
        assert v["bad"] == [], v["bad"]
        assert v["left"] == 0, v
        assert "size (5,)" in v["mismatch"] and "size (6,)" in v["mismatch"], v["mismatch"]
    assert all(v["digests"] == values[0]["digests"] for v in values)


def body_peer_killed():
    """Rank 1 is SIGKILLed after a symmetric all_reduce; rank 0's next one names it at once."""
    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=60)
    comm.use_backend("shm")
    x = comm.symmetric_empty(1 << 16, dtype=torch.float32).fill_(1)
    comm.all_reduce(x)
    torch.distributed.barrier()
    pids = [None] * topo.world_size
    torch.distributed.all_gather_object(pids, os.getpid())
    if topo.rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # torchrun stops the others: report first
    start = time.monotonic()
    try:
        comm.all_reduce(x)
        raise AssertionError("an all_reduce with a killed peer returned")
    except RuntimeError as exc:
        return [time.monotonic() - start, str(exc), pids]


def test_killed_peer_is_named_at_once_and_nothing_leaks():
    launch = run_ranks(2, body_peer_killed, launcher="torchrun", check=False, timeout=90)
    assert 0 in launch.results and launch.results[0]["ok"], launch.describe()
    elapsed, message, pids = launch.results[0]["value"]
    assert "all_reduce (symmetric): rank 0 found rank 1 dead" in message, message
    assert elapsed < 5, (elapsed, message)
    assert segments_of(pids) == set()


@pytest.mark.parametrize("victim", [0, 1])
def test_no_segment_left_when_a_rank_dies_during_setup(victim, tmp_path):
    """Rank 1 agrees on the size, then is slow to map the segment, so rank 0 waits with its name
    in /dev/shm; then one rank gets SIGKILL: the name goes too (the creator's reaper)."""
    code = ("import os, time, torch, fastpar\n"
            "from fastpar import comm\n"
            "topo = fastpar.init(timeout=120)\n"
            "comm.use_backend('shm')\n"
            "comm.all_reduce(torch.ones(2))\n"  # the group's own segment: mapped and unlinked
            f"open(os.path.join({str(tmp_path)!r}, f'pid{{topo.rank}}'), 'w').write("
            "str(os.getpid()))\n"
            "if topo.rank == 1:\n"  # past the size check, slow to map the segment
            "    import _posixshmem, fastpar.comm.engines.segments as segments\n"
            "    class Slow:\n"
            "        def shm_open(self, *args, **kwargs):\n"
            "            time.sleep(60)\n"
            "            return _posixshmem.shm_open(*args, **kwargs)\n"
            "        shm_unlink = staticmethod(_posixshmem.shm_unlink)\n"
            "    segments._posixshmem = Slow\n"
            "comm.symmetric_empty(1000)\n")
    pending, left, output = cut_short_during_setup(
        code, tmp_path, lambda proc: os.kill(int((tmp_path / f"pid{victim}").read_text()),
                                             signal.SIGKILL),
        keep=lambda path: "-sym-" in path)
    assert pending, f"the segment never appeared:\n{output}"
    assert left == set(), output


def body_segment_setup_fails():
    """map_segments (the one setup of every shm segment) when a step fails after the owner
    mapped its segment: the mapping is closed, the name unlinked, the error names the rank."""
    import glob
    import os

    import fastpar
    from fastpar.comm.engines.segments import map_segments

    topo = fastpar.init(timeout=60)
    out, seen = {}, []
    for kind in (OSError, KeyboardInterrupt):
        def init(key, mapping, kind=kind):
            seen.append(mapping)
            assert glob.glob(f"/dev/shm/fastpar-t-{os.getpid()}-*"), "no name while set up"
            raise kind("injected")
        try:
            map_segments(None, topo.rank, {"k": (topo.rank, [topo.rank])}, 8192, "the test",
                         tag="t-", init=init)
        except BaseException as exc:  # noqa: BLE001 - what came out is the result
            out[kind.__name__] = f"{type(exc).__name__}: {exc}"
    out["closed"] = [m.closed for m in seen]
    out["left"] = glob.glob(f"/dev/shm/fastpar-t-{os.getpid()}-*")
    maps = map_segments(None, topo.rank, {"k": (topo.rank, [topo.rank])}, 8192, "the test",
                        tag="t-")
    out["ok"] = [len(maps["k"]), glob.glob(f"/dev/shm/fastpar-t-{os.getpid()}-*")]
    maps["k"].close()
    return out


def test_segment_setup_failure_closes_and_unlinks():
    out = run_ranks(1, body_segment_setup_fails).values()[0]
    assert out["OSError"] == ("RuntimeError: the test failed on global rank 0 (a peer died or "
                              "did not reach this collective in time, or /dev/shm refused 8192 "
                              "bytes): injected"), out
    assert out["KeyboardInterrupt"] == "KeyboardInterrupt: injected", out
    assert out["closed"] == [True, True] and out["left"] == [], out
    assert out["ok"] == [8192, []], out  # mapped, and its name already gone


def body_release_and_gather_from():
    """``release`` gives a symmetric tensor's pages back (zeros after, ``resident_bytes`` down
    by them, other symmetric memory intact) and it works again when written; bad input is
    refused. ``all_gather(t, out=plain)`` with ``t`` a piece of a symmetric tensor (ZeRO-3's
    master pieces) reads every rank's ``t`` where it lies, bitwise the copying path, also for
    pieces at an offset; a symmetric ``out`` whose block ``t`` is takes the in-place kernel."""
    import torch

    import fastpar
    from fastpar import comm
    from fastpar.comm import symmetric
    from fastpar.comm.engines.shm import ShmCommunicator

    topo = fastpar.init(timeout=60)
    comm.use_backend("shm")
    me, n = topo.rank, topo.world_size
    calls = count_calls(ShmCommunicator, "all_gather_from_symmetric", "all_gather_symmetric")
    out, bad = {}, []
    g = torch.Generator().manual_seed(me)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        src = comm.symmetric_empty(3 * 40001, dtype=dtype)
        src.copy_(torch.randn(src.numel(), generator=g).to(dtype))
        symmetric.register_parts(src, [(0, 40001), (40001, 40001)])  # collective
        # registered parts at offset 0 and in the middle: from symmetric; each rank's own
        # block of another (offsets differ by rank, not registered): the copying path
        other = comm.symmetric_empty(n * 40001, dtype=dtype)
        other[me * 40001:(me + 1) * 40001].copy_(src[:40001])
        for piece in (src[:40001], src[40001:80002], other[me * 40001:(me + 1) * 40001]):
            ref = comm.all_gather(piece.clone())
            got = comm.all_gather(piece, out=torch.full((n * 40001,), -1.0).to(dtype))
            bad += [] if torch.equal(got.view(torch.uint8), ref.view(torch.uint8)) else \
                [f"gather from {dtype}"]
        k = 40000  # out symmetric too, t its own block: the in-place kernel, not this one
        whole = comm.symmetric_empty(n * k, dtype=dtype)
        whole[me * k:(me + 1) * k].fill_(me)  # (its block: out's own, no registration)
        comm.all_gather(whole[me * k:(me + 1) * k], out=whole)
        bad += [] if torch.equal(whole, torch.arange(n).repeat_interleave(k).to(dtype)) \
            else [f"in place {dtype}"]
    out["calls"] = dict(calls)
    a = comm.symmetric_empty(300000)
    b = comm.symmetric_empty(300000).fill_(7)
    a.fill_(me + 1)
    before = symmetric.resident_bytes()
    symmetric.release(a)
    out["released"] = before - symmetric.resident_bytes() >= a.nbytes - 4096
    out["a_resident"] = symmetric.resident_bytes(a)
    out["zeros"] = bool((a == 0).all())
    out["others"] = bool((b == 7).all())
    a.fill_(me + 1)
    comm.all_reduce(a)
    out["again"] = bool((a == n * (n + 1) / 2).all())
    errors = []
    for t in (a[1:], torch.ones(4096), a[::2]):  # not on a page; not symmetric; not contiguous
        try:
            symmetric.release(t)
        except ValueError as exc:
            errors.append(str(exc))
    symmetric.release(a[:0])  # nothing to give back: no error
    out["errors"] = errors
    out["bad"] = bad
    fastpar.shutdown()
    return out


@pytest.mark.quick
@pytest.mark.parametrize("nranks", [2, 4])
def test_release_and_gather_from_symmetric(nranks):
    for out in run_ranks(nranks, body_release_and_gather_from, timeout=240).values():
        assert out["bad"] == [], out
        # two pieces of each dtype from their symmetric source (not each rank's own block:
        # copying); one in place each
        assert out["calls"] == {"all_gather_from_symmetric": 6, "all_gather_symmetric": 3}, out
        assert out["released"] and out["a_resident"] == 0 and out["zeros"], out
        assert out["others"] and out["again"], out
        assert len(out["errors"]) == 3 and all("starting on a page" in e
                                               for e in out["errors"]), out


def body_mismatch():
    """Each case on a fresh group (a failed call leaves its group's segment unusable): ranks
    that pass different registered parts of one symmetric tensor, or different symmetric
    tensors of the same size, fail on every rank with the mismatch error; ranks that register
    different parts get a ValueError naming both."""
    import torch.distributed as dist

    import fastpar
    from fastpar import comm
    from fastpar.comm import symmetric
    from fastpar.comm.engines.native_errors import ShmError

    topo = fastpar.init(timeout=60)
    comm.use_backend("shm")
    me = topo.rank
    out = {}
    for case in ("offsets", "tensors", "gather"):
        g = dist.new_group(list(range(topo.world_size)))
        x = comm.symmetric_empty(1 << 17, group=g)
        y = comm.symmetric_empty(1 << 17, group=g)
        symmetric.register_parts(x, [(0, 100000), (1024, 100000)])
        t = x[1024 * me:1024 * me + 100000] if case == "offsets" else x if me == 0 else y
        try:
            if case == "gather":
                k = t.numel() // topo.world_size
                comm.all_gather(t[me * k:(me + 1) * k], group=g, out=t)
            else:
                comm.all_reduce(t, group=g)
            out[case] = "returned"
        except ShmError as exc:
            out[case] = str(exc)
    x = comm.symmetric_empty(1000)
    try:  # register_parts is collective: ranks that differ get a ValueError naming both
        symmetric.register_parts(x, [(0, 10 + me)])
        out["register"] = "returned"
    except ValueError as exc:
        out["register"] = str(exc)
    fastpar.shutdown()
    return out


def test_ranks_passing_different_symmetric_memory_fail_alike():
    for rank, out in enumerate(run_ranks(2, body_mismatch, timeout=120).values()):
        words = out.pop("register")
        assert "global rank 0: [(0, 10)]; global rank 1: [(0, 11)]" in words, words
        for case, words in out.items():
            assert "rank 1 passed" in words and "but rank 0 passed" in words, (case, words)
            assert "of a symmetric tensor" in words, (case, words)  # this rank's, described
            assert "in other symmetric memory" in words, (case, words)  # the peer's
