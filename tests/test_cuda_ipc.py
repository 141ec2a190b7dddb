"""CUDA IPC all-reduce and nccl_mpi on a GPU: processes sharing the machine's GPU(s)
(``FASTPAR_SHARED_GPU=1``), launched by torchrun (it comes with torch; a GPU image may lack
mpirun). Run by tests/gpu_check.sh; every test is marked ``gpu``.

Every result is compared bitwise with a CPU reference (the fp32 sum in rank order, rounded once
to the dtype: what the kernels compute) and across ranks. One launch per world size (2, 3, 4)
runs: every dtype 16 B..8 MiB with one-shot and two-shot forced; 300 calls of varying sizes in
flight without a synchronisation (packs not divisible by the world or the block); exactly the
limit and just over it; CUDA graph capture with many replays; a side-stream call then a
main-stream one; misaligned and non-contiguous views; symmetric tensors; two groups at once; an
injected setup failure on one rank (every rank falls back); shutdown then init again. Separate
launches: expandable segments on; a rank that skips a call under a short timeout; nccl_mpi in
one process (NCCL refuses several ranks on one GPU).
"""

import pytest

from tests.multirank import count_calls, run_ranks

pytestmark = pytest.mark.gpu

SHARED = {"FASTPAR_SHARED_GPU": "1"}


def _inputs(ranks_n, count, dtype, seed):
    import torch

    return [torch.randn(count, generator=torch.Generator().manual_seed(seed * 131 + r))
            .to(dtype) for r in range(ranks_n)]


def _reference(ins):
    """What the kernels compute: fp32 sum in rank order, rounded once."""
    acc = ins[0].float()
    for x in ins[1:]:
        acc = acc + x.float()
    return acc.to(ins[0].dtype)


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and torch.equal(a.cpu().contiguous().view(torch.uint8),
                                              b.cpu().contiguous().view(torch.uint8))


class Checker:
    """Counts checks, keeps the first failures (by name), and a digest of every world-group
    result (``world=False``: a subgroup's, left out) to compare across ranks."""

    def __init__(self):
        self.count, self.failed, self.digest = 0, [], []

    def __call__(self, name, got, want, world=True):
        self.count += 1
        if not _same(got, want):
            self.failed.append(name)
        if world:
            self.digest.append(float(got.double().sum().item()))


def _ipc(group=None):
    import torch.distributed as dist

    from fastpar.comm.engines.cuda_ipc import CudaIpc
    from fastpar.comm.state import current

    st = current()
    group = group or dist.group.WORLD
    g, ranks, _ = st.resolve(group)
    return st.communicator(CudaIpc, g, ranks, st.topo.device)


