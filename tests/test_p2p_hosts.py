"""Pipeline P2P across hosts: the engine per neighbour (fastpar/comm/transport/routes.py).

``FASTPAR_HOST_ID`` makes the ranks of this machine two hosts (a, a, b, b), so a pp 4 ring has
one neighbour on its host (shm rings) and one on the other (torch / gloo) at every rank:
- the choice as a table (pure), the forced engines and the error of a forced shm across hosts;
- on 4 ranks: what each rank's Channels reports, messages both ways on both engines (small,
  large, changing shapes), abort messages on both, a forced shm refused on every rank naming the
  ranks and hosts, then 1F1B, interleaved and ZB pipelines against the serial model;
- a stage that stops answering: both its neighbours (one per engine) time out naming it.
The main job at pp 4 on real hosts: tests/test_cluster_jobs.py.
"""

import os
import re

import pytest
import torch

from tests.multirank import run_ranks
from tests.test_pipeline import run_case

HOSTS = ["a", "a", "b", "b"]


def _rank() -> int:
    return int(os.environ.get("PMI_RANK") or os.environ.get("RANK") or 0)


@pytest.mark.quick
def test_routes_per_neighbour():
    from fastpar.comm.transport.routes import choose_routes

    cpu, ring, aabb = torch.device("cpu"), [0, 1, 2, 3], ("a", "a", "b", "b")

    def routes(rank, *args, ranks=ring, groups=(ring,), hosts=aabb, device=cpu, **kw):
        r = choose_routes(*args, ranks, rank, [list(g) for g in groups], hosts, device, **kw)
        return r.by_peer, r.name, r.reason, r.torch, r.shm

    assert routes(0, "auto") == ({1: "shm", 3: "torch"}, "shm+torch",
                                 "shm with rank 1 (this host), torch with rank 3 (host b)",
                                 True, True)
    assert routes(2, "auto")[:3] == ({1: "torch", 3: "shm"}, "shm+torch",
                                     "shm with rank 3 (this host), torch with rank 1 (host a)")
    # pp 2 x dp 2 placed by host: each pp group on one host, nothing crosses, no clones
    assert routes(0, "auto", ranks=[0, 1], groups=([0, 1], [2, 3])) == (
        {1: "shm"}, "shm", "every stage of the group is on this host, tensors on the CPU",
        False, True)
    # tp 2 x pp 2: each pp group spans the hosts; the world makes clones, no group sets up rings
    assert routes(0, "auto", ranks=[0, 2], groups=([0, 2], [1, 3])) == (
        {2: "torch"}, "torch", "torch with rank 2 (host b)", True, False)
    # one group on one host, the other across: the world makes the clones all the same
    assert routes(0, "auto", ranks=[0, 1], groups=([0, 1], [2, 3]),
                  hosts=("a", "a", "b", "c"))[3:] == (True, True)
    assert routes(1, "auto", ranks=list(range(6)), groups=(range(6),), hosts="aaabbb")[:3] == (
        {0: "shm", 2: "shm"}, "shm", "shm with rank 0 (this host) and rank 2 (this host)")
    # one engine for every neighbour: asked, forced, or the only one that can
    assert routes(0, "torch")[:3] == ({1: "torch", 3: "torch"}, "torch", "forced")
    assert routes(0, "auto", forced="gloo", forced_by="FASTPAR_COMM_BACKEND")[1:3] == (
        "torch", "forced by FASTPAR_COMM_BACKEND=gloo")
    assert routes(0, "auto", device=torch.device("cuda"))[1:3] == ("torch", "tensors on cuda")
    assert routes(0, "auto", hosts=())[1:3] == ("torch", "the ranks' hosts are unknown")
    assert routes(0, "shm", ranks=[0, 1], groups=([0, 1], [2, 3]))[:2] == ({1: "shm"}, "shm")
    assert routes(0, "auto", ranks=[0], groups=([0], [1], [2], [3]))[1] == "local"
    # a forced shm across hosts: every rank refuses, naming its own pair where it has one
    for rank, pair in ((0, "rank 0 (host a) and rank 3 (host b)"),
                       (1, "rank 1 (host a) and rank 2 (host b)")):
        want = ("(forced by comm.use_backend('shm')) carries messages within a host only, but "
                f"neighbouring stages {pair}")
        with pytest.raises(ValueError, match=re.escape(want)):
            routes(rank, "auto", forced="shm", forced_by="comm.use_backend")
    with pytest.raises(ValueError, match=r"stages rank 0 \(host a\) and rank 2 \(host b\)"):
        routes(0, "shm", ranks=[0, 2], groups=([0, 2], [1, 3]))
    # this rank's group is on one host, another group is not: every rank refuses alike
    with pytest.raises(ValueError, match=r"stages rank 2 \(host b\) and rank 3 \(host c\)"):
        routes(0, "shm", ranks=[0, 1], groups=([0, 1], [2, 3]), hosts=("a", "a", "b", "c"))


