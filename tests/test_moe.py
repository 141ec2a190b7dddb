"""fastpar.nn.MoE against a serial MoE written here, one token and one choice at a time, from the
full weights: forward, the input's, router's and every expert's gradient, both router losses,
the expert load and the dropped slots, in float32 against float64 with the rounding bound of
``fastpar.testing`` (a multiple of the float32 serial loop's own error).

Layouts: ep 1 without a group (in this process) and with a group of one rank per rank (world
2), ep 2 (world 2), ep 4 and ep 2 inside world 4 (groups {0, 1} and {2, 3}). Every rank has its
own tokens (a different count per rank); a rank's reference regenerates the tokens of every rank
of its ep group, runs them through the serial layer (capacities per rank, as the layer does),
and sums the ranks' losses, so the experts' gradients are the group's. One rank body per world
size runs every case (the suite's time).
"""

import copy
import math

import pytest
import torch
from torch import nn

from tests.multirank import run_ranks

H, F, E = 8, 12, 8  # hidden, ffn, experts (divisible by every ep)
A, B = 0.3, 0.05  # aux_loss_coef, z_loss_coef: large enough to show in the router's gradient
NAMES = {"gelu": ("fc1", "fc2"), "swiglu": ("gate_proj", "up_proj", "down_proj")}
# (activation, top_k, capacity_factor, renormalize, starve): starve biases the router so that
# experts 2 and 3 get no token (at ep 4 rank 1 then receives no row at all)
CASES = [("gelu", 2, None, False, False), ("swiglu", 1, None, False, False),
         ("swiglu", 2, 1.0, True, False), ("gelu", 1, 1.25, True, False),
         ("gelu", 2, 0.5, False, True)]
STARVED = (2, 3)


def _serial(seed, activation):
    """The serial layer as ``MoE``'s docstring defines it: router, then E bias-free MLPs, drawn
    in that order from the stream of ``seed``."""
    from fastpar.testing import SerialMLP

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        router = nn.Linear(H, E, bias=False)
        experts = nn.ModuleList(SerialMLP(H, F, activation, bias=False) for _ in range(E))
    return router, experts


