"""Pipeline against the serial model: loss, every parameter gradient, the state after an optimizer
step and inference, for every schedule, pp 2 and 4, microbatches {1, pp-1, pp, 2pp+1}, virtual
stages 1 and 2; tp 2 x pp 2 with TP layers inside the stages (scatter-gather on and off); pp 2 on
4 ranks (each dp replica with its own data); tuple outputs, tensors without grad, factories,
uneven layer counts, an explicit balance, both P2P engines; and the failures: a shape mismatch,
a peer that stops answering, a killed rank (no shm segment left behind).

Every result is compared with a float64 run of the same serial model with the rounding bound of
``fastpar.testing`` (the serial float32 error times a small factor), so the checks hold on any
CPU. One launch per layout runs every case.
"""

import copy

import uuid

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multirank import run_ranks

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
IN, H, OUT = 6, 8, 5


class Block(nn.Module):
    """Linear + LayerNorm + tanh: parameters in two modules, so the split backward (zb) has
    two weight-gradient graphs per block."""

    def __init__(self, width):
        super().__init__()
        self.fc, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

    def forward(self, x):
        return torch.tanh(self.norm(self.fc(x)))


class TupleBlock(nn.Module):
    """Takes and returns ``(hidden, mask)``: the mask is a float tensor without grad that every
    stage passes on (a tuple output; a tensor without grad crossing stages)."""

    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, xm):
        x, mask = xm if isinstance(xm, tuple) else (xm, None)
        if mask is None:
            mask = (x[..., :1] > 0).float()  # made on stage 0 from the data, no grad
        return torch.tanh(self.fc(x)) * (0.5 + mask), mask


class Head(nn.Module):
    def __init__(self, width, out):
        super().__init__()
        self.fc = nn.Linear(width, out)

    def forward(self, xm):
        return self.fc(xm[0] if isinstance(xm, tuple) else xm)


def factories(n_blocks, *, kind="block"):
    """Zero-argument factories: input projection, ``n_blocks`` blocks, a head."""
    block = Block if kind == "block" else TupleBlock
    return ([lambda: nn.Linear(IN, H)] + [lambda: block(H) for _ in range(n_blocks)]
            + [lambda: Head(H, OUT)])


def _mse(out, target):
    return F.mse_loss(out, target)


class Case:
    """One pipeline against the serial model on this rank's data."""

    def __init__(self, topo, seed, name):
        self.topo, self.name = topo, name
        # same draws within a pp group, different on each dp replica (and tp group)
        self.gen = torch.Generator().manual_seed(seed + 7919 * topo.dp_rank)
        self.worst = 0.0

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen)

    def close(self, what, got, ref, serial, **kw):
        from fastpar.testing import assert_close

        got = got.detach().cpu() if got is not None else None  # a GPU run compares on the CPU
        self.worst = max(self.worst, assert_close(f"{self.name}: {what}", got, ref, serial, **kw))


