"""fastpar.optim.DistributedOptimizer (ZeRO-1/2/3) against a serial model trained on the full
batch.

The serial model (float32) and its float64 copy step with ``torch.optim`` on the whole batch;
the ZeRO model is a plain copy on every rank, each dp rank backpropagating its 1/dp slice, and
the optimizer averages those per-rank gradients. Parameters are compared with the float64
reference within ``fastpar.testing``'s rounding bound after every step. Cases, one launch per
world size (1, 2, 4; dp = world): Adam (a frozen layer and a never-used parameter), AdamW with
weight decay and a StepLR schedule, SGD with momentum; ``clip_grad_norm_`` (norm value and
clipped update, both clipping and not); ``state_bytes`` about 1/dp of the serial state; the
per-rank state dict round trip; a consolidated state saved at dp 2 (a pair of ranks) and
reloaded at dp = world and at dp 1, training on equal to the reference. One more launch at
tp 2 x dp 2: ``ParallelMLP`` with ZeRO over dp and ``clip_grad_norm_(model=)`` against the
serial ``SerialMLP`` clip. Stages 2 and 3 run every case again (``test_zero_stages``), each
step as two accumulated halves (the first under ``no_sync()``, or on odd steps both reduced, the
shards accumulating; the never-used parameter's run then reduced at the step), stage 3 compared inside
``gathered()``; the checkpoint continuations load into the next stage (1 -> 2 -> 3 -> 1).
"""

import contextlib
import copy
import io
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastpar.testing import Checks
from tests.multirank import run_ranks

MB = 4  # rows per dp rank per step


class Net(nn.Module):
    """x (N, 10) -> (N, 5): a frozen layer, two trainable ones, and a parameter never used."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(10, 16), nn.Linear(16, 13), nn.Linear(13, 5)
        self.a.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def batches(seed, n, dp_max=4):
    """``n`` (x, y) full batches; dp ranks slice them, so the rows are a multiple of any dp."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(dp_max * MB, 10, generator=gen), torch.randn(dp_max * MB, 5,
                                                                        generator=gen))
            for _ in range(n)]


def serial_step(net, opt, x, y, max_norm=None):
    opt.zero_grad()
    F.mse_loss(net(x.to(net.b.weight.dtype)), y.to(net.b.weight.dtype)).backward()
    norm = None
    if max_norm is not None:
        norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
    opt.step()
    return norm


def make_opt(model, cls, stage, **kw):
    from fastpar.optim import DistributedOptimizer

    # stage 2 with 256-byte buckets: a run per parameter or two, launched during backward
    extra = {"bucket_mb": 256 / 2**20} if stage == 2 else {}
    return DistributedOptimizer(model.parameters(), cls, stage=stage, module=model, **extra,
                                **kw)


class in_place_calls:
    """Counts the shm engine's in-place (symmetric) all-gathers and reduce-scatters until
    ``restore()``; ``lower``: take them at any size (this test's buffers are small), and stage
    ZeRO-2/3's gradients through 64-byte rows, so that a run takes several chunks."""

    def __init__(self, lower: bool):
        from fastpar.comm.engines import shm as engines
        from fastpar.comm.engines.shm import ShmCommunicator
        from fastpar.optim import zero_grads
        from tests.multirank import count_calls

        self.engines, self.cls = engines, ShmCommunicator
        self.limits = {(engines, k): getattr(engines, k) for k in (
            "SYMMETRIC_GATHER_MIN", "SYMMETRIC_SCATTER_MIN", "SYMMETRIC_ALL_REDUCE_MIN")}
        self.limits[(zero_grads, "STAGING_ROW_BYTES")] = zero_grads.STAGING_ROW_BYTES
        if lower:
            for (module, k) in self.limits:
                setattr(module, k, 64 if k == "STAGING_ROW_BYTES" else 0)
        self.counts = count_calls(ShmCommunicator, "all_gather_symmetric",
                                  "all_gather_from_symmetric", "reduce_scatter_symmetric")

    def restore(self) -> None:
        for (module, k), v in self.limits.items():
            setattr(module, k, v)
        for name in self.counts:
            setattr(self.cls, name, getattr(self.cls, name).__wrapped__)


