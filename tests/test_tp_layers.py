"""fastpar.nn layers against the serial modules built from the same seed: outputs, input gradients
and every parameter gradient, float32 and bfloat16, sequence parallelism on and off, dropout
streams, and vocab-parallel cross-entropy.

Every result is checked against a float64 run of the serial module with the rounding bound of
``fastpar.testing`` (a multiple of the serial module's own error in the working dtype), so the
check holds on any CPU and catches any real bug. Layouts: tp = world (1, 2, 4) and tp 2 on 4
ranks (dp 2), where each dp replica draws its own data and checks against its own serial
reference: a layer that talks over the world instead of its tp group fails there. One launch
per layout runs the whole list of checks.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multirank import run_ranks

pytestmark = pytest.mark.quick  # every test here: the quick tier

DTYPES = ("float32", "bfloat16")
B, T = 2, 8  # batch, sequence (divisible by every tp)
LAYOUTS = [(1, 1), (2, 2), (4, 4), (4, 2)]  # (world, tp)


class Checker:
    """Runs serial (working dtype), reference (float64) and parallel modules on one rank's data
    and compares every result; records the names checked and the worst error / bound seen."""

    def __init__(self, topo, seed):
        self.n, self.r = topo.tp_size, topo.tp_rank
        # Same draws on the ranks of one tp group, different draws on each dp replica.
        self.data = torch.Generator().manual_seed(seed + 7919 * topo.dp_rank)
        self.checked, self.worst = [], (0.0, "")

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.data)

    def seed(self):
        return int(torch.randint(1 << 30, (1,), generator=self.data))

    def close(self, name, got, ref, serial, **kw):
        from fastpar.testing import assert_close

        ratio = assert_close(f"{name} (tp={self.n})", got, ref, serial, **kw)
        self.worst = max(self.worst, (ratio, name))
        self.checked.append(name)

    def shard(self, t, dim):
        return t.chunk(self.n, dim)[self.r]

    def compare(self, tag, par, ser, x_full, *, sp, sp_in=None, sp_out=None, seq_dim=1,
                in_parallel=False, out_parallel=False, before=None, ref=None):
        """Serial, float64 reference and parallel on the same data: output, dx, every parameter
        gradient. ``sp``: input and output sequence-sharded (``sp_in`` / ``sp_out`` override);
        ``in_parallel`` / ``out_parallel``: sharded along the last dim; ``before()`` runs before
        each forward (to seed dropout alike); ``ref``: the float64 reference module (default:
        ``ser`` in float64)."""
        from fastpar import nn as pnn

        sp_in = sp if sp_in is None else sp_in
        sp_out = sp if sp_out is None else sp_out
        dtype = next(ser.parameters()).dtype
        floating = x_full.is_floating_point()
        x_full = x_full.to(dtype) if floating else x_full
        ref = copy.deepcopy(ser).double() if ref is None else ref

        def run(module, x, dy=None):
            x = x.clone().requires_grad_(floating)
            if before is not None:
                before()
            y = module(x)
            if dy is None:
                dy = self.randn(*y.shape).to(dtype)
            y.backward(dy.to(y.dtype))
            return y.detach(), x.grad, dy, dict(module.named_parameters())

        y_s, dx_s, dy, p_s = run(ser, x_full)
        y_r, dx_r, _, p_r = run(ref, x_full.double() if floating else x_full, dy)

        def local_in(t):
            if in_parallel:
                t = self.shard(t, -1)
            return self.shard(t, seq_dim) if sp_in else t

        def local_out(t):
            if out_parallel:
                t = self.shard(t, -1)
            return self.shard(t, seq_dim) if sp_out else t

        yp, dxp, _, p_p = run(par, local_in(x_full), local_out(dy))
        self.close(f"{tag}.out", yp, local_out(y_r), local_out(y_s))
        if floating:
            self.close(f"{tag}.dx", dxp, local_in(dx_r), local_in(dx_s))
        for pname, p in p_p.items():
            owner, _, leaf = pname.rpartition(".")
            module = par.get_submodule(owner) if owner else par
            sharded = isinstance(module, pnn.ShardedModule)

            def local(full):
                return module.shard_full(leaf, full) if sharded else full

            self.close(f"{tag}.d{pname}", p.grad, local(p_r[pname].grad), local(p_s[pname].grad))


def body_layers(tp, seed):
    import fastpar
    from fastpar import nn as pnn
    from fastpar.testing import SerialAttention, SerialMLP

    topo = fastpar.init(tp=tp, timeout=60)
    c = Checker(topo, seed)
    n, r = c.n, c.r
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        fp32 = dtype == torch.float32
        for sp in (False, True):
            s = c.seed()
            tag = f"{dtype_name}.sp{int(sp)}"

            # ColumnParallelLinear: sharded and gathered output; init = slice of nn.Linear's.
            for gather in (False, True):
                torch.manual_seed(s)
                ser = nn.Linear(16, 24)
                par = pnn.ColumnParallelLinear(16, 24, gather_output=gather, sequence_parallel=sp,
                                               seed=s, dtype=dtype)
                if fp32:
                    assert torch.equal(par.weight, ser.weight.chunk(n, 0)[r]), "column init"
                    assert torch.equal(par.bias, ser.bias.chunk(n, 0)[r]), "column bias init"
                c.compare(f"{tag}.column.gather{int(gather)}", par, ser.to(dtype),
                          c.randn(B, T, 16), sp=sp, sp_out=False, out_parallel=not gather)

            # RowParallelLinear: parallel and replicated input.
            for in_par in (True, False):
                torch.manual_seed(s)
                ser = nn.Linear(24, 16)
                par = pnn.RowParallelLinear(24, 16, input_is_parallel=in_par, sequence_parallel=sp,
                                            seed=torch.Generator().manual_seed(s), dtype=dtype)
                if fp32:
                    assert torch.equal(par.weight, ser.weight.chunk(n, 1)[r]), "row init"
                    assert torch.equal(par.bias, ser.bias), "row bias init"
                c.compare(f"{tag}.row.in_par{int(in_par)}", par, ser.to(dtype), c.randn(B, T, 24),
                          sp=sp, sp_in=False, in_parallel=in_par)

            # Sequence dim 0 (sequence-first activations).
            if sp:
                torch.manual_seed(s)
                ser = nn.Linear(16, 24)
                par = pnn.ColumnParallelLinear(16, 24, gather_output=True, sequence_parallel=True,
                                               sequence_dim=0, seed=s, dtype=dtype)
                c.compare(f"{tag}.column.seqdim0", par, ser.to(dtype), c.randn(T, B, 16), sp=True,
                          sp_out=False, seq_dim=0)

            # VocabParallelEmbedding: vocabularies divisible and not by tp, an empty shard (5 rows
            # over 4 ranks), a padding_idx; its state dict holds no padding rows.
            for vocab, pad in ((32, None), (31, 3), (5, None)):
                torch.manual_seed(s)
                ser = nn.Embedding(vocab, 12, padding_idx=pad)
                par = pnn.VocabParallelEmbedding(vocab, 12, pad, sequence_parallel=sp, seed=s,
                                                 dtype=dtype)
                ids = torch.randint(vocab, (B, T), generator=c.data)
                if fp32:
                    assert torch.equal(par.weight, ser.weight[par.vocab_start:par.vocab_end])
                    assert par.state_dict()["weight"].shape[0] == par.vocab_end - par.vocab_start
                    full = fastpar.full_state_dict(par)["weight"]
                    assert torch.equal(full, ser.weight), "embedding full_state_dict"
                c.compare(f"{tag}.embedding.V{vocab}", par, ser.to(dtype), ids, sp=sp,
                          sp_in=False)

            # Norms: replicated parameters, gradients summed over ranks under sequence parallel.
            for kind in ("layer", "rms"):
                if kind == "layer":
                    ser = nn.LayerNorm(12)
                    par = pnn.LayerNorm(12, sequence_parallel=sp, dtype=dtype)
                else:
                    ser = nn.RMSNorm(12, eps=1e-6)
                    par = pnn.RMSNorm(12, eps=1e-6, sequence_parallel=sp, dtype=dtype)
                with torch.no_grad():
                    for p in ser.parameters():
                        p.copy_(c.randn(*p.shape))
                ser = ser.to(dtype)
                par.load_state_dict(ser.state_dict())
                c.compare(f"{tag}.{kind}norm", par, ser, c.randn(B, T, 12), sp=sp)

            # ParallelMLP against the same block of nn.Linear, drawn in the same order.
            for act in ("gelu", "swiglu"):
                torch.manual_seed(s)
                ser = SerialMLP(16, 32, act)
                par = pnn.ParallelMLP(16, 32, act, sequence_parallel=sp, seed=s, dtype=dtype)
                if fp32:
                    full = fastpar.full_state_dict(par)
                    assert full.keys() == ser.state_dict().keys()
                    assert all(torch.equal(full[k], v) for k, v in ser.state_dict().items())
                c.compare(f"{tag}.mlp.{act}", par, ser.to(dtype), c.randn(B, T, 16), sp=sp)

            # ParallelSelfAttention: MHA and GQA, causal, with and without biases.
            for heads, kv in ((4, 4), (8, 4)):
                # Serial on SDPA, the parallel layer's kernel; reference written out in float64.
                torch.manual_seed(s)
                ser = SerialAttention(32, heads, kv, bias=True, sdpa=True)
                par = pnn.ParallelSelfAttention(32, heads, kv, bias=True, sequence_parallel=sp,
                                                seed=s, dtype=dtype)
                ref = copy.deepcopy(ser).double()
                ref.sdpa = False
                c.compare(f"{tag}.attn.h{heads}kv{kv}", par, ser.to(dtype), c.randn(B, T, 32),
                          sp=sp, ref=ref)

        check_cross_entropy(c, dtype)
    check_overlap(c)
    check_rng(c, topo, seed)
    check_dropout(c, topo)
    check_errors(c)
    return {"checked": c.checked, "worst": c.worst}


def check_cross_entropy(c, dtype):
    """vocab_parallel_cross_entropy against F.cross_entropy on the full logits: 2-D and 3-D
    logits, a vocabulary padded to a multiple of tp, label smoothing, every reduction."""
    from fastpar import nn as pnn

    n, r = c.n, c.r
    name_dtype = str(dtype).removeprefix("torch.")
    for vocab in (32, 30):
        per = -(-vocab // n)
        for smoothing in (0.0, 0.1):
            for lead in ((B * T,), (B, T)):
                logits = (3 * c.randn(*lead, vocab)).to(dtype)
                target = torch.randint(vocab, lead, generator=c.data)
                target.view(-1)[::5] = -100
                for reduction in ("mean", "sum", "none"):
                    name = f"{name_dtype}.ce.{len(lead) + 1}d.V{vocab}.ls{smoothing}.{reduction}"
                    # Serial: F.cross_entropy in float32 (the arithmetic of ours), gradient
                    # rounded to the logits' dtype; reference: the same in float64.
                    outs = {}
                    for kind, wide in (("serial", torch.float32), ("ref", torch.float64)):
                        x = logits.to(wide, copy=True).requires_grad_(True)
                        loss = F.cross_entropy(x.flatten(0, -2), target.flatten(),
                                               ignore_index=-100, label_smoothing=smoothing,
                                               reduction=reduction)
                        loss = loss.view(target.shape) if reduction == "none" else loss
                        dloss = torch.ones_like(loss) if reduction != "none" else \
                            torch.randn(loss.shape, generator=torch.Generator().manual_seed(7))
                        loss.backward(dloss.to(wide))
                        grad = x.grad if kind == "ref" else x.grad.to(dtype)
                        outs[kind] = (loss.detach(), grad, dloss)
                    # Padded vocabulary: columns past `vocab` hold large garbage that must not
                    # count.
                    padded = torch.cat([logits, 50 + c.randn(*lead, per * n - vocab).to(dtype)],
                                       -1)
                    shard = padded.chunk(n, -1)[r].clone().requires_grad_(True)
                    calls = []
                    real = pnn.cross_entropy.all_reduce
                    pnn.cross_entropy.all_reduce = lambda t, *a, **k: (calls.append(t.shape),
                                                                        real(t, *a, **k))[1]
                    try:
                        loss = pnn.vocab_parallel_cross_entropy(shard, target, -100, smoothing,
                                                                vocab_size=vocab,
                                                                reduction=reduction)
                    finally:
                        pnn.cross_entropy.all_reduce = real
                    assert len(calls) == 2, \
                        f"expected max + one fused sum all_reduce, got {calls}"
                    loss.backward(outs["serial"][2])
                    assert shard.grad.dtype == dtype
                    c.close(f"{name}.loss", loss, outs["ref"][0], outs["serial"][0])

                    def local(g, fill):
                        pad = torch.zeros(*lead, per * n - vocab, dtype=g.dtype)
                        return torch.cat([g, pad], -1).chunk(n, -1)[r] if fill else g

                    c.close(f"{name}.dlogits", shard.grad, local(outs["ref"][1], True),
                            local(outs["serial"][1], True))

    # Targets outside [0, vocab) that are not ignore_index raise, as F.cross_entropy does.
    shard = torch.randn(B * T, 32 // n)
    for bad in (32, -5):
        target = torch.randint(32, (B * T,), generator=c.data)
        target[3] = bad
        try:
            pnn.vocab_parallel_cross_entropy(shard, target)
            raise AssertionError(f"target {bad} did not raise")
        except ValueError as exc:
            assert f"Target {bad} is out of bounds" in str(exc) and "vocab_size 32" in str(exc), exc
    c.checked.append(f"{name_dtype}.ce.target_bounds")


def check_dropout(c, topo):
    """Dropout under the RNG tracker, by Megatron's rule: a replicated activation is dropped
    with the same mask on every tp rank, the mask the serial model draws from the same seed;
    a sharded one (sequence-parallel tokens, attention heads) with a different mask per rank."""
    import fastpar
    from fastpar import comm
    from fastpar import nn as pnn
    from fastpar.testing import SerialAttention, SerialMLP

    n, g, p = c.n, topo.tp_group, 0.3

    def masked(module, mask):
        """``module`` followed by the given dropout mask (what F.dropout does with it)."""
        module.register_forward_hook(lambda m, i, y: y * mask.to(y.dtype) / (1 - p))
        return module

    def tp_gather(t, dim):
        return comm.all_gather(t.contiguous(), g, dim=dim)

    for sp in (False, True):
        s, k = c.seed(), c.seed()
        torch.manual_seed(s)
        ser = SerialMLP(16, 32, "gelu", dropout=p).train()
        par = pnn.ParallelMLP(16, 32, "gelu", dropout=p, sequence_parallel=sp, seed=s).train()
        pnn.random.seed(k)  # default stream alike on the tp group, "tp" stream per rank
        x = c.randn(B, T, 16)
        y_par = par(x.chunk(n, 1)[c.r] if sp else x)
        mask = tp_gather(y_par != 0, 1) if sp else y_par != 0  # (B, T, 16), every rank's
        torch.manual_seed(k)
        serial_mask = ser(x) != 0
        if not sp:
            assert torch.equal(mask, serial_mask), "replicated dropout: not the serial mask"
            everyone = tp_gather(mask.unsqueeze(0), 0)
            assert all(torch.equal(everyone[i], mask) for i in range(n)), "masks differ by rank"
        elif n > 1:
            pieces = mask.chunk(n, 1)
            assert all(not torch.equal(pieces[0], q) for q in pieces[1:]), \
                "sequence-parallel dropout: tp ranks drew the same mask for their tokens"
        dropped = 1 - mask.float().mean().item()
        assert 0.1 < dropped < 0.5, f"dropped fraction {dropped:.2f} for p={p}"
        # Forward and every gradient with that mask, against the serial block with that mask.
        plain = masked(SerialMLP(16, 32, "gelu"), mask)
        plain.load_state_dict(ser.state_dict())
        c.compare(f"dropout.mlp.sp{int(sp)}", par, plain, x, sp=sp,
                  before=lambda: pnn.random.seed(k))

    # Attention dropout on sharded heads: every tp rank's heads get their own mask. Give every
    # head the same weights, so that without dropout all ranks compute the same local heads.
    torch.manual_seed(c.seed())
    ser = SerialAttention(32, 4 * n, 4 * n, bias=False)
    with torch.no_grad():
        for proj in (ser.q_proj, ser.k_proj, ser.v_proj):
            proj.weight.copy_(proj.weight[:ser.head_dim].repeat(4 * n, 1))
    par = pnn.ParallelSelfAttention(32, 4 * n, 4 * n, bias=False, attn_dropout=p, dropout=p)
    fastpar.load_full_state_dict(par, ser.state_dict())
    heads = []
    par.o_proj.register_forward_pre_hook(lambda m, args: heads.append(args[0].detach()))
    x = c.randn(B, T, 32)
    k = c.seed()
    pnn.random.seed(k)
    y = par.train()(x)
    after = torch.get_rng_state()
    torch.manual_seed(k)
    want_mask = F.dropout(torch.ones_like(y), p) != 0  # the output dropout's serial mask
    assert torch.equal(y != 0, want_mask), "attention output dropout: not the serial mask"
    torch.manual_seed(k)
    F.dropout(torch.ones_like(y), p)
    assert torch.equal(after, torch.get_rng_state()), \
        "attention dropout on sharded heads drew from the default stream"
    pnn.random.seed(k)
    y_again = par(x)
    assert torch.equal(y, y_again), "same seed, different attention dropout"
    local = heads[0]  # (B, T, 4 * hd): this rank's 4 heads after attention dropout
    everyone = tp_gather(local.unsqueeze(0), 0)
    if n > 1:
        assert all(not torch.equal(everyone[0], everyone[i]) for i in range(1, n)), \
            "attention dropout: tp ranks drew the same mask for their heads"
    heads.clear()
    y_eval = par.eval()(x)
    heads_eval = heads[0]
    assert not torch.equal(local, heads_eval), "attention dropout dropped nothing"
    everyone = tp_gather(heads_eval.unsqueeze(0), 0)
    assert all(torch.equal(everyone[0], everyone[i]) for i in range(n)), \
        "identical heads differ by rank without dropout"
    ref = ser.eval()(x)
    c.close("dropout.attn.eval", y_eval, ser.double()(x.double()), ref)
    c.checked.append("dropout.attn")


def check_overlap(c):
    """overlap=True with overlap_pieces 1, 2, 3 and 4 (uneven pieces: 2 x 28 tokens, 28 / tp
    sequence per rank), sequence parallelism on and off, against the same serial modules as
    above: the column and row layers, and at 3 pieces the MLP and attention blocks (one
    overlapped entry for q, k, v).
    The CPU groups' engine is shm, which completes each call before returning; 3 pieces run
    again on gloo, whose calls really are in flight (its own thread) while the GEMMs run.
    bfloat16 (rounding, not the decomposition, differs) runs 3 pieces on shm only."""
    from fastpar import comm
    from fastpar import nn as pnn
    from fastpar.nn import overlap as ov
    from fastpar.testing import SerialAttention, SerialMLP

    if c.n == 1:  # nothing is sent: the layers say so, the plain path runs (checked above)
        layer = pnn.RowParallelLinear(8, 8, overlap=True)
        layer(torch.randn(2, 8))
        assert layer.overlap_decision == ov.Decision(False, 1, "tp 1: no communication")
        c.checked.append("overlap.tp1")
        return
    t2 = 28
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        fp32 = dtype == torch.float32
        for sp, k, engine in [(sp, k, None) for sp in (False, True)
                              for k in ((1, 2, 3, 4) if fp32 else (3,))] \
                + ([(False, 3, "gloo"), (True, 3, "gloo")] if fp32 else []):
            previous = comm.use_backend(engine)
            try:
                s = c.seed()
                tag = f"overlap.{dtype_name}.sp{int(sp)}.k{k}.{engine or 'policy'}"
                kw = dict(sequence_parallel=sp, overlap=True, overlap_pieces=k, dtype=dtype)
                torch.manual_seed(s)
                ser = nn.Linear(16, 24)
                par = pnn.ColumnParallelLinear(16, 24, gather_output=sp, seed=s, **kw)
                c.compare(f"{tag}.column", par, ser.to(dtype), c.randn(B, t2, 16), sp=sp,
                          sp_out=False, out_parallel=not sp)
                torch.manual_seed(s)
                ser = nn.Linear(24, 16)
                par = pnn.RowParallelLinear(24, 16, seed=torch.Generator().manual_seed(s), **kw)
                c.compare(f"{tag}.row", par, ser.to(dtype), c.randn(B, t2, 24), sp=sp,
                          sp_in=False, in_parallel=True)
                want = c.n > 1
                assert par.overlap_decision.enabled == want, par.overlap_decision
                assert ("overlap: on" in repr(par)) == want, repr(par)
                if k != 3:  # the blocks (shared column entry) at one piece count
                    continue
                torch.manual_seed(s)
                ser = SerialMLP(16, 32, "swiglu")
                par = pnn.ParallelMLP(16, 32, "swiglu", seed=s, **kw)
                c.compare(f"{tag}.mlp", par, ser.to(dtype), c.randn(B, t2, 16), sp=sp)
                assert par.up_proj.overlap_decision == par.gate_proj.overlap_decision
                torch.manual_seed(s)
                ser = SerialAttention(32, 8, 4, bias=True, sdpa=True)
                par = pnn.ParallelSelfAttention(32, 8, 4, bias=True, seed=s, **kw)
                ref = copy.deepcopy(ser).double()
                ref.sdpa = False
                c.compare(f"{tag}.attn", par, ser.to(dtype), c.randn(B, t2, 32), sp=sp, ref=ref)
            finally:
                comm.use_backend(previous)


def check_errors(c):
    from fastpar import nn as pnn

    n = c.n
    for bad in (dict(overlap="yes"), dict(overlap_pieces=0), dict(overlap_pieces=2.0),
                dict(overlap_pieces=True)):
        try:
            pnn.ColumnParallelLinear(8, 8, **bad)
            raise AssertionError(f"{bad} did not raise")
        except ValueError as exc:
            assert repr(next(iter(bad.values()))) in str(exc), exc
    pnn.RowParallelLinear(8, 8, overlap=False, overlap_pieces=2)
    try:
        pnn.VocabParallelEmbedding.from_serial(nn.Embedding(8, 4, max_norm=1.0, sparse=True))
        raise AssertionError("from_serial of an embedding with max_norm did not raise")
    except ValueError as exc:
        assert "max_norm=1.0, sparse=True" in str(exc), exc
    if n == 4:
        for heads, kv in ((6, 6), (12, 3)):  # 3 KV heads neither divide nor fill 4 ranks
            try:
                pnn.ParallelSelfAttention(48, heads, kv)
                raise AssertionError("indivisible heads did not raise")
            except ValueError as exc:
                assert f"num_heads {heads}" in str(exc) and "tensor-parallel size 4" in str(exc)
        # 2 KV heads on 4 ranks: each replicated on 2 (inference; tests/test_generate.py)
        assert pnn.ParallelSelfAttention(48, 8, 2).kv_replicas == 2
        try:
            pnn.ColumnParallelLinear(8, 6)
            raise AssertionError("indivisible out_features did not raise")
        except ValueError as exc:
            assert "out_features 6" in str(exc) and "4" in str(exc)
    c.checked.append("errors")


def check_rng(c, topo, seed):
    """The streams themselves: alike across tp ranks outside a sharded region, per rank inside,
    and the default stream undisturbed by a fork."""
    from fastpar import nn as pnn
    from fastpar.comm import all_gather

    n = c.n
    pnn.random.seed(seed)
    alike = torch.rand(4)
    with pnn.random.fork("tp"):
        own = torch.rand(4)
    after = torch.rand(4)
    torch.manual_seed(seed)
    torch.rand(4)
    assert torch.equal(after, torch.rand(4)), "fork disturbed the default stream"
    everyone = all_gather(torch.stack([alike, own]).unsqueeze(0), topo.tp_group, dim=0)
    assert all(torch.equal(everyone[i, 0], alike) for i in range(n))
    assert len({tuple(everyone[i, 1].tolist()) for i in range(n)}) == n
    c.checked.append("rng")


@pytest.mark.parametrize("world, tp", LAYOUTS)
def test_layers_against_serial(world, tp):
    values = run_ranks(world, body_layers, tp=tp, seed=2000 + 10 * world + tp,
                       timeout=300).values()
    counts = {len(v["checked"]) for v in values}
    assert len(counts) == 1 and counts.pop() > (250 if tp == 1 else 250 + 12 * 6)
    # Report how close to the bound the worst check came (pytest -s shows it).
    ratio, name = max(tuple(v["worst"]) for v in values)
    print(f"world {world} tp {tp}: worst error / bound = {ratio:.3f} ({name})")
