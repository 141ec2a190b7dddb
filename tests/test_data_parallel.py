"""fastpar.DataParallel against a serial model trained on the full batch.

Each dp replica gets its 1/dp slice of every micro-batch; the serial model (float32) and its
float64 copy see the whole batch. Several Adam steps, each accumulating two micro-batches (the
first under ``no_sync()``), with every gradient and the final weights checked against the float64
reference within ``fastpar.testing``'s rounding bound. Cases: dp 1, 2 and 4 (one parameter per
bucket and one bucket for all, overlap on and off, a frozen layer, replicas perturbed before the
wrap so that only the broadcast from dp rank 0 makes them equal); tp 2 x dp 2 on 4 ranks
(``ParallelMLP`` against ``SerialMLP``, each dp replica its own data); an unused parameter (the
error on every rank, and ``find_unused_parameters=True``); buffers broadcast at construction;
state dict keys; a bfloat16 model reducing in float32. One launch per layout.
"""

import contextlib
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastpar.testing import Checks
from tests.multirank import run_ranks

LAYOUTS = [(1, 1, 1), (2, 1, 1), (4, 1, 1), (4, 2, 1), (4, 1, 2)]  # (world, tp, pp)
STEPS, ACCUM, MB = 3, 2, 4  # Adam steps, micro-batches per step, rows per replica per micro-batch
TINY = 1e-6  # bucket_mb: every parameter in a bucket of its own


def serial_net():
    """A frozen first layer, then two trainable ones: x (N, 12) -> (N, 6)."""
    net = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(),
                        nn.Linear(24, 6))
    net[0].requires_grad_(False)
    return net


def train_and_compare(c, topo, tag, ser, par, x_shape, y_shape, local, gen, **dp_kwargs):
    """Train ``ser`` (float32, full batch), its float64 copy and ``DataParallel(par)`` (this
    replica's slice) for STEPS Adam steps of ACCUM micro-batches; compare every gradient and the
    final weights. ``local(name, full)``: this rank's part of a serial tensor (its TP shard)."""
    import fastpar

    dp, r = topo.dp_size, topo.dp_rank
    ref = copy.deepcopy(ser).double()
    with torch.no_grad():  # replicas differ before the wrap: the broadcast must fix that
        for p in par.parameters():
            p.add_(float(r))
    model = fastpar.DataParallel(par, **dp_kwargs)
    # CPU buckets of a dp group on one host live in symmetric memory (reduced in place)
    want_symmetric = dp > 1 and os.environ.get("FASTPAR_COMM_BACKEND") in (None, "", "shm")
    assert all(b.symmetric == want_symmetric for b in model.reducer.buckets), \
        (tag, model.reducer.buckets)
    for name, p in model.module.named_parameters():
        assert torch.equal(p, local(name, dict(ser.named_parameters())[name])), \
            f"{tag}: {name} differs from dp rank 0's after the wrap"
    opts = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (ser, ref, model)]
    for step in range(STEPS):
        for m in range(ACCUM):
            x = torch.randn(dp * x_shape[0], *x_shape[1:], generator=gen)
            y = torch.randn(dp * y_shape[0], *y_shape[1:], generator=gen)
            for net, dtype in ((ser, torch.float32), (ref, torch.float64)):
                (F.mse_loss(net(x.to(dtype)), y.to(dtype)) / ACCUM).backward()
            last = m == ACCUM - 1
            with contextlib.nullcontext() if last else model.no_sync():
                out = model(x.chunk(dp)[r])
                (F.mse_loss(out, y.chunk(dp)[r]) / ACCUM).backward()
        serial_p, ref_p = dict(ser.named_parameters()), dict(ref.named_parameters())
        for name, p in model.module.named_parameters():
            if not p.requires_grad:
                assert p.grad is None, f"{tag}: frozen {name} got a gradient"
                continue
            c.close(f"{tag}.step{step}.d{name}", p.grad, local(name, ref_p[name].grad),
                    local(name, serial_p[name].grad))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)  # both ways of zeroing, views re-attached
    serial_p, ref_p = dict(ser.named_parameters()), dict(ref.named_parameters())
    for name, p in model.module.named_parameters():
        c.close(f"{tag}.{name}", p, local(name, ref_p[name]), local(name, serial_p[name]))
    return model