def zero_step(net, opt, x, y, group, max_norm=None, reduce_each=False):
    """One step on this rank's rows; stages 2 and 3 as two accumulated halves, the first under
    ``no_sync()`` or, with ``reduce_each``, both reduced (the shards accumulate)."""
    from fastpar.runtime import group_rank, group_size

    dp, r = group_size(group), group_rank(group)
    x, y = x.chunk(dp)[r], y.chunk(dp)[r]
    if opt.stage > 1:  # two accumulated halves: the mean over this rank's rows
        h = len(x) // 2
        with opt.no_sync() if not reduce_each else contextlib.nullcontext():
            (0.5 * F.mse_loss(net(x[:h]), y[:h])).backward()
        (0.5 * F.mse_loss(net(x[h:]), y[h:])).backward()
    else:
        F.mse_loss(net(x), y).backward()  # mean over this rank's rows
    norm = opt.clip_grad_norm_(max_norm) if max_norm is not None else None
    opt.step()
    opt.zero_grad(set_to_none=False)  # the next backward accumulates into zeros
    return norm


def compare(c, tag, par, ref, ser, opt):
    rp, sp = dict(ref.named_parameters()), dict(ser.named_parameters())
    with opt.gathered():  # stage 3: the full parameters, for the comparison
        for name, p in par.named_parameters():
            c.close(f"{tag}.{name}", p, rp[name], sp[name])


