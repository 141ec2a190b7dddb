"""comm.all_to_all and all_to_all_v on real ranks, every engine, against a reference that every
rank builds from every rank's input (each rank regenerates the others' from a seed).

Rank i's rows for rank j are ``_rows(i, j, count, dtype)``; the reference result of rank j is
``cat_i _rows(i, j, counts[i][j])``. All cases of a world size run in one body (the suite's time).
"""

import os
import zlib

import pytest

from tests.multirank import run_ranks

DTYPES = ["float32", "float64", "bfloat16", "float16", "int8", "uint8", "int32", "int64", "bool"]


def _rows(i, j, count, dtype, width=3, salt=""):
    """Rank i's ``count`` rows (each ``width`` wide) for rank j, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{i}/{j}/{count}/{dtype}/{salt}".encode()))
    x = torch.randint(-100, 100, (count, width), generator=g)
    if dtype == "bool":
        return x > 0
    if dtype == "uint8":
        return (x + 100).to(torch.uint8)
    return x.to(getattr(torch, dtype))


def _matrices(n, seed):
    """Count matrices [i][j] (rows rank i sends rank j): uneven, one rank sending nothing, all
    zeros, equal."""
    import random

    rnd = random.Random(seed)
    uneven = [[rnd.randrange(0, 6) for _ in range(n)] for _ in range(n)]
    silent = [row[:] for row in uneven]
    silent[n - 1] = [0] * n
    return [uneven, silent, [[0] * n for _ in range(n)], [[2] * n for _ in range(n)]]


def _case(comm, counts, rank, n, dtype, width=3, give_recv=False, as_tensor=False, salt=""):
    import torch

    x = torch.cat([_rows(rank, j, counts[rank][j], dtype, width, salt) for j in range(n)])
    want = torch.cat([_rows(i, rank, counts[i][rank], dtype, width, salt) for i in range(n)])
    send = counts[rank]
    recv = [counts[i][rank] for i in range(n)] if give_recv else None
    if as_tensor:
        send = torch.tensor(send)
    got = comm.all_to_all_v(x, send, recv)
    assert got.dtype == want.dtype and torch.equal(got, want), (dtype, counts, rank)


def body_all_to_all(engines, big):
    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=120)
    n, rank = topo.world_size, topo.rank
    chosen = {}
    for engine in engines:
        comm.use_backend(engine)
        chosen[str(engine)] = comm.engine_for("all_to_all", torch.ones(4))[0]
        for d, dtype in enumerate(DTYPES):
            for m, counts in enumerate(_matrices(n, d)):
                _case(comm, counts, rank, n, dtype, give_recv=m % 2 == 1, as_tensor=m == 2)
            # equal splits
            x = torch.cat([_rows(rank, j, 2, dtype) for j in range(n)])
            want = torch.cat([_rows(i, rank, 2, dtype) for i in range(n)])
            assert torch.equal(comm.all_to_all(x), want), (engine, dtype)
        # 1-D tensors (rows of one element) and rows of zero bytes
        flat = torch.arange(n * 2, dtype=torch.float32) + 100 * rank
        want = torch.cat([torch.arange(2 * rank, 2 * rank + 2, dtype=torch.float32) + 100 * i
                          for i in range(n)])
        assert torch.equal(comm.all_to_all(flat), want), (engine, comm.all_to_all(flat))
        empty_rows = torch.empty(3 * n, 0)
        assert comm.all_to_all_v(empty_rows, [3] * n).shape == (3 * n, 0)
        # Over the shm slot (a half of 2 MiB holds ~2 MiB / n per pair): several rounds, uneven;
        # the first large call probes process_vm_readv, the next ones copy once (shm)
        counts = [[big * ((i + j) % 3) for j in range(n)] for i in range(n)]
        for salt in ("big", "again", "third"):
            _case(comm, counts, rank, n, "float32", width=1, salt=salt)
        _case(comm, [[(i * n + j) % 5 * 9000 for j in range(n)] for i in range(n)], rank, n,
              "int8", width=8, salt="mid")
        # async: a Handle that unpacks as (tensor, handle)
        x = torch.cat([_rows(rank, j, 1 + j, "float32") for j in range(n)])
        want = torch.cat([_rows(i, rank, 1 + rank, "float32") for i in range(n)])
        out, handle = comm.all_to_all_v(x, [1 + j for j in range(n)], async_op=True)
        assert handle.wait() is out and torch.equal(out, want), engine
        # non-contiguous input: rows of a transposed tensor
        t = (torch.arange(3 * n, dtype=torch.float64).reshape(3, n) + 1000 * rank).t()
        want = torch.stack([torch.arange(3, dtype=torch.float64) * n + rank + 1000 * i
                            for i in range(n)])
        assert torch.equal(comm.all_to_all(t), want), engine
        # out=: written in place and returned, reused across calls, uneven and large rows too
        x = torch.cat([_rows(rank, j, 2, "float32") for j in range(n)])
        out = torch.full_like(x, float("nan"))
        for _ in range(2):
            assert comm.all_to_all(x, out=out) is out, engine
            assert torch.equal(out, torch.cat([_rows(i, rank, 2, "float32") for i in range(n)]))
        for counts, salt in ((_matrices(n, 5)[0], "out"),
                             ([[big * ((i + j) % 3) for j in range(n)] for i in range(n)],
                              "outbig")):
            x = torch.cat([_rows(rank, j, counts[rank][j], "float32", 1, salt) for j in range(n)])
            recv = [counts[i][rank] for i in range(n)]
            out = torch.empty(sum(recv), 1)
            assert comm.all_to_all_v(x, counts[rank], recv, out=out) is out, engine
            assert torch.equal(out, torch.cat([_rows(i, rank, counts[i][rank], "float32", 1, salt)
                                               for i in range(n)])), (engine, salt)
    comm.use_backend(None)
    return {"chosen": chosen, "errors": _argument_errors(comm, n),
            "autograd": _autograd(comm, topo), "device": _device_path(comm, n, rank)}


def _argument_errors(comm, n):
    """Bad counts are ValueErrors naming the values, raised before any communication."""
    import torch

    x = torch.ones(4, 2)
    messages = []
    for call in (lambda: comm.all_to_all_v(x, [4] + [0] * n),
                 lambda: comm.all_to_all_v(x, [3] + [0] * (n - 1)),
                 lambda: comm.all_to_all_v(x, [5, -1] + [0] * (n - 2)) if n > 1 else
                 comm.all_to_all_v(x, [-1]),
                 lambda: comm.all_to_all_v(x, [4] + [0] * (n - 1), recv_counts=[1] * (n + 1)),
                 lambda: comm.all_to_all_v(x, [4.0] + [0] * (n - 1)),
                 lambda: comm.all_to_all(torch.ones(n + 1) if n > 1 else torch.tensor(1.0)),
                 lambda: comm.all_to_all_v(x, [4] + [0] * (n - 1), out=torch.empty(4, 2)),
                 lambda: comm.all_to_all(x if n in (1, 2, 4) else x[:n],
                                         out=torch.empty(4, 3))):
        try:
            call()
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


def _autograd(comm, topo):
    """all_to_all_rows' gradient is the transposed exchange: with loss = sum(y * w), dx must be,
    for rank i's rows bound for j, the rows of j's w that came from i (exact: data only moves).
    The forward is checked against the reference too."""
    import torch

    n, rank = topo.world_size, topo.rank
    counts = _matrices(n, 11)[0]
    x = torch.cat([_rows(rank, j, counts[rank][j], "float64") for j in range(n)])
    x.requires_grad_(True)
    group = torch.distributed.group.WORLD
    y = comm.all_to_all_rows(x, group, counts[rank])

    def w_of(j):  # rank j's weights, one block per source rank i
        return [_rows(i, j, counts[i][j], "float64", salt="w") for i in range(n)]
    (y * torch.cat(w_of(rank))).sum().backward()
    want = torch.cat([w_of(j)[rank] for j in range(n)])
    assert torch.equal(x.grad, want)
    equal = torch.arange(2.0 * n, dtype=torch.float64, requires_grad=True)
    (comm.all_to_all_rows(equal, group) * (rank + 1)).sum().backward()
    assert torch.equal(equal.grad, torch.arange(1.0, n + 1, dtype=torch.float64)
                       .repeat_interleave(2)), equal.grad
    return "ok"


def _device_path(comm, n, rank):
    """all_to_all_v_device on CPU tensors (gloo): the first sum(recv) rows are the
    all_to_all_v result, the rest zeros; recv counts as exchanged."""
    import torch

    counts = _matrices(n, 5)[0]
    cap = 5
    x = torch.cat([_rows(rank, j, counts[rank][j], "bfloat16") for j in range(n)])
    want = torch.cat([_rows(i, rank, counts[i][rank], "bfloat16") for i in range(n)])
    for async_op in (False, True):
        out, recv = comm.all_to_all_v_device(x, torch.tensor(counts[rank]), cap,
                                             async_op=async_op)
        if async_op:
            out = out.wait()
        assert out.shape == (n * cap, 3) and recv.tolist() == [counts[i][rank] for i in range(n)]
        assert torch.equal(out[:want.shape[0]], want) and not out[want.shape[0]:].any()
    return "ok"


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_to_all_every_engine(world):
    engines = ["shm", "mpi", "gloo"] if world > 1 else [None]
    values = run_ranks(world, body_all_to_all, engines=engines, big=300_000, timeout=240).values()
    for v in values:
        assert v["autograd"] == "ok" and v["device"] == "ok"
        if world > 1:
            assert v["chosen"] == {"shm": "shm", "mpi": "mpi", "gloo": "gloo"}, v["chosen"]
        e = v["errors"]
        assert f"has {world + 1} entries [4, " in e[0] and f"group of {world} ranks" in e[0], e[0]
        assert "add up to 3 rows but dim 0 of the input has 4" in e[1], e[1]
        assert "negative counts: -1 for rank" in e[2], e[2]
        assert f"recv_counts has {world + 1} entries" in e[3], e[3]
        assert "must be integers" in e[4], e[4]
        assert "is not divisible by the group size" in e[5] if world > 1 else \
            "0-dim" in e[5], e[5]
        assert "out= needs recv_counts" in e[6], e[6]
        assert "out must be a contiguous torch.float32 tensor of shape" in e[7] and \
            "got torch.float32 (4, 3)" in e[7], e[7]


def body_subgroup_and_mismatch():
    """The dp group of a tp=2 grid (global ranks [0, 2] and [1, 3]) on shm and mpi; then
    mismatches on a fresh group: fail on every rank with the same message."""
    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar import comm

    topo = fastpar.init(tp=2, timeout=60)
    dp = topo.ranks("dp")
    me = dp.index(topo.rank)
    for engine in ("shm", "mpi", "gloo"):
        comm.use_backend(engine)
        counts = [[1, 3], [0, 2]]  # dp index i sends counts[i][j] rows to dp index j
        x = torch.cat([torch.full((counts[me][j], 2), 10.0 * dp[me] + j) for j in range(2)])
        y = comm.all_to_all_v(x, counts[me], group=topo.dp_group)
        want = torch.cat([torch.full((counts[i][me], 2), 10.0 * dp[i] + me) for i in range(2)])
        assert torch.equal(y, want), (engine, y)
    comm.use_backend("shm")
    messages = []
    r = topo.rank
    for call in (  # a wrong expectation on rank 1, a dtype that differs on rank 1
            lambda g: comm.all_to_all_v(torch.ones(4, 2), [1, 1, 1, 1],
                                        [1, 2, 1, 1] if r == 1 else None, group=g),
            lambda g: comm.all_to_all(torch.ones(4, 2, dtype=torch.int32 if r == 1 else
                                                 torch.float32), group=g)):
        try:
            call(dist.new_group(list(range(topo.world_size))))
        except RuntimeError as exc:
            messages.append([str(exc), exc.kind.name])
            continue
        raise AssertionError("a mismatch was not detected")
    comm.use_backend(None)
    return messages


@pytest.mark.quick
def test_subgroup_and_mismatches_on_every_rank():
    values = run_ranks(4, body_subgroup_and_mismatch, timeout=120).values()
    for rank, (counts, dtype) in enumerate(values):
        assert counts[1] == dtype[1] == "MISMATCH", (counts, dtype)
        assert "fastpar shm all_to_all: rank 1 expects 2 rows from rank 1 but rank 1 sends " \
               "it 1" in counts[0], counts[0]
        assert "all_to_all: rank 1 passed" in dtype[0] and "int32" in dtype[0], dtype[0]


def body_across_hosts(hosts):
    """A world spanning two hosts (FASTPAR_HOST_ID): all_to_all takes one flat call (MPI
    here), never the hierarchical engine."""
    import torch

    import fastpar
    from fastpar import comm

    os.environ["FASTPAR_HOST_ID"] = hosts[int(os.environ.get("PMI_RANK", 0))]
    topo = fastpar.init(timeout=60)
    n, rank = topo.world_size, topo.rank
    engine, reason = comm.engine_for("all_to_all", torch.ones(1 << 18))
    counts = _matrices(n, 3)[1]
    for dtype in ("float32", "bfloat16", "bool"):
        _case(comm, counts, rank, n, dtype)
    return [engine, reason]


def test_across_hosts_is_flat():
    values = run_ranks(4, body_across_hosts, hosts=["h0", "h0", "h1", "h1"]).values()
    for engine, reason in values:
        assert engine == "mpi" and "all_to_all is flat" in reason, (engine, reason)


def body_device_counts_cuda():
    """The device-counts path on a GPU with NCCL: no device-to-host sync anywhere (torch's
    sync debug mode raises on one), the result as all_to_all_v's."""
    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=60)
    assert topo.backend == "nccl", topo.backend
    n, dev = topo.world_size, topo.device
    x = torch.arange(12.0, device=dev).reshape(6, 2)
    counts = torch.tensor([6] + [0] * (n - 1), device=dev)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, recv = comm.all_to_all_v_device(x, counts, capacity=8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = comm.all_to_all_v(x, [6] + [0] * (n - 1))
    assert torch.equal(out[:want.shape[0]], want) and not out[want.shape[0]:].any()
    return recv.tolist()


@pytest.mark.gpu
def test_device_counts_without_host_sync_gpu():
    run_ranks(1, body_device_counts_cuda, timeout=120)