def _tokens(seed, rank, starve):
    """Rank ``rank``'s input (2, 2 + rank, H) and output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    x = torch.randn(2, 2 + rank, H, generator=g)
    if starve:  # feature 0 positive: the starved experts' logits are -8 x[0] <= -8
        x[..., 0] = x[..., 0].abs() + 1
    return x, torch.randn(2, 2 + rank, H, generator=g)


def _reference(router, experts, xs, dys, spec, dtype):
    """The ranks' tokens ``xs`` through the serial layer in ``dtype``, loss = sum over ranks of
    sum(y * dy) + A load_balancing + B z_loss. Returns one dict per rank and the experts'
    gradients stacked as the layer stores its weights."""
    activation, k, factor, renormalize, _ = spec
    routers = [copy.deepcopy(router).to(dtype) for _ in xs]
    mlps = copy.deepcopy(experts).to(dtype)
    total, ranks = 0.0, []
    for x, dy, r in zip(xs, dys, routers):
        x = x.reshape(-1, H).to(dtype).requires_grad_()
        t = x.shape[0]
        logits = r(x)
        p = logits.softmax(-1)
        ranked = p.argsort(-1, descending=True)
        if k < E:  # a choice within rounding of a tie would make float32 route differently
            gap = p.gather(1, ranked[:, k - 1:k]) - p.gather(1, ranked[:, k:k + 1])
            assert gap.min() > 1e-5, f"test data: top-{k} within {gap.min():.2g} of a tie"
        chosen = ranked[:, :k]
        gates = p.gather(1, chosen)
        if renormalize:
            gates = gates / gates.sum(1, keepdim=True)
        cap = None if factor is None else math.ceil(factor * t * k / E)
        taken, kept, dropped = [0] * E, [0] * t, 0
        ys = [x.new_zeros(H) for _ in range(t)]
        for j in range(k):  # the drop rule: queue by choice, then by token
            for tok in range(t):
                e = int(chosen[tok, j])
                if cap is not None and taken[e] >= cap:
                    dropped += 1
                    continue
                taken[e] += 1
                kept[tok] += 1
                ys[tok] = ys[tok] + gates[tok, j] * mlps[e](x[tok])
        y = torch.stack(ys)
        load = torch.bincount(chosen.reshape(-1), minlength=E)
        balance = E * (load.to(dtype) / (t * k) * p.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean()
        total = total + (y * dy.reshape(-1, H).to(dtype)).sum() + A * balance + B * z
        ranks.append({"y": y, "x": x, "router": r, "balance": balance, "z": z, "load": load,
                      "dropped": dropped, "emptied": [tok for tok in range(t) if not kept[tok]]})
    total.backward()
    grads = {}
    for name in NAMES[activation]:
        grads[name] = torch.stack([
            getattr(m, name).weight.grad.t() if getattr(m, name).weight.grad is not None
            else torch.zeros_like(getattr(m, name).weight.t()) for m in mlps])
    return ranks, grads


def _check_cases(group, members, me, seed):
    """Every case of ``CASES`` on this rank (``members``: the global ranks of the ep group,
    ``me``: this rank's index there); returns what the test asserts across ranks."""
    from fastpar.nn import MoE
    from fastpar.testing import Checks

    c, ep = Checks(), len(members)
    seen = {"dropped": 0, "emptied": 0, "starved_rows": 0}
    for i, spec in enumerate(CASES):
        activation, k, factor, renormalize, starve = spec
        tag = f"ep{ep}.{activation}.k{k}.cap{factor}.renorm{int(renormalize)}"
        s = seed + 17 * i
        router, experts = _serial(s, activation)
        moe = MoE(H, F, E, k, group=group, capacity_factor=factor, activation=activation,
                  renormalize=renormalize, aux_loss_coef=A, z_loss_coef=B, seed=s)
        # the initialisation contract: this rank's slice of the serial layer's weights
        per = E // ep
        assert torch.equal(moe.router.weight, router.weight), tag
        for name in NAMES[activation]:
            full = torch.stack([getattr(m, name).weight.t() for m in experts])
            assert torch.equal(getattr(moe.experts, name), full[me * per:(me + 1) * per]), name
        if starve:
            with torch.no_grad():
                router.weight[list(STARVED)] = 0.0
                router.weight[list(STARVED), 0] = -8.0
                moe.router.weight.copy_(router.weight)
        data = [_tokens(s, g, starve) for g in members]
        xs, dys = [d[0] for d in data], [d[1] for d in data]
        ref64, g64 = _reference(router, experts, xs, dys, spec, torch.float64)
        ref32, g32 = _reference(router, experts, xs, dys, spec, torch.float32)
        x = xs[me].clone().requires_grad_()
        y = moe(x)
        ((y * dys[me]).sum() + moe.aux_loss).backward()
        r64, r32 = ref64[me], ref32[me]
        c.close(f"{tag}.out", y.reshape(-1, H), r64["y"], r32["y"])
        c.close(f"{tag}.dx", x.grad.reshape(-1, H), r64["x"].grad, r32["x"].grad)
        c.close(f"{tag}.drouter", moe.router.weight.grad, r64["router"].weight.grad,
                r32["router"].weight.grad)
        for name in NAMES[activation]:
            local = slice(me * per, (me + 1) * per)
            c.close(f"{tag}.d{name}", getattr(moe.experts, name).grad, g64[name][local],
                    g32[name][local])
        c.close(f"{tag}.load_balancing", moe.last_aux["load_balancing"], r64["balance"],
                r32["balance"])
        c.close(f"{tag}.z_loss", moe.last_aux["z_loss"], r64["z"], r32["z"])
        assert moe.expert_load.tolist() == r64["load"].tolist(), (tag, moe.expert_load)
        assert moe.last_dropped == r64["dropped"], (tag, moe.last_dropped, r64["dropped"])
        if factor is None:
            assert moe.last_dropped == 0
        # a token whose every slot was dropped gets exactly zero (the residual carries it)
        emptied = r64["emptied"]
        assert torch.equal(y.reshape(-1, H)[emptied], torch.zeros(len(emptied), H)), tag
        seen["dropped"] += moe.last_dropped
        seen["emptied"] += len(emptied)
        if starve:
            assert all(moe.expert_load[e] == 0 for e in STARVED), moe.expert_load
            for name in NAMES[activation]:  # a starved expert here: a zero gradient
                for e in STARVED:
                    if me * per <= e < (me + 1) * per:
                        assert not getattr(moe.experts, name).grad[e - me * per].any()
                        seen["starved_rows"] += 1
    return {"checked": c.checked, "worst": c.worst, **seen}


def _state_dict_and_marker(group, seed):
    """The state dict gathers to the serial layer's (group None); loading it back slices it;
    only expert parameters carry the expert-parallel marker."""
    import fastpar
    from fastpar.nn import MoE

    moe = MoE(H, F, E, 2, group=group, activation="swiglu", seed=seed)
    serial = MoE(H, F, E, 2, activation="swiglu", seed=seed).state_dict()
    full = fastpar.full_state_dict(moe)
    assert list(full) == list(serial), (list(full), list(serial))
    assert all(torch.equal(full[key], serial[key]) for key in serial)
    other = MoE(H, F, E, 2, group=group, activation="swiglu", seed=seed + 1)
    fastpar.load_full_state_dict(other, serial)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(),
                                                 moe.state_dict().values()))
    marked = {name for name, p in moe.named_parameters() if getattr(p, "expert_parallel", False)}
    assert marked == {f"experts.{n}" for n in NAMES["swiglu"]}, marked


