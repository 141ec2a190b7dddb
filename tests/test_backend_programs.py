"""Real torch.distributed programs, unchanged but for the backend string, on "fastpar" and on
"gloo": DDP (default, no_sync, find_unused_parameters, a communication hook), FSDP2, DTensor
tensor parallelism, distributed checkpointing, torch.compile over functional collectives and
Hugging Face's own tensor parallelism with generate. Each gives gloo's result (losses within
float32 reduction-order bounds, tokens identical) and, where one process can compute it, the
one-process result."""

import os

import pytest

from tests.multirank import run_ranks
from tests.test_backend import init

# Two backends sum the ranks' float32 gradients in different orders: each reduced gradient may
# differ by up to n - 1 = 3 ulps (4 ranks), and the 5 steps carry at most 5 such differences
# into the loss; 64 float32 ulps of the loss leaves a factor 4 over 5 x 3.
LOSS_RTOL = 64 * 2.0**-23


def mlp(seed=0, width=32):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def batch(rank, step, rows=8):
    import torch

    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)


def body_ddp(path, backend):
    """DDP four ways; each returns its losses and a checksum of the final parameters."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, n = init(path, backend)
    out = {}

    class Branchy(nn.Module):  # one branch unused on odd steps: find_unused_parameters
        def __init__(self):
            super().__init__()
            self.body, self.extra = mlp(1), nn.Linear(4, 4)

        def forward(self, x, step):
            y = self.body(x)
            return self.extra(y) if step % 2 == 0 else y

    def hook(state, bucket):  # a Python hook: an async all_reduce's future, then the mean
        return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(
            lambda fut: fut.value()[0].div_(n))

    for variant in ("default", "no_sync", "unused", "hook"):
        model = Branchy() if variant == "unused" else mlp()
        ddp = DDP(model, find_unused_parameters=variant == "unused", bucket_cap_mb=0.001)
        if variant == "hook":
            ddp.register_comm_hook(None, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(5):
            x, y = batch(rank, step)
            if variant == "no_sync":  # two microbatches, the first without reduction
                with ddp.no_sync():
                    loss0 = torch.nn.functional.mse_loss(ddp(x[:4]), y[:4])
                    loss0.backward()
                loss = torch.nn.functional.mse_loss(ddp(x[4:]), y[4:])
                loss.backward()
                loss = loss + loss0
            else:
                args = (x, step) if variant == "unused" else (x,)
                loss = torch.nn.functional.mse_loss(ddp(*args), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[variant] = {"losses": losses,
                        "params": sum(p.double().sum().item() for p in model.parameters())}
    return {"runs": out, "served": served(backend)}


def body_fsdp2(path, backend):
    """FSDP2 ``fully_shard`` per layer and at the root, Adam; losses and the full parameters'
    checksum (its gradients reduce with ReduceOp.AVG where the backend is not gloo)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, n = init(path, backend)
    mesh = init_device_mesh("cpu", (n,))
    model = mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(5):
        x, y = batch(rank, step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    full = sum(p.full_tensor().double().sum().item() for p in model.parameters())
    return {"losses": losses, "params": full, "served": served(backend)}


def body_dtensor(path, backend):
    """DTensor tensor parallelism (Colwise then Rowwise) against the same model in one process
    (float64): output and every gradient."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    rank, n = init(path, backend)
    mesh = init_device_mesh("cpu", (n,))
    model, serial = mlp(width=8 * n), mlp(width=8 * n).double()
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x, _ = batch(0, 0)  # the same input on every rank
    y = model(x)
    y.sum().backward()
    ys = serial(x.double())
    ys.sum().backward()
    worst = (y.double() - ys).abs().max().item()
    for (name, p), ps in zip(model.named_parameters(), serial.parameters()):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        worst = max(worst, (g.double() - ps.grad).abs().max().item())
    return {"worst": worst, "out": y.double().sum().item(), "served": served(backend)}


def body_dcp(path, backend, ckpt):
    """Distributed checkpoint save and load of an FSDP2 model: the loaded parameters equal the
    saved ones bitwise."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, n = init(path, backend)
    mesh = init_device_mesh("cpu", (n,))
    model = fully_shard(mlp(3), mesh=mesh)
    dcp.save({"model": model.state_dict()}, checkpoint_id=ckpt)
    fresh = fully_shard(mlp(4), mesh=mesh)
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    fresh.load_state_dict(state["model"])
    same = all(torch.equal(a.to_local(), b.to_local())
               for a, b in zip(model.parameters(), fresh.parameters()))
    return {"same": same}


def body_compile(path, backend):
    """torch.compile(fullgraph=True) of a function with functional collectives (all_reduce,
    all_gather_tensor, reduce_scatter_tensor) gives eager's results."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    rank, n = init(path, backend)
    group = dist.group.WORLD

    def f(x):
        s = funcol.all_reduce(x * 2, "sum", group)
        g = funcol.all_gather_tensor(x + 1, 0, group)
        r = funcol.reduce_scatter_tensor(g * 3, "sum", 0, group)
        return s + r.sum()

    x = torch.arange(8.0) + rank
    eager = f(x)
    compiled = torch.compile(f, fullgraph=True)(x)
    return {"equal": torch.equal(eager, compiled), "value": eager.tolist()}


def body_pipelining(path, backend, schedule):
    """torch.distributed.pipelining: a stack of 8 linear layers cut into 2 stages a rank
    (interleaved and ZBV: 2 virtual stages a rank, ZBV's V order), 4 microbatches; the loss and
    a checksum of every gradient, against the same model's serial step (float64)."""
    import torch
    import torch.distributed as dist
    from torch.distributed import pipelining as pl

    rank, n = init(path, backend)
    per_rank = 1 if schedule == "1f1b" else 2
    stages_total = n * per_rank
    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(8)]
    serial = torch.nn.Sequential(*[torch.nn.Sequential(l, torch.nn.Tanh()) for l in layers])
    ref = __import__("copy").deepcopy(serial).double()
    if schedule == "zbv":  # rank r holds stages r and 2n-1-r
        mine = [rank, stages_total - 1 - rank]
    else:  # looped: rank r holds stages r, r + n, ...
        mine = [rank + k * n for k in range(per_rank)]
    chunk = len(layers) // stages_total
    stages = [pl.PipelineStage(serial[s * chunk:(s + 1) * chunk], s, stages_total,
                               torch.device("cpu")) for s in mine]
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target, reduction="sum")

    cls = {"1f1b": pl.Schedule1F1B, "interleaved": pl.ScheduleInterleaved1F1B,
           "zbv": pl.ScheduleZBVZeroBubble}[schedule]
    sched = cls(stages[0] if schedule == "1f1b" else stages, n_microbatches=4, loss_fn=loss_fn,
                scale_grads=False)  # sums over microbatches, as the serial loss does
    losses = []
    if rank == 0:
        sched.step(x, target=y, losses=losses)
    elif schedule == "zbv":  # the last stage is rank 0's too: the others only pass through
        sched.step()
    else:
        sched.step(target=y, losses=losses) if rank == n - 1 else sched.step()
    mine_grads = {}
    for s in mine:
        for i, layer in enumerate(serial[s * chunk:(s + 1) * chunk]):
            mine_grads[s * chunk + i] = layer[0].weight.grad.double().sum().item()
    loss_fn(ref(x.double()), y.double()).backward()
    worst = max(abs(v - ref[i][0].weight.grad.sum().item()) for i, v in mine_grads.items())
    total = sum(l.item() for l in losses)
    return {"worst": worst, "loss": total, "ref": loss_fn(ref(x.double()), y.double()).item()
            if losses else None, "served": served(backend)}


