"""``fastpar plan --calibrate``: this machine's speeds as a cluster file, in about a minute.

    cluster = calibrate(hosts=1, ranks_per_host=4)     # then cluster.save(path)
    mpirun -np 2 python -m fastpar.plan.calibrate OUT.json   # the link part alone

Measured: GEMM throughput at a sweep of shapes (squares and the tall-skinny shapes of layers:
many tokens, a few hundred to a thousand features), causal attention (SDPA, forward and
backward) at a few sequence lengths, a large copy (memory bandwidth), and the intra-host link:
all_reduce on the engine the policy picks, at sizes 4 KiB .. 16 MiB on the ranks per host (a
CPU: even past its cores, as the job runs; a GPU: at most its devices) launched with
``mpirun``, fitted to ``t = 2(n-1) alpha + 2(n-1)/n S / busbw`` by least squares of the
relative error. The inter-host link cannot be measured from one host: it comes from
``--inter-gbps`` / ``--inter-latency-us`` (or ``scripts/cluster.sh`` and bench/collectives.py).
A CPU's peak is its best measured GEMM rate (no data sheet); a GPU's the bf16 data sheet's. On
a CPU the rates are measured by this one process on all the host's cores, so the file says
``rates_per_core``: the rates are measured on one thread (on a loaded machine several threads
wait for each other) and each rank gets its share of the host's cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from fastpar.plan.cluster import Cluster, Link
from fastpar.plan.fitting import fit

GEMM_SHAPES_CPU = [(n, n, n) for n in (128, 256, 512, 1024)] + \
    [(m, n, k) for m in (512, 2048) for n in (256, 1024) for k in (256, 1024)]
GEMM_SHAPES_GPU = [(n, n, n) for n in (1024, 2048, 4096, 8192)] + \
    [(m, n, k) for m in (4096, 16384) for n in (1024, 4096, 16384) for k in (1024, 4096)]
ATTN_LENGTHS = (128, 512, 1024)
LINK_SIZES = [4096 * 4 ** i for i in range(7)]  # 4 KiB .. 16 MiB


def _timed(fn, device, reps: int, budget_s: float = 2.0) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (fewer if they exceed ``budget_s``)."""
    fn()
    times = []
    start = time.perf_counter()
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times)


def gemm_points(device, dtype, reps: int = 10, budget_s: float = 2.0) -> list[tuple]:
    shapes = GEMM_SHAPES_GPU if device.type == "cuda" else GEMM_SHAPES_CPU
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = _timed(lambda: a @ b, device, reps, budget_s)
        out.append((m, n, k, 2 * m * n * k / t))
    return out


def attention_points(device, dtype, head_dim: int = 64, heads: int = 8) -> list[tuple]:
    """Causal SDPA forward + backward: (tokens, head dim, FLOP/s) with the FLOPs the planner
    counts (2 T^2 hd per head forward, 2.5 x that backward)."""
    import torch.nn.functional as F

    from fastpar.plan.costs import ATTN_BACKWARD

    out = []
    for T in ATTN_LENGTHS:
        q, k, v = (torch.randn(1, heads, T, head_dim, device=device, dtype=dtype,
                               requires_grad=True) for _ in range(3))

        def step():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        t = _timed(step, device, 5)
        out.append((T, head_dim, heads * 2 * T * T * head_dim * (1 + ATTN_BACKWARD) / t))
    return out


def host_overheads(cfg, reps: int = 30, budget_s: float = 1.0) -> tuple[float, float, float]:
    """Host time beyond the math of ``cfg``'s layers, on this process: ``(per block, per
    embedding or head layer, per parameter tensor)``. The model's forward and backward at one
    row of 8 tokens (next to no math) with L and 2L blocks: the difference over L is a
    block's, the rest over 2 an end layer's; then clip + AdamW's step over its tensors."""
    import fastpar
    from fastpar import runtime

    own = not runtime.is_initialized()  # the layers need a job (one process here: tp 1)
    if own:
        fastpar.init()
    try:
        return _overheads(cfg, reps, budget_s)
    finally:
        if own:
            fastpar.shutdown()


def _overheads(cfg, reps: int, budget_s: float) -> tuple[float, float, float]:
    import dataclasses

    from fastpar.models import GPT, gpt_loss

    small = dataclasses.replace(cfg, seq_len=8, recompute="none", context_parallel=None,
                                sequence_parallel=False)
    cpu = torch.device("cpu")
    x = torch.randint(0, cfg.vocab_size, (1, 8))
    models = [GPT(dataclasses.replace(small, layers=n)) for n in (cfg.layers, 2 * cfg.layers)]
    rounds = [[], []]  # alternated, so a busy spell of the machine hits both; the fastest
    for _ in range(reps):  # of each: what the host work costs when it gets the core
        for j, model in enumerate(models):
            t0 = time.perf_counter()
            gpt_loss(model(x), x).backward()
            rounds[j].append(time.perf_counter() - t0)
    times = [min(r[1:]) for r in rounds]
    block = max(0.0, (times[1] - times[0]) / cfg.layers)
    end = max(0.0, times[0] - cfg.layers * block) / 2
    model = GPT(small)
    gpt_loss(model(x), x).backward()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-9)

    def update():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    update()
    best = min(_timed(update, cpu, 1) for _ in range(reps))
    return block, end, best / len(params)


