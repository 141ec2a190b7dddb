"""Context-parallel attention (fastpar.nn.context) against serial attention in float64.

Every rank draws the full q, k, v and output gradient, takes its slice with ``context_split``,
runs ring or Ulysses attention, and gathers the output and the input gradients back with
``context_gather``; all are compared on every rank with attention written out here in float64,
the bound derived from the same formula's float32 error (``fastpar.testing``). Layouts: cp 1
(groups of one rank), cp 2, cp 4, and cp 2 on {0, 1} and {2, 3} of a 4-rank world (the two
groups get different data, so a call that talked over the wrong group cannot pass).
"""

import pytest
import torch

from fastpar.nn.attention import apply_rotary, rotary_tables
from fastpar.nn import context_math
from fastpar.nn.context_math import keep_mask
from fastpar.testing import Checks
from tests.multirank import run_ranks

B, H, D = 2, 4, 8
T = 24  # divisible by 2cp for cp 1, 2, 4
P_DROP = 0.3
# (kind, causal, kv heads, dropout p): MHA, GQA with Hkv >= cp and Hkv < cp, dropout on/off;
# "ring" takes its default engine (p2p: torch isend/irecv), "ring-shared" the shared-memory one
# (causal only: the engines differ in how blocks reach a rank, not in the block math; each
# block shape is a segment set-up)
CASES = [(kind, causal, hkv, p) for kind in ("ring", "ulysses")
         for causal in (True, False) for hkv, p in ((4, 0.0), (2, 0.0), (1, 0.0), (2, P_DROP))]
CASES += [("ring-shared", True, hkv, p) for hkv, p in ((1, 0.0), (2, P_DROP))]
# the ring's written-out blocks without dropout (on the CPU those run torch's fused kernel;
# a GPU, or dropout, runs the written-out math, which is what these check here)
CASES += [("ring-written", causal, hkv, 0.0) for causal, hkv in ((True, 2), (False, 1))]


def serial_attention(q, k, v, causal, p=0.0, seed=0):
    """softmax(q k^T / sqrt(D) + mask) v written out, kv heads repeated; dropout by the rule
    of ``context_math.keep_mask`` (global heads and positions)."""
    b, h, t, d = q.shape
    rep = h // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / d ** 0.5
    if causal:
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    prob = s.softmax(-1)
    if p:
        pos = torch.arange(t)
        prob = prob * keep_mask(seed, p, b, torch.arange(h), pos, pos) / (1 - p)
    return prob @ v


def _reference(inputs, dout, causal, p, seed, dtype):
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    out = serial_attention(*leaves, causal, p, seed)
    out.backward(dout.to(dtype))
    return [out.detach()] + [x.grad for x in leaves]


def _check_layout(group, seed, checks: Checks):
    from fastpar.nn import context

    for case, (kind, causal, hkv, p) in enumerate(CASES):
        gen = torch.Generator().manual_seed(seed * 100 + case)
        full = [torch.randn(B, H, T, D, generator=gen), torch.randn(B, hkv, T, D, generator=gen),
                torch.randn(B, hkv, T, D, generator=gen)]
        dout = torch.randn(B, H, T, D, generator=gen)
        drop_seed = seed * 7 + case
        ref = _reference(full, dout, causal, p, drop_seed, torch.float64)
        serial = _reference(full, dout, causal, p, drop_seed, torch.float32)
        local = [context.context_split(x, group, 2).detach().requires_grad_() for x in full]
        attend = {"ring": context.ring_attention, "ulysses": context.ulysses_attention,
                  "ring-shared": lambda *a, **kw: context.ring_attention(*a, engine="shared", **kw),
                  "ring-written": context.ring_attention}
        fused, asked = context_math.fused_kernel, []
        if kind == "ring-written":
            context_math.fused_kernel = lambda q, keep: asked.append(1) and False
        try:
            out = attend[kind](*local, group, causal=causal, dropout_p=p, dropout_seed=drop_seed)
            out.backward(context.context_split(dout, group, 2))
        finally:
            context_math.fused_kernel = fused
        assert kind != "ring-written" or asked, "the ring never asked for a block's kernel"
        got = [context.context_gather(t.detach(), group, 2)
               for t in (out, *(x.grad for x in local))]
        name = f"{kind} causal={causal} hkv={hkv} p={p}"
        for what, g, r, s in zip(("out", "dq", "dk", "dv"), got, ref, serial):
            checks.close(f"{name} {what}", g, r, s)


def _check_layout_helpers(group, cp, rank):
    from fastpar.nn import context

    x = torch.arange(2 * T * 3, dtype=torch.float32).view(2, T, 3)
    pos = context.context_positions(T, group)
    c = T // (2 * cp)
    want = list(range(rank * c, (rank + 1) * c)) + \
        list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))
    assert pos.tolist() == want
    assert torch.equal(context.context_split(x, group, 1), x[:, pos])
    assert torch.equal(context.context_gather(x[:, pos], group, 1), x)
    # rotary embedding of a slice at its true positions = the slice of the rotated sequence
    q = torch.randn(2, H, T, D, generator=torch.Generator().manual_seed(rank))
    cos, sin = rotary_tables(T, D, 10000.0, q.dtype, q.device)
    assert torch.equal(apply_rotary(context.context_split(q, group, 2), cos[pos], sin[pos]),
                       context.context_split(apply_rotary(q, cos, sin), group, 2))


