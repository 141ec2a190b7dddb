"""fastpar.models.gpt: configuration errors, presets, layers built on meta, rotary embedding, tied
weights, and the tensor- and pipeline-parallel model against the serial one.

The parallel checks follow tests/test_tp_layers.py: the same seed builds a serial model (tp 1,
float32), its float64 copy (the reference) and the parallel model; the loss, the logits and every
parameter gradient of the parallel model must lie within the rounding bound of
``fastpar.testing`` (a multiple of the serial float32 model's own error). One 4-rank launch
(tp 2 x pp 2) runs every case: tp 2 over the topology's tp group (two groups, each on its own
data, so talking over the world would fail), tp 4 over the whole world, and the pipeline.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import fastpar
from fastpar.models import (GPT, PRESETS, GPTConfig, gpt_layers, gpt_loss, sum_tied_grads,
                            tied_parameters)
from fastpar.testing import Checks
from tests.multirank import run_ranks

pytestmark = pytest.mark.quick  # every test here: the quick tier

B, T = 4, 8  # batch (two microbatches in the pipeline), sequence (divisible by every tp)
CONFIGS = {  # every one fits tp 4: heads, kv heads, vocab, ffn and seq divisible by 4
    "rope.swiglu.rms.gqa": dict(heads=8, kv_heads=4),
    "learned.gelu.ln.bias": dict(heads=4, mlp="gelu", norm="layernorm", positions="learned",
                                 bias=True),
    "sp.learned.swiglu.rms": dict(heads=8, kv_heads=4, positions="learned",
                                  sequence_parallel=True),
    "sp.tied.rope.gelu.ln": dict(heads=4, mlp="gelu", norm="layernorm", sequence_parallel=True,
                                 tie_embeddings=True),
}


def config(name, **extra):
    return GPTConfig(seq_len=T, layers=2, hidden=32, **{**CONFIGS[name], **extra})


@pytest.fixture
def single():
    """A one-process fastpar job: its tp group of one rank is the serial model's group."""
    fastpar.init(timeout=30)
    try:
        yield fastpar.topology()
    finally:
        fastpar.shutdown()


def test_config_validation_names_the_numbers():
    cases = [
        (dict(hidden=60, heads=8), 1, ["hidden 60 is not divisible by heads 8"]),
        (dict(heads=8, kv_heads=3), 1, ["heads 8 is not divisible by kv_heads 3"]),
        (dict(hidden=48, heads=6, kv_heads=2), 4, ["heads 6 is not divisible by tp 4",
                                                    "kv_heads 2 is not divisible by tp 4"]),
        (dict(vocab_size=250), 4, ["vocab_size 250 is not divisible by tp 4"]),
        (dict(seq_len=66, sequence_parallel=True), 4, ["seq_len 66 is not divisible by tp 4"]),
        (dict(ffn_hidden=90), 4, ["ffn_hidden 90 is not divisible by tp 4"]),
        (dict(hidden=36, heads=4), 1, ["even head dim", "36 / heads 4 = 9"]),
        (dict(mlp="relu", layers=0), 1, ["mlp must be one of", "layers must be a positive"]),
        (dict(dropout=1.0), 1, ["dropout must be in [0, 1), got 1.0"]),
    ]
    for fields, tp, messages in cases:
        with pytest.raises(ValueError) as info:
            GPTConfig(**fields).validate(tp)
        assert all(m in str(info.value) for m in messages), (fields, str(info.value))
    GPTConfig(hidden=36, heads=4, positions="learned").validate(1)  # odd head dim without rope
    assert GPTConfig(hidden=64, mlp="gelu").ffn_size == 256
    assert GPTConfig(hidden=64).ffn_size == 176  # 8/3 * 64 = 170.7, up to a multiple of 8
    assert GPTConfig(hidden=256).ffn_size == 688 and GPTConfig(ffn_hidden=100).ffn_size == 100


