"""Hierarchical collectives on one machine: ``FASTPAR_HOST_ID`` makes ranks of this host
behave as ranks of several (each rank's identity set before ``fastpar.init``), so the policy and
the hierarchical engine run here; the cluster tests (test_cluster.py) run them across real
namespaces.

Every result is compared with a float64 reference built from every rank's input, within a bound
derived from the dtype: a sum of n terms taken in any order, in two levels (within a host, then
across), each partial sum rounded once, is off by at most ``n * eps * sum(|x_r|)`` per element.
"""

import os
import zlib

import pytest

from tests.multirank import run_ranks

DTYPES = ["float32", "float64", "bfloat16", "float16"]
SIZES = [1, 5, 4099, (1 << 18) + 3]  # 1 and 5: padding to the host's ranks; the last > 64 KiB


def _rank() -> int:
    return int(os.environ.get("PMI_RANK") or os.environ.get("RANK") or 0)


def _input(rank, n, dtype, salt):
    import torch

    g = torch.Generator().manual_seed(zlib.crc32(f"{rank}/{n}/{salt}".encode()))
    return torch.randn(n, generator=g, dtype=torch.float64).to(getattr(torch, dtype))


def _close(what, got, parts):
    """``got`` against the float64 sum of ``parts`` (every rank's input) within the bound of
    the module docstring."""
    import torch

    stack = torch.stack([p.double() for p in parts])
    want = stack.sum(0)
    eps = torch.finfo(got.dtype).eps
    bound = len(parts) * eps * stack.abs().sum(0)
    err = (got.double() - want).abs()
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert bool((err <= bound).all()), f"{what}: error {err.max():.3g} above its bound"