def _check_refusals(group, cp):
    from fastpar.nn import context

    bad = 2 * cp * 3 + cp  # not divisible by 2cp (odd per rank)
    with pytest.raises(ValueError, match=f"sequence length {bad} is not divisible by 2 x cp = "
                                         f"{2 * cp}"):
        context.context_split(torch.zeros(1, 1, bad, 2), group, 2)
    q = torch.zeros(1, 2, bad // cp, 4)
    for attend in (context.ring_attention, context.ulysses_attention):
        with pytest.raises(ValueError, match=f"sequence length {bad} is not divisible by "
                                             f"2 x cp = {2 * cp}"):
            attend(q, q, q, group)
        with pytest.raises(ValueError, match="3 query heads are not divisible by 2 kv heads"):
            attend(torch.zeros(1, 3, 2, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4),
                   group)
    if cp > 1:
        odd = torch.zeros(1, cp + 1, 2, 4)
        with pytest.raises(ValueError, match=f"{cp + 1} query heads are not divisible by cp "
                                             f"{cp}"):
            context.ulysses_attention(odd, odd, odd, group)
    with pytest.raises(ValueError, match="group is None"):
        context.ring_attention(q, q, q, None)
    q = torch.zeros(1, 2, 2, 4)
    with pytest.raises(ValueError, match="engine must be 'p2p' or 'shared', got 'nccl'"):
        context.ring_attention(q, q, q, group, engine="nccl")


def _layout(group, cp, rank, seed):
    from fastpar.runtime import job

    checks = Checks()
    _check_layout_helpers(group, cp, rank)
    _check_layout(group, seed, checks)
    # engine="shared" ran on its buffers, made for this group (none at cp 1: nothing moves)
    held = job().parts.get("nn.context_ring.buffers", {})
    shared = [key for key in held if key[0] == id(group)]
    assert bool(shared) == (cp > 1), (cp, list(held))
    _check_refusals(group, cp)
    return {"checked": len(checks.checked), "worst": list(checks.worst)}


def body_context(seed):
    import torch.distributed as dist

    import fastpar

    topo = fastpar.init(timeout=60)
    n, rank = topo.world_size, topo.rank
    out = {f"cp{n}": _layout(dist.group.WORLD, n, rank, seed)}
    if n == 2:  # cp 1: groups of one rank, no communication
        singles = [dist.new_group([r]) for r in range(n)]  # collective, in order
        out["cp1"] = _layout(singles[rank], 1, 0, seed + rank + 1)
    if n == 4:  # cp 2 twice, each pair with its own data
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        out["cp2x2"] = _layout(pairs[rank // 2], 2, rank % 2, seed + 10 + rank // 2)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_context_attention_against_serial(world):
    values = run_ranks(world, body_context, seed=world, timeout=120).values()
    for layout in values[0]:
        results = [v[layout] for v in values]
        assert {r["checked"] for r in results} == {4 * len(CASES)}, layout
        ratio, name = max(tuple(r["worst"]) for r in results)
        print(f"world {world} {layout}: worst error / bound = {ratio:.3f} ({name})")


@pytest.mark.quick
def test_dropout_rule_keeps_one_minus_p():
    """The hash keeps 1 - p of the entries, independently of position, head and batch row."""
    pos = torch.arange(128)
    keep = keep_mask(1234, P_DROP, 2, torch.arange(4), pos, pos).double()
    assert abs(keep.mean().item() - (1 - P_DROP)) < 0.01
    # no structure along rows, columns or heads: each row's and column's rate is near 1 - p
    assert (keep.mean(-1) - (1 - P_DROP)).abs().max() < 0.15
    assert (keep.mean(-2) - (1 - P_DROP)).abs().max() < 0.15
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep, keep_mask(1235, P_DROP, 2, torch.arange(4), pos, pos).double())


@pytest.mark.quick
def test_choose_type_follows_the_layout():
    """The policy of docs/design.md: Ulysses where the heads per tp rank divide by cp inside a
    host without dropout; the ring otherwise, each answer naming why."""
    from fastpar.nn.context import choose_type

    assert choose_type(8, 8, 2)[0] == "ulysses"
    kind, why = choose_type(8, 2, 4)  # GQA with fewer kv heads than cp: repeated, still fine
    assert kind == "ulysses" and "repeated 2x" in why
    kind, why = choose_type(6, 6, 4)
    assert kind == "ring" and "6 heads per tp rank" in why and "cp 4" in why
    kind, why = choose_type(8, 8, 4, tp=4)  # tp leaves 2 heads a rank
    assert kind == "ring" and "2 heads per tp rank (heads 8 / tp 4)" in why
    assert choose_type(8, 8, 2, same_host=False)[0] == "ring"
    assert choose_type(8, 8, 2, dropout=True)[0] == "ring"
    with pytest.raises(ValueError, match="heads 6, kv heads 4"):
        choose_type(6, 4, 2)
