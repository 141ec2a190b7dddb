"""Structured pruning (``fastpar.prune``, ``python -m fastpar.prune``) against the original
model with the removed heads and channels zeroed.

- ``fastpar.prune`` by magnitude, activations and random, on a GQA model (16 heads over 8 KV
  groups, its own head_dim, q/k/v biases, SwiGLU) and an MHA one (GELU, LayerNorm, learned
  positions, biases), every weight perturbed: the pruned model's logits are the original's with
  the removed heads' o_proj columns and the removed channels' down_proj (fc2) columns zeroed,
  within the float32 rounding bound of that zeroed model (``fastpar.testing``), at tp 1, tp 2,
  tp 4 and tp 2 of 4 ranks (a wrong group fails); every layout keeps the units tp 1 kept, every
  block the same counts, a multiple of tp; random keeps other units than magnitude. Bad input
  is a ValueError naming the values.
- The command on a trainer checkpoint (tiny preset, GQA; pruned by activations over the
  trainer's corpus, the real front door) and on a Hugging Face Llama directory (at tp 2, by
  magnitude): ``python -m fastpar.train --resume`` of each at another layout trains with the
  pruned config from a fresh optimizer, its loss finite; the ``--save-hf`` directory loads with
  ``from_pretrained``, its logits fastpar's pruned model's within the float32 bound, and reads
  back into fastpar bit for bit; bad flags are one line from rank 0, exit status 2.
"""

import math
import os

import pytest
import torch

from tests.multirank import run_ranks

VOCAB, SEQ = 96, 16
CONFIGS = {
    "gqa": dict(vocab_size=VOCAB, seq_len=SEQ, layers=2, hidden=64, heads=16, kv_heads=8,
                head_dim=8, ffn_hidden=96, qkv_bias=True),
    "mha": dict(vocab_size=VOCAB, seq_len=SEQ, layers=2, hidden=64, heads=8, ffn_hidden=128,
                mlp="gelu", norm="layernorm", positions="learned", bias=True),
}
BY = ("magnitude", "activations", "random")


def _tokens(seed: int, rows: int = 2):
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def _model(cfg):
    """The GPT of ``cfg`` at the job's tp with every tensor perturbed (the same serial values
    at every tp: drawn whole, in key order, from one seeded generator)."""
    import fastpar
    from fastpar.models import GPT

    model = GPT(cfg, seed=0)
    full = fastpar.full_state_dict(model)
    gen = torch.Generator().manual_seed(1)
    for key, value in full.items():
        scale = 0.2 if "norm" in key else 0.05
        value += scale * torch.randn(value.shape, generator=gen)
    fastpar.load_full_state_dict(model, full)
    return model


def _logits(model, tokens, group) -> torch.Tensor:
    """The full logits (B, T, V) of a GPT whose head gives this rank's vocab shard."""
    from fastpar import comm

    with torch.no_grad():
        return comm.all_gather(model(tokens).contiguous(), group=group, dim=-1)


def _zeroed(model, kept, tokens, group, dtype) -> torch.Tensor:
    """The original ``model``'s logits in ``dtype`` with the heads and channels ``kept`` leaves
    out zeroed: their columns of o_proj and of down_proj (fc2)."""
    import fastpar
    from fastpar.pruning.structured import empty_gpt

    cfg, full = model.cfg, fastpar.full_state_dict(model)
    hd = cfg.head_size
    for b in range(cfg.layers):
        gone = [h for h in range(cfg.heads) if h not in kept.query_heads(b)]
        o = full[f"{b + 1}.attn.o_proj.weight"]
        for h in gone:
            o[:, h * hd:(h + 1) * hd] = 0
        down = full[f"{b + 1}.mlp.{'down_proj' if cfg.mlp == 'swiglu' else 'fc2'}.weight"]
        down[:, [c for c in range(cfg.ffn_size) if c not in kept.channels[b]]] = 0
    twin = empty_gpt(cfg, group, device="cpu", dtype=dtype).eval()
    fastpar.load_full_state_dict(twin, {k: v.to(dtype) for k, v in full.items()})
    return _logits(twin, tokens, group)