def memory_bandwidth(device) -> float:
    n = (256 if device.type == "cuda" else 64) * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    t = _timed(lambda: dst.copy_(src), device, 10)
    return 2 * 4 * n / t


def measure_link(ranks: int, timeout: float = 180.0) -> Link | None:
    """The intra-host link, from an ``mpirun -np ranks`` of this module (None: no mpirun)."""
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep +
                          os.environ.get("PATH", ""))
    if mpirun is None or ranks < 2:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "link.json")
        env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
        subprocess.run([mpirun, "-np", str(ranks), sys.executable, "-m",
                        "fastpar.plan.calibrate", out], check=True, timeout=timeout, env=env,
                       stdout=subprocess.DEVNULL)
        with open(out) as f:
            d = json.load(f)
    alpha, busbw = fit(d["ranks"], [tuple(p) for p in d["points"]])
    return Link(alpha, busbw, d["engine"])


@contextlib.contextmanager
def _one_thread(yes: bool):
    """torch's intra-op threads at 1 inside (``yes``), put back after."""
    threads = torch.get_num_threads()
    if yes:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def calibrate(hosts: int = 1, ranks_per_host: int = 1, inter: Link | None = None,
              cfg=None, fit=None) -> Cluster:
    """This machine as a ``Cluster``. With ``cfg`` on a CPU: the model's host overheads, and
    with ``fit`` (``fastpar.training.fit.trainer_fit``, which trains: the front doors
    pass it, the trainer's own ``--layout auto`` does not) the trainer fit."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with _one_thread(device.type == "cpu"):  # one core's rates (Cluster.rates_per_core)
        gemm = gemm_points(device, dtype)
        attn = attention_points(device, dtype)
        membw = memory_bandwidth(device)
    if device.type == "cuda":
        from fastpar.plan.cluster import gpu_peak_flops

        name = torch.cuda.get_device_name(device)
        peak = gpu_peak_flops(name) or max(p[-1] for p in gemm)
        memory = torch.cuda.mem_get_info(device)[1]
    else:
        name = "cpu"
        peak = max(p[-1] for p in gemm)  # one core's
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks_per_host
    # a CPU: as many ranks as the job puts on a host (more than its cores: each collective
    # step then waits for peers the scheduler has taken off, which the job's steps pay too)
    n = max(2, ranks_per_host) if device.type == "cpu" else \
        min(ranks_per_host, torch.cuda.device_count())
    link = measure_link(n) or Link(2e-6, membw / 2, "memcpy estimate")
    host = {}
    if device.type == "cpu":
        block, end, tensor = host_overheads(cfg) if cfg is not None else (0.0, 0.0, 0.0)
        host = {"overhead_block_s": block, "overhead_end_s": end, "overhead_tensor_s": tensor,
                "cpus_per_host": len(os.sched_getaffinity(0))}
        if cfg is not None and fit is not None:
            with _one_thread(True):  # one rank's thread, as the rates
                host["trainer_fit"] = fit(cfg, membw, tensor)
    return Cluster(name=f"calibrated {name}", device=device.type, hosts=hosts,
                   ranks_per_host=ranks_per_host, peak_flops=peak, memory_bytes=memory,
                   membw_Bps=membw, intra=link, inter=inter, gemm_efficiency=0.7,
                   gemm_points=tuple(gemm), attention_points=tuple(attn),
                   rates_per_core=device.type == "cpu", **host)


def link_points(topo, comm, sizes=LINK_SIZES, reps: int = 20,
                budget_s: float = 1.0) -> tuple[list, str]:
    """Every rank (collective over the world): all_reduce at ``sizes`` on the policy's
    engine; ``([(bytes, the slowest rank's median seconds)], engine)``."""
    points, engine = [], ""
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, device=topo.device)
        engine = comm.engine_for("all_reduce", t)[0]
        s = torch.tensor([_timed(lambda: comm.all_reduce(t), topo.device, reps,
                                 budget_s=budget_s)], dtype=torch.float64)
        comm.all_reduce(s, op="max")
        points.append((nbytes, s.item()))
    return points, engine


def _link_worker(out: str) -> None:
    """Each rank: ``link_points``; rank 0 writes them."""
    import fastpar
    from fastpar import comm

    topo = fastpar.init()
    result = {"ranks": topo.world_size}
    result["points"], result["engine"] = link_points(topo, comm)
    if topo.rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    fastpar.shutdown()


if __name__ == "__main__":
    _link_worker(sys.argv[1])