def body_hier(hosts, tp=1, forced=None, expect=None, dtypes=DTYPES, sizes=SIZES):
    """Set this rank's host identity (``hosts``: every rank's; None: leave the real ones), then every op x dtype x size on the world (and the dp
    group); ``expect``: {op: engine the policy must pick for 1 MiB of float32 on the world}.
    Returns a digest per result (for equality across ranks) and the engines chosen."""
    import hashlib

    import torch

    import fastpar
    from fastpar import comm
    from fastpar.comm import routing

    if hosts is not None:  # else: real hosts (the cluster tests)
        os.environ["FASTPAR_HOST_ID"] = hosts[_rank()]
    topo = fastpar.init(tp=tp, timeout=120)
    n, rank = topo.world_size, topo.rank
    assert topo.hosts == tuple(hosts) if hosts is not None else len(set(topo.hosts)) > 1, \
        topo.hosts
    big = torch.empty(1 << 18)
    chosen = {op: routing.choose(op, big, None)[2] for op in ("all_reduce", "all_gather",
                                                              "reduce_scatter", "broadcast")}
    for op, engine in (expect or {}).items():
        assert chosen[op].engine == engine, (op, chosen[op])
    comm.use_backend(forced)
    digests = {}
    for dtype in dtypes:
        for size in sizes:
            key = f"{dtype}/{size}"
            inputs = [_input(r, size, dtype, "x") for r in range(n)]
            for op in ("sum", "max"):
                x = inputs[rank].clone()
                comm.all_reduce(x, op=op)
                if op == "max":  # exact in any order
                    assert torch.equal(x, torch.stack(inputs).amax(0)), f"all_reduce max {key}"
                else:
                    _close(f"all_reduce {op} {key}", x, inputs)
                digests[f"ar-{op}/{key}"] = hashlib.sha1(x.view(torch.uint8).numpy()).hexdigest()
            out = comm.all_gather(inputs[rank].reshape(size, 1), dim=1)
            assert torch.equal(out, torch.stack(inputs, 1)), f"all_gather dim 1 {key}"
            into = torch.empty(n * size, dtype=inputs[0].dtype)
            into[rank * size:(rank + 1) * size] = inputs[rank]
            comm.all_gather(into[rank * size:(rank + 1) * size], out=into)
            assert torch.equal(into, torch.cat(inputs)), f"all_gather out= {key}"
            blocks = [_input(r, size * n, dtype, "rs") for r in range(n)]
            shard = comm.reduce_scatter(blocks[rank])
            _close(f"reduce_scatter {key}", shard, [b.chunk(n)[rank] for b in blocks])
    # From 4 MiB the cross-host stage runs on torch's engine, pipelined in parts
    size = (1 << 20) + 5
    inputs = [_input(r, size, "float32", "big") for r in range(n)]
    x = inputs[rank].clone()
    comm.all_reduce(x)
    _close("all_reduce 4 MiB + 20 B", x, inputs)
    digests["ar-big"] = hashlib.sha1(x.view(torch.uint8).numpy()).hexdigest()
    if topo.dp_group is not None and topo.dp_size > 1:  # a group of the grid, not the world
        x = torch.full((1 << 17,), float(rank))
        comm.all_reduce(x, group=topo.dp_group)
        assert torch.equal(x, torch.full_like(x, float(sum(topo.ranks("dp")))))
    if forced in (None, "hier") and tp == 1:
        digests.update(quantized_cases(topo))
    comm.use_backend(None)
    return {"digests": digests, "engines": {k: (c.engine, c.reason) for k, c in chosen.items()},
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def quantized_cases(topo):
    """quant="int8" on the hierarchical engine: full precision within a host, int8 across
    (``HierCommunicator.quantized_*``). Bounds: each host's sum s_h (its ranks' inputs,
    summed in the dtype's precision within the host) crosses quantized, so the error is
    ``sum_h b(s_h)`` plus the float32 sum and, for all_reduce, b of the summed chunk, plus
    the host sums' and the output's rounding (test_quantized's terms). Error feedback: after
    three all_reduces, what arrived plus what is carried is the exact sum."""
    import hashlib

    import torch

    from fastpar import comm
    from fastpar.comm import quant
    from tests.test_quantized import U, piecewise_bound, ratio, reduce_bound

    n, rank = topo.world_size, topo.rank
    hosts = sorted(set(topo.hosts))
    members = [[r for r in range(n) if topo.hosts[r] == h] for h in hosts]
    spec = comm.Quant("int8", block=64)
    out = {}
    def crossing(parts, all_reduce=False):
        """What crosses quantized: each host's sum (hierarchical), or each rank's part (a size
        the policy sends to a flat engine); the rounding before it; and the lengths of the
        pieces quantized on their own (an all_reduce's chunks: of its host piece, hier)."""
        engine = comm.engine_for("all_gather", parts[0].reshape(-1).view(torch.uint8))[0]
        size = parts[0].numel()

        def cut(total, k):
            step = -(-total // k)
            return [min(step, total - a) for a in range(0, total, step)]
        if engine != "hier":
            return parts, 0, cut(size, n) if all_reduce else None
        dt = parts[0].dtype
        rounding = 2 * (U if dt == torch.float32 else 2.0**-8) * sum(p.double().abs()
                                                                       for p in parts)
        local = len(members[0])
        pieces = [c for p in cut(size, local) for c in cut(-(-size // local), len(members))]
        pieces = [c for c in pieces if c > 0]
        while sum(pieces) > size:  # the last host piece is shorter: trim its chunks
            pieces[-1] -= min(pieces[-1], sum(pieces) - size)
            pieces = [c for c in pieces if c > 0]
        return [sum(parts[r].double() for r in m).to(dt) for m in members], rounding, \
            pieces if all_reduce else None

    for dtype in ("float32", "bfloat16"):
        ud = U if dtype == "float32" else 2.0**-8
        for size in (33, 4099):
            xs = [_input(r, size, dtype, "q") for r in range(n)]
            want = sum(x.double() for x in xs)
            sums, intra, pieces = crossing(xs, all_reduce=True)
            t = xs[rank].clone()
            comm.all_reduce(t, quant=spec)
            b1 = reduce_bound(sums, 64, pieces) + intra
            b = b1 + piecewise_bound(want.abs() + b1, 64, pieces)
            assert ratio(t, want, b * (1 + ud) + ud * want.abs()) <= 1, (dtype, size)
            out[f"q-ar/{dtype}/{size}"] = hashlib.sha1(t.double().numpy().tobytes()).hexdigest()
            got = comm.all_gather(xs[rank], quant=spec)
            cat = torch.cat([x.double() for x in xs])
            b = torch.cat([quant.bound(x, 64) for x in xs])
            assert ratio(got, cat, b * (1 + ud) + ud * cat.abs()) <= 1, (dtype, size)
            out[f"q-ag/{dtype}/{size}"] = hashlib.sha1(got.double().numpy().tobytes()).hexdigest()
            big = [_input(r, n * size, dtype, "qrs") for r in range(n)]
            got = comm.reduce_scatter(big[rank], quant=spec)
            chunk = slice(rank * size, (rank + 1) * size)
            want = sum(x.double() for x in big)[chunk]
            sums, intra, _ = crossing([x[chunk] for x in big])
            b = reduce_bound(sums, 64) + intra
            assert ratio(got, want, b * (1 + ud) + ud * want.abs()) <= 1, (dtype, size)
    residual = torch.zeros(4099)
    total_in = torch.zeros(4099, dtype=torch.float64)
    total_out = torch.zeros(4099, dtype=torch.float64)
    for call in range(3):
        x = _input(10 * rank + call, 4099, "float32", "qfb")
        total_in += x.double()
        t = x.clone()
        comm.all_reduce(t, quant=spec, residual=residual)
        total_out += t.double()
    left = comm.all_reduce(residual.clone()).double()
    everyone = comm.all_reduce(total_in.float()).double()
    assert (total_out + left - everyone).abs().max() <= 64 * U * everyone.abs().max()
    # bfloat16 with error feedback: the residual joins the input in float32 and what bfloat16
    # cannot hold of that sum stays carried; on hier that is all a rank's residual holds
    # outside the piece it sends across (its cross-stage rounding is added there)
    xb = _input(rank, 4099, "bfloat16", "qbf")
    res = _input(rank + 50, 4099, "float32", "qbfres") * 1e-3
    s = xb.float() + res
    lost = s - s.bfloat16().float()
    t = xb.clone()
    comm.all_reduce(t, quant=spec, residual=res)
    if comm.engine_for("all_gather", xb.view(torch.uint8))[0] == "hier":
        local = len(members[0])
        i = next(m.index(rank) for m in members if rank in m)
        per = -(-4099 // local)
        outside = torch.ones(4099, dtype=torch.bool)
        outside[i * per:(i + 1) * per] = False
        assert torch.equal(res[outside], lost[outside]) and lost.abs().max() > 0
    # an inf at step 0 (rank 0) does not poison the carried error: later steps are finite
    res, res_rs = torch.zeros(4099), torch.zeros(n * 4099)
    for step in range(3):
        x = _input(rank, 4099, "float32", f"qinf{step}")
        big = _input(rank, n * 4099, "float32", f"qinfrs{step}")
        if step == 0 and rank == 0:
            x[100] = big[100] = float("inf")
        comm.all_reduce(x, quant=spec, residual=res)
        got = comm.reduce_scatter(big, quant=spec, residual=res_rs)
        if step > 0:
            assert x.isfinite().all() and got.isfinite().all(), step
        assert res.isfinite().all() and res_rs.isfinite().all(), step
    return out


def _same_everywhere(launch):
    values = launch.values()
    for key in values[0]["digests"]:
        assert len({v["digests"][key] for v in values}) == 1, key
    return values[0]["engines"]


HIER = {"all_reduce": "hier", "all_gather": "hier", "reduce_scatter": "hier"}


def test_hierarchical_forced_at_every_size():
    """Ranks by host (the reordering path), MPI across; ``hier`` forced, so the small sizes
    (padding, fewer elements than ranks) go through it too."""
    engines = _same_everywhere(run_ranks(4, body_hier, hosts=["a", "a", "b", "b"],
                                         forced="hier", expect=HIER, timeout=300))
    assert engines["all_reduce"][1] == "2 hosts x 2 ranks: shm within each host, mpi across"
    assert engines["broadcast"][0] == "mpi", engines


def body_layouts(cases):
    """``body_hier(**case)`` for each case in turn (one launch, one job per case)."""
    import fastpar

    out = []
    for case in cases:
        out.append(body_hier(**case))
        fastpar.shutdown()
    return out


def test_gloo_across_round_robin_and_out_of_rank_order():
    """torchrun (gloo across): ranks round robin over the hosts (blocks already in [i][h]
    order), every dtype; then hosts a, b, b, a, whose cross group of local index 1 holds ranks
    3 (a) and 2 (b), which a group orders 2, 3, against the order of the hosts."""
    launch = run_ranks(4, body_layouts, launcher="torchrun", timeout=300, cases=[
        {"hosts": ["a", "b", "a", "b"], "expect": HIER, "sizes": [1, 5, 4099, 65539]},
        {"hosts": ["a", "b", "b", "a"], "forced": "hier", "expect": HIER,
         "dtypes": ["float32", "bfloat16"], "sizes": [8, 4099]}])
    for case in range(2):
        values = [v[case] for v in launch.values()]
        for key in values[0]["digests"]:
            assert len({v["digests"][key] for v in values}) == 1, (case, key)
    engines = launch.values()[0][0]["engines"]
    assert engines["all_reduce"][1] == "2 hosts x 2 ranks: shm within each host, gloo across"
    assert engines["broadcast"][0] == "gloo", engines


def test_mpi_across_hosts_out_of_rank_order():
    """Hosts a, b, b, a with MPI across (its sub-communicator takes the same sorted order)."""
    _same_everywhere(run_ranks(4, body_hier, hosts=["a", "b", "b", "a"], forced="hier",
                               expect=HIER, dtypes=["float32", "bfloat16"], sizes=[8, 4099],
                               timeout=300))


@pytest.mark.parametrize("hosts,why", [
    (["a", "a", "a", "b"], "its hosts hold 3 + 1 of its ranks (uneven)"),
    (["a", "b", "c", "d"], "one of its ranks per host: nothing to share within a host"),
])
def test_flat_where_hierarchical_cannot_serve(hosts, why):
    engines = _same_everywhere(run_ranks(4, body_hier, hosts=hosts, dtypes=["float32"],
                                         sizes=[5, 4099], timeout=300))
    assert engines["all_reduce"] == ["mpi", f"spans hosts, not hier: {why}"], engines


@pytest.mark.quick
def test_one_host_and_tp_inside_hosts():
    """1 x 4 stays on shm; tp 2 inside each of 2 hosts: the dp groups ({0, 2}, {1, 3}) span
    hosts with one rank on each (flat)."""
    engines = _same_everywhere(run_ranks(4, body_hier, hosts=["a"] * 4, dtypes=["float32"],
                                         sizes=[5], expect={"all_reduce": "shm"}, timeout=300))
    assert engines["all_reduce"] == ["shm", "CPU tensors on one host"]
    run_ranks(4, body_hier, hosts=["a", "a", "b", "b"], tp=2, expect=HIER, dtypes=["float32"],
              sizes=[5], timeout=300)


@pytest.mark.quick
def test_buffers_passed_to_mpi_stay_releasable():
    """MPI gets numpy views made from the tensor's address: ``tensor.numpy()`` would mark the
    storage not resizable for good, and ZeRO-3 releases its gather buffers by resizing them
    (it crashed under MPI, across hosts, at the end of the first step)."""
    import torch

    from fastpar.comm.views import numpy_view

    t = torch.arange(6, dtype=torch.float32)
    view = numpy_view(t)
    view[2] = 7.0
    assert t[2].item() == 7.0 and view.shape == (6,)
    t.untyped_storage().resize_(0)  # raises if the view had pinned it
    assert numpy_view(torch.empty(0, dtype=torch.uint8)).shape == (0,)