def body_prune(tp: int, refs: dict | None = None) -> dict:
    """Each config pruned by each score; tp 1 (``refs`` None) returns the float64 and float32
    references of the zeroed model, other layouts check against them."""
    import fastpar
    from fastpar.models import GPTConfig
    from fastpar.testing import assert_close

    topo = fastpar.init(tp=tp)
    tokens, data = _tokens(3), [_tokens(10 + i) for i in range(3)]
    out = {}
    for name, fields in CONFIGS.items():
        model = _model(GPTConfig(**fields)).eval()
        out[name] = {}
        for by in BY:
            small = fastpar.prune(model, heads=0.5, mlp=0.25, by=by, data=data)
            kept, cfg = small.kept, small.cfg
            assert len({len(g) for g in kept.groups}) == len({len(c) for c in kept.channels}) == 1
            assert cfg.heads % tp == cfg.num_kv_heads % tp == cfg.ffn_size % tp == 0, cfg
            assert small[1].attn.local_heads * tp == cfg.heads == model.cfg.heads // 2
            got = _logits(small, tokens, topo.tp_group)
            rec = {"groups": kept.groups, "channels": kept.channels}
            if refs is None:
                rec["ref64"] = _zeroed(model, kept, tokens, topo.tp_group, torch.float64).tolist()
                rec["serial32"] = _zeroed(model, kept, tokens, topo.tp_group,
                                          torch.float32).tolist()
            else:
                ref = refs[name][by]
                assert (kept.groups, kept.channels) == (ref["groups"], ref["channels"]), by
                rec.update(ref64=ref["ref64"], serial32=ref["serial32"])
            assert_close(f"{name} by {by}: logits", got, torch.tensor(rec["ref64"]),
                         torch.tensor(rec["serial32"]))
            out[name][by] = rec
        same = [out[name]["random"][k] == out[name]["magnitude"][k] for k in ("groups",
                                                                            "channels")]
        assert not all(same), f"{name}: random kept what magnitude kept"
    if tp == 4:
        refusals(model)
    return out


def refusals(model) -> None:
    """Bad input, at tp 4 over the MHA model's 8 heads and 128 channels: ValueError naming the
    values."""
    import fastpar
    from fastpar.models import GPT, GPTConfig

    for kwargs, words in (
            (dict(heads=0.25), "heads=0.25 removes 2 of the 8 heads of each block and keeps "
                               "6, which tp 4 does not divide"),
            (dict(heads=1.0), "heads=1 removes all 8 heads"),
            (dict(mlp=0.3), "mlp=0.3 removes 38 of the 128 MLP channels of each block and "
                            "keeps 90, which tp 4 does not divide"),
            (dict(mlp=-0.1), "mlp must be a fraction in [0, 1], got -0.1"),
            (dict(heads=0.5, by="norm"), "by must be one of ('magnitude', 'activations', "
                                         "'random'), got 'norm'"),
            (dict(heads=0.5, by="activations"), "by='activations' needs data="),
            (dict(heads=0.5, by="activations", data=[]), "data= holds no batch")):
        with pytest.raises(ValueError) as info:
            fastpar.prune(model, **kwargs)
        assert words in str(info.value), (kwargs, str(info.value))
    with pytest.raises(TypeError, match="takes a fastpar GPT"):
        fastpar.prune(list(model), heads=0.5)
    moe = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, layers=2, hidden=32, heads=4,
                        moe_experts=2, moe_every=2))
    with pytest.raises(ValueError, match=r"blocks \[2\] are Mixture-of-Experts blocks"):
        fastpar.prune(moe, mlp=0.5)


@pytest.fixture(scope="module")
def at_tp1():
    return run_ranks(1, body_prune, tp=1, timeout=300).values()[0]


