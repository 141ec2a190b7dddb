"""The torch.distributed backend "fastpar" on real ranks: every operation of the c10d interface
through torch.distributed's own functions, each against a float64 (or exact) reference built
from every rank's input, and which engine served it (the shm kernels where they serve, gloo for
the rest, never a silent no-op)."""

import os
import threading
import zlib

import pytest

from tests.multirank import run_ranks

pytestmark = pytest.mark.quick  # ~15 s: the backend's every operation, for iterating on it

FLOATS = ["float32", "float64", "bfloat16", "float16"]
INTS = ["int8", "uint8", "int16", "int32", "int64"]
TOL = {"float32": 1e-6, "float64": 1e-12, "bfloat16": 1e-2, "float16": 2e-3,
       "complex64": 1e-6, "complex128": 1e-12}


def init(path: str, backend: str = "fastpar", method: str = "file"):
    """This rank's default group of ``backend``, rendezvous by ``method`` (file, tcp, env)."""
    import torch.distributed as dist

    import fastpar  # noqa: F401  (registers the backend)
    from fastpar.runtime.launcher import detect

    me = detect(os.environ)
    if method == "file":
        dist.init_process_group(backend, init_method=f"file://{path}", rank=me.rank,
                                world_size=me.world_size)
    elif method == "tcp":
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{path}", rank=me.rank,
                                world_size=me.world_size)
    else:
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def data(rank, shape, dtype, salt):
    """Rank ``rank``'s input, reproducible on every rank (each builds the reference)."""
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{shape}/{dtype}/{salt}".encode()))
    dt = getattr(torch, dtype)
    if dt.is_complex:
        return torch.randn(shape, generator=g, dtype=torch.complex128).to(dt)
    if dt.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    lo, hi = (0, 4) if dt == torch.uint8 else (-3, 4)
    return torch.randint(lo, hi, shape, generator=g).to(dt)


def close(name, got, want, dtype):
    import torch

    assert got.shape == want.shape and got.dtype == getattr(torch, dtype), \
        (name, got.shape, want.shape, got.dtype)
    if dtype in TOL:
        err = (got.to(want.dtype) - want).abs().max().item() if got.numel() else 0.0
        bound = TOL[dtype] * max(1.0, want.abs().max().item() if want.numel() else 1.0)
        assert err <= bound, f"{name} {dtype}: max error {err:.3g} > {bound:.3g}"
    else:
        assert torch.equal(got, want.to(got.dtype)), (name, dtype, got, want)


def reference(op, xs, dtype):
    """op over the ranks' inputs ``xs``, in float64 (complex128 for complex; exact for
    integers and bool)."""
    import functools

    import torch

    wide = {"float32": torch.float64, "bfloat16": torch.float64, "float16": torch.float64,
            "float64": torch.float64, "complex64": torch.complex128,
            "complex128": torch.complex128}.get(dtype)
    ys = [x.to(wide) if wide is not None else x for x in xs]
    if op == "SUM":
        return functools.reduce(torch.add, ys)
    if op == "AVG":
        s = functools.reduce(torch.add, ys)
        return s / len(ys) if wide is not None else torch.div(s, len(ys), rounding_mode="trunc")
    if op == "PRODUCT":
        return functools.reduce(torch.mul, ys)
    if op == "MIN":
        return functools.reduce(torch.minimum, ys)
    if op == "MAX":
        return functools.reduce(torch.maximum, ys)
    if op == "PREMUL_SUM":
        return functools.reduce(torch.add, [2.5 * y for y in ys])
    return functools.reduce({"BAND": torch.bitwise_and, "BOR": torch.bitwise_or,
                             "BXOR": torch.bitwise_xor}[op], ys)