def run_case(topo, seed, *, schedule, m, v, n_blocks=None, kind="block", balance=None,
             modules=False, layers=None, serial_layers=None, batch_per_mb=2,
             check_forward=False, input_grad=False, **pipe_kwargs):
    """Build serial, float64 and pipelined models from one seed, run one training step and an
    SGD update, and compare loss, every local gradient, the full state dict, and (optionally)
    inference. Returns (worst error / bound, pipeline)."""
    import fastpar
    from fastpar.pipeline import Pipeline

    pp = topo.pp_size
    n_blocks = n_blocks if n_blocks is not None else max(pp * v - 2, 1) + 1
    name = f"{schedule} pp={pp} m={m} v={v} {kind}"
    case = Case(topo, seed, name)
    make = layers if layers is not None else factories(n_blocks, kind=kind)
    torch.manual_seed(seed)
    serial = nn.Sequential(*(serial_layers() if serial_layers else [f() for f in make]))
    ref = copy.deepcopy(serial).double()
    given = [f() for f in make] if modules else make
    pipe = Pipeline(given, loss_fn=_mse, schedule=schedule, microbatches=m, virtual_stages=v,
                    balance=balance, **pipe_kwargs)
    fastpar.load_full_state_dict(pipe, serial.state_dict())

    batch = m * batch_per_mb
    x, y = case.randn(batch, IN), case.randn(batch, OUT)
    xs, x64 = x.clone().requires_grad_(input_grad), x.double().requires_grad_(input_grad)
    xp = (x * 1.0).requires_grad_() if input_grad else x
    loss = pipe.step(xp * 1.0 if input_grad else x, y)  # a non-leaf: its grad flows on to xp
    serial_loss = _mse(serial(xs), y)
    serial_loss.backward()
    ref_loss = _mse(ref(x64), y.double())
    ref_loss.backward()
    case.close("loss", torch.tensor(loss), ref_loss.detach(), serial_loss.detach())
    if input_grad and topo.pp_rank == 0:
        case.close("input grad", xp.grad, x64.grad, xs.grad, scale=1.0)

    ser_params, ref_params = dict(serial.named_parameters()), dict(ref.named_parameters())
    from fastpar.state_dict import sharded_keys

    seen = 0
    for chunk in pipe.chunks:
        sharded = sharded_keys(chunk)  # TP layers' shards: compared whole (gathered)
        for key, p in chunk.named_parameters():
            grad = sharded[key][0].gather_full(sharded[key][1], p.grad) if key in sharded \
                else p.grad
            case.close(f"grad {key}", grad, ref_params[key].grad, ser_params[key].grad,
                       scale=1.0)
            seen += 1
    assert seen > 0, f"{name}: no parameters on pipeline rank {topo.pp_rank}"

    for model in (serial, ref):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    torch.optim.SGD(pipe.parameters(), lr=0.5).step()
    full = fastpar.full_state_dict(pipe)
    assert list(full) == list(serial.state_dict()), (name, list(full))
    ref_sd, ser_sd = ref.state_dict(), serial.state_dict()
    for key, value in full.items():
        case.close(f"after SGD {key}", value, ref_sd[key], ser_sd[key], scale=1.0)

    if check_forward:
        with torch.no_grad():
            got = pipe(x)
            case.close("forward", got, ref(x.double()), serial(x))
    return case.worst, pipe


def _config_error(schedule, pp, m, v):
    """The ValueError a configuration must raise, or None if it must run."""
    if schedule == "interleaved" and v < 2:
        return "virtual_stages"
    if schedule == "interleaved" and m % pp:
        return f"microbatches={m}"
    if schedule in ("1f1b", "zb") and v > 1:
        return "interleaved"
    return None


def body_schedules(pp, seed):
    """Every schedule x microbatches {1, pp-1, pp, 2pp+1} x virtual stages {1, 2}."""
    import fastpar
    from fastpar.pipeline import Pipeline

    topo = fastpar.init(pp=pp, timeout=60)
    worst, ran, refused = 0.0, [], []
    for schedule in SCHEDULES:
        for m in sorted({1, max(pp - 1, 1), pp, 2 * pp + 1}):
            for v in (1, 2):
                err = _config_error(schedule, pp, m, v)
                if err:
                    with pytest.raises(ValueError, match=err):
                        Pipeline(factories(pp * v), loss_fn=_mse, schedule=schedule,
                                 microbatches=m, virtual_stages=v)
                    refused.append((schedule, m, v))
                    continue
                w, pipe = run_case(topo, seed + len(ran), schedule=schedule, m=m, v=v,
                                   check_forward=m == pp)
                pipe.close()
                worst = max(worst, w)
                ran.append((schedule, m, v))
    engine = pipe.channels.engine_name
    fastpar.shutdown()
    return {"ran": ran, "refused": refused, "worst": worst, "engine": engine}


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_every_schedule_equals_serial(pp):
    launch = run_ranks(pp, body_schedules, pp=pp, seed=11 * pp, timeout=300)
    values = launch.values()
    ran = [tuple(r) for r in values[0]["ran"]]
    refused = [tuple(r) for r in values[0]["refused"]]
    assert {s for s, _, _ in ran} == set(SCHEDULES)
    assert ("interleaved", pp, 2) in ran and ("zb", 2 * pp + 1, 1) in ran
    assert ("1f1b", pp, 2) in refused and ("interleaved", 1, 1) in refused
    if pp > 1:
        assert ("interleaved", 1, 2) in refused
    want = "shm" if pp > 1 else "local"  # CPU stages on one host: the shm rings
    assert all(v["engine"] == want for v in values), values
    print(f"pp={pp}: {len(ran)} configurations, worst error / bound "
          f"{max(v['worst'] for v in values):.3f}")