def test_presets_layers_on_meta_and_init(single):
    from fastpar.pipeline.partition import partition

    for name, cfg in PRESETS.items():
        cfg.validate(2)
        with torch.device("meta"):
            layers = [f() for f in gpt_layers(cfg)]
        assert len(layers) == cfg.layers + 2
        assert all(p.is_meta for m in layers for p in m.parameters())
        assert sum(p.numel() for m in layers for p in m.parameters()) == cfg.num_params()
        items, bounds, keys = partition(gpt_layers(cfg), 2, 1)  # weighed on meta
        assert bounds[0] == 0 and bounds[-1] == len(items)
        model = GPT(cfg, seed=3)
        assert [k for ks in keys for k in ks] == list(model.state_dict())
    assert 0.1e6 < PRESETS["tiny"].num_params() < 0.2e6
    assert 3e6 < PRESETS["small"].num_params() < 4e6

    # Layers built one by one (as a pipeline stage does) hold the whole model's values; norms are
    # ones; residual projections have the smaller std; the tied head copies the embedding.
    cfg = GPTConfig(seq_len=16, layers=4, hidden=64, heads=4, tie_embeddings=True)
    model = GPT(cfg, seed=11)
    alone = gpt_layers(cfg, seed=11)[2]()
    assert all(torch.equal(v, model[2].state_dict()[k]) for k, v in alone.state_dict().items())
    assert not torch.equal(model[1].attn.q_proj.weight, model[2].attn.q_proj.weight)
    assert not torch.equal(model[1].attn.q_proj.weight,
                           GPT(cfg, seed=12)[1].attn.q_proj.weight)
    assert torch.equal(model[1].norm1.weight, torch.ones(64))
    std_q, std_o = model[1].attn.q_proj.weight.std(), model[1].attn.o_proj.weight.std()
    assert abs(std_q / 0.02 - 1) < 0.1 and abs(std_o / (0.02 / math.sqrt(8)) - 1) < 0.1
    emb, head = tied_parameters(model)
    assert emb is model[0].tok.weight and head is model[-1].out.weight
    assert torch.equal(emb, head) and emb is not head
    assert tied_parameters(model[1:-1]) == [] and tied_parameters([model[-1]]) == [head]