def test_pruned_logits_are_the_zeroed_originals_at_every_tp(at_tp1):
    """tp 1 (the references), tp 2, tp 2 of 4 ranks and tp 4 (with the refusals)."""
    for nranks, tp in ((2, 2), (4, 2), (4, 4)):
        run_ranks(nranks, body_prune, tp=tp, refs=at_tp1, timeout=300)


# ---- the command ------------------------------------------------------------------------------


def body_train(argv: list) -> dict:
    """``python -m fastpar.train argv`` in this job: the losses and the model it trained."""
    import fastpar
    from fastpar.training.args import parse_args
    from fastpar.training.trainer import Trainer

    try:
        trainer = Trainer(parse_args(["--no-progress", "--plot", "", "--global-batch", "4",
                                      "--log-every", "1", "--timeout", "60"] + argv))
        records = trainer.run()
        c = trainer.cfg
        return {"losses": [r["loss"] for r in records], "shape": [c.heads, c.num_kv_heads,
                                                                  c.ffn_size, c.head_size]}
    finally:
        fastpar.shutdown()


def body_command(argvs: list) -> list:
    """``python -m fastpar.prune`` (``cli.main``) for each argv in this job, and ``python -m
    fastpar.train`` for those that start with "train": [exit status, this rank's stderr]."""
    import contextlib
    import io

    from fastpar.pruning.cli import main
    from fastpar.training.args import parse_args

    said = []
    for argv in argvs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                if argv[0] == "train":
                    parse_args(argv[1:])
                    code = 0
                else:
                    code = main(argv)
            except SystemExit as exc:
                code = exc.code
        said.append([code, err.getvalue()])
    return said


def _one_line(said: list, words: str, prog: str = "python -m fastpar.prune") -> None:
    """Rank 0 said one error line holding ``words``, the other ranks nothing; exit status 2."""
    for rank, (code, err) in enumerate(said):
        lines = [x for x in err.splitlines() if f"{prog}: error" in x]
        assert code == 2 and len(lines) == (1 if rank == 0 else 0), (rank, words, err)
        assert rank or words in lines[0], (words, err)