def check_training(c, topo, seed, stage):
    cases = [("adam.clip", torch.optim.Adam, {"lr": 1e-2}, 0.05, None),
             ("adam.noclip", torch.optim.Adam, {"lr": 1e-2}, 1e3, None),
             ("adamw.steplr", torch.optim.AdamW, {"lr": 2e-2, "weight_decay": 0.1}, None, 0.5),
             ("sgd", torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9}, 0.05, None)]
    data = batches(seed, 4)
    for name, cls, kw, max_norm, gamma in cases:
        tag = f"s{stage}.dp{topo.dp_size}.{name}"
        torch.manual_seed(seed)
        ser = Net()
        if cls is torch.optim.AdamW:  # decay moves a zero-gradient master: no unused param
            ser.unused.requires_grad_(False)
        ref, par = copy.deepcopy(ser).double(), copy.deepcopy(ser)
        trainable = [p for p in ser.parameters() if p.requires_grad]
        opts = [cls([p for p in m.parameters() if p.requires_grad], **kw) for m in (ser, ref)]
        # SGD takes the copying path (plain buffers), the others symmetric buffers when dp > 1
        # (the group's collectives go to shm here): both must match the serial optimizer. This
        # model's buffers are below the sizes where the in-place kernels pay, so the symmetric
        # cases lower those to 0 and count the in-place calls: every stage takes them.
        symmetric = topo.dp_size > 1 and cls is not torch.optim.SGD
        os.environ["FASTPAR_SYMMETRIC"] = "1" if symmetric else "0"
        inplace = in_place_calls(symmetric)
        opt = make_opt(par, cls, stage, **kw)
        del os.environ["FASTPAR_SYMMETRIC"]
        assert opt.symmetric == symmetric, repr(opt)
        assert opt.grads is None or opt.grads.symmetric == symmetric, repr(opt)
        if symmetric and opt.grads is not None:  # 16-element rows: runs in several chunks
            assert opt.grads.staging.numel() == 64 * topo.dp_size, opt.grads.staging.shape
        scheds = []
        if gamma is not None:
            scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=gamma) for o in (*opts, opt)]
        for step, (x, y) in enumerate(data):
            ns, nr = (serial_step(m, o, x, y, max_norm) for m, o in zip((ser, ref), opts))
            # odd steps reduce each half (a reduction per microbatch, shards accumulating)
            n = zero_step(par, opt, x, y, topo.dp_group, max_norm, reduce_each=step % 2 == 1)
            if max_norm is not None:
                c.close(f"{tag}.step{step}.norm", n, nr, ns)
                if step == 0:  # the clip cases clip (at least at first), noclip does not
                    assert (float(nr) > max_norm) == (name != "adam.noclip"), (tag, float(nr))
            for s in scheds:
                s.step()
            compare(c, f"{tag}.step{step}", par, ref, ser, opt)
        inplace.restore()
        if symmetric:  # the parameters' all-gathers and the gradients' reduce-scatters in place
            gathers = "all_gather_from_symmetric" if stage == 3 else "all_gather_symmetric"
            assert inplace.counts[gathers] >= len(data), (tag, inplace.counts)
            assert inplace.counts["reduce_scatter_symmetric"] >= len(data), (tag, inplace.counts)
        else:
            assert sum(inplace.counts.values()) == 0, (tag, inplace.counts)
        if scheds:
            lrs = {o.param_groups[0]["lr"] for o in (*opts, opt)}
            assert lrs == {kw["lr"] * gamma ** len(data)}, lrs
        with opt.gathered():
            assert torch.equal(par.a.weight, ser.a.weight)  # frozen: untouched
            if cls is torch.optim.Adam:
                assert torch.equal(par.unused, ser.unused)  # zero gradient, zero Adam update
        if name == "adam.noclip":  # fp32 masters, exp_avg, exp_avg_sq; a float32 step per group
            n_el = sum(p.numel() for p in trainable)
            got = opt.state_bytes()
            shard, runs = opt.flat[0].shard, len(opt.flat[0].runs)
            assert shard == sum(-(-(r.hi - r.lo) // topo.dp_size) for r in opt.flat[0].runs)
            assert got == 3 * 4 * shard + 4, (got, shard)
            # Against the unsharded optimizer, measured: its state tensors plus the float32
            # weights (what ZeRO's masters hold). Slack: padding (< 1 element of 12 bytes per
            # rank) and Adam's step, one 4-byte tensor per parameter there, per group here.
            full = sum(t.nbytes for st in opts[0].state.values() for t in st.values()
                       if torch.is_tensor(t)) + 4 * n_el
            assert abs(got - full / topo.dp_size) <= 12 * runs + 4 * len(trainable), \
                (got, full, topo.dp_size)
            c.checked.append(f"{tag}.state_bytes")


class Mixed(nn.Module):
    """A float32 layer and a bfloat16 one: two flat groups (float32 masters for both)."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(10, 12), nn.Linear(12, 5).to(torch.bfloat16)

    def forward(self, x):
        h = torch.tanh(self.l1(x.to(self.l1.weight.dtype)))
        return self.l2(h.to(self.l2.weight.dtype)).to(self.l1.weight.dtype)


def check_mixed(c, topo, seed, stage):
    """bfloat16 parameters step from float32 masters: no further from the float64 reference
    than serial Adam on the bfloat16 parameters themselves."""
    from fastpar import comm

    torch.manual_seed(seed)
    ser = Mixed()
    ref, par = copy.deepcopy(ser).double(), copy.deepcopy(ser)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ser, ref)]
    opt = make_opt(par, torch.optim.Adam, stage, lr=1e-2)
    assert [f.master.dtype for f in opt.flat] == [torch.float32, torch.float32]
    dp, r = topo.dp_size, topo.dp_rank
    for x, y in batches(seed + 5, 3):
        for m, o in zip((ser, ref), opts):
            o.zero_grad()
            F.mse_loss(m(x), y.to(m.l1.weight.dtype)).backward()
            o.step()
        F.mse_loss(par(x.chunk(dp)[r]), y.chunk(dp)[r]).backward()
        opt.step()
        opt.zero_grad()
    compare(c, f"mixed.s{stage}.dp{dp}", par, ref, ser, opt)
    with opt.gathered():
        w = par.l2.weight.detach().float().reshape(1, -1).clone()
    every = comm.all_gather(w, group=topo.dp_group)
    assert bool((every == every[0]).all()), "dp ranks hold different bfloat16 weights"


def check_checkpoints(c, topo, seed, stage):
    """Phase 1 at dp 2 (or 1 alone), then the same run continued after (a) the per-rank state
    dict into a new optimizer of the same group, (b) the consolidated state into dp = world and
    (c) into dp 1; every continuation matches the reference trained straight through."""
    import torch.distributed as dist


    world, rank = topo.world_size, topo.rank
    if world == 1:
        first, singles = topo.dp_group, [topo.dp_group]
    else:
        pairs = [dist.new_group([i, i + 1]) for i in range(0, world, 2)]  # every rank calls each
        first = pairs[rank // 2]
        singles = [dist.new_group([i]) for i in range(world)]
    single = singles[rank]
    kw = {"lr": 1e-2, "betas": (0.8, 0.95)}
    data = batches(seed + 7, 5)
    k1 = 3
    torch.manual_seed(seed)
    ser = Net()
    ref = copy.deepcopy(ser).double()
    opts = [torch.optim.Adam([p for p in m.parameters() if p.requires_grad], **kw)
            for m in (ser, ref)]
    par = copy.deepcopy(ser)
    opt = make_opt(par, torch.optim.Adam, stage, group=first, **kw)
    for i, (x, y) in enumerate(data):
        for m, o in zip((ser, ref), opts):
            serial_step(m, o, x, y)
        if i < k1:
            zero_step(par, opt, x, y, first)
    per_rank = opt.state_dict()
    buf = io.BytesIO()
    torch.save(opt.consolidated_state_dict(), buf)
    consolidated = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert consolidated["masters"][0].shape == (sum(
        p.numel() for p in ser.parameters() if p.requires_grad),)

    for label, group, how in (("same", first, "per_rank"), ("world", topo.dp_group, "full"),
                              ("one", single, "full")):
        torch.manual_seed(seed + 99)
        fresh = Net()  # other weights: the checkpoint must set them
        fresh.a.load_state_dict(ser.a.state_dict())  # the frozen layer is the model's business
        # the consolidated state loads into the next stage (the layout of its shards differs)
        new = make_opt(fresh, torch.optim.Adam, stage if how == "per_rank" else stage % 3 + 1,
                       group=group, lr=1.0)
        if how == "per_rank":
            new.load_state_dict(per_rank)
        else:
            new.load_consolidated_state_dict(consolidated)
        assert new.param_groups[0]["lr"] == kw["lr"] and new.param_groups[0]["betas"] == (0.8,
                                                                                          0.95)
        for x, y in data[k1:]:
            zero_step(fresh, new, x, y, group)
        compare(c, f"ckpt.s{stage}.{label}.dp{new.dp_size}", fresh, ref, ser, new)

    if world > 1:  # the per-rank state dict is tied to its dp size
        other = make_opt(copy.deepcopy(ser), torch.optim.Adam, stage, group=single, **kw)
        with pytest.raises(ValueError, match="consolidated_state_dict"):
            other.load_state_dict(per_rank)
        c.checked.append("ckpt.per_rank_mismatch")


def check_errors(c, topo):
    from fastpar.optim import DistributedOptimizer

    net = Net()
    with pytest.raises(TypeError, match="per-group"):
        DistributedOptimizer([{"params": list(net.parameters())}], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3, got 4"):
        DistributedOptimizer(net.parameters(), torch.optim.SGD, stage=4, lr=0.1)
    with pytest.raises(ValueError, match="needs module="):
        DistributedOptimizer(net.parameters(), torch.optim.SGD, stage=3, lr=0.1)
    with pytest.raises(ValueError, match="prefetch=False changes stage 3's"):
        DistributedOptimizer(net.parameters(), torch.optim.SGD, stage=2, prefetch=False, lr=0.1)
    with pytest.raises(ValueError, match="no trainable"):
        DistributedOptimizer(net.a.parameters(), torch.optim.SGD, lr=0.1)
    opt = DistributedOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    assert f"dp={topo.dp_size}" in repr(opt)
    for bad in (0.0, -1.0, float("nan")):  # before any collective: no reduction pending after
        with pytest.raises(ValueError, match="max_norm must be positive"):
            opt.clip_grad_norm_(bad)
    assert not opt._reduced
    c.checked.append("errors")


def check_released(c, topo, seed):
    """Stage 3 outside forward/backward and ``gathered()``: a released parameter reads as NaN
    of its shape (never freed memory), writing it raises, ``state_dict`` / ``load_state_dict``
    raise naming ``gathered()``; inside ``gathered()`` everything is the trained values."""
    from fastpar.optim import DistributedOptimizer

    torch.manual_seed(seed)
    net = Net()
    first = {k: v.clone() for k, v in net.state_dict().items()}
    opt = DistributedOptimizer(net.parameters(), torch.optim.SGD, stage=3, module=net, lr=0.1)
    w = net.b.weight
    assert w.shape == (13, 16) and w.numel() == 208 and bool(torch.isnan(w).all())
    assert "nan" in str(w)  # printing reads it: no crash
    assert not torch.isnan(net.a.weight).any()  # frozen: not sharded, always there
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            w.add_(1.0)  # the NaN is one element expanded: writes refuse
    for call in (net.state_dict, net.b.state_dict, lambda: net.load_state_dict(first)):
        with pytest.raises(RuntimeError, match=r"ZeRO-3: the parameters of (Net|Linear) are "
                                               r"released.*opt.gathered\(\)"):
            call()
    assert net.state_dict(keep_vars=True)["b.weight"] is w  # the Parameters: no values read
    with opt.gathered():
        got = net.state_dict()
        assert all(torch.equal(got[k], first[k]) for k in first)
    x, y = batches(seed, 1)[0]
    F.mse_loss(net(x[:MB]), y[:MB]).backward()
    assert bool(torch.isnan(w).all())  # released again after its backward
    opt.step()
    with opt.gathered():
        assert not torch.equal(net.b.weight, first["b.weight"])
        assert not torch.isnan(net.b.weight).any()
    c.checked.append("stage3.released")


def check_prefetch(c, topo, seed):
    """Stage 3 with ``prefetch=False``: the same training, bitwise, holding one unit fewer:
    inside b's forward the root's own unit and b's are gathered, not c's as well; as c's
    backward starts, c's, not b's as well (the root's gathers after: its hook on the same
    output tensor was registered later)."""
    from fastpar.optim import DistributedOptimizer

    x, y = batches(seed, 1)[0]
    x, y = x.chunk(topo.dp_size)[topo.dp_rank], y.chunk(topo.dp_size)[topo.dp_rank]
    trained, most, kinds = [], [], set()
    for prefetch in (True, False):
        torch.manual_seed(seed)
        net = Net()
        opt = DistributedOptimizer(net.parameters(), torch.optim.SGD, stage=3, module=net,
                                   lr=0.1, prefetch=prefetch)
        held = {"forward": [], "backward": []}

        def holds(buf):  # memory, not bookkeeping
            return buf.untyped_storage().nbytes() > 0

        def count(phase):  # after ZeRO-3's hooks: the unit is gathered, the next launched
            held[phase].append(sum(holds(e[2]) for e in opt.sharded.runs.values()))

        def on_output(module, args, out):  # its grad hook runs after ZeRO-3's gather
            out.register_hook(lambda g: count("backward"))
        hooks = [m.register_forward_pre_hook(lambda *_: count("forward"))
                 for m in (net.b, net.c)] + [net.c.register_forward_hook(on_output)]
        for _ in range(2):
            F.mse_loss(net(x), y).backward()
            opt.step()
            opt.zero_grad()
        for h in hooks:
            h.remove()
        with opt.gathered():
            trained.append({k: v.clone() for k, v in net.state_dict().items()})
        most.append((max(held["forward"]), max(held["backward"])))
        kinds.add(opt.symmetric)  # the masters, which the gathers read in place
        assert sum(holds(e[2]) for e in opt.sharded.runs.values()) == 0  # all released
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])
    assert most == [(3, 2), (2, 1)], most
    assert kinds == {topo.dp_size > 1}, kinds  # the group's collectives go to shm here
    c.checked.append("stage3.prefetch")


def check_no_room(c, topo, seed, stage):
    """A /dev/shm without room for the symmetric buffers (as in a container's 64 MiB): the
    optimizer keeps ordinary memory on every rank (one rank short is enough) and trains the
    same as with room, bitwise."""
    from unittest import mock

    from fastpar.comm import symmetric
    from fastpar.optim import DistributedOptimizer

    x, y = batches(seed, 1)[0]
    x, y = x.chunk(topo.dp_size)[topo.dp_rank], y.chunk(topo.dp_size)[topo.dp_rank]
    real, trained, kinds = symmetric.os.statvfs, [], []

    def full(path):  # the last rank's /dev/shm is (nearly) full
        st = real(path)
        if topo.rank != topo.world_size - 1:
            return st
        return type("St", (), {"f_bavail": 1, "f_frsize": st.f_frsize})()
    for room in (True, False):
        torch.manual_seed(seed)
        net = Net()
        with mock.patch.object(symmetric.os, "statvfs", real if room else full):
            opt = DistributedOptimizer(net.parameters(), torch.optim.Adam, stage=stage,
                                       module=net, lr=0.1)
        kinds.append(opt.symmetric)
        F.mse_loss(net(x), y).backward()
        opt.step()
        with opt.gathered():
            trained.append([p.detach().clone() for p in net.parameters()])
    assert kinds == [topo.dp_size > 1, False], kinds
    assert all(torch.equal(a, b) for a, b in zip(*trained))
    c.checked.append(f"stage{stage}.no_room")


def check_tp(c, topo, seed, stage):
    """tp x dp: ParallelMLP shards, ZeRO over the dp group; clip_grad_norm_(model=) sums the
    shards over tp once and the replicated fc2 bias once."""
    from fastpar import nn as pnn
    from fastpar.testing import SerialMLP

    torch.manual_seed(seed)
    ser = SerialMLP(8, 16)
    par = pnn.ParallelMLP(8, 16, seed=seed)
    ref = copy.deepcopy(ser).double()

    def local(name, full):
        owner, _, leaf = name.rpartition(".")
        module = par.get_submodule(owner)
        return module.shard_full(leaf, full) if isinstance(module, pnn.ShardedModule) else full

    kw = {"lr": 1e-2}
    opts = [torch.optim.AdamW(m.parameters(), **kw) for m in (ser, ref)]
    opt = make_opt(par, torch.optim.AdamW, stage, **kw)
    gen = torch.Generator().manual_seed(seed + 3)
    dp, r = topo.dp_size, topo.dp_rank
    for step in range(3):
        x, y = torch.randn(dp * MB, 3, 8, generator=gen), torch.randn(dp * MB, 3, 8, generator=gen)
        norms = []
        for m, o in zip((ser, ref), opts):
            o.zero_grad()
            dt = next(m.parameters()).dtype
            F.mse_loss(m(x.to(dt)), y.to(dt)).backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
            o.step()
        F.mse_loss(par(x.chunk(dp)[r]), y.chunk(dp)[r]).backward()
        n = opt.clip_grad_norm_(0.05, model=par)
        opt.step()
        opt.zero_grad()
        c.close(f"tp.s{stage}.step{step}.norm", n, norms[1], norms[0])
        rp, sp = dict(ref.named_parameters()), dict(ser.named_parameters())
        with opt.gathered():
            for name, p in par.named_parameters():
                c.close(f"tp.s{stage}.step{step}.{name}", p, local(name, rp[name]),
                        local(name, sp[name]))
    assert float(norms[1]) > 0.05  # it clipped


def body_zero(seed, tp=1, stages=(1,)):
    import fastpar

    topo = fastpar.init(tp=tp, timeout=60)
    c = Checks()
    for stage in stages:
        if tp > 1:
            check_tp(c, topo, seed, stage)
            continue
        check_errors(c, topo)
        check_training(c, topo, seed, stage)
        check_mixed(c, topo, seed, stage)
        check_checkpoints(c, topo, seed, stage)
        if stage == 3:
            check_released(c, topo, seed)
            check_prefetch(c, topo, seed)
        check_no_room(c, topo, seed, stage)
    return {"checked": c.checked, "worst": c.worst}


LAYOUTS = [(1, 1), (2, 1), (4, 1), (4, 2)]  # (world, tp)


@pytest.mark.quick
@pytest.mark.parametrize("world,tp", LAYOUTS, ids=[f"w{w}tp{t}" for w, t in LAYOUTS])
def test_zero(world, tp):
    values = run_ranks(world, body_zero, seed=4321, tp=tp, timeout=120).values()
    assert all(v["checked"] == values[0]["checked"] for v in values)
    assert len(values[0]["checked"]) > (10 if tp > 1 else 50), values[0]["checked"]


STAGE_LAYOUTS = [(1, 1), (2, 1), (4, 1), (4, 2)]  # (world, tp)


@pytest.mark.parametrize("world,tp", STAGE_LAYOUTS, ids=[f"w{w}tp{t}" for w, t in STAGE_LAYOUTS])
def test_zero_stages(world, tp):
    """Stages 2 and 3: every case of ``test_zero`` with accumulation, in one body per layout."""
    values = run_ranks(world, body_zero, seed=4321, tp=tp, stages=(2, 3), timeout=240).values()
    assert all(v["checked"] == values[0]["checked"] for v in values)
    assert len(values[0]["checked"]) > (20 if tp > 1 else 100), values[0]["checked"]