def body_hf_generate(path, backend, model_dir, prompt):
    """Hugging Face transformers' own tensor parallelism (``tp_plan="auto"``) and greedy
    ``generate`` on a small Llama: the tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    init(path, backend)
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32)
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    return {"tokens": out[0].tolist(), "served": served(backend)}


def served(backend):
    """What ran the calls of the world group (fastpar's backend), ``{}`` on gloo."""
    from fastpar.backend import served as what

    return what() if backend == "fastpar" else {}


def shm(got, op):
    """How many ``op`` calls of the fastpar run the shm kernels served."""
    return got["fastpar"]["served"].get(op, {}).get("shm", 0)


def both(body, tmp_path, nranks=2, launcher="mpirun", **kwargs):
    """``{backend: rank 0's value}`` of ``body`` run on gloo and on fastpar."""
    return {b: run_ranks(nranks, body, path=str(tmp_path / f"rdv-{b}"), backend=b,
                         launcher=launcher, timeout=240, **kwargs).values()[0]
            for b in ("gloo", "fastpar")}


def close_losses(a, b):
    for x, y in zip(a, b):
        assert abs(x - y) <= LOSS_RTOL * max(1.0, abs(y)), (a, b)


@pytest.mark.parametrize("nranks", [2, 4])
def test_ddp(nranks, tmp_path):
    got = both(body_ddp, tmp_path, nranks)
    for variant, want in got["gloo"]["runs"].items():
        close_losses(got["fastpar"]["runs"][variant]["losses"], want["losses"])
        assert abs(got["fastpar"]["runs"][variant]["params"] - want["params"]) <= 1e-4, variant
    assert shm(got, "allreduce") >= 4 * 5 and shm(got, "broadcast") > 0  # buckets, parameters


def test_fsdp2(tmp_path):
    got = both(body_fsdp2, tmp_path)
    close_losses(got["fastpar"]["losses"], got["gloo"]["losses"])
    assert abs(got["fastpar"]["params"] - got["gloo"]["params"]) <= 1e-4
    assert shm(got, "reduce_scatter") >= 5 and shm(got, "_allgather_base") >= 5


def test_dtensor_tensor_parallel(tmp_path):
    got = both(body_dtensor, tmp_path)
    for b in got:
        assert got[b]["worst"] <= 1e-5, (b, got[b])  # float32 against float64, width 16
    assert shm(got, "allreduce") > 0


def test_distributed_checkpoint(tmp_path):
    for b in ("gloo", "fastpar"):
        res = run_ranks(2, body_dcp, path=str(tmp_path / f"rdv-{b}"), backend=b,
                        ckpt=str(tmp_path / f"ckpt-{b}"), timeout=240).values()
        assert all(r["same"] for r in res)


def test_compile_fullgraph_functional_collectives(tmp_path):
    got = both(body_compile, tmp_path)
    assert got["fastpar"]["equal"] and got["fastpar"]["value"] == got["gloo"]["value"]


def test_hugging_face_tensor_parallel_generate(tmp_path):
    pytest.importorskip("transformers")
    import torch

    from tests.test_tp_parallelize import tiny_llama

    model = tiny_llama()
    model.save_pretrained(tmp_path / "llama")
    prompt = [1, 17, 42, 99, 5, 23]
    want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0].tolist()
    # under torchrun: transformers sizes its mesh from WORLD_SIZE (under mpirun, without it,
    # tp_plan="auto" loads the whole model on every rank and nothing is parallel)
    got = both(body_hf_generate, tmp_path, launcher="torchrun", model_dir=str(tmp_path / "llama"),
               prompt=prompt)
    assert got["gloo"]["tokens"] == want and got["fastpar"]["tokens"] == want, (got, want)
    # tensor parallel on fastpar's kernels: at least one all-reduce per generated token (how
    # many per layer is transformers' business: 2 per layer run alone, fewer after other tests
    # in one process)
    assert shm(got, "allreduce") >= 12



@pytest.mark.parametrize("schedule", ["1f1b", "interleaved", "zbv"])
def test_torch_pipelining(schedule, tmp_path):
    got = both(body_pipelining, tmp_path, schedule=schedule)
    for b in got:
        assert got[b]["worst"] <= 1e-4, (b, got[b])  # float32 grads against float64
        if got[b]["ref"] is not None:
            assert abs(got[b]["loss"] - got[b]["ref"]) <= 1e-4 * abs(got[b]["ref"]), got[b]
    assert got["fastpar"]["served"].get("send", {}).get("gloo", 0) > 0  # P2P: gloo's