def test_rotary_attention_against_complex_rotation(single):
    """ParallelSelfAttention(rope_base=b) at tp 1 against a written-out reference: q and k as
    complex pairs (x_i + i x_{i+hd/2}) times exp(i p b^(-2i/hd)), then causal softmax attention."""
    from fastpar.nn import ParallelSelfAttention

    hidden, heads, kv, base = 32, 4, 2, 500.0
    attn = ParallelSelfAttention(hidden, heads, kv, bias=False, rope_base=base, seed=5).double()
    x = torch.randn(2, 12, hidden, dtype=torch.float64)
    b, t, hd = 2, 12, hidden // heads

    def rotate(z):  # (B, n, T, hd)
        c = torch.complex(z[..., :hd // 2], z[..., hd // 2:])
        theta = base ** (-2.0 * torch.arange(hd // 2, dtype=torch.float64) / hd)
        c = c * torch.polar(torch.ones(t, hd // 2, dtype=torch.float64),
                            torch.arange(t, dtype=torch.float64)[:, None] * theta)
        return torch.cat([c.real, c.imag], -1)

    q = rotate((x @ attn.q_proj.weight.T).view(b, t, heads, hd).transpose(1, 2))
    k = rotate((x @ attn.k_proj.weight.T).view(b, t, kv, hd).transpose(1, 2))
    v = (x @ attn.v_proj.weight.T).view(b, t, kv, hd).transpose(1, 2)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    att = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(
        ~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    want = (att @ v).transpose(1, 2).reshape(b, t, hidden) @ attn.o_proj.weight.T
    torch.testing.assert_close(attn(x), want, rtol=1e-12, atol=1e-12)
    plain = ParallelSelfAttention(hidden, heads, kv, bias=False, seed=5).double()
    assert not torch.allclose(plain(x), want)  # rope_base=None: no rotation, as before
    with pytest.raises(ValueError, match="even head dim"):
        ParallelSelfAttention(36, 4, rope_base=base)


def test_serial_float32_against_float64_and_tied_grads(single):
    cfg = config("sp.tied.rope.gelu.ln", sequence_parallel=False)
    tokens, targets = torch.randint(256, (B, T)), torch.randint(256, (B, T))
    model, ref = GPT(cfg, seed=1), GPT(cfg, seed=1).double()
    logits = model(tokens)
    assert logits.shape == (B, T, 256)
    loss, loss64 = gpt_loss(logits, targets), F.cross_entropy(ref(tokens).flatten(0, 1),
                                                               targets.flatten())
    assert abs(loss.item() - loss64.item()) < 1e-5 and abs(loss64.item() - math.log(256)) < 0.1
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), targets.flatten()))

    # The sum of the two copies' grads is the gradient of one shared weight.
    shared = GPT(cfg, seed=1).double()
    shared[-1].out.weight = shared[0].tok.weight
    F.cross_entropy(shared(tokens).flatten(0, 1), targets.flatten()).backward()
    loss64.backward()
    sum_tied_grads(ref)
    emb, head = tied_parameters(ref)
    torch.testing.assert_close(emb.grad, shared[0].tok.weight.grad, rtol=1e-12, atol=1e-15)
    assert torch.equal(emb.grad, head.grad) and emb.grad is not head.grad

    # Dropout runs (on the default stream at tp 1) in training mode only.
    fastpar.nn.random.seed(0)
    drop = GPT(config("sp.learned.swiglu.rms", sequence_parallel=False, dropout=0.2), seed=1)
    assert not torch.equal(drop(tokens), drop(tokens))
    assert torch.equal(drop.eval()(tokens), drop(tokens))


# -- multi-rank -------------------------------------------------------------------------------


class Checker(Checks):
    def grads(self, tag, named, ser, ref):
        """Every parameter gradient of ``named`` (name -> (owner, leaf, param), serial names)
        against the serial and reference models' gradients, cut to this rank's shard."""
        from fastpar.nn import ShardedModule

        ps, pr = dict(ser.named_parameters()), dict(ref.named_parameters())
        for name, (owner, leaf, p) in named.items():
            def local(full):
                return owner.shard_full(leaf, full) if isinstance(owner, ShardedModule) else full
            self.close(f"{tag}.d{name}", p.grad, local(pr[name].grad), local(ps[name].grad))


def named_params(module):
    out = {}
    for name, p in module.named_parameters():
        owner, _, leaf = name.rpartition(".")
        out[name] = (module.get_submodule(owner), leaf, p)
    return out


def serial_pair(cfg, me, seed, tokens, targets):
    """The serial float32 model and its float64 reference, after forward and backward."""
    ser, ref = GPT(cfg, group=me, seed=seed), GPT(cfg, group=me, seed=seed).double()
    logits_s, logits_r = ser(tokens), ref(tokens)
    loss_s = gpt_loss(logits_s, targets, group=me)
    loss_r = F.cross_entropy(logits_r.flatten(0, 1), targets.flatten())
    loss_s.backward()
    loss_r.backward()
    for m in (ser, ref):
        sum_tied_grads(m)
    return ser, ref, (logits_s, loss_s, logits_r, loss_r)


def body_gpt(seed):
    import torch.distributed as dist

    topo = fastpar.init(tp=2, pp=2, timeout=60)
    singles = [dist.new_group([r]) for r in range(topo.world_size)]  # collective, in order
    me = singles[topo.rank]
    c = Checker()
    for name in CONFIGS:
        cfg = config(name)
        for tag, group, data_seed in (("tp2", topo.tp_group, seed + 101 * topo.pp_rank),
                                      ("tp4", dist.group.WORLD, seed)):
            tag = f"{name}.{tag}"
            n, r = dist.get_world_size(group), dist.get_rank(group)
            gen = torch.Generator().manual_seed(data_seed)
            tokens, targets = torch.randint(256, (2, 2, T), generator=gen)
            ser, ref, (logits_s, loss_s, logits_r, loss_r) = serial_pair(cfg, me, seed, tokens,
                                                                         targets)
            par = GPT(cfg, group=group, seed=seed)
            full = fastpar.full_state_dict(par)
            assert list(full) == list(ser.state_dict()), f"{tag}: state-dict keys"
            for k, v in ser.state_dict().items():
                assert torch.equal(full[k], v), f"{tag}: init of {k} differs from tp 1"
            logits = par(tokens)
            assert logits.shape == (2, T, 256 // n), f"{tag}: logits shard {logits.shape}"
            loss = gpt_loss(logits, targets, group=group)
            loss.backward()
            sum_tied_grads(par)
            c.close(f"{tag}.logits", logits, logits_r.chunk(n, -1)[r], logits_s.chunk(n, -1)[r])
            c.close(f"{tag}.loss", loss, loss_r, loss_s)
            c.close(f"{tag}.loss_fn", loss_s, loss_r,
                    F.cross_entropy(logits_s.flatten(0, 1), targets.flatten()))
            c.grads(tag, named_params(par), ser, ref)
    check_pipeline(c, topo, me, seed)
    check_dropout(c, topo)
    return {"checked": c.checked, "worst": c.worst}


def check_pipeline(c, topo, me, seed):
    """tp 2 x pp 2 through fastpar.pipeline: the step's loss, every gradient on every stage
    (tied copies summed over the embedding group), the global gradient norm of both clips, and
    the full state dict."""
    from fastpar.optim import DistributedOptimizer, clip_grad_norm_
    from fastpar.pipeline import Pipeline

    for name in ("sp.tied.rope.gelu.ln", "learned.gelu.ln.bias"):
        cfg = config(name)
        gen = torch.Generator().manual_seed(seed + 7)
        tokens, targets = torch.randint(256, (2, B, T), generator=gen)
        ser, ref, (_, loss_s, _, loss_r) = serial_pair(cfg, me, seed, tokens, targets)
        pipe = Pipeline(gpt_layers(cfg, seed=seed), loss_fn=gpt_loss, microbatches=2)
        try:
            loss = pipe.step(tokens, targets)
            sum_tied_grads(pipe.chunks, topo.embedding_group)
            c.close(f"pipe.{name}.loss", torch.tensor(loss), loss_r, loss_s)
            named = {}
            for chunk in pipe.chunks:
                named.update(named_params(chunk))
            assert len(tied_parameters(pipe.chunks)) == int(cfg.tie_embeddings)
            c.grads(f"pipe.{name}", named, ser, ref)
            # Both clips count the tied weight once, as a model where it is one Parameter
            # (Hugging Face's): the serial GPT's norm without its head's output weight.
            want = [torch.nn.utils.get_total_norm(
                [p.grad for p in m.parameters()
                 if not (cfg.tie_embeddings and p is m[-1].out.weight)]) for m in (ref, ser)]
            c.close(f"pipe.{name}.clip_norm", clip_grad_norm_(pipe, 1e9), *want)
            zero = DistributedOptimizer(pipe.parameters(), torch.optim.SGD, lr=0.0)  # dp 1
            c.close(f"pipe.{name}.zero_clip_norm", zero.clip_grad_norm_(1e9, model=pipe), *want)
            full = fastpar.full_state_dict(pipe)
            assert list(full) == list(ser.state_dict()), "pipeline state-dict keys"
            assert all(torch.equal(full[k], v) for k, v in ser.state_dict().items())
        finally:
            pipe.close()


def check_dropout(c, topo):
    """Dropout everywhere under tp 2 with sequence parallelism: runs, draws, and is off in
    eval mode (masks cannot match the serial model's: sharded regions draw per rank)."""
    fastpar.nn.random.seed(3)
    cfg = config("sp.learned.swiglu.rms", dropout=0.2)
    model = GPT(cfg, group=topo.tp_group, seed=0)
    tokens = torch.randint(256, (2, T), generator=torch.Generator().manual_seed(5))
    a, b = model(tokens), model(tokens)
    assert not torch.equal(a, b), "dropout dropped nothing"
    gpt_loss(a, tokens, group=topo.tp_group).backward()
    model.eval()
    assert torch.equal(model(tokens), model(tokens))
    c.checked.append("dropout")


def test_gpt_parallel_against_serial():
    launch = run_ranks(4, body_gpt, seed=1234, timeout=300)
    counts = [len(v["checked"]) for v in launch.values()]  # stages hold different layers
    assert min(counts) > 200, counts
    ratio, name = max(tuple(v["worst"]) for v in launch.values())
    print(f"tp 2 x pp 2 on 4 ranks: {counts} checks per rank, worst error / bound = "
          f"{ratio:.3f} ({name})")