def body_ipc():
    import os

    import torch
    import torch.distributed as dist

    import fastpar
    from fastpar import comm
    from fastpar.comm.engines import cuda_ipc
    from fastpar.comm import routing
    from fastpar.comm.engines.cuda_ipc import CudaIpcCommunicator

    topo = fastpar.init(timeout=120)
    n, rank, dev = topo.world_size, topo.rank, topo.device
    check = Checker()
    ipc = _ipc()
    assert ipc is not None, "cuda_ipc is off on this GPU (see the log)"
    limit = ipc.max_bytes
    comm.use_backend("cuda_ipc")

    # 1. every dtype, 16 B .. 8 MiB, each algorithm forced
    for algo in (1, 2):
        ipc.algo = algo
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            esize = torch.empty((), dtype=dtype).element_size()
            nbytes = 16
            while nbytes <= min(8 << 20, limit):
                ins = _inputs(n, nbytes // esize, dtype, seed=nbytes + algo)
                x = ins[rank].to(dev)
                comm.all_reduce(x)
                check(f"sweep {dtype} {nbytes} algo {algo}", x, _reference(ins))
                nbytes *= 4
    ipc.algo = 0

    # 2. 300 calls in flight, sizes varying (not multiples of the world, the block or 512
    # threads), no synchronisation until all are enqueued
    g = torch.Generator().manual_seed(5)
    sizes = [int(s) * 8 for s in torch.randint(1, 40_000, (300,), generator=g)]
    pending = []
    for i, count in enumerate(sizes):
        dtype = (torch.float32, torch.bfloat16)[i % 2]
        ins = _inputs(n, count, dtype, seed=10_000 + i)
        x = ins[rank].to(dev)
        comm.all_reduce(x)
        pending.append((x, ins))
    torch.cuda.synchronize()
    for i, (x, ins) in enumerate(pending):
        check(f"in flight {i}", x, _reference(ins))

    # 3. exactly the limit (cuda_ipc), and 16 bytes over it (the policy's fallback engine)
    comm.use_backend(None)
    for count, engine in ((limit // 4, "cuda_ipc"), (limit // 4 + 4, topo.backend)):
        ins = _inputs(n, count, torch.float32, seed=count)
        x = ins[rank].to(dev)
        _, _, choice = routing.choose("all_reduce", x, None)
        assert choice.engine == engine, (count * 4, choice)
        comm.all_reduce(x)
        if engine == "cuda_ipc":
            check(f"exactly the limit {limit}", x, _reference(ins))
        else:  # gloo's own order of summation: close, not bitwise
            torch.testing.assert_close(x.cpu(), _reference(ins), rtol=1e-5, atol=1e-5)
    comm.use_backend("cuda_ipc")

    # 4. CUDA graph: capture one all_reduce (and a one-shot and a two-shot size), replay 40
    # times with fresh inputs, eager calls in between
    static = [torch.zeros(c, device=dev) for c in (1000, 300_000)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (routes, checks)
        for s in static:
            comm.all_reduce(s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for s in static:
            comm.all_reduce(s)
    for replay in range(40):
        ins_all = [_inputs(n, s.numel(), torch.float32, seed=50_000 + 7 * replay + k)
                   for k, s in enumerate(static)]
        for s, ins in zip(static, ins_all):
            s.copy_(ins[rank])
        graph.replay()
        eager_ins = _inputs(n, 4096, torch.float32, seed=90_000 + replay)
        eager = eager_ins[rank].to(dev)
        comm.all_reduce(eager)
        for k, (s, ins) in enumerate(zip(static, ins_all)):
            check(f"graph replay {replay} tensor {k}", s, _reference(ins))
        check(f"eager after replay {replay}", eager, _reference(eager_ins))

    # 5. a side-stream call, then at once a main-stream one: the second must not overwrite the
    # staging buffer the first is still reading (two-shot sizes, so it takes a while)
    for trial in range(5):
        a_ins = _inputs(n, 1 << 20, torch.float32, seed=70_000 + trial)
        b_ins = _inputs(n, 1 << 20, torch.float32, seed=80_000 + trial)
        a, b = a_ins[rank].to(dev), b_ins[rank].to(dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            comm.all_reduce(a)
        comm.all_reduce(b)
        torch.cuda.synchronize()
        check(f"side stream {trial}", a, _reference(a_ins))
        check(f"main stream after side {trial}", b, _reference(b_ins))

    # 6. views: misaligned (4 bytes into a buffer) and non-contiguous
    ins = _inputs(n, 4097, torch.float32, seed=3)
    buf = torch.zeros(4097, device=dev)
    buf[1:].copy_(ins[rank][1:].to(dev))
    view = buf[1:]
    assert view.data_ptr() % 16
    comm.all_reduce(view)
    check("misaligned view", view, _reference([i[1:] for i in ins]))
    ins = _inputs(n, 64 * 64, torch.bfloat16, seed=4)
    full = ins[rank].view(64, 64).to(dev)
    strided = full[:, ::2]
    comm.all_reduce(strided)
    check("non-contiguous view", strided, _reference([i.view(64, 64)[:, ::2] for i in ins]))

    # 7. symmetric tensors: in place, bitwise the copying path, interleaved with it
    taken = count_calls(CudaIpcCommunicator, "all_reduce_symmetric")
    sym_checked = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        esize = torch.empty((), dtype=dtype).element_size()
        for nbytes in (16, 4096, 65536 + 48, 1 << 20, 8 << 20):
            ins = _inputs(n, nbytes // esize, dtype, seed=nbytes * 3)
            x = comm.symmetric_empty(nbytes // esize, dtype=dtype, device=dev)
            x.copy_(ins[rank].to(dev))
            ref = ins[rank].to(dev)
            comm.all_reduce(ref)
            comm.all_reduce(x)
            check(f"symmetric {dtype} {nbytes}", x, _reference(ins))
            check(f"symmetric = copying {dtype} {nbytes}", x, ref)
            sym_checked += 1
    assert taken["all_reduce_symmetric"] == sym_checked, (taken, sym_checked)

    # 8. two groups at once: the world and pairs, calls interleaved, no synchronisation
    pairs = [dist.new_group([r, r + 1]) for r in range(0, n - 1, 2)]
    mine = next((p, [r, r + 1]) for p, r in zip(pairs, range(0, n - 1, 2))
                if rank in (r, r + 1)) if rank < n - n % 2 else None
    pending = []
    for i in range(20):
        w_ins = _inputs(n, 2048 + 8 * i, torch.float32, seed=100_000 + i)
        w = w_ins[rank].to(dev)
        comm.all_reduce(w)
        pending.append((f"world {i}", w, w_ins))
        if mine is not None:
            group, members = mine
            p_ins = _inputs(n, 4096 + 16 * i, torch.float32, seed=200_000 + i)
            p = p_ins[rank].to(dev)
            comm.all_reduce(p, group=group)
            pending.append((f"pair {i}", p, [p_ins[m] for m in members]))
    torch.cuda.synchronize()
    for name, x, ins in pending:
        check(name, x, _reference(ins), world=name.startswith("world"))
    if mine is not None:
        assert _ipc(mine[0]) is not None

    # 9a. the signal-driven row layer (Triton GEMM into the staging buffer, one-shot per finished
    # row block; opt-in), then the copying path again on the same staging buffer
    comm.use_backend(None)
    os.environ["FASTPAR_SIGNAL_OVERLAP"] = "1"
    signal_checked = _signal_driven_row_layer(topo, check)
    del os.environ["FASTPAR_SIGNAL_OVERLAP"]
    comm.use_backend("cuda_ipc")
    ins = _inputs(n, 65536, torch.float32, seed=9)
    x = ins[rank].to(dev)
    comm.all_reduce(x)
    check("copying path after the signal-driven layer", x, _reference(ins))

    # 9. a setup failure on one rank (opening a peer's handle): every rank falls back
    comm.use_backend(None)
    real_open = cuda_ipc.Driver.open
    if rank == 1:
        def failing_open(self, handle, device):
            raise RuntimeError("injected: cudaIpcOpenMemHandle failed")
        cuda_ipc.Driver.open = failing_open
    fresh = dist.new_group(list(range(n)))
    ins = _inputs(n, 1024, torch.float32, seed=6)
    x = ins[rank].to(dev)
    comm.all_reduce(x, group=fresh)
    cuda_ipc.Driver.open = real_open
    assert _ipc(fresh) is None, "a rank kept cuda_ipc although global rank 1 could not"
    torch.testing.assert_close(x.cpu(), _reference(ins), rtol=1e-5, atol=1e-5)

    # every rank saw the same results
    digests = [None] * n
    dist.all_gather_object(digests, check.digest)
    assert all(d == digests[0] for d in digests), "ranks disagree"
    counted = check.count

    # 10. shutdown, then init again: a new communicator, still right
    fastpar.shutdown()
    topo = fastpar.init(timeout=120)
    ins = _inputs(n, 8192, torch.bfloat16, seed=7)
    x = ins[rank].to(topo.device)
    comm.use_backend("cuda_ipc")
    comm.all_reduce(x)
    check("after re-init", x, _reference(ins))
    fastpar.shutdown()
    return {"checks": check.count, "before_reinit": counted, "failed": check.failed[:10],
            "limit": limit, "reason": ipc.reason, "signal": signal_checked}


def _signal_driven_row_layer(topo, check) -> str:
    """RowParallelLinear(overlap=True) on CUDA takes the signal-driven forward; its output
    against float64 over every rank's shard, within the rounding of a K-term fp32 GEMM per rank,
    the rounding of each rank's partial to the dtype and of the sum; gradients flow."""
    import torch
    import torch.distributed as dist

    from fastpar import nn as pnn

    n, rank, dev = topo.world_size, topo.rank, topo.device
    said = ""
    for dtype in (torch.float32, torch.bfloat16):
        layer = pnn.RowParallelLinear(512 * n, 384, overlap=True, dtype=dtype, device=dev,
                                      seed=11)
        g = torch.Generator().manual_seed(100 + rank)
        x = torch.randn(3, 400, 512, generator=g).to(dtype).to(dev).requires_grad_(True)
        y = layer(x)  # (3, 400, 384): 1200 rows, 10 row blocks of 128 (several waves of tiles)
        said = str(layer.overlap_decision)
        assert "signal-driven: Triton GEMM" in said, said
        shards = [None] * n
        dist.all_gather_object(shards, (x.detach().cpu(), layer.weight.detach().cpu()))
        ref = sum(xr.double() @ wr.double().T for xr, wr in shards) + layer.bias.double().cpu()
        mag = sum(xr.double().abs() @ wr.double().abs().T for xr, wr in shards)
        eps = torch.finfo(torch.float32).eps
        bound = (512 + n + 2) * eps * mag + (n + 1) * torch.finfo(dtype).eps * (
            mag + layer.bias.double().abs().cpu())
        err = (y.detach().double().cpu() - ref).abs()
        check.count += 1
        if not bool((err <= bound).all()):
            check.failed.append(f"signal-driven row layer {dtype}: worst error / bound "
                                f"{(err / bound).max().item():.3g}")
        y.float().square().sum().backward()
        assert torch.isfinite(x.grad).all() and torch.isfinite(layer.weight.grad).all()
    return said


@pytest.fixture(scope="module", params=[2, 3, 4])
def ipc_results(request):
    return run_ranks(request.param, body_ipc, launcher="torchrun", env=SHARED,
                     timeout=300).values()


def test_cuda_ipc_bitwise_in_every_situation(ipc_results):
    for out in ipc_results:
        assert out["failed"] == [], out
        assert out["checks"] > 500, out
    print(ipc_results[0]["reason"])


def body_expandable():
    import torch

    import fastpar
    from fastpar import comm
    from fastpar.comm.state import current

    topo = fastpar.init(timeout=120)
    n, rank = topo.world_size, topo.rank
    assert _ipc() is not None, "cuda_ipc fell back under expandable segments"
    comm.use_backend("cuda_ipc")
    for count in (64, 100_000, 1 << 20):
        ins = _inputs(n, count, torch.bfloat16, seed=count)
        x = ins[rank].to(topo.device)
        comm.all_reduce(x)
        assert _same(x, _reference(ins)), count
    # a symmetric tensor cannot be exported from an expandable segment: a plain tensor,
    # reduced through the staging buffer, still right
    x = comm.symmetric_empty(4096, dtype=torch.float32, device=topo.device)
    assert x.data_ptr() not in current().symmetric
    ins = _inputs(n, 4096, torch.float32, seed=1)
    x.copy_(ins[rank].to(topo.device))
    comm.all_reduce(x)
    assert _same(x, _reference(ins))
    fastpar.shutdown()
    return True


def test_cuda_ipc_under_expandable_segments():
    env = {**SHARED, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert run_ranks(2, body_expandable, launcher="torchrun", env=env,
                     timeout=180).values() == [True, True]


def body_skipped_call(timeout=8.0):
    import time

    import torch

    import fastpar
    from fastpar import comm

    topo = fastpar.init(timeout=timeout)
    rank = topo.rank
    comm.use_backend("cuda_ipc")
    x = torch.ones(4096, device=topo.device)
    comm.all_reduce(x)  # sets the communicator up; both ranks
    torch.cuda.synchronize()
    t0 = time.monotonic()
    if rank == 0:
        comm.all_reduce(x)  # global rank 1 is away for longer than the timeout
        torch.cuda.synchronize()  # returns: the kernel gives up after the timeout, no trap
    else:
        time.sleep(1.5 * timeout)
    waited = time.monotonic() - t0
    errors = []
    for _ in range(2):  # rank 1's next call finds rank 0 gone: it times out in turn
        try:
            comm.all_reduce(x)
            torch.cuda.synchronize()
        except RuntimeError as exc:
            errors.append(str(exc))
    try:
        fastpar.shutdown()
    except RuntimeError as exc:
        errors.append(f"shutdown: {exc}")
    y = torch.arange(10, device="cuda").sum().item()  # the CUDA context still works
    return {"errors": errors, "waited": waited, "cuda_ok": y == 45}


def test_a_skipped_call_times_out_naming_the_ranks():
    outs = run_ranks(2, body_skipped_call, launcher="torchrun", env=SHARED,
                     timeout=120).values()
    for rank, out in enumerate(outs):
        assert out["cuda_ok"], out
        assert out["errors"], out
        first = out["errors"][0]
        assert "timed out" in first and "global ranks [0, 1]" in first, first
        if rank == 0:
            assert "for global rank 1" in first, first
            assert out["waited"] < 30, out  # the job's 8 s, not the old 120 s trap


def body_nccl_mpi_one():
    """NCCL refuses two ranks on one GPU, so the real NCCL runs on a 1-rank communicator:
    every op, on torch's current stream, and inside a captured graph."""
    import torch
    from mpi4py import MPI

    from fastpar.comm.engines.nccl_mpi import NcclMpiCommunicator

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    comm = NcclMpiCommunicator(MPI.COMM_SELF, dev)
    x = torch.randn(1000, device=dev, dtype=torch.bfloat16)
    want = x.clone()
    comm.all_reduce(x, "sum")
    out = torch.empty_like(x)
    comm.all_gather(x, out)
    shard = torch.empty_like(x)
    comm.reduce_scatter(x, shard, "max")
    comm.broadcast(shard, 0)
    assert torch.equal(x, want) and torch.equal(out, want) and torch.equal(shard, want)
    static = torch.zeros(4096, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        comm.all_reduce(static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static.mul_(2)
        comm.all_reduce(static)
    for k in range(10):
        static.fill_(k)
        graph.replay()
        torch.cuda.synchronize()
        assert static.eq(2 * k).all(), k
    comm.close()
    return True


def test_nccl_mpi_one_process_and_graph_capture():
    pytest.importorskip("cupy", reason="nccl_mpi needs CuPy (fastpar[gpu])")
    # its own process: MPI_Init (mpi4py) stays out of the pytest process that launches the rest
    assert run_ranks(1, body_nccl_mpi_one, launcher="torchrun", timeout=120).values() == [True]