def _not_divisible(group, ep):
    from fastpar.nn import MoE

    experts = ep + 1 if ep > 2 else 3
    with pytest.raises(ValueError, match=f"num_experts {experts} is not divisible by the "
                                         f"expert-parallel size {ep}"):
        MoE(H, F, experts, 1, group=group)


def _phase_hook(group, rank):
    """``phase_hook`` sees every phase in order with its result, and changes nothing: the same
    output and gradients, bitwise, with it on as off. Returns the phases it saw."""
    from fastpar.nn import MoE

    moe = MoE(H, F, E, 2, group=group, seed=7)
    x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    runs = []
    for seen in (None, []):
        moe.zero_grad(set_to_none=True)
        x.grad = None
        moe.phase_hook = None if seen is None else (lambda name, t: seen.append((name, t)))
        y = moe(x)
        (y.square().sum() + moe.aux_loss).backward()
        runs.append((y.detach(), x.grad, *(p.grad for p in moe.parameters())))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    names = [name for name, _ in seen]
    tensors = dict(seen)
    assert tensors["route"] is None and seen[-1][1] is y, names
    assert tensors["permute"].shape == (2 * 15, H) and tensors["experts"].requires_grad, names
    if group is None:  # (a process group does not deepcopy)
        assert copy.deepcopy(moe).phase_hook is None
    return names