def check_dp_training(c, topo, seed):
    for bucket_mb in (TINY, 25.0):
        for overlap in (True, False):
            tag = f"dp{topo.dp_size}.b{bucket_mb:g}.overlap{int(overlap)}"
            torch.manual_seed(seed)
            ser = serial_net()
            gen = torch.Generator().manual_seed(seed + 1)
            model = train_and_compare(c, topo, tag, ser, copy.deepcopy(ser), (MB, 12), (MB, 6),
                                      lambda name, t: t, gen, bucket_mb=bucket_mb,
                                      overlap=overlap)
            n_buckets = len(model.buckets)
            assert n_buckets == (4 if bucket_mb == TINY else 1), (tag, model.buckets)
            assert model.state_dict().keys() == ser.state_dict().keys()
            sd = fastpar_full(model)
            assert sd.keys() == ser.state_dict().keys()
            model.load_state_dict(ser.state_dict())  # serial keys load into the wrapper
            assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ser.parameters()))
            c.checked.append(f"{tag}.state_dict")


def fastpar_full(model):
    import fastpar

    return fastpar.full_state_dict(model)


def fastpar_load_full(model, sd):
    import fastpar

    return fastpar.load_full_state_dict(model, sd)


def check_tp_training(c, topo, seed):
    """tp x dp: ParallelMLP shards under DataParallel over the dp group; each dp replica its own
    slice of the batch, the same slice on the ranks of one tp group."""
    from fastpar import nn as pnn
    from fastpar.testing import SerialMLP

    torch.manual_seed(seed)
    ser = SerialMLP(16, 32)
    par = pnn.ParallelMLP(16, 32, seed=seed)

    def local(name, full):
        owner, _, leaf = name.rpartition(".")
        module = par.get_submodule(owner) if owner else par
        return module.shard_full(leaf, full) if isinstance(module, pnn.ShardedModule) else full

    gen = torch.Generator().manual_seed(seed + 2)
    model = train_and_compare(c, topo, f"tp{topo.tp_size}xdp{topo.dp_size}", ser, par,
                              (MB, 3, 16), (MB, 3, 16), local, gen, bucket_mb=TINY)
    full = fastpar_full(model)
    assert full.keys() == ser.state_dict().keys()
    for k, p in model.module.named_parameters():  # the gather itself is exact
        assert torch.equal(local(k, full[k]), p), k
    fastpar_load_full(model, ser.state_dict())  # each rank takes its shards of the serial one
    assert all(torch.equal(p, local(n, dict(ser.named_parameters())[n]))
               for n, p in model.module.named_parameters())
    c.checked.append("tp.full_state_dict")


class Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(6, 4)
        self.unused = nn.Linear(6, 4)

    def forward(self, x):
        return self.used(x)