def body_variants(seed):
    """pp 2 on 2 ranks: tuple outputs with a no-grad tensor, modules instead of factories,
    uneven layer counts, an explicit balance, the torch engine, and the error paths."""
    import time

    import fastpar
    from fastpar.pipeline.channels import P2PError
    from fastpar.pipeline import Pipeline

    topo = fastpar.init(pp=2, timeout=60)
    worst = 0.0
    for schedule in ("1f1b", "zb"):
        w, p = run_case(topo, seed, schedule=schedule, m=3, v=1, n_blocks=3, kind="tuple",
                        check_forward=True, input_grad=True)
        p.close()
        worst = max(worst, w)
    w, p = run_case(topo, seed + 1, schedule="interleaved", m=2, v=2, n_blocks=4, modules=True,
                    input_grad=True)
    p.close()
    worst = max(worst, w)
    # 7 layers over 2 stages, cut by hand: 5 on stage 0, 2 on stage 1
    w, p = run_case(topo, seed + 2, schedule="gpipe", m=2, v=1, n_blocks=5, balance=[5, 2])
    assert len(p.chunks[0]) == (5 if topo.pp_rank == 0 else 2)
    p.close()
    worst = max(worst, w)
    for schedule in ("1f1b", "interleaved"):
        w, p = run_case(topo, seed + 3, schedule=schedule, m=2, v=2 if schedule != "1f1b" else 1,
                        p2p="torch")
        assert p.channels.engine_name == "torch"
        p.close()
        worst = max(worst, w)

    # bad input, named
    with pytest.raises(ValueError, match=r"balance .* \[3, 3\]"):
        Pipeline(factories(3), loss_fn=_mse, microbatches=2, balance=[3, 3])
    with pytest.raises(ValueError, match="5 equal microbatches"):
        Pipeline(factories(3), loss_fn=_mse, microbatches=5).step(torch.randn(8, IN),
                                                                 torch.randn(8, OUT))
    with pytest.raises(ValueError, match="3 layers cannot fill"):
        Pipeline(factories(1), loss_fn=_mse, microbatches=2, virtual_stages=2,
                 schedule="interleaved")

    # a stage whose output shape changes between microbatches: both sides name it
    class Shrink(nn.Module):
        calls = 0

        def forward(self, x):
            Shrink.calls += 1
            return x if Shrink.calls == 1 else x[:, :-1]

    class Collapse(nn.Module):  # takes any width
        def forward(self, x):
            return x.sum(-1, keepdim=True).expand(-1, OUT)

    pipe = Pipeline([lambda: nn.Linear(IN, H), Shrink, Collapse, lambda: nn.Identity()],
                    loss_fn=_mse, microbatches=2, balance=[2, 2])
    with pytest.raises(P2PError) as info:
        pipe.step(torch.randn(4, IN), torch.randn(4, OUT))
    text = str(info.value)
    assert "shape mismatch at stage 1, microbatch 1" in text, text
    assert "float32 [2, 8]" in text and "float32 [2, 7]" in text, text
    pipe.close()

    # a layer that raises on stage 1: stage 0, waiting for a gradient, hears of it at once
    class Boom(nn.Module):
        def forward(self, x):
            raise ZeroDivisionError("boom in a layer")

    pipe = Pipeline([lambda: nn.Linear(IN, OUT), Boom], loss_fn=_mse, microbatches=2)
    start = time.monotonic()
    expected = ZeroDivisionError if topo.pp_rank == 1 else P2PError
    with pytest.raises(expected) as info:
        pipe.step(torch.randn(4, IN), torch.randn(4, OUT))
    took = time.monotonic() - start
    assert took < 10, took  # not the 60 s timeout
    boom = str(info.value)
    if topo.pp_rank == 0:
        assert "which gave up instead: rank 1: ZeroDivisionError: boom in a layer" in boom, boom
    pipe.close()
    fastpar.shutdown()
    return {"worst": worst, "mismatch": text.splitlines()[0], "boom": boom}