def body_moe(seed):
    import torch.distributed as dist

    import fastpar

    topo = fastpar.init(timeout=60)
    n, rank = topo.world_size, topo.rank
    world = dist.group.WORLD
    out = {f"ep{n}": _check_cases(world, list(range(n)), rank, seed)}
    if n == 2:  # ep 1 on a group of one rank: no communication, each rank its own reference
        singles = [dist.new_group([r]) for r in range(n)]  # collective, in order
        out["ep1"] = _check_cases(singles[rank], [rank], 0, seed + 1)
    if n == 4:  # ep 2 twice: a layer that talked over the world would mix the two groups
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        first = rank // 2 * 2
        out["ep2"] = _check_cases(pairs[rank // 2], [first, first + 1], rank - first, seed + 2)
        _state_dict_and_marker(pairs[rank // 2], seed)
    _state_dict_and_marker(world, seed)
    _not_divisible(world, n)
    if n == 2:
        out["phases"] = _phase_hook(world, rank)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_moe_against_serial(world):
    values = run_ranks(world, body_moe, seed=300 + world, timeout=120).values()
    if world == 2:
        assert [v.pop("phases") for v in values] == [[
            "route", "permute", "counts", "a2a_out", "experts", "a2a_back", "unpermute"]] * 2
    for layout in values[0]:
        results = [v[layout] for v in values]
        assert len({len(r["checked"]) for r in results}) == 1
        assert len(results[0]["checked"]) == sum(5 + len(NAMES[case[0]]) for case in CASES)
        # the capacity cases dropped slots, emptied some token, and starved a local expert
        assert sum(r["dropped"] for r in results) > 0, layout
        assert sum(r["emptied"] for r in results) > 0, layout
        assert sum(r["starved_rows"] for r in results) > 0, layout
        ratio, name = max(tuple(r["worst"]) for r in results)
        print(f"world {world} {layout}: worst error / bound = {ratio:.3f} ({name})")


def test_moe_without_a_group():
    """group=None: every expert here, no communication and no fastpar.init."""
    result = _check_cases(None, [3], 0, seed=900)  # 10 tokens
    assert result["dropped"] > 0 and result["emptied"] > 0 and result["starved_rows"] > 0
    print(f"ep1 without a group: worst error / bound = {result['worst'][0]:.3f} "
          f"({result['worst'][1]})")


@pytest.mark.quick
def test_moe_phase_hook_without_a_group():
    assert _phase_hook(None, 0) == ["route", "permute", "experts", "unpermute"]


@pytest.mark.quick
def test_moe_expert_marker_survives_copies_and_materialisation():
    import pickle

    from fastpar.nn import MoE

    def marked(m):
        return sorted(n for n, p in m.named_parameters() if getattr(p, "expert_parallel", False))

    moe = MoE(H, F, E, 2, seed=0)
    want = ["experts.fc1", "experts.fc2"]
    moe(torch.randn(3, H)).sum().backward()  # aux_loss (a non-leaf) is not part of a copy
    assert marked(copy.deepcopy(moe)) == want and copy.deepcopy(moe).aux_loss is None
    assert marked(pickle.loads(pickle.dumps(moe))) == want
    meta = MoE(H, F, E, 2, device="meta")
    meta.to_empty(device="cpu")
    assert marked(meta) == want and marked(moe.double()) == want


@pytest.mark.quick
def test_moe_bad_arguments_name_the_values():
    from fastpar.nn import MoE

    for kwargs, message in [
            (dict(num_experts=4, top_k=5), "top_k 5 is larger than num_experts 4"),
            (dict(num_experts=4, top_k=0), "top_k must be a positive integer, got 0"),
            (dict(num_experts=4, top_k=1, capacity_factor=0.0),
             "capacity_factor must be positive or None"),
            (dict(num_experts=4, top_k=1, activation="relu"),
             "activation must be 'gelu' or 'swiglu', got 'relu'")]:
        with pytest.raises(ValueError, match=message):
            MoE(H, F, **kwargs)
    with pytest.raises(ValueError, match=r"last dim is 5, hidden_size is 8 \(input shape "
                                         r"\(2, 5\)\)"):
        MoE(H, F, 4, 1)(torch.randn(2, 5))


@pytest.mark.quick
def test_sequence_balance_and_aux_through_the_output():
    """balance="sequence" is the mean over sequences of each sequence's own load-balancing loss
    (so any cut of a batch into microbatches or ranks has the same mean), and with_aux_loss
    backpropagates scale x aux_loss through the output: the same gradients as adding it."""
    import torch

    from fastpar.nn import MoE, with_aux_loss

    torch.manual_seed(3)
    x = torch.randn(4, 6, 16, dtype=torch.float64)
    seq = MoE(16, 24, 4, 2, balance="sequence", seed=1, dtype=torch.float64)
    tok = MoE(16, 24, 4, 2, seed=1, dtype=torch.float64)
    seq(x)
    alone = []
    for b in range(4):
        tok(x[b:b + 1])
        alone.append(tok.last_aux["load_balancing"])
    assert torch.allclose(seq.last_aux["load_balancing"], torch.stack(alone).mean(), rtol=1e-12)
    tok(x)  # over all 24 tokens at once: another number (the product of two means)
    assert not torch.allclose(tok.last_aux["load_balancing"], seq.last_aux["load_balancing"])
    # two halves (microbatches) average to the whole batch's loss
    halves = []
    for h in (x[:2], x[2:]):
        seq(h)
        halves.append(seq.last_aux["load_balancing"])
    seq(x)
    assert torch.allclose(torch.stack(halves).mean(), seq.last_aux["load_balancing"], rtol=1e-12)

    grads = []
    for attach in (False, True):
        seq.zero_grad(set_to_none=True)
        y = seq(x)
        if attach:
            with_aux_loss(y, seq.aux_loss, 0.25).square().sum().backward()
        else:
            (y.square().sum() + 0.25 * seq.aux_loss).backward()
        grads.append([p.grad.clone() for p in seq.parameters()])
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)
    assert seq.router.weight.grad.abs().sum() > 0
    with torch.no_grad():
        y = seq(x)
        assert with_aux_loss(y, seq.aux_loss, 1.0) is y