def check_replicated_grads_in_fp32(c, topo, seed):
    """A bf16 RMSNorm and a row layer's bias under sequence parallelism: their gradients are
    summed over tp in float32 (every all-reduce of the backward carries float32, not bf16: the
    FSDP2 bug pytorch#190626), and the norm's matches the serial one within bf16's bound."""
    from fastpar import nn as pnn
    from fastpar.comm import autograd as ag

    tp, r = topo.tp_size, topo.tp_rank
    gen = torch.Generator().manual_seed(seed + 5)
    x = torch.randn(2, 4 * tp, 16, generator=gen)  # (B, T, H), the same on every rank
    w = 1 + 0.1 * torch.randn(16, generator=gen)
    norm = pnn.RMSNorm(16, sequence_parallel=True, dtype=torch.bfloat16)
    row = pnn.RowParallelLinear(16, 16, sequence_parallel=True, seed=seed, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
    seen, real = [], ag.all_reduce

    def spy(t, group, *args, **kwargs):
        seen.append(t.dtype)
        return real(t, group, *args, **kwargs)

    ag.all_reduce = spy
    try:
        norm(x.chunk(tp, 1)[r].bfloat16()).float().square().sum().backward()  # (B, T/tp, H)
        row(x.chunk(tp, -1)[r].bfloat16()).float().square().sum().backward()  # (B, T, H/tp)
    finally:
        ag.all_reduce = real
    assert len(seen) == 2 and all(d == torch.float32 for d in seen), seen
    grads = []
    for dtype in (torch.float64, torch.bfloat16):  # the serial norm over the whole sequence
        wt = w.bfloat16().to(dtype).requires_grad_(True)  # the weight the model holds
        F.rms_norm(x.bfloat16().to(dtype), (16,), wt, 1e-6).float().square().sum().backward()
        grads.append(wt.grad)
    c.close("sp.norm.bf16.dweight", norm.weight.grad, *grads)
    c.checked.append("sp.replicated_grads_fp32")


def check_unused(c, topo, seed):
    import fastpar

    dp, r = topo.dp_size, topo.dp_rank
    x = torch.randn(dp * 2, 6, generator=torch.Generator().manual_seed(seed))
    for bucket_mb in (TINY, 25.0):
        for finish in (False, True):  # the error at the next forward, or in the finish step
            torch.manual_seed(seed)
            model = fastpar.DataParallel(Unused(), bucket_mb=bucket_mb)
            model(x.chunk(dp)[r]).sum().backward()
            try:
                model.finish_gradient_synchronization() if finish else model(x)
                raise AssertionError("an unused parameter did not raise")
            except RuntimeError as exc:
                msg = str(exc)
                assert "'unused.weight'" in msg and "'unused.bias'" in msg, msg
                assert "Every dp rank raises" in msg and "find_unused_parameters=True" in msg
            c.checked.append(f"unused.error.b{bucket_mb:g}.finish{int(finish)}")
        # find_unused_parameters=True: the used layer averages, the unused one gets zeros.
        torch.manual_seed(seed)
        ser = Unused()
        model = fastpar.DataParallel(copy.deepcopy(ser), bucket_mb=bucket_mb,
                                     find_unused_parameters=True)
        ref = copy.deepcopy(ser).double()
        for it in range(2):
            ser.zero_grad()
            ref.zero_grad()
            model.module.zero_grad()
            ser(x).sum().backward()
            ref(x.double()).sum().backward()
            model(x.chunk(dp)[r]).sum().backward()
            for name in ("weight", "bias"):
                got = getattr(model.module.used, name).grad * dp  # the mean of local sums
                c.close(f"unused.find.b{bucket_mb:g}.it{it}.used.d{name}", got,
                        getattr(ref.used, name).grad, getattr(ser.used, name).grad)
                assert torch.equal(getattr(model.module.unused, name).grad,
                                   torch.zeros_like(getattr(ser.unused, name)))
        model.finish_gradient_synchronization()  # nothing open: a no-op


class Reversed(nn.Module):
    """Registered a then b, run b then a: backward makes the buckets ready in reverse order."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.a(torch.tanh(self.b(x)))


def check_launch_order(c, topo, seed):
    """Buckets are launched in index order on every rank; with overlap, during backward (before
    the last gradient is ready), without it, only at the end."""
    import fastpar
    from fastpar import comm

    real, launched = comm.all_reduce, []
    gen = torch.Generator().manual_seed(seed)
    for net, overlap in ((serial_net, True), (serial_net, False), (Reversed, True)):
        torch.manual_seed(seed)
        model = fastpar.DataParallel(net(), bucket_mb=TINY, overlap=overlap)
        index = {b.data.data_ptr(): b.index for b in model.buckets}
        n = len(model.reducer.params)
        x = torch.randn(4, 12 if net is serial_net else 6, generator=gen)

        def spy(t, *a, _index=index, _reducer=model.reducer, **k):
            launched.append((_index[t.data_ptr()], _reducer._hooked))  # (bucket, hooks run)
            return real(t, *a, **k)

        comm.all_reduce = spy
        try:
            launched.clear()
            model(x).sum().backward()
        finally:
            comm.all_reduce = real
        assert [i for i, _ in launched] == list(range(len(model.buckets))), launched
        at = [h for _, h in launched]
        if net is Reversed:  # a's buckets (2, 3) are ready first and wait for b's (0, 1)
            assert at[0] >= 3 and at[2:] == [n, n], at
        elif not overlap:
            assert all(h == n for h in at), at
        else:
            assert at == list(range(1, n + 1)), at  # each bucket as soon as its gradient is
        c.checked.append(f"launch_order.{net.__name__}.overlap{int(overlap)}")


def check_buffers_and_bf16(c, topo, seed):
    import fastpar
    from fastpar import comm

    dp, r = topo.dp_size, topo.dp_rank
    bn = nn.BatchNorm1d(5)
    with torch.no_grad():
        bn.running_mean.fill_(float(r + 1))
        bn.running_var.fill_(float(10 * r + 2))
    bn.num_batches_tracked.fill_(r + 3)
    model = fastpar.DataParallel(bn)
    assert torch.equal(bn.running_mean, torch.ones(5)) and torch.equal(bn.running_var,
                                                                       torch.full((5,), 2.0))
    assert int(bn.num_batches_tracked) == 3
    every = comm.all_gather(bn.running_var.unsqueeze(0), group=topo.dp_group)
    assert all(torch.equal(every[0], every[i]) for i in range(dp))
    assert model.state_dict().keys() == nn.BatchNorm1d(5).state_dict().keys()
    c.checked.append("buffers")

    # bfloat16 model, float32 buckets: gradients reduced in float32 and cast back.
    torch.manual_seed(seed)
    ser = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(torch.bfloat16)
    ref = copy.deepcopy(ser).double()
    model = fastpar.DataParallel(copy.deepcopy(ser), bucket_mb=TINY, reduce_dtype=torch.float32)
    assert all(b.copy and b.dtype == torch.float32 for b in model.buckets)
    gen = torch.Generator().manual_seed(seed + 3)
    for it in range(2):
        x = torch.randn(dp * 4, 8, generator=gen)
        for net in (ser, ref, model.module):
            net.zero_grad()
        ser(x.bfloat16()).float().square().mean().backward()
        ref(x.double()).square().mean().backward()
        with model.no_sync():  # half the local batch each, accumulated in bfloat16
            model(x.chunk(dp)[r][:2].bfloat16()).float().square().mean().div(2).backward()
        model(x.chunk(dp)[r][2:].bfloat16()).float().square().mean().div(2).backward()
        sp, rp = dict(ser.named_parameters()), dict(ref.named_parameters())
        for name, p in model.module.named_parameters():
            assert p.grad.dtype == torch.bfloat16
            c.close(f"bf16.it{it}.d{name}", p.grad, rp[name].grad, sp[name].grad)


def check_pipeline_training(c, topo, seed):
    """DataParallel around a Pipeline (pp x dp; also pp 1): ``model.step`` runs the pipeline's
    microbatches, then reduces; every dp replica trains on its own slice of the batch. The
    serial-layout weights after each Adam step against the serial model on the full batch
    (float32) and its float64 copy; schedules 1f1b and zb (whose W pass writes .grad directly).
    Under 1f1b the buckets are launched during the pipeline's last backward (overlapped, as
    DDP does), under zb after the step."""
    import fastpar
    from fastpar.pipeline import Pipeline

    dp, r = topo.dp_size, topo.dp_rank
    for schedule in ("1f1b", "zb"):
        tag = f"pp{topo.pp_size}dp{dp}.{schedule}"
        torch.manual_seed(seed)
        ser = serial_net()
        ref = copy.deepcopy(ser).double()
        pipe = Pipeline(list(copy.deepcopy(ser)), loss_fn=F.mse_loss, schedule=schedule,
                        microbatches=2, balance=[3, 2] if topo.pp_size == 2 else None)
        model = fastpar.DataParallel(pipe, bucket_mb=TINY)
        opts = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-2)
                for m in (ser, ref, model)]
        inside, launched = [False], []  # whether the pipeline's executor runs; each launch's
        run = pipe.executor.run

        def timed_run(*args, **kwargs):
            inside[0] = True
            try:
                return run(*args, **kwargs)
            finally:
                inside[0] = False
        pipe.executor.run = timed_run
        for red in model._reducers:
            def launch(b, real=red._all_reduce):
                launched.append(inside[0])
                return real(b)
            red._all_reduce = launch
        gen = torch.Generator().manual_seed(seed + 2)
        for step in range(STEPS):
            x = torch.randn(dp * 2 * MB, 12, generator=gen)
            y = torch.randn(dp * 2 * MB, 6, generator=gen)
            for net, dtype in ((ser, torch.float32), (ref, torch.float64)):
                F.mse_loss(net(x.to(dtype)), y.to(dtype)).backward()
            loss = model.step(x.chunk(dp)[r], y.chunk(dp)[r])
            with torch.no_grad():  # this replica's loss, serial float32 and float64
                want = [F.mse_loss(net(x.to(dt)).chunk(dp)[r], y.to(dt).chunk(dp)[r])
                        for net, dt in ((ref, torch.float64), (ser, torch.float32))]
            c.close(f"{tag}.step{step}.loss", torch.tensor(loss, dtype=torch.float32), *want)
            for opt in opts:
                opt.step()
                opt.zero_grad()
            full = fastpar.full_state_dict(model)
            sp, rp = ser.state_dict(), ref.state_dict()
            for name, t in full.items():
                c.close(f"{tag}.step{step}.{name}", t, rp[name], sp[name])
        n = len(model.buckets) * STEPS
        want = [schedule == "1f1b"] * n  # 1f1b: each bucket as its last backward fills it
        assert launched == want, (tag, launched)
        c.checked.append(f"{tag}.overlap")


def check_replicas_differ(c, topo):
    """A replica with another model: a ValueError naming it on every rank, no hang (the check
    runs before the broadcasts and the symmetric bucket allocations)."""
    import fastpar

    if topo.dp_size == 1:
        return
    net = nn.Linear(3, 4 if topo.dp_rank == 0 else 5)
    try:
        fastpar.DataParallel(net)
        raise AssertionError("DataParallel accepted replicas of different models")
    except ValueError as exc:
        assert "hold different models" in str(exc) and "16 elements" in str(exc) \
            and "20 elements" in str(exc), exc
    c.checked.append("replicas_differ")


def body_dp(tp, seed, pp=1):
    import fastpar

    topo = fastpar.init(tp=tp, pp=pp, timeout=60)
    c = Checks()
    if pp > 1:
        check_pipeline_training(c, topo, seed)
    elif tp == 1:
        check_dp_training(c, topo, seed)
        check_unused(c, topo, seed)
        check_launch_order(c, topo, seed)
        check_buffers_and_bf16(c, topo, seed)
        check_pipeline_training(c, topo, seed)
        check_replicas_differ(c, topo)
    else:
        check_tp_training(c, topo, seed)
        check_replicated_grads_in_fp32(c, topo, seed)
    return {"checked": c.checked, "worst": c.worst}


@pytest.mark.quick
@pytest.mark.parametrize("world,tp,pp", LAYOUTS, ids=[f"w{w}tp{t}pp{p}" for w, t, p in LAYOUTS])
def test_data_parallel(world, tp, pp):
    values = run_ranks(world, body_dp, tp=tp, pp=pp, seed=1234, timeout=180).values()
    assert all(v["checked"] == values[0]["checked"] for v in values)
    assert len(values[0]["checked"]) > 10


def test_master_weights_keep_updates_below_bf16_resolution():
    """``MasterWeights``: AdamW on float32 masters of a bf16 model, bitwise as AdamW on a float32
    copy given the same (bf16) gradients; updates of -1e-4 on weights of 1.0 (bf16's spacing below
    1 is 2^-8) move the bf16 weights, where AdamW on the bf16 weights themselves never moves them.
    ``state_dict`` / ``masters_as_params`` round-trip exactly."""
    from fastpar.optim import MasterWeights

    kw = {"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.0}
    model = nn.Linear(4, 3, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    ref = copy.deepcopy(model.weight).detach().requires_grad_(True)
    plain = copy.deepcopy(model).to(torch.bfloat16)
    opt = MasterWeights(model.parameters(), torch.optim.AdamW, **kw)
    model.to(torch.bfloat16)
    ropt = torch.optim.AdamW([ref], **kw)
    popt = torch.optim.AdamW(plain.parameters(), **kw)
    gen = torch.Generator().manual_seed(7)
    for _ in range(100):
        g = (torch.rand(3, 4, generator=gen) + 0.5).bfloat16()  # one sign: a steady drift
        model.weight.grad, ref.grad, plain.weight.grad = g.clone(), g.float(), g.clone()
        for o in (opt, ropt, popt):
            o.step()
            o.zero_grad()
    master = opt.master_of(model.weight)
    assert master.dtype == torch.float32 and torch.equal(master, ref), (master, ref)
    assert torch.equal(model.weight, ref.bfloat16()) and (model.weight != 1).any()
    assert (plain.weight == 1).all(), plain.weight  # the bug MasterWeights fixes
    assert opt.state[master]["exp_avg"].dtype == torch.float32
    twin = nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    topt = MasterWeights(twin.parameters(), torch.optim.AdamW, **kw)
    topt.load_state_dict(opt.state_dict())
    with opt.masters_as_params():
        saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert saved["weight"].dtype == torch.float32 and torch.equal(saved["weight"], master)
    with topt.masters_as_params():
        twin.load_state_dict(saved)
    assert torch.equal(topt.master_of(twin.weight), master)
    assert torch.equal(twin.weight, model.weight) and twin.weight.dtype == torch.bfloat16
    assert torch.equal(topt.state[topt.master_of(twin.weight)]["exp_avg_sq"],
                       opt.state[master]["exp_avg_sq"])


@pytest.mark.quick
def test_bucket_plan():
    from fastpar.data_parallel import plan_buckets
    from fastpar.data_parallel.buckets import ParamSpec

    f32, bf16 = (torch.float32, "cpu"), (torch.bfloat16, "cpu")
    mib = 1 << 20
    specs = [ParamSpec(n, key, 4 if key is f32 else 2) for n, key in
             [(mib // 8, f32), (mib // 8, f32), (mib // 8, bf16), (mib, f32), (mib // 4, f32),
              (mib // 8, f32)]]
    # Reverse order; the first float32 bucket capped at 1 MiB (0.5 + 1 MiB do not fit), the rest
    # up to 8 MiB; bfloat16 in a bucket of its own, ordered by where it opened.
    assert plan_buckets(specs, 8 * mib) == [[5], [4, 3, 1, 0], [2]]
    assert plan_buckets(specs, 1) == [[5], [4], [3], [2], [1], [0]]


def test_bench_runs(tmp_path):
    """bench/data_parallel.py still runs (tiny model) and writes its documented JSON."""
    import json
    from tests.multirank import run_script

    out = tmp_path / "dp.json"
    run_script(2, "bench/data_parallel.py", "--hidden", "32", "--steps", "1", "--warmup", "1",
               "--json", str(out))
    result = json.loads(out.read_text())
    variants = {(r["engine"], r["variant"]) for r in result["records"]}
    assert ("gloo", "torch-ddp") in variants and ("shm", "dp-overlap") in variants, variants
    assert set(result["hidden_fraction"]) == {"shm", "gloo"}


def body_ddp_arguments():
    """DataParallel with DistributedDataParallel's arguments, hooks and checkpoints, beside
    torch's DDP on the same group: equal losses and gradients."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastpar

    topo = fastpar.init()
    g = topo.dp_group

    def model(seed=0):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                   torch.nn.Linear(16, 4))

    def grads(wrapped, inner):
        torch.manual_seed(100 + topo.rank)
        wrapped(torch.randn(6, 8)).square().sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in inner.parameters()])

    theirs_model, ours_model = model(), model()
    ddp = DDP(theirs_model, process_group=g, bucket_cap_mb=0.001)
    ours = fastpar.DataParallel(ours_model, process_group=g, bucket_cap_mb=0.001,
                                broadcast_buffers=True, gradient_as_bucket_view=True,
                                static_graph=True)
    want = grads(ddp, theirs_model)
    worst = {"plain": (grads(ours, ours_model) - want).abs().max().item()}
    hooked_model, hooked_ddp_model = model(), model()
    hooked = fastpar.DataParallel(hooked_model, process_group=g, bucket_cap_mb=0.001)
    hooked.register_comm_hook(g, default_hooks.allreduce_hook)
    hooked_ddp = DDP(hooked_ddp_model, process_group=g, bucket_cap_mb=0.001)
    hooked_ddp.register_comm_hook(g, default_hooks.allreduce_hook)
    worst["allreduce_hook"] = (grads(hooked, hooked_model) -
                               grads(hooked_ddp, hooked_ddp_model)).abs().max().item()
    # a DDP checkpoint (keys with "module.") loads into DataParallel
    saved = model(5)
    ddp5 = DDP(saved, process_group=g)
    fresh = fastpar.DataParallel(model(6), process_group=g)
    fresh.load_state_dict(ddp5.state_dict())
    loaded = all(torch.equal(a, b) for a, b in zip(saved.parameters(), fresh.parameters()))
    # buffers: dp rank 0's at every forward, as DDP's broadcast_buffers
    with_buf = model()
    with_buf.register_buffer("stat", torch.zeros(3))
    dp_buf = fastpar.DataParallel(with_buf, process_group=g, broadcast_buffers=True)
    with_buf.stat.fill_(float(topo.rank + 7))
    dp_buf(torch.randn(2, 8))
    errors = []
    for kwargs in ({"device_ids": [0]}, {"group": g, "process_group": g},
                   {"bucket_mb": 4.0, "bucket_cap_mb": 2.0}):
        try:
            fastpar.DataParallel(model(), **kwargs)
        except ValueError as exc:
            errors.append(str(exc))
    dist.barrier()
    return {"worst": worst, "loaded": loaded, "buffer": with_buf.stat.tolist(),
            "errors": errors}


