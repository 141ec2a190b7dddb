"""fastpar.parallelize on a model we did not write (Hugging Face LlamaForCausalLM, random init, no
downloads) and on a plain module, at tp = 1, 2, 4: logits and one optimizer step against the
untouched model through full_state_dict, load_full_state_dict, and every bad-plan error."""

import importlib.util

import pytest

from tests.multirank import run_ranks

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
TOL = 2e-5
EXPLICIT_PLAN = {
    "model.embed_tokens": "embedding",
    "model.layers.*.self_attn.[qkv]_proj": "column",
    "model.layers.*.self_attn.o_proj": "row",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                  tie_word_embeddings=False, attention_dropout=0.0)
    config.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def close(name, got, want, tol=TOL):
    assert tuple(got.shape) == tuple(want.shape), (name, tuple(got.shape), tuple(want.shape))
    err = ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-3)).item()
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol}"


def body_hf(tp, seed):
    import copy

    import torch
    import torch.nn.functional as F

    import fastpar
    from fastpar import nn as pnn

    fastpar.init(tp=tp, timeout=60)
    report = {}
    torch.manual_seed(seed)  # the same random model on every rank
    ref = tiny_llama()
    ids = torch.randint(128, (2, 16))
    labels = torch.randint(128, (2, 16))
    for plan_name, plan in (("declared", "auto"), ("explicit", EXPLICIT_PLAN)):
        model = fastpar.parallelize(copy.deepcopy(ref), plan, verbose=plan_name == "declared")
        serial = copy.deepcopy(ref)
        changed = {c["module"]: c["style"] for c in model.fastpar_changes
                   if c["style"] != "heads"}
        assert changed["model.embed_tokens"] == "embedding", changed
        assert changed["lm_head"] == "column_gather", changed
        assert changed["model.layers.1.self_attn.k_proj"] == "column", changed
        assert changed["model.layers.0.mlp.down_proj"] == "row", changed
        assert isinstance(model.model.layers[0].self_attn.q_proj, pnn.ColumnParallelLinear)
        assert model.model.layers[0].self_attn.q_proj.weight.shape == (64 // tp, 64)
        report[plan_name] = len(changed)

        sd = fastpar.full_state_dict(model)
        assert sd.keys() == serial.state_dict().keys()
        for k, v in serial.state_dict().items():
            assert torch.equal(sd[k], v), f"{plan_name}: {k} differs before training"

        # Logits, loss and one optimizer step, parallel against serial. SGD, whose update is
        # linear in the gradient: Adam's m / sqrt(v) turns rounding noise in near-zero
        # gradients into full-size updates, which says nothing about the parallel gradients.
        before = {k: v.clone() for k, v in serial.state_dict().items()}
        optims = [torch.optim.SGD(m.parameters(), lr=2.0) for m in (model, serial)]
        for step in range(2):
            out = [m(input_ids=ids).logits for m in (model, serial)]
            close(f"{plan_name}.logits.step{step}", out[0], out[1].detach())
            losses = [F.cross_entropy(o.flatten(0, 1), labels.flatten()) for o in out]
            close(f"{plan_name}.loss.step{step}", losses[0].detach(), losses[1].detach())
            if step == 1:
                break
            for loss, opt in zip(losses, optims):
                opt.zero_grad()
                loss.backward()
                opt.step()
            sd = fastpar.full_state_dict(model)
            for k, v in serial.state_dict().items():
                close(f"{plan_name}.{k}.after_step", sd[k], v)
                moved = ((v - before[k]).norm() / before[k].norm()).item()
                assert moved > 10 * TOL, f"{k}: the step barely moved it ({moved:.2g})"
            assert sd["model.embed_tokens.weight"].shape == (128, 64)

    # load_full_state_dict: a freshly parallelized copy of another random model takes the serial
    # weights and then computes what they compute.
    torch.manual_seed(seed + 1)
    other = fastpar.parallelize(tiny_llama(), "auto", verbose=False)
    fastpar.load_full_state_dict(other, ref.state_dict())
    close("loaded.logits", other(input_ids=ids).logits, ref(input_ids=ids).logits.detach())
    report["loaded"] = True
    report["errors"] = check_errors(tp)
    return report


def check_errors(tp):
    """Every bad plan fails with a ValueError naming the problem, before anything is replaced."""
    import torch
    from torch import nn

    import fastpar

    def expect(model, plan, *needles):
        before = [type(m).__name__ for m in model.modules()]
        try:
            fastpar.parallelize(model, plan, verbose=False)
        except ValueError as exc:
            for needle in needles:
                assert needle in str(exc), f"{needle!r} not in: {exc}"
            assert [type(m).__name__ for m in model.modules()] == before, "model was changed"
            return str(exc)
        raise AssertionError(f"plan {plan} did not raise at tp={tp}")

    messages = []
    llama = tiny_llama()
    messages.append(expect(llama, {"model.layers.*.mlp.nope_proj": "column"}, "nope_proj",
                           "matches no module"))
    messages.append(expect(llama, {"lm_head": "diagonal"}, "unknown style 'diagonal'"))
    messages.append(expect(llama, {"model.embed_tokens": "column"}, "model.embed_tokens",
                           "needs an nn.Linear"))
    messages.append(expect(llama, {"model.norm": "row"}, "model.norm", "needs an nn.Linear"))
    messages.append(expect(llama, "everything", "plan must be 'auto'"))
    # Subclasses of nn.Linear / nn.Embedding may change forward: exact types only. The valid
    # third layer is not replaced either.
    class MyLinear(nn.Linear):
        pass

    class MyEmbedding(nn.Embedding):
        pass

    sub = nn.Sequential(MyEmbedding(8, 8), MyLinear(8, 8 * tp), nn.Linear(8 * tp, 8))
    messages.append(expect(sub, {"0": "embedding", "1": "column", "2": "row"},
                           "0 (MyEmbedding)", "1 (MyLinear)", "subclass"))
    # Embedding options whose semantics a vocab-sharded table cannot keep.
    opts = nn.Sequential(nn.Embedding(8, 4, max_norm=1.0), nn.Embedding(8, 4, sparse=True),
                         nn.Embedding(8, 4, scale_grad_by_freq=True), nn.Embedding(8, 4))
    messages.append(expect(opts, {"*": "embedding"}, "0 (Embedding): max_norm=1.0",
                           "1 (Embedding): sparse=True", "2 (Embedding): scale_grad_by_freq=True"))
    tied = tiny_llama(tie_word_embeddings=True)
    messages.append(expect(tied, EXPLICIT_PLAN, "tied"))
    if tp > 1:
        odd = nn.Sequential(nn.Linear(8, 6 * tp + 1), nn.Linear(6 * tp + 1, 8))
        messages.append(expect(odd, {"0": "column", "1": "row"},
                               f"0 (Linear): out_features {6 * tp + 1} is not divisible by tp {tp}",
                               f"1 (Linear): in_features {6 * tp + 1} is not divisible by tp {tp}"))
        # 6 heads of 8: every projection's width (48) divides by 2 and 4, the head count does not
        # divide by 4 (and 3 kv heads not by 2).
        kv = 6 if tp == 4 else 3
        heads = tiny_llama(hidden_size=48, num_attention_heads=6, num_key_value_heads=kv)
        messages.append(expect(heads, "auto", f"num_key_value_heads = {kv} is not divisible by "
                               f"tp {tp}", "heads"))
    del torch
    return messages


def body_inferred(tp, seed):
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn

    import fastpar

    fastpar.init(tp=tp, timeout=60)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(50, 16)
            self.up_proj, self.down_proj = nn.Linear(16, 32), nn.Linear(32, 16)
            self.lm_head = nn.Linear(16, 52)

        def forward(self, ids):
            h = self.embed_tokens(ids)
            return self.lm_head(h + self.down_proj(F.gelu(self.up_proj(h))))

    torch.manual_seed(seed)
    ref = Block()
    model = fastpar.parallelize(Block(), "auto", verbose=False)
    fastpar.load_full_state_dict(model, ref.state_dict())
    styles = {c["module"]: c["style"] for c in model.fastpar_changes}
    assert styles == {"embed_tokens": "embedding", "up_proj": "column", "down_proj": "row",
                      "lm_head": "column_gather"}, styles
    ids = torch.randint(50, (3, 5))
    close("inferred.logits", model(ids), ref(ids).detach())

    # A serial tensor of the wrong shape is refused, naming the key and both shapes, before
    # anything is copied (a too-long vocabulary used to be silently truncated).
    for key, shape in (("embed_tokens.weight", (52, 16)), ("up_proj.weight", (33, 16)),
                       ("lm_head.bias", (50,))):
        try:
            fastpar.load_full_state_dict(model, {**ref.state_dict(), key: torch.zeros(shape)})
            raise AssertionError(f"{key} of shape {shape} was loaded")
        except ValueError as exc:
            want = tuple(ref.state_dict()[key].shape)
            assert (f"size mismatch for {key}: copying a param with shape {shape}" in str(exc)
                    and f"the shape in current model is {want}" in str(exc)), exc
    close("inferred.logits.after_refused_loads", model(ids), ref(ids).detach())

    # Frozen parameters stay frozen.
    frozen = Block()
    frozen.embed_tokens.weight.requires_grad_(False)
    frozen.up_proj.bias.requires_grad_(False)
    frozen.lm_head.requires_grad_(False)
    want = {k: p.requires_grad for k, p in frozen.named_parameters()}
    fastpar.parallelize(frozen, "auto", verbose=False)
    got = {k: p.requires_grad for k, p in frozen.named_parameters()}
    assert got == want, (got, want)
    frozen(ids).sum().backward()
    assert frozen.embed_tokens.weight.grad is None and frozen.lm_head.weight.grad is None

    # Hugging Face's replicated-input row style (rowwise_rep, alias rowwise_split_input) scatters
    # the input; colwise_rep gathers the output.
    torch.manual_seed(seed + 1)
    mlp = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    x = torch.randn(3, 8)
    for plan in ({"2": "rowwise_rep"}, {"0": "colwise_rep", "2": "rowwise_split_input"}):
        par = fastpar.parallelize(copy.deepcopy(mlp), plan, verbose=False)
        xs = [x.clone().requires_grad_(True) for _ in range(2)]
        outs = [m(xi) for m, xi in zip((par, mlp), xs)]
        close(f"{plan}.out", outs[0], outs[1].detach())
        for o in outs:
            o.square().sum().backward()
        close(f"{plan}.dx", xs[0].grad, xs[1].grad)
    return styles


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed "
                    "(pip install transformers) - the Hugging Face parallelize test needs it")
@pytest.mark.parametrize("world", [1, 2, 4])
def test_parallelize_hf_llama(world):
    launch = run_ranks(world, body_hf, tp=world, seed=3000 + world, env=ENV, timeout=300)
    for value in launch.values():
        assert value["declared"] == value["explicit"] == 16  # 2 x 7 projections, embed, head
        assert value["loaded"]
        assert len(value["errors"]) == (8 if world == 1 else 10)


@pytest.mark.parametrize("world", [2])
def test_parallelize_inferred_plan(world):
    run_ranks(world, body_inferred, tp=world, seed=4000)