def body_two_hosts(seed):
    import fastpar
    from fastpar import comm
    from fastpar.pipeline import channels as p2p

    os.environ["FASTPAR_HOST_ID"] = HOSTS[_rank()]
    topo = fastpar.init(pp=4, timeout=30)
    out, rank = {}, topo.rank
    ch = p2p.Channels(topo.pp_group, all_groups=topo.grid.groups("pp"))
    prev, nxt = ch.prev, ch.next  # the ring wraps around
    out["channels"] = [ch.engine_name, ch.reason, {str(k): v for k, v in ch.routes.by_peer.items()}]
    # messages both ways on both engines: small, large (single copy / streamed), new shapes
    for step, n in enumerate((3, 1 << 18, 5)):
        x = torch.arange(n, dtype=torch.float32) + 1000 * rank
        g = (x * -1).to(torch.float64)
        hs = [ch.send_forward((x, x[:2].int()), mb=step, stage=nxt),
              ch.send_backward(g, mb=step, stage=rank)]
        got_x, got_i = ch.recv_forward(mb=step, stage=rank)
        got_g = ch.recv_backward(mb=step, stage=nxt)
        assert torch.equal(got_x, torch.arange(n, dtype=torch.float32) + 1000 * prev), step
        assert got_i.dtype == torch.int32 and got_i.tolist() == got_x[:2].int().tolist()
        assert torch.equal(got_g, -(torch.arange(n, dtype=torch.float64) + 1000 * nxt)), step
        for h in hs:
            h.wait()
        ch.finish_step()
    # a failing rank tells both neighbours at once: rank 1's neighbours are one per engine
    if rank == 1:
        ch.abandon(RuntimeError("boom"))
    elif rank in (0, 2):
        try:
            (ch.recv_backward if rank == 0 else ch.recv_forward)(mb=0, stage=1)
        except p2p.P2PError as exc:
            out["abort"] = str(exc)
    ch.close()
    # a forced shm across hosts: refused on every rank, naming the ranks and their hosts
    for how in ("engine", "forced"):
        previous = comm.use_backend("shm") if how == "forced" else None
        try:
            p2p.Channels(topo.pp_group, all_groups=topo.grid.groups("pp"),
                         engine="shm" if how == "engine" else "auto")
        except ValueError as exc:
            out[f"shm_{how}"] = str(exc)
        if how == "forced":
            comm.use_backend(previous)
    worst = 0.0
    for i, (schedule, m, v) in enumerate((("1f1b", 4, 1), ("interleaved", 4, 2), ("zb", 5, 1))):
        w, pipe = run_case(topo, seed + i, schedule=schedule, m=m, v=v, check_forward=True)
        assert pipe.channels.engine_name == "shm+torch", pipe.channels.engine_name
        pipe.close()
        worst = max(worst, w)
    out["worst"] = worst
    return out


@pytest.mark.quick
def test_pp4_on_two_hosts_shm_within_torch_across():
    values = run_ranks(4, body_two_hosts, seed=5, timeout=240).values()
    for rank, v in enumerate(values):
        same, other = rank ^ 1, (rank + (1 if rank % 2 else -1)) % 4
        host = "b" if HOSTS[rank] == "a" else "a"
        assert v["channels"] == [
            "shm+torch", f"shm with rank {same} (this host), torch with rank {other} (host {host})",
            {str(same): "shm", str(other): "torch"}], v["channels"]
        for how in ("engine", "forced"):
            assert "carries messages within a host only" in v[f"shm_{how}"], v
            # a rank names its own pair across hosts: rank 0 with 3, rank 1 with 2, ...
            a, b = sorted((rank, other))
            assert (f"rank {a} (host {HOSTS[a]}) and rank {b} (host {HOSTS[b]})"
                    in v[f"shm_{how}"]), v
        assert "forced by comm.use_backend('shm')" in v["shm_forced"], v
    for rank in (0, 2):  # over shm (rank 0) and over gloo (rank 2)
        assert "from rank 1, which gave up instead: rank 1: RuntimeError: boom" in \
            values[rank]["abort"], values[rank]
    print("pp 4 on hosts a a b b: worst error / bound", max(v["worst"] for v in values))


def body_stall():
    """Stage 1 stops answering: stage 0 (its shm neighbour) waits for a gradient, stage 2 (its
    torch neighbour) for an activation; both time out naming rank 1."""
    import time

    from torch import nn

    import fastpar
    from fastpar.pipeline.channels import P2PTimeout
    from fastpar.pipeline import Pipeline
    from tests.test_pipeline import IN, OUT, _mse

    os.environ["FASTPAR_HOST_ID"] = HOSTS[_rank()]
    # MPI_Init first, without fastpar's watchdog: under load the ranks finish importing torch
    # seconds apart, and the 1.5 s meant for the stalled stage would also bound MPI_Init.
    from mpi4py import MPI  # noqa: F401
    fastpar.init(pp=4, timeout=1.5)

    class Stall(nn.Module):
        def forward(self, x):
            time.sleep(3)
            return x

    layers = [lambda: nn.Linear(IN, OUT), Stall, lambda: nn.Identity(), lambda: nn.Identity()]
    pipe = Pipeline(layers, loss_fn=_mse, microbatches=2, schedule="gpipe")
    try:
        pipe.step(torch.randn(4, IN), torch.randn(4, OUT))
    except P2PTimeout as exc:
        return {"engine": pipe.channels.engine_name, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - stage 1 and 3, once the others have left
        return {"engine": pipe.channels.engine_name, "other": f"{type(exc).__name__}: {exc}"}
    return {"engine": pipe.channels.engine_name}


def test_stalled_stage_times_out_on_both_engines():
    # gloo's timed-out receive stays posted: that job ends with the test (a launch of its own)
    values = run_ranks(4, body_stall, own_job=True, timeout=120).values()
    assert {v["engine"] for v in values} == {"shm+torch"}, values
    for rank, what in ((0, "gradient"), (2, "activation")):
        err = values[rank].get("error")
        assert err is not None, (rank, values[rank])
        assert "peer rank 1" in err and f"waited 1.5 s for the header of the {what}" in err, err