def test_ddp_arguments_comm_hook_and_ddp_checkpoints():
    for r in run_ranks(2, body_ddp_arguments).values():
        assert r["worst"]["plain"] <= 1e-6 and r["worst"]["allreduce_hook"] <= 1e-6, r
        assert r["loaded"] and r["buffer"] == [7.0] * 3, r
        assert len(r["errors"]) == 3 and "device_ids=[0]" in r["errors"][0], r["errors"]


def body_join():
    """Uneven inputs under join(): rank r has 2 + 2r batches. DataParallel and torch's DDP (on
    the same group, the same model and data) end with the same parameters on every rank."""
    import torch
    from torch.distributed.algorithms.join import Join
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastpar

    topo = fastpar.init()

    def train(wrapped, inner, context):
        opt = torch.optim.SGD(inner.parameters(), lr=0.1)
        with context:
            for step in range(2 + 2 * topo.rank):
                g = torch.Generator().manual_seed(100 * topo.rank + step)
                wrapped(torch.randn(4, 8, generator=g)).square().sum().backward()
                opt.step()
                opt.zero_grad()
        return torch.cat([p.detach().reshape(-1) for p in inner.parameters()])

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))

    a, b = model(), model()
    ours = fastpar.DataParallel(a, process_group=topo.dp_group, bucket_cap_mb=0.0002)
    theirs = DDP(b, process_group=topo.dp_group, bucket_cap_mb=0.0002)
    got = train(ours, a, ours.join())
    want = train(theirs, b, Join([theirs]))
    return {"worst": (got - want).abs().max().item(), "sum": got.sum().item()}


@pytest.mark.parametrize("nranks", [2, 4])
def test_join_uneven_inputs_like_ddp(nranks):
    got = run_ranks(nranks, body_join).values()
    assert all(g["worst"] <= 1e-6 for g in got), got
    assert len({round(g["sum"], 5) for g in got}) == 1, got  # every rank the same model
