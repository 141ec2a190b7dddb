"""fastpar.comm on real ranks: every op x dtype x engine against a float64 reference."""

import glob
import hashlib
import os
import threading
import uuid
import zlib

import pytest

from tests.multirank import run_ranks, segments_of

SIZES = [1, 7, 4099, (1 << 19) + 3]  # the last: over the 1 MiB shm chunk in every dtype
ENGINE_DTYPES = {
    "shm": ["float32", "bfloat16", "float16", "float64"],
    "gloo": ["float32", "bfloat16", "float16", "float64"],
    "mpi": ["float32", "float64"],
}
TOL = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 1e-2, "float16": 2e-3}


def _input(rank, n, dtype, salt):
    """Rank ``rank``'s input, reproducible on every rank (so each can build the reference)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{n}/{salt}".encode()))
    return torch.randn(n, generator=g, dtype=torch.float64).to(getattr(torch, dtype))


def _check(name, got, want, dtype):

    got = got.double()
    err = (got - want).abs().max().item() if got.numel() else 0.0
    bound = TOL[dtype] * max(1.0, want.abs().max().item() if want.numel() else 1.0)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"
    return hashlib.sha1(got.numpy().tobytes()).hexdigest()[:12]


def body_every_op(engines, sizes):
    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=120)
    n, rank = topo.world_size, topo.rank
    digests = {}
    for engine in engines:
        comm.use_backend(engine)
        for dtype in ENGINE_DTYPES[engine]:
            for size in sizes:
                key = f"{engine}/{dtype}/{size}"
                inputs = [_input(r, size, dtype, "x") for r in range(n)]
                ref = [x.double() for x in inputs]
                for op in ("sum", "max"):
                    x = inputs[rank].clone()
                    comm.all_reduce(x, op=op)
                    want = torch.stack(ref).sum(0) if op == "sum" else torch.stack(ref).amax(0)
                    digests[f"ar-{op}/{key}"] = _check(f"all_reduce {op} {key}", x, want, dtype)
                out = comm.all_gather(inputs[rank])
                digests[f"ag/{key}"] = _check(f"all_gather {key}", out, torch.cat(ref), dtype)
                big = [_input(r, size * n, dtype, "rs") for r in range(n)]
                shard = comm.reduce_scatter(big[rank])
                want = torch.stack([b.double() for b in big]).sum(0).chunk(n)[rank]
                _check(f"reduce_scatter {key}", shard, want, dtype)
                b = inputs[rank].clone()
                comm.broadcast(b, src=n - 1)
                digests[f"bc/{key}"] = _check(f"broadcast {key}", b, ref[n - 1], dtype)
    # Other dims, non-float dtypes (gather/broadcast carry bytes), non-contiguous input.
    comm.use_backend("shm")
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3) + 10 * rank
    got = comm.all_gather(t, dim=1)
    assert torch.equal(got, torch.cat([torch.arange(6).reshape(2, 3) + 10 * r
                                       for r in range(n)], dim=1))
    m = torch.ones(3, 2 * n).t()  # non-contiguous (2n, 3)
    comm.all_reduce(m)
    assert torch.equal(m, torch.full((2 * n, 3), float(n)))
    rs = comm.reduce_scatter(torch.ones(3, 2 * n) * (rank + 1), dim=1)
    assert torch.equal(rs, torch.full((3, 2), n * (n + 1) / 2))
    comm.use_backend(None)
    h = comm.all_reduce(torch.ones(5), async_op=True)
    assert torch.equal(h.wait(), torch.full((5,), float(n)))
    # Async calls unpack as the raw (tensor, handle) pair; the tensor is final after wait().
    for engine in ("gloo", "shm"):
        comm.use_backend(engine)
        x = torch.arange(6.0).reshape(2, 3) + 10 * rank
        out, h = comm.all_gather(x, dim=1, async_op=True)
        assert h.wait() is out
        assert torch.equal(out, torch.cat([torch.arange(6.0).reshape(2, 3) + 10 * r
                                           for r in range(n)], dim=1)), (engine, out)
        out, h = comm.reduce_scatter(torch.ones(3, 2 * n) * (rank + 1), dim=1, async_op=True)
        h.wait()
        assert torch.equal(out, torch.full((3, 2), n * (n + 1) / 2)), (engine, out)
    comm.use_backend(None)
    return digests


@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.quick), 3, 4])
def test_every_op_dtype_engine(world):
    launch = run_ranks(world, body_every_op, engines=list(ENGINE_DTYPES), sizes=SIZES,
                       timeout=300)
    digests = launch.values()
    # shm reduces in a fixed rank order: every rank holds bitwise the same result.
    for key in digests[0]:
        if key.startswith(("ar-", "ag/", "bc/")) and "/shm/" in f"/{key.split('/', 1)[1]}":
            assert len({d[key] for d in digests}) == 1, key


def body_subgroups_and_many_calls():
    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(tp=2, timeout=60)
    for i in range(200):  # two different subgroups used alternately
        for group, axis in ((topo.tp_group, "tp"), (topo.dp_group, "dp")):
            x = torch.full((33,), float(topo.rank + i))
            comm.all_reduce(x, group=group)
            members = topo.ranks(axis)
            assert x[0].item() == sum(r + i for r in members), (axis, i, x[0].item())
    world = torch.zeros(1)
    for i in range(5000):  # consecutive tiny calls on the world group
        world.fill_(float(topo.rank))
        comm.all_reduce(world)
    assert world.item() == sum(range(topo.world_size))
    return "ok"


def test_subgroups_alternate_and_5000_tiny_calls():
    run_ranks(4, body_subgroups_and_many_calls, timeout=180)


def body_mismatch():
    import torch

    import fastpar
    from fastpar import comm

    import torch.distributed as dist

    from fastpar.comm.engines.native_errors import Kind

    topo = fastpar.init(timeout=30)
    r = topo.rank
    messages = []
    # A size, then a dtype and a shape of the same byte count (all_gather and broadcast move
    # bytes: only the signature tells float32 x 4 from int32 x 4), each on a fresh group.
    calls = [lambda g: comm.all_reduce(torch.ones(1024 * (r + 1)), group=g),
             lambda g: comm.broadcast(torch.ones(4, dtype=torch.int32 if r else torch.float32),
                                      group=g),
             lambda g: comm.all_gather(torch.ones(4, dtype=torch.int32 if r else torch.float32),
                                       group=g),
             lambda g: comm.all_gather(torch.ones((3, 2) if r else (2, 3)), group=g)]
    for call in calls:
        try:
            call(dist.new_group([0, 1]))
        except RuntimeError as exc:
            messages.append(str(exc))
            assert (exc.kind, exc.cause) == (Kind.MISMATCH, Kind.MISMATCH), (exc.kind, exc)
            continue
        raise AssertionError("a mismatch was not detected")
    return messages


def test_mismatches_raise_on_every_rank():
    for rank, msgs in enumerate(run_ranks(2, body_mismatch,
                                          env={"FASTPAR_COMM_BACKEND": "shm"}).values()):
        assert "rank 1 passed 2048 float32 elements" in msgs[0] and "1024" in msgs[0], msgs[0]
        for msg, op in zip(msgs[1:3], ("broadcast", "all_gather")):
            mine = "int32 (4,)" if rank else "float32 (4,)"
            other = "float32 with 1 dims" if rank else "int32 with 1 dims"
            assert msg.startswith(f"fastpar shm {op}: rank 1 passed 16 bytes of "), msg
            assert mine in msg and other in msg, msg
        assert "(3, 2)" in msgs[3] if rank else "(2, 3)" in msgs[3], msgs[3]


def body_missing_peer(gave_up):
    """A peer of a subgroup skips a call: its partner fails within the timeout, naming it by
    its global rank (the kernel numbers ranks within the group)."""
    import torch

    import fastpar
    from fastpar import comm
    from tests.multirank import late_until

    topo = fastpar.init(tp=2, timeout=3)  # dp groups: global ranks [0, 2] and [1, 3]
    x = torch.ones(4)
    comm.all_reduce(x, group=topo.dp_group)  # creates the segments; everyone takes part
    if topo.rank == 2:
        late_until(topo.store, gave_up, 20)  # never joins the next call
        return "skipped"
    if topo.rank in (1, 3):
        return "other group"
    try:
        comm.all_reduce(x, group=topo.dp_group)
    except RuntimeError as exc:
        message = str(exc)
        # the code, not the text, says what happened: a caller catches TimeoutError
        kinds = [exc.kind.name, exc.cause.name, isinstance(exc, TimeoutError)]
    else:
        raise AssertionError("a missing peer did not time out")
    finally:
        topo.store.set(gave_up, "1")
    try:  # the segment stays poisoned: the next call fails at once, with the first error
        comm.all_reduce(x, group=topo.dp_group)
    except RuntimeError as exc:
        return [message, str(exc), kinds,
                [exc.kind.name, exc.cause.name, isinstance(exc, TimeoutError)]]
    raise AssertionError("a poisoned segment served a call")


def test_missing_peer_times_out_naming_it():
    values = run_ranks(4, body_missing_peer, gave_up=uuid.uuid4().hex,
                       env={"FASTPAR_COMM_BACKEND": "shm"}).values()
    first, second, first_kind, second_kind = values[0]
    assert first_kind == ["TIMEOUT", "TIMEOUT", True], first_kind
    assert second_kind == ["POISONED", "TIMEOUT", True], second_kind
    assert "timed out" in first and "waiting for rank 1 (global rank 2)" in first, first
    assert "shm group of global ranks [0, 2]" in first, first
    assert "poisoned" in second and "global rank 2" in second, second


def body_setup_failure(gave_up):
    """A peer that never reaches the segment setup: the creator fails in time and unlinks."""
    import torch

    import fastpar
    from fastpar import comm
    from tests.multirank import late_until

    # A job of its own: MPI_Init first, without fastpar's watchdog, so that the 3 s bound the
    # segment's set-up and not ranks that finish importing torch seconds apart under load.
    from mpi4py import MPI  # noqa: F401
    topo = fastpar.init(timeout=3)
    if topo.rank == 1:
        late_until(topo.store, gave_up, 20)  # until rank 0's set-up has failed
        return "late"
    try:
        comm.all_reduce(torch.ones(4))
    except RuntimeError as exc:
        return str(exc)
    finally:
        topo.store.set(gave_up, "1")
    raise AssertionError("setup with a missing peer did not fail")


def _segments():
    return set(glob.glob("/dev/shm/fastpar-*"))


def body_tagged_sums(tag, calls):
    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=60)
    for i in range(calls):
        x = torch.full((4099,), float(tag * 1000 + topo.rank + i))
        comm.all_reduce(x)
        assert x.eq(sum(tag * 1000 + r + i for r in range(topo.world_size))).all(), (tag, i)
    return sorted(_segments())


def test_two_jobs_on_one_host_do_not_collide():
    results = {}

    def job(tag):
        results[tag] = run_ranks(2, body_tagged_sums, tag=tag, calls=2000, timeout=120,
                                 env={"FASTPAR_COMM_BACKEND": "shm"}, own_job=True)

    threads = [threading.Thread(target=job, args=(tag,)) for tag in (1, 2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert set(results) == {1, 2}
    # Segments are unlinked once mapped: after its set-up, a job sees none of its own (the
    # names carry their creators' pids; the other job's may still be in its set-up, and was
    # once seen there)
    pids = [pid for launch in results.values() for pid in launch.pids.values()]
    assert len(pids) == 4, [launch.pids for launch in results.values()]
    for launch in results.values():
        for seen in launch.values():
            assert not segments_of(launch.pids.values(), seen), seen
    assert not segments_of(pids)


def body_killed_rank():
    import signal

    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=30)
    x = torch.ones(8)
    comm.all_reduce(x)
    if topo.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(x)
    return "unreachable"


def test_no_segment_left_after_a_rank_is_killed():
    launch = run_ranks(2, body_killed_rank, check=False, timeout=60,
                       env={"FASTPAR_COMM_BACKEND": "shm"})
    assert launch.returncode not in (0, None), launch.describe()
    assert len(launch.pids) == 2 and not segments_of(launch.pids.values()), launch.describe()


def test_no_segment_left_when_setup_fails():
    launch = run_ranks(2, body_setup_failure, gave_up=uuid.uuid4().hex, timeout=90,
                       env={"FASTPAR_COMM_BACKEND": "shm"}, check=False)
    message = launch.results[0]["value"]
    assert "setting up the shared segment of the group of global ranks [0, 1] failed" in message
    assert len(launch.pids) == 2 and not segments_of(launch.pids.values()), launch.describe()


def body_edges():
    """Bad dims, 0-dim tensors, ReduceOp values, non-tensors, non-contiguous async calls: the same
    rule at every world size and on every engine."""
    import math

    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=30)
    n, rank = topo.world_size, topo.rank
    errors = []
    for call in (lambda: comm.all_gather(torch.ones(2, 3), dim=2),
                 lambda: comm.all_gather(torch.ones(2, 3), dim=-3),
                 lambda: comm.reduce_scatter(torch.ones(2, 4), dim=2),
                 lambda: comm.reduce_scatter(torch.tensor(1.0)),
                 lambda: comm.reduce_scatter(torch.ones(3, 2)),
                 lambda: comm.all_reduce(torch.ones(2), op="mean"),
                 lambda: comm.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND),
                 lambda: comm.all_reduce([1.0, 2.0])):
        try:
            call()
            errors.append(None)
        except (IndexError, ValueError, TypeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    for engine in ("shm", "gloo") if n > 1 else (None,):
        comm.use_backend(engine)
        # A 0-dim tensor gathers into (n,) at every world size.
        got = comm.all_gather(torch.tensor(float(rank)))
        assert got.shape == (n,) and got.tolist() == [float(r) for r in range(n)], got
        # torch.distributed's ReduceOp names the same ops as the strings.
        for op, want in ((dist.ReduceOp.SUM, n * (n + 1) // 2), (dist.ReduceOp.MAX, n),
                         (dist.ReduceOp.MIN, 1), (dist.ReduceOp.PRODUCT, math.factorial(n))):
            if engine == "shm" and op in (dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
                continue  # shm reduces with sum and max only (the policy refuses the others)
            x = torch.full((3,), float(rank + 1))
            assert comm.all_reduce(x, op=op)[0].item() == want, (engine, op)
        shard = comm.reduce_scatter(torch.full((n, 2), float(rank)), op=dist.ReduceOp.SUM)
        assert shard.tolist() == [[float(sum(range(n)))] * 2], shard
        # Non-contiguous inputs, asynchronously: the result lands in the input's layout.
        m = torch.arange(6.0).reshape(2, 3).t() + rank  # (3, 2), non-contiguous
        handle = comm.all_reduce(m, async_op=True)
        out, same = handle
        assert out is m and same is handle
        assert torch.equal(handle.wait(), torch.arange(6.0).reshape(2, 3).t() * n
                           + sum(range(n))), m
        b = torch.zeros(2, 3).t()
        if rank == n - 1:
            b.copy_(torch.arange(6.0).reshape(2, 3).t())
        assert torch.equal(comm.broadcast(b, src=n - 1, async_op=True).wait(),
                           torch.arange(6.0).reshape(2, 3).t())
    return errors


@pytest.mark.parametrize("world", [1, 2])
def test_edges_follow_one_rule_at_any_world_size(world):
    errors = run_ranks(world, body_edges).values()[0]
    assert errors[0] == ("IndexError: all_gather: dim 2 is out of range for a tensor of shape "
                         "(2, 3) (2 dims)")
    assert errors[1].startswith("IndexError: all_gather: dim -3 is out of range")
    assert errors[2].startswith("IndexError: reduce_scatter: dim 2 is out of range")
    assert "0-dim" in errors[3]
    assert errors[4] == (None if world == 1 else "ValueError: reduce_scatter: dim 0 of size 3 is "
                         "not divisible by the group size 2")
    # "avg" is taken (the sum divided: test_all_reduce_and_reduce_scatter_avg); other names not
    assert errors[5].startswith("ValueError: op must be one of 'sum', 'max', 'min', 'prod', "
                                "'avg' or the torch.distributed.ReduceOp of the same name, got "
                                "'mean'"), errors[5]
    assert errors[6].startswith("ValueError: op must be one of") and "BAND" in errors[6], errors[6]
    assert errors[7] == "TypeError: all_reduce: expected a torch.Tensor, got list"


def body_forced_engine_that_cannot_serve():
    import torch

    import fastpar
    from fastpar import comm

    fastpar.init()
    try:
        comm.all_reduce(torch.ones(2), group=fastpar.topology().dp_group)
    except ValueError as exc:
        return str(exc)
    return None


def test_forced_engine_that_cannot_serve_is_an_error():
    for message in run_ranks(2, body_forced_engine_that_cannot_serve,
                             env={"FASTPAR_COMM_BACKEND": "nccl"}).values():
        assert "FASTPAR_COMM_BACKEND=nccl cannot serve all_reduce" in str(message), message


def body_avg(engine):
    """op="avg" (and ReduceOp.AVG): the sum over the group divided by its size; all_reduce
    in place, sync and async, float and integer; reduce_scatter; on a subgroup too."""
    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar import comm

    topo = fastpar.init(tp=2)
    comm.use_backend(engine)
    n, out = topo.world_size, {}
    for name, group, members in (("world", None, list(range(n))),
                                 ("tp", topo.tp_group, topo.ranks("tp"))):
        k = len(members)
        x = _input(topo.rank, 37, "float64", "avg").float()
        want = sum(_input(r, 37, "float64", "avg") for r in members) / k
        got = comm.all_reduce(x.clone(), group=group, op="avg")
        _check(f"avg {name}", got, want, "float32")
        h = comm.all_reduce(x.clone(), group=group, op=dist.ReduceOp.AVG, async_op=True)
        _check(f"avg async {name}", h.wait(), want, "float32")
        i = torch.full((5,), 3 * topo.rank + 1, dtype=torch.int64)
        forced = comm.use_backend(None)  # integers: whatever engine reduces them (not shm)
        comm.all_reduce(i, group=group, op="avg")
        comm.use_backend(forced)
        assert i.tolist() == [sum(3 * r + 1 for r in members) // k] * 5, (name, i)
        big = _input(topo.rank, 4 * k, "float64", "rs").float()
        shard = comm.reduce_scatter(big, group=group, op="avg")
        me = members.index(topo.rank)
        full = sum(_input(r, 4 * k, "float64", "rs") for r in members) / k
        _check(f"reduce_scatter avg {name}", shard, full[4 * me:4 * (me + 1)], "float32")
        out[name] = comm.engine_for("all_reduce", x, group)[0]
    return out


@pytest.mark.parametrize("nranks", [2, 4])
@pytest.mark.parametrize("engine", ["shm", "gloo"])
def test_all_reduce_and_reduce_scatter_avg(nranks, engine):
    got = run_ranks(nranks, body_avg, engine=engine).values()
    assert all(g["tp"] == engine for g in got), got
