"""fastpar.nn layers at tp = 1, 2, 4 against the serial modules built from the same seed: outputs,
input gradients and every parameter gradient, float32 (tight) and bfloat16 (loose), sequence
parallelism on and off. One launch per world size runs the whole list of checks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.multirank import run_ranks

TOL = {"float32": 2e-5, "bfloat16": 3e-2}
B, T = 2, 8  # batch, sequence (divisible by every tp)


def body_layers(tp, seed):
    import fastpar
    from fastpar import nn as pnn

    topo = fastpar.init(tp=tp, timeout=60)
    n, r = topo.tp_size, topo.tp_rank
    checked = []
    data = torch.Generator().manual_seed(seed)  # same draws on every rank

    def randn(*shape):
        return torch.randn(*shape, generator=data)

    def close(name, got, want, tol):
        assert got is not None, f"{name}: no gradient"
        assert tuple(got.shape) == tuple(want.shape), (name, tuple(got.shape), tuple(want.shape))
        if want.numel() == 0:  # an empty shard (a rank that owns no vocabulary rows)
            checked.append(name)
            return
        # Relative to the reference's norm, with a floor for gradients that are zero in exact
        # arithmetic (a key bias under softmax).
        floor = 1e-2 * want.numel() ** 0.5
        err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(floor)).item()
        assert err <= tol, f"{name} (tp={n}): relative error {err:.3g} > {tol}"
        checked.append(name)

    def local_of(model, pname, full):
        """This rank's piece of a serial tensor for parameter ``pname`` of the parallel model."""
        owner, _, leaf = pname.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        return module.shard_full(leaf, full) if isinstance(module, pnn.ShardedModule) else full

    def compare(tag, par, ser, x_full, *, sp, tol, sp_in=None, sp_out=None, seq_dim=1,
                in_parallel=False, out_parallel=False):
        """Run serial and parallel on the same data; compare output, dx and every param grad.
        ``sp``: input and output sequence-sharded (``sp_in`` / ``sp_out`` override each)."""
        sp_in = sp if sp_in is None else sp_in
        sp_out = sp if sp_out is None else sp_out
        dtype = next(ser.parameters()).dtype
        x_full = x_full.to(dtype) if x_full.is_floating_point() else x_full
        x = x_full.clone().requires_grad_(x_full.is_floating_point())
        y = ser(x)
        dy = randn(*y.shape).to(dtype)
        y.backward(dy)
        xs = x_full
        if in_parallel:
            xs = xs.chunk(n, -1)[r]
        if sp_in:
            xs = xs.chunk(n, seq_dim)[r]
        xs = xs.clone().requires_grad_(xs.is_floating_point())
        yp = par(xs)
        want_y, want_dy = y.detach(), dy
        if out_parallel:
            want_y, want_dy = want_y.chunk(n, -1)[r], want_dy.chunk(n, -1)[r]
        if sp_out:
            want_y, want_dy = want_y.chunk(n, seq_dim)[r], want_dy.chunk(n, seq_dim)[r]
        close(f"{tag}.out", yp, want_y, tol)
        yp.backward(want_dy)
        if xs.is_floating_point():
            want_dx = x.grad
            if in_parallel:
                want_dx = want_dx.chunk(n, -1)[r]
            if sp_in:
                want_dx = want_dx.chunk(n, seq_dim)[r]
            close(f"{tag}.dx", xs.grad, want_dx, tol)
        ser_params = dict(ser.named_parameters())
        for pname, p in par.named_parameters():
            close(f"{tag}.d{pname}", p.grad, local_of(par, pname, ser_params[pname].grad), tol)

    for dtype_name, tol in TOL.items():
        dtype = getattr(torch, dtype_name)
        fp32 = dtype == torch.float32
        for sp in (False, True):
            s = int(torch.randint(1 << 30, (1,), generator=data))
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
                compare(f"{tag}.column.gather{int(gather)}", par, ser.to(dtype), randn(B, T, 16),
                        sp=sp, sp_out=False, out_parallel=not gather, tol=tol)

            # RowParallelLinear: parallel and replicated input.
            for in_par in (True, False):
                torch.manual_seed(s)
                ser = nn.Linear(24, 16)
                par = pnn.RowParallelLinear(24, 16, input_is_parallel=in_par, sequence_parallel=sp,
                                            seed=torch.Generator().manual_seed(s), dtype=dtype)
                if fp32:
                    assert torch.equal(par.weight, ser.weight.chunk(n, 1)[r]), "row init"
                    assert torch.equal(par.bias, ser.bias), "row bias init"
                compare(f"{tag}.row.in_par{int(in_par)}", par, ser.to(dtype), randn(B, T, 24),
                        sp=sp, sp_in=False, in_parallel=in_par, tol=tol)

            # Sequence dim 0 (sequence-first activations).
            if sp:
                torch.manual_seed(s)
                ser = nn.Linear(16, 24)
                par = pnn.ColumnParallelLinear(16, 24, gather_output=True, sequence_parallel=True,
                                               sequence_dim=0, seed=s, dtype=dtype)
                compare(f"{tag}.column.seqdim0", par, ser.to(dtype), randn(T, B, 16), sp=True,
                        sp_out=False, seq_dim=0, tol=tol)

            # VocabParallelEmbedding: vocabularies divisible and not by tp, an empty shard (5 rows
            # over 4 ranks), a padding_idx; its state dict holds no padding rows.
            for vocab, pad in ((32, None), (31, 3), (5, None)):
                torch.manual_seed(s)
                ser = nn.Embedding(vocab, 12, padding_idx=pad)
                par = pnn.VocabParallelEmbedding(vocab, 12, pad, sequence_parallel=sp, seed=s,
                                                 dtype=dtype)
                ids = torch.randint(vocab, (B, T), generator=data)
                if fp32:
                    assert torch.equal(par.weight, ser.weight[par.vocab_start:par.vocab_end])
                    assert par.state_dict()["weight"].shape[0] == par.vocab_end - par.vocab_start
                    full = fastpar.full_state_dict(par)["weight"]
                    assert torch.equal(full, ser.weight), "embedding full_state_dict"
                compare(f"{tag}.embedding.V{vocab}", par, ser.to(dtype), ids, sp=sp, sp_in=False,
                        tol=tol)

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
                        p.copy_(randn(*p.shape))
                par.load_state_dict(ser.state_dict())
                compare(f"{tag}.{kind}norm", par, ser.to(dtype), randn(B, T, 12), sp=sp, tol=tol)

            # ParallelMLP against the same block of nn.Linear, drawn in the same order.
            for act in ("gelu", "swiglu"):
                torch.manual_seed(s)
                ser = SerialMLP(16, 32, act)
                par = pnn.ParallelMLP(16, 32, act, sequence_parallel=sp, seed=s, dtype=dtype)
                if fp32:
                    full = fastpar.full_state_dict(par)
                    assert full.keys() == ser.state_dict().keys()
                    assert all(torch.equal(full[k], v) for k, v in ser.state_dict().items())
                compare(f"{tag}.mlp.{act}", par, ser.to(dtype), randn(B, T, 16), sp=sp, tol=tol)

            # ParallelSelfAttention: MHA and GQA, causal.
            for heads, kv in ((4, 4), (8, 4)):
                torch.manual_seed(s)
                # The key bias's gradient is zero in exact arithmetic (softmax ignores a shift),
                # so in bfloat16 it is pure rounding noise: test biases in float32 only.
                ser = SerialAttention(32, heads, kv, bias=fp32)
                par = pnn.ParallelSelfAttention(32, heads, kv, bias=fp32, sequence_parallel=sp,
                                                seed=s, dtype=dtype)
                compare(f"{tag}.attn.h{heads}kv{kv}", par, ser.to(dtype), randn(B, T, 32), sp=sp,
                        tol=tol)

        # vocab_parallel_cross_entropy against F.cross_entropy on the full logits.
        for vocab in (32, 30):
            per = -(-vocab // n)
            for smoothing in (0.0, 0.1):
                logits = (3 * randn(B * T, vocab)).to(dtype)
                target = torch.randint(vocab, (B * T,), generator=data)
                target[::5] = -100
                ref_logits = logits.clone().requires_grad_(True)
                ref = F.cross_entropy(ref_logits.float(), target, ignore_index=-100,
                                      label_smoothing=smoothing)
                ref.backward()
                # Padded vocabulary: columns past `vocab` hold large garbage that must not count.
                padded = torch.cat([logits, 50 + randn(B * T, per * n - vocab).to(dtype)], -1)
                shard = padded.chunk(n, -1)[r].clone().requires_grad_(True)
                calls = []
                real = pnn.cross_entropy.all_reduce
                pnn.cross_entropy.all_reduce = lambda t, *a, **k: (calls.append(t.shape),
                                                                    real(t, *a, **k))[1]
                try:
                    loss = pnn.vocab_parallel_cross_entropy(shard, target, -100, smoothing,
                                                            vocab_size=vocab)
                finally:
                    pnn.cross_entropy.all_reduce = real
                assert len(calls) == 2, f"expected max + one fused sum all_reduce, got {calls}"
                loss.backward()
                name = f"{dtype_name}.ce.V{vocab}.ls{smoothing}"
                close(f"{name}.loss", loss, ref, tol)
                want_grad = torch.cat([ref_logits.grad, torch.zeros(B * T, per * n - vocab)],
                                      -1).chunk(n, -1)[r]
                close(f"{name}.dlogits", shard.grad, want_grad, tol)
                assert shard.grad.dtype == dtype
                none = pnn.vocab_parallel_cross_entropy(shard.detach(), target, vocab_size=vocab,
                                                        label_smoothing=smoothing,
                                                        reduction="none")
                close(f"{name}.none", none, F.cross_entropy(
                    logits.float(), target, reduction="none", label_smoothing=smoothing), tol)

    # Targets outside [0, vocab) that are not ignore_index raise, as F.cross_entropy does.
    shard = torch.randn(B * T, 32 // n)
    for bad in (32, -5):
        target = torch.randint(32, (B * T,), generator=data)
        target[3] = bad
        try:
            pnn.vocab_parallel_cross_entropy(shard, target)
            raise AssertionError(f"target {bad} did not raise")
        except ValueError as exc:
            assert f"Target {bad} is out of bounds" in str(exc) and "vocab_size 32" in str(exc), exc
    checked.append("ce.target_bounds")

    # Errors and options.
    try:
        pnn.ColumnParallelLinear(8, 8, overlap=True)
        raise AssertionError("overlap=True did not raise")
    except NotImplementedError as exc:
        assert "later issue" in str(exc)
    pnn.RowParallelLinear(8, 8, overlap=False, chunks=2)
    try:
        pnn.VocabParallelEmbedding.from_serial(nn.Embedding(8, 4, max_norm=1.0, sparse=True))
        raise AssertionError("from_serial of an embedding with max_norm did not raise")
    except ValueError as exc:
        assert "max_norm=1.0, sparse=True" in str(exc), exc
    if n == 4:
        for heads, kv in ((6, 6), (8, 2)):
            try:
                pnn.ParallelSelfAttention(48, heads, kv)
                raise AssertionError("indivisible heads did not raise")
            except ValueError as exc:
                assert f"num_heads {heads}" in str(exc) and "tensor-parallel size 4" in str(exc)
        try:
            pnn.ColumnParallelLinear(8, 6)
            raise AssertionError("indivisible out_features did not raise")
        except ValueError as exc:
            assert "out_features 6" in str(exc) and "4" in str(exc)
    checked.append("errors")

    # Dropout streams: alike across ranks outside a sharded region, per rank inside it.
    from fastpar.comm import all_gather

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
    checked.append("rng")
    return checked


class SerialMLP(nn.Module):
    """The serial block ParallelMLP shards (same parameter names, same draw order)."""

    def __init__(self, hidden, ffn, act):
        super().__init__()
        self.act = act
        if act == "gelu":
            self.fc1, self.fc2 = nn.Linear(hidden, ffn), nn.Linear(ffn, hidden)
        else:
            self.gate_proj, self.up_proj = nn.Linear(hidden, ffn), nn.Linear(hidden, ffn)
            self.down_proj = nn.Linear(ffn, hidden)

    def forward(self, x):
        if self.act == "gelu":
            return self.fc2(F.gelu(self.fc1(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SerialAttention(nn.Module):
    """Causal MHA/GQA written out without SDPA (kv heads repeated, explicit mask)."""

    def __init__(self, hidden, heads, kv, bias):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias)
        self.k_proj = nn.Linear(hidden, kv * self.hd, bias)
        self.v_proj = nn.Linear(hidden, kv * self.hd, bias)
        self.o_proj = nn.Linear(hidden, hidden, bias)

    def forward(self, x):
        b, t, h = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = (q @ k.transpose(-1, -2)).float() / self.hd ** 0.5  # (B, nh, T, T)
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        y = att.softmax(-1).to(v.dtype) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, h))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_layers_against_serial(world):
    launch = run_ranks(world, body_layers, tp=world, seed=2000 + world, timeout=240)
    counts = {len(v) for v in launch.values()}
    assert len(counts) == 1 and counts.pop() > 150