def test_variants_and_errors():
    launch = run_ranks(2, body_variants, seed=5, timeout=240)
    for v in launch.values():
        assert "shape mismatch" in v["mismatch"]
    print("variants worst error / bound:", max(v["worst"] for v in launch.values()))


def body_grid(seed, pp, tp):
    """tp x pp with fastpar.nn TP layers inside the stages (scatter-gather on and off), or pp
    below the world (dp replicas with their own data)."""
    import fastpar
    from fastpar import nn as pnn
    from fastpar.testing import SerialMLP

    topo = fastpar.init(tp=tp, pp=pp, timeout=60)
    worst, sent = 0.0, {}
    if tp > 1:
        mlp = [lambda: nn.Linear(IN, H)] + [lambda: pnn.ParallelMLP(H, 4 * H)
                                            for _ in range(3)] + [lambda: Head(H, OUT)]

        def serial_layers():
            return [nn.Linear(IN, H)] + [SerialMLP(H, 4 * H) for _ in range(3)] + [Head(H, OUT)]

        for scatter in (True, False):
            for schedule, v in (("1f1b", 1), ("zb", 1), ("interleaved", 2)):
                w, p = run_case(topo, seed, schedule=schedule, m=2, v=v, layers=mlp,
                                serial_layers=serial_layers, batch_per_mb=4,
                                scatter_gather=scatter)
                sent[f"{schedule} scatter={scatter}"] = p.channels.bytes_sent
                p.close()
                worst = max(worst, w)

        # a stage whose output differs across its tp group cannot be scattered: it says so
        from fastpar.pipeline.channels import P2PError
        from fastpar.pipeline import Pipeline

        class PerRank(nn.Module):
            def forward(self, x):
                return x + topo.tp_rank

        pipe = Pipeline([lambda: nn.Linear(IN, H), PerRank, lambda: Head(H, OUT)],
                        loss_fn=_mse, microbatches=2, balance=[2, 1], scatter_gather=True)
        with pytest.raises(P2PError, match="scatter-gather needs the activation"):
            pipe.step(torch.randn(4, IN), torch.randn(4, OUT))
        pipe.close()
    else:
        for schedule, v in (("1f1b", 1), ("interleaved", 2), ("zb", 1)):
            w, p = run_case(topo, seed, schedule=schedule, m=pp, v=v)
            p.close()
            worst = max(worst, w)
    fastpar.shutdown()
    return {"worst": worst, "sent": sent}


def body_grids(seed):
    return [body_grid(seed, pp, tp) for pp, tp in ((2, 2), (2, 1))]


@pytest.mark.quick
def test_tp_inside_stages_and_pp_below_the_world():
    """tp 2 x pp 2 (scatter-gather on and off), then pp 2 x dp 2, in one 4-rank launch."""
    launch = run_ranks(4, body_grids, seed=3, timeout=300)
    for values in launch.values():
        sent = values[0]["sent"]  # scatter-gather: 1/tp of every activation and gradient
        for schedule in ("1f1b", "zb", "interleaved"):
            whole, cut = sent[f"{schedule} scatter=False"], sent[f"{schedule} scatter=True"]
            assert cut * 2 == whole, (schedule, cut, whole)
    print("tp2 x pp2, pp2 x dp2: worst error / bound:",
          max(max(v["worst"] for v in values) for values in launch.values()))