def test_the_command_prunes_a_trainer_checkpoint_that_trains_at_another_layout(tmp_path):
    """The tiny preset (8 heads over 4 KV heads) trained 2 steps at tp 1; pruned by
    activations (``python -m fastpar.prune``, its own process) to 4 / 2 heads and 132 of 176
    channels; 2 steps of ``fastpar.train --resume`` at tp 2; the refusals at 2 ranks."""
    import sys

    from tests.multirank import launch

    ck, pruned = str(tmp_path / "ck"), str(tmp_path / "pruned")
    run_ranks(1, body_train, argv=["--preset", "tiny", "--heads", "8", "--kv-heads", "4",
                                   "--steps", "2", "--save", ck])
    done = launch([sys.executable, "-m", "fastpar.prune", "--resume", ck, "--heads", "0.5",
                   "--mlp", "0.25", "--by", "activations", "--batches", "2", "--batch-size",
                   "4", "--save", pruned], timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "keeps heads 4 of 8 (kv_heads 2 of 4) and MLP channels 132 of 176" in done.stdout
    trained = run_ranks(2, body_train, argv=["--resume", pruned, "--tp", "2", "--steps", "2",
                                             "--save", str(tmp_path / "recovered")]).values()
    for got in trained:
        assert got["shape"] == [4, 2, 132, 8] and len(got["losses"]) == 2, got
        assert all(math.isfinite(x) for x in got["losses"]), got
    out = str(tmp_path / "x")
    cases = [
        (["--resume", ck, "--heads", "0.75", "--tp", "2", "--save", out],
         "heads=0.75 removes 3 of the 4 KV groups (heads 8, kv_heads 4) of each block and "
         "keeps 1, which tp 2 does not divide"),
        (["--resume", ck, "--heads", "1", "--tp", "2", "--save", out], "removes all 4"),
        (["--resume", ck, "--mlp", "0.5", "--tp", "2", "--save-hf", out],
         "is fastpar's own GPT (a --preset run), which has no Hugging Face form"),
        (["--resume", ck, "--mlp", "0.5", "--by", "nope", "--save", out], "invalid choice"),
        (["--resume", ck, "--mlp", "0.5", "--tp", "2"], "nothing would be written"),
        (["--resume", ck, "--save", out], "--heads and --mlp are both 0"),
        (["--resume", ck, "--mlp", "0.5", "--save", ck], f"--save {ck} exists and is not"),
        (["--resume", ck, "--mlp", "0.5", "--data", ck, "--save", out],
         "--data is the calibration text of --by activations"),
        (["train", "--resume", pruned, "--preset", "tiny"],
         "--preset with --resume"),
    ]
    said = run_ranks(2, body_command, argvs=[argv for argv, _ in cases]).values()
    for i, (argv, words) in enumerate(cases):
        prog = "python -m fastpar.train" if argv[0] == "train" else "python -m fastpar.prune"
        _one_line([rank[i] for rank in said], words, prog)
    assert not os.path.exists(out)


def body_hugging_face(ckpt: str, out: str) -> dict:
    """The pruned checkpoint in fastpar (float32) against ``from_pretrained(out)`` (float64,
    and float32 for the bound); the directory read back into fastpar bit for bit."""
    import dataclasses

    import fastpar
    from fastpar.checkpoint import loading
    from fastpar.checkpoint.sharded import ShardedCheckpointer
    from fastpar.hf_files import SafetensorsReader
    from fastpar.models import GPTConfig
    from fastpar.models.hf import hf_config, read_hf_config
    from fastpar.models.hf_weights import load_layer
    from fastpar.pruning.structured import empty_gpt
    from fastpar.testing import assert_close
    from tests.test_hf_models import hf_logits

    topo = fastpar.init()
    cfg = GPTConfig(**loading.open_index(ckpt)[1]["meta"]["model"])
    model = empty_gpt(cfg, topo.tp_group, device="cpu").eval()
    ShardedCheckpointer().load(ckpt, model, None)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        got = model(tokens)
    assert_close("Hugging Face's logits", got, hf_logits(out, tokens, torch.float64),
                 hf_logits(out, tokens, torch.float32))
    back, info = hf_config(read_hf_config(out), seq_len=cfg.seq_len)
    assert dataclasses.replace(back, head_dim=cfg.head_dim) == cfg, (back, cfg)
    again = empty_gpt(back, topo.tp_group, device="cpu")
    reader = SafetensorsReader(out)
    for i, layer in enumerate(again):
        load_layer(layer, i, back, info, reader)
    mine, theirs = fastpar.full_state_dict(model), fastpar.full_state_dict(again)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    return {k: info.config[k] for k in ("num_attention_heads", "num_key_value_heads",
                                        "head_dim", "intermediate_size")}


def test_the_command_prunes_a_hugging_face_model_and_exports_it(tmp_path):
    """A Llama of 8 heads over 4 KV heads (256 tokens: the trainer's byte corpus) pruned at tp 2
    by magnitude to 4 / 2 heads and 72 of 96 channels, saved both ways; the checkpoint trains at
    tp 1."""
    from tests.test_hf_models import make_model

    hf, ckpt, out = (str(tmp_path / name) for name in ("llama", "pruned", "pruned-hf"))
    make_model("llama", hf, num_attention_heads=8, num_key_value_heads=4, vocab_size=256)
    said = run_ranks(2, body_command, argvs=[[
        "--hf-model", hf, "--tp", "2", "--heads", "0.5", "--mlp", "0.25", "--save", ckpt,
        "--save-hf", out]]).values()
    assert [s[0][0] for s in said] == [0, 0], said
    fields = run_ranks(1, body_hugging_face, ckpt=ckpt, out=out).values()[0]
    assert fields == {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                      "intermediate_size": 72}, fields
    got = run_ranks(1, body_train, argv=["--resume", ckpt, "--steps", "2"]).values()[0]
    assert got["shape"] == [4, 2, 72, 8] and all(math.isfinite(x) for x in got["losses"]), got