def body_reductions(path, subgroup=None):
    """all_reduce (every op x dtype it applies to), reduce, reduce_scatter (both forms) and
    all_reduce_coalesced, on the world or on ``subgroup`` (global ranks), against references."""
    import torch
    import torch.distributed as dist

    from fastpar.backend import served

    rank, world = init(path)
    ranks = list(range(world)) if subgroup is None else subgroup
    group = None if subgroup is None else dist.new_group(subgroup, backend="fastpar")
    if rank not in ranks:
        dist.barrier()
        return {}
    n = len(ranks)
    ops = {d: ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"] for d in FLOATS}
    ops.update({d: ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"] for d in INTS})
    ops.update({"complex64": ["SUM", "AVG"], "complex128": ["SUM", "AVG"],
                "bool": ["MIN", "MAX"]})
    for dtype, names in ops.items():
        for op in names:
            for shape in ((5, 3), (4099,)):
                xs = [data(r, shape, dtype, op) for r in ranks]
                t = xs[ranks.index(rank)].clone()
                red = (dist._make_nccl_premul_sum(2.5) if op == "PREMUL_SUM"
                       else getattr(dist.ReduceOp, op))
                dist.all_reduce(t, op=red, group=group)
                close(f"all_reduce {op}", t, reference(op, xs, dtype), dtype)
    for dtype in ("float32", "bfloat16", "int64"):
        for op in ("SUM", "MAX", "MIN", "AVG") if dtype != "int64" else ("SUM", "MAX"):
            xs = [data(r, (n * 6, 2), dtype, "rs" + op) for r in ranks]
            want = reference(op, xs, dtype)
            mine = ranks.index(rank)
            out = torch.empty(6, 2, dtype=getattr(torch, dtype))
            dist.reduce_scatter_tensor(out, xs[mine].clone(), op=getattr(dist.ReduceOp, op),
                                       group=group)
            close(f"reduce_scatter_tensor {op}", out, want[mine * 6:(mine + 1) * 6], dtype)
            out = torch.empty(6, 2, dtype=getattr(torch, dtype))
            dist.reduce_scatter(out, list(xs[mine].clone().chunk(n)),
                                op=getattr(dist.ReduceOp, op), group=group)
            close(f"reduce_scatter {op}", out, want[mine * 6:(mine + 1) * 6], dtype)
            root = ranks[-1]
            t = xs[mine].clone()
            dist.reduce(t, dst=root, op=getattr(dist.ReduceOp, op), group=group)
            if rank == root:  # (the others' tensors: unspecified; gloo changes them)
                close(f"reduce {op}", t, want, dtype)
    ts = [data(rank, (k,), "float32", "co") for k in (3, 1000, 7)]
    want = [reference("SUM", [data(r, (k,), "float32", "co") for r in ranks], "float32")
            for k in (3, 1000, 7)]
    dist.all_reduce_coalesced(ts, group=group)
    for t, w in zip(ts, want):
        close("all_reduce_coalesced", t, w, "float32")
    got = served(group)
    dist.barrier()
    return got


def point_to_point(rank, n):
    """A ring of batch_isend_irecv, then every rank sends to rank 0, which receives from any
    source."""
    import torch
    import torch.distributed as dist

    x = data(rank, (4,), "float32", "p2p")
    right, left = (rank + 1) % n, (rank - 1) % n
    got = torch.empty(4)
    ops = [dist.P2POp(dist.isend, x, right), dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    close("batch_isend_irecv", got, data(left, (4,), "float32", "p2p"), "float32")
    if rank == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.empty(4)
            src = dist.recv(t)
            close("recv any source", t, data(src, (4,), "float32", "any"), "float32")
            seen.add(src)
        assert seen == set(range(1, n))
    else:
        dist.send(data(rank, (4,), "float32", "any"), dst=0)


def body_moves(path):
    """The byte-moving operations and the rest of the interface: broadcast, all_gather (list,
    into a tensor, coalesced), all_to_all (equal, uneven, lists), gather, scatter, send/recv
    (any source too), batch_isend_irecv, barrier, monitored_barrier and the object collectives,
    every dtype."""
    import datetime

    import torch
    import torch.distributed as dist

    from fastpar.backend import served

    rank, n = init(path)
    for dtype in FLOATS + INTS + ["bool", "complex64", "complex128"]:
        xs = [data(r, (3, 5), dtype, "mv") for r in range(n)]
        t = xs[rank].clone()
        dist.broadcast(t, src=n - 1)
        close("broadcast", t, xs[n - 1], dtype)
        outs = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(outs, xs[rank])
        for r in range(n):
            close("all_gather", outs[r], xs[r], dtype)
        out = torch.empty(n * 3, 5, dtype=t.dtype)
        dist.all_gather_into_tensor(out, xs[rank])
        close("all_gather_into_tensor", out, torch.cat(xs), dtype)
        # all_to_all_single, uneven: rank r sends r + p + 1 rows to rank p
        send = [rank + p + 1 for p in range(n)]
        recv = [r + rank + 1 for r in range(n)]
        rows = [data(r, (sum(r + p + 1 for p in range(n)), 2), dtype, "a2a") for r in range(n)]
        out = torch.empty(sum(recv), 2, dtype=t.dtype)
        dist.all_to_all_single(out, rows[rank], output_split_sizes=recv, input_split_sizes=send)
        want = torch.cat([rows[r][sum(r + p + 1 for p in range(rank)):][:r + rank + 1]
                          for r in range(n)])
        close("all_to_all_single uneven", out, want, dtype)
        out = torch.empty(n * 2, 3, dtype=t.dtype)
        eq = [data(r, (n * 2, 3), dtype, "eq") for r in range(n)]
        dist.all_to_all_single(out, eq[rank])
        close("all_to_all_single", out, torch.cat([eq[r][2 * rank:2 * rank + 2]
                                                   for r in range(n)]), dtype)
        outs = [torch.empty(2, 3, dtype=t.dtype) for _ in range(n)]
        dist.all_to_all(outs, list(eq[rank].chunk(n)))
        for r in range(n):
            close("all_to_all", outs[r], eq[r][2 * rank:2 * rank + 2], dtype)
        gathered = [torch.empty_like(t) for _ in range(n)] if rank == 0 else None
        dist.gather(xs[rank], gathered, dst=0)
        if rank == 0:
            for r in range(n):
                close("gather", gathered[r], xs[r], dtype)
        t = torch.empty_like(xs[0])
        dist.scatter(t, [x.clone() for x in xs] if rank == 0 else None, src=0)
        close("scatter", t, xs[rank], dtype)
    if n > 1:  # (a rank cannot send to itself, on gloo either)
        point_to_point(rank, n)
    dist.barrier()
    with pytest.raises(ValueError, match="only implemented for GLOO"):
        dist.monitored_barrier()  # torch's Python checks the name (docs/backend.md)
    dist.group.WORLD.monitored_barrier(datetime.timedelta(seconds=30), wait_all_ranks=True)
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    assert objs == [{"rank": r, "s": "x" * r} for r in range(n)]
    lst = [rank, "a"] if rank == 1 % n else [None, None]
    dist.broadcast_object_list(lst, src=1 % n)
    assert lst == [1 % n, "a"]
    out = [None] * n if rank == 0 else None
    dist.gather_object(("g", rank), out, dst=0)
    if rank == 0:
        assert out == [("g", r) for r in range(n)]
    got = [None]
    dist.scatter_object_list(got, [("s", r) for r in range(n)] if rank == 0 else None, src=0)
    assert got == [("s", rank)]
    return served()


def body_async_and_threads(path):
    """Works: async handles, futures with the result tensors, wait(timeout); two groups driven
    from two threads at once stay correct (each group its own segment and order)."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, n = init(path)
    t = torch.full((1000,), float(rank + 1))
    w = dist.all_reduce(t, async_op=True)
    assert w.wait(timeout=datetime.timedelta(seconds=30))
    assert w.is_completed() and w.exception() is None
    fut_value = w.get_future().wait()
    assert torch.equal(fut_value[0], t) and t[0].item() == n * (n + 1) / 2
    w = dist.all_reduce(torch.ones(3, dtype=torch.int64), async_op=True)  # on gloo: in flight
    assert w.get_future().wait()[0].tolist() == [n] * 3
    groups = [dist.new_group(backend="fastpar") for _ in range(2)]
    errors = []

    def drive(i):
        try:
            for k in range(200):
                x = torch.full((257,), float(rank + i + k))
                dist.all_reduce(x, group=groups[i])
                assert x[0].item() == sum(r + i + k for r in range(n)), (i, k, x[0].item())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    return True


def body_layouts(path):
    """Ranks pass the same calls with different strides (rank 0 contiguous, the others a
    transposed view): all take the same engine and get the same results."""
    import torch
    import torch.distributed as dist

    rank, n = init(path)

    def shaped(t):  # the same values, another layout on ranks other than 0
        return t if rank == 0 else t.t().contiguous().t()

    xs = [data(r, (6, 4), "float32", "lay") for r in range(n)]
    t = shaped(xs[rank].clone())
    dist.all_reduce(t)
    close("all_reduce strided", t, reference("SUM", xs, "float32"), "float32")
    t = shaped(xs[rank].clone())
    dist.broadcast(t, src=0)
    close("broadcast strided", t, xs[0], "float32")
    out = shaped(torch.empty(6 * n, 4))
    dist.all_gather_into_tensor(out, shaped(xs[rank].clone()))
    close("all_gather_into_tensor strided", out, torch.cat(xs), "float32")
    out = shaped(torch.empty(6, 4))
    big = [data(r, (6 * n, 4), "float32", "rsl") for r in range(n)]
    dist.reduce_scatter_tensor(out, shaped(big[rank].clone()))
    close("reduce_scatter_tensor strided", out,
          reference("SUM", big, "float32")[6 * rank:6 * (rank + 1)], "float32")
    return True


@pytest.mark.parametrize("nranks", [2, 4])
def test_every_reduction_matches_its_reference(nranks, tmp_path):
    launch = run_ranks(nranks, body_reductions, path=str(tmp_path / "rdv"), timeout=240)
    served = launch.values()[0]
    # the kernels took the float reductions; gloo the integer ones; nothing else ran them
    assert served["allreduce"]["shm"] > 0 and served["allreduce"]["gloo"] > 0
    assert set(served["allreduce"]) == {"shm", "gloo"}
    assert served["reduce_scatter"]["shm"] > 0 and served["reduce"]["shm"] > 0


def test_a_subgroup_smaller_than_the_world(tmp_path):
    launch = run_ranks(4, body_reductions, path=str(tmp_path / "rdv"), subgroup=[1, 3],
                       timeout=240)
    assert launch.values()[0] == {} and launch.values()[1]["allreduce"]["shm"] > 0


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_every_move_and_the_rest_of_the_interface(nranks, tmp_path):
    served = run_ranks(nranks, body_moves, path=str(tmp_path / "rdv"), timeout=240).values()[0]
    if nranks > 1:
        for op in ("broadcast", "allgather", "_allgather_base", "alltoall_base"):
            assert served[op].get("shm", 0) > 0, (op, served[op])
        assert served["alltoall"] == {"gloo": 12}


def test_ranks_passing_different_layouts_take_the_same_engine(tmp_path):
    run_ranks(2, body_layouts, path=str(tmp_path / "rdv"), timeout=120)


def test_async_work_futures_and_two_groups_from_two_threads(tmp_path):
    run_ranks(2, body_async_and_threads, path=str(tmp_path / "rdv"), timeout=240)


def test_init_puts_its_groups_on_the_backend_by_default():
    """fastpar.init's default group on CPU: the fastpar backend (NCCL for a GPU of its own);
    its groups' dist.* calls take the kernels (``fastpar.init`` under mpirun below)."""
    import torch

    from fastpar.runtime.bootstrap import default_backend

    assert default_backend(torch.device("cpu"), False) == "fastpar"
    assert default_backend(torch.device("cuda", 0), False) == "nccl"
    assert default_backend(torch.device("cuda", 0), True) == "fastpar"  # a shared GPU: CPU comm
    got = run_ranks(2, body_init_groups, timeout=120).values()
    assert all(g == {"backend": "fastpar", "dist_on_shm": 1, "forced_on_gloo": 1, "sum": 3.0}
               for g in got), got


def body_init_groups():
    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar.backend import served

    from fastpar import comm

    topo = fastpar.init(tp=2)
    x = torch.full((16,), float(topo.rank + 1))
    dist.all_reduce(x, group=topo.tp_group)
    # fastpar.comm's own gloo engine on a fastpar group is gloo's, not the kernels behind it
    comm.use_backend("gloo")
    comm.all_reduce(torch.ones(16), group=topo.tp_group)
    comm.use_backend(None)
    got = served(topo.tp_group)["allreduce"]
    return {"backend": dist.get_backend(topo.tp_group), "dist_on_shm": got["shm"],
            "forced_on_gloo": got.get("gloo", 0), "sum": x[0].item()}


def body_cuda(path):
    """One rank on one GPU: CUDA tensors through "fastpar" (its NCCL backend) and through the
    mixed form "cpu:fastpar,cuda:nccl" (torch's own NCCL); CPU tensors on fastpar in both."""
    import torch
    import torch.distributed as dist

    from fastpar.backend import served

    out = {}
    for i, backend in enumerate(("fastpar", "cpu:fastpar,cuda:nccl")):
        dist.init_process_group(backend, init_method=f"file://{path}-{i}", rank=0, world_size=1)
        x = torch.arange(8.0, device="cuda")
        dist.all_reduce(x)
        y = torch.empty(8, device="cuda")
        dist.all_gather_into_tensor(y, x)
        c = torch.ones(4)
        dist.all_reduce(c)
        torch.cuda.synchronize()
        assert x.tolist() == list(range(8)) and torch.equal(y, x) and c.tolist() == [1.0] * 4
        out[backend] = {"cuda": served(device="cuda"), "cpu": served(device="cpu")}
        dist.destroy_process_group()
    return out


@pytest.mark.gpu
def test_cuda_tensors_take_nccl_gpu(tmp_path):
    got = run_ranks(1, body_cuda, path=str(tmp_path / "rdv"), timeout=120).values()[0]
    assert got["fastpar"]["cuda"]["allreduce"] == {"nccl": 1}, got
    assert got["cpu:fastpar,cuda:nccl"]["cuda"] == {}  # torch's NCCL group, not ours
    assert got["cpu:fastpar,cuda:nccl"]["cpu"]["allreduce"] == {"gloo": 1}  # one rank: gloo


def body_cuda_ipc(path):
    """Two ranks on one GPU: CUDA all-reduces within the size limit take fastpar's CUDA IPC
    kernels behind ``dist.all_reduce`` (NCCL, which wants a GPU per rank, is never called):
    every dtype the kernels reduce, SUM and AVG, an odd-address view and a strided one (each
    through a copy), against the float64 sum."""
    import torch
    import torch.distributed as dist

    from fastpar.backend import served

    torch.cuda.set_device(0)
    dist.init_process_group("fastpar", init_method=f"file://{path}")
    rank, n = dist.get_rank(), dist.get_world_size()
    for dtype in ("float32", "bfloat16", "float16"):
        for op in ("SUM", "AVG"):
            for numel in (8, 4096, 1 << 20):  # 16 bytes and up: the kernels' 16-byte loads
                xs = [data(r, (numel,), dtype, "ipc" + op) for r in range(n)]
                t = xs[rank].cuda()
                dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
                want = reference("SUM", xs, dtype) / (n if op == "AVG" else 1)
                close(f"cuda_ipc {op} {numel}", t.cpu(), want, dtype)
    xs = [data(r, (1 + 4096,), "float32", "view") for r in range(n)]
    base = xs[rank].cuda()
    dist.all_reduce(base[1:])  # 4 bytes past the allocation: not 16-byte aligned
    close("odd address", base[1:].cpu(), reference("SUM", [x[1:] for x in xs], "float32"),
          "float32")
    xs = [data(r, (64, 8), "float32", "strided") for r in range(n)]
    t = xs[rank].cuda().t()  # (8, 64), strides (1, 8)
    dist.all_reduce(t)
    close("strided", t.cpu(), reference("SUM", [x.t() for x in xs], "float32"), "float32")
    torch.cuda.synchronize()
    got = served(device="cuda")
    dist.destroy_process_group()  # the collective release of the IPC region
    return got


@pytest.mark.gpu
def test_cuda_all_reduce_takes_cuda_ipc_gpu(tmp_path):
    for got in run_ranks(2, body_cuda_ipc, path=str(tmp_path / "rdv"), timeout=180).values():
        assert got == {"allreduce": {"cuda_ipc": 3 * 2 * 3 + 2}}, got


def body_across_hosts(hosts=None):
    """On hosts of their own (tests/test_cluster_jobs.py; or ``hosts``, one identity per rank,
    FASTPAR_HOST_ID on one machine): fastpar.init's world spans the hosts (its float
    all-reduces, all-gathers and reduce-scatters from 4 KiB go through each host's kernels and
    across on gloo, the rest to gloo), a group of one host's ranks takes the kernels; reductions, moves and point to point
    against references, on both."""
    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar.backend import served

    if hosts is not None:
        from fastpar.runtime.launcher import detect

        os.environ["FASTPAR_HOST_ID"] = hosts[detect(os.environ).rank]
    topo = fastpar.init(timeout=120)
    rank, n = topo.rank, topo.world_size
    hosts = sorted(set(topo.hosts))
    mine = [r for r in range(n) if topo.hosts[r] == topo.hosts[rank]]
    local = None
    for h in hosts:  # new_group is collective over the world: every host's, in order
        g = dist.new_group([r for r in range(n) if topo.hosts[r] == h], backend="fastpar")
        local = g if h == topo.hosts[rank] else local
    for group, members in ((None, list(range(n))), (local, mine)):
        for dtype in ("float32", "bfloat16"):
            for op in ("SUM", "AVG", "MIN", "MAX", "PREMUL_SUM"):
                # float32: 16 KiB, 64.1 KiB, 60 bytes (the hierarchy from 4 KiB; under MPI,
                # MPI below 64 KiB and the hierarchy from there)
                for shape in ((4099,), (16411,), (3, 5)):
                    xs = [data(r, shape, dtype, "x" + op) for r in members]
                    t = xs[members.index(rank)].clone()
                    red = (dist._make_nccl_premul_sum(2.5) if op == "PREMUL_SUM"
                           else getattr(dist.ReduceOp, op))
                    dist.all_reduce(t, op=red, group=group)
                    close(f"all_reduce {op}", t, reference(op, xs, dtype), dtype)
        xs = [data(r, (4099,), "float32", "x") for r in members]
        ints = [data(r, (7,), "int64", "i") for r in members]
        t = ints[members.index(rank)].clone()
        dist.all_reduce(t, op=dist.ReduceOp.PRODUCT, group=group)
        close("all_reduce prod", t, reference("PRODUCT", ints, "int64"), "int64")
        out = torch.empty(len(members) * 4099)
        dist.all_gather_into_tensor(out, xs[members.index(rank)], group=group)
        close("all_gather", out, torch.cat(xs), "float32")
        i = members.index(rank)
        block = out.zero_()[i * 4099:(i + 1) * 4099]  # in place: the input is a block of out
        block.copy_(xs[i])
        dist.all_gather_into_tensor(out, block, group=group)
        close("all_gather in place", out, torch.cat(xs), "float32")
        for dtype in ("complex64", "int16", "bool"):  # moved as bytes (bool: below 4 KiB)
            ys = [data(r, (700,), dtype, "g") for r in members]
            out = torch.empty(len(members) * 700, dtype=getattr(torch, dtype))
            dist.all_gather_into_tensor(out, ys[i], group=group)
            close(f"all_gather {dtype}", out, torch.cat(ys), dtype)
        for dtype in ("float32", "bfloat16"):  # from 64 KiB (bf16, 4 ranks): the hierarchy
            for op in ("SUM", "AVG", "MIN", "MAX", "PREMUL_SUM"):
                ys = [data(r, (len(members) * 8209,), dtype, "rs" + op) for r in members]
                inp, out = ys[i].clone(), torch.empty(8209, dtype=getattr(torch, dtype))
                red = (dist._make_nccl_premul_sum(2.5) if op == "PREMUL_SUM"
                       else getattr(dist.ReduceOp, op))
                dist.reduce_scatter_tensor(out, inp, op=red, group=group)
                want = reference(op, ys, dtype)[i * 8209:(i + 1) * 8209]
                close(f"reduce_scatter {op}", out, want, dtype)
                assert torch.equal(inp, ys[i]), f"reduce_scatter {op} changed its input"
        t = xs[members.index(rank)].clone()
        dist.broadcast(t, src=members[-1], group=group)
        close("broadcast", t, xs[-1], "float32")
        # uneven all-to-all: rank index a sends a + b + 1 rows of 3 to rank index b
        m = len(members)
        rows = [[data(members[a], (a + b + 1, 3), "float32", f"a2a{b}") for b in range(m)]
                for a in range(m)]
        out = torch.empty(sum(a + i + 1 for a in range(m)), 3)
        dist.all_to_all_single(out, torch.cat(rows[i]), [i + b + 1 for b in range(m)],
                               [a + i + 1 for a in range(m)], group=group)
        close("all_to_all_single", out, torch.cat([rows[a][i] for a in range(m)]), "float32")
    other = [r for r in range(n) if topo.hosts[r] != topo.hosts[rank]]
    peer = other[mine.index(rank)]  # the same local index on the other host
    got = torch.empty(5)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, data(rank, (5,), "float32", "p"),
                                                peer),
                                     dist.P2POp(dist.irecv, got, peer)]):
        w.wait()
    close("p2p across hosts", got, data(peer, (5,), "float32", "p"), "float32")
    return {"world": served(), "local": served(local)}


def check_across_hosts(v: dict, mpi: bool) -> None:
    """What served body_across_hosts' calls on a world of 2 hosts x 2 ranks. Without MPI: the
    hierarchy from 4 KiB, gloo below. Under mpirun, as fastpar.comm's policy: the hierarchy
    from 64 KiB for the dtypes MPI reduces (from 4 KiB for the others), MPI's flat calls for
    those below it and for every move, gloo for the rest."""
    world = v["world"]
    assert "shm" not in world["allreduce"], v
    if mpi:  # MPI: float32 16 KiB and 60 B x 5 ops, int64 PRODUCT; the hierarchy: float32
        # from 64 KiB, bf16 from 4 KiB (MPI cannot reduce it); gloo: bf16's 30 bytes
        assert world["allreduce"]["mpi"] == 11 and world["allreduce"]["hier"] == 15, world
        assert world["allreduce"]["gloo"] >= 5, world
        assert world["alltoall_base"] == {"mpi": 1}, world
        # float32's 64.1 KB of output (2): the hierarchy; complex64, int16, bool: MPI
        assert world["_allgather_base"] == {"hier": 2, "mpi": 3}, world
        assert world["broadcast"] == {"mpi": 1}, world
    else:  # 16 and 64.1 KiB x 2 dtypes x 5 ops; float32 (2, one in place), complex64, int16
        assert world["allreduce"]["hier"] == 20 and world["allreduce"]["gloo"] >= 10, world
        assert "mpi" not in world["allreduce"], world
        assert world["alltoall_base"] == {"gloo": 1}, world
        assert world["_allgather_base"] == {"hier": 4, "gloo": 1}, world  # bool 2.8 KB: gloo
    assert world["reduce_scatter"] == {"hier": 10}, world
    assert v["local"]["allreduce"]["shm"] >= 30 and v["local"]["reduce_scatter"] == {"shm": 10}


@pytest.mark.quick
@pytest.mark.parametrize("hosts, place", [
    ("aabb", [0, 2, 1, 3]), ("abab", [0, 1, 2, 3]), ("abba", [0, 1, 3, 2]),
    ("aabbcc", [0, 3, 1, 4, 2, 5]), ("abcabc", [0, 1, 2, 3, 4, 5]),
    ("cab" "cab", [0, 1, 2, 3, 4, 5]), ("abccba", [0, 1, 2, 5, 4, 3])])
def test_hierarchy_placement(hosts, place):
    """Where the hierarchy puts each rank's block ([local index][host], hosts in order of first
    appearance); csrc/c10d_hier.cpp gathers with it and reduce-scatters with its inverse. At 4
    ranks every placement is its own inverse; 3 hosts x 2 ranks ("aabbcc") is not, and was
    run by hand (6 ranks: past the tests' limit of 4) with correct results: docs/backend.md."""
    from fastpar.backend.create import placement

    assert placement(list(hosts)) == place


@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_hierarchy_on_one_machine(launcher):
    """Two host identities of two ranks each on this machine (FASTPAR_HOST_ID), interleaved
    (global ranks 0 and 2 on one, 1 and 3 on the other): the world's float all-reduces,
    all_gather_into_tensor and reduce_scatter_tensor go through the hierarchy, under mpirun the
    small calls through MPI; every result against its reference."""
    got = run_ranks(4, body_across_hosts, launcher=launcher, hosts=["a", "b", "a", "b"],
                    timeout=240).values()
    for v in got:
        check_across_hosts(v, mpi=launcher == "mpirun")


def body_init_method(path, method):
    """One all_reduce and one reduce on a group made by ``method`` (tcp://, env:// under
    torchrun)."""
    import torch
    import torch.distributed as dist

    from fastpar.backend import served

    rank, n = init(path, method=method)
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    dist.reduce(t.clone(), dst=0)  # counted once, as a reduce
    return {"sum": t[0].item(), "shm": served()["allreduce"].get("shm", 0),
            "reduce": served()["reduce"], "backend": dist.get_backend()}


@pytest.mark.parametrize("method,launcher", [("tcp", "mpirun"), ("env", "torchrun")])
def test_init_methods(method, launcher):
    import socket

    with socket.socket() as s:  # a free port for tcp://127.0.0.1:<port>
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = run_ranks(2, body_init_method, launcher=launcher, path=str(port), method=method,
                    timeout=120).values()
    assert got == [{"sum": 3.0, "shm": 1, "reduce": {"shm": 1}, "backend": "fastpar"}] * 2, got