def body_timeout(gave_up, p2p="auto"):
    """Stage 1 stops answering (stays in its forward until stage 0 has given up): stage 0's
    wait for the gradient fails, naming itself, the peer, the action and its position, as a
    P2PTimeout on either engine (shm's typed error; gloo's timed-out wait)."""
    import fastpar
    from fastpar.pipeline.channels import P2PTimeout
    from fastpar.pipeline import Pipeline
    from tests.multirank import late_until

    # MPI_Init first, without fastpar's watchdog (as body_stall in test_p2p_hosts): the 3 s are
    # for the stalled stage, not for ranks that finish importing torch seconds apart under load.
    from mpi4py import MPI  # noqa: F401
    topo = fastpar.init(pp=2, timeout=3)

    class Stall(nn.Module):
        calls = 0

        def forward(self, x):
            Stall.calls += 1
            if Stall.calls == 1:
                late_until(topo.store, gave_up, 20)
            return x

    pipe = Pipeline([lambda: nn.Linear(IN, OUT), Stall], loss_fn=_mse, microbatches=2,
                    schedule="gpipe", p2p=p2p)
    try:
        pipe.step(torch.randn(4, IN), torch.randn(4, OUT))
    except P2PTimeout as exc:
        topo.store.set(gave_up, "1")
        return {"error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - stage 1, once stage 0 has given up and left
        return {"error": None, "other": f"{type(exc).__name__}: {exc}"[:300]}
    return {"error": None}


@pytest.mark.parametrize("p2p", ["auto", "torch"])
def test_peer_that_stops_answering_is_named(p2p):
    # gloo's timed-out receive stays posted: that job ends with the test (a launch of its own)
    launch = run_ranks(2, body_timeout, p2p=p2p, gave_up=uuid.uuid4().hex, timeout=120,
                       launcher="mpirun", own_job=p2p == "torch")
    err = launch.values()[0]["error"]
    assert err is not None, "rank 0 did not time out"
    assert "pipeline rank 0 (global rank 0)" in err and "peer rank 1" in err, err
    assert "waited 3 s for the header of the gradient of microbatch 1" in err, err
    assert "action" in err and "RB" in err, err
    assert "rank 1: step 1" in err, err  # the status board: what the stuck rank is doing


def body_killed():
    """Stage 1 is killed (SIGKILL) in its first forward: stage 0's wait for its gradient fails
    at once naming the dead rank, well before the 60 s timeout."""
    import os
    import signal
    import time

    import fastpar
    from fastpar.pipeline.channels import P2PError
    from fastpar.pipeline import Pipeline

    fastpar.init(pp=2, timeout=60)
    import torch.distributed as dist

    pids = [None, None]
    dist.all_gather_object(pids, os.getpid())

    class Die(nn.Module):
        def forward(self, x):
            os.kill(os.getpid(), signal.SIGKILL)

    pipe = Pipeline([lambda: nn.Linear(IN, OUT), Die], loss_fn=_mse, microbatches=2)
    # torchrun stops the other workers with SIGTERM when one dies: finish the report first.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    start = time.monotonic()
    try:
        pipe.step(torch.randn(4, IN), torch.randn(4, OUT))
    except P2PError as exc:
        return {"elapsed": time.monotonic() - start, "error": str(exc), "pids": pids}
    return {"elapsed": None, "error": None, "pids": pids}


def test_killed_stage_is_named_and_leaves_no_segment():
    from tests.multirank import segments_of

    launch = run_ranks(2, body_killed, launcher="torchrun", check=False, timeout=90)
    assert 0 in launch.results and launch.results[0]["ok"], launch.describe()
    value = launch.results[0]["value"]
    assert value["error"] and "rank 1 dead" in value["error"], value
    assert value["elapsed"] < 10, value
    assert segments_of(value["pids"]) == set()  # this job's, whoever runs beside it


def body_gpu(seed):
    """One rank on its GPU: every schedule's chunks on CUDA (pp 1, chunks exchanged locally)."""
    import fastpar

    topo = fastpar.init(timeout=120)
    assert topo.device.type == "cuda", topo.device
    worst = 0.0
    for schedule, v in (("1f1b", 1), ("zb", 1), ("interleaved", 2), ("gpipe", 2)):
        w, p = run_case(topo, seed, schedule=schedule, m=3, v=v, check_forward=True)
        p.close()
        worst = max(worst, w)
    fastpar.shutdown()
    return worst


@pytest.mark.gpu
def test_pipeline_on_gpu():
    launch = run_ranks(1, body_gpu, seed=2, timeout=240)
    print("GPU pipeline worst error / bound:", launch.values()[0])
