"""int8 / int4 weight-only quantized parallel linears (fastpar.nn.qweight, fastpar.nn.quantized)
against a float64 reference of the dequantized weights.

The format: the serial weight quantized is what every tp shard holds (gathered bit for bit at
tp 2 and 4, with row shards whose columns start mid-group), each element within half a step of
its float value. The GEMM: the native CPU kernel (decode rows), the dequantizing fallback (more
rows, and inputs that need a gradient) and the Triton kernel under the interpreter, each within
the rounding bound of the serial float32 GEMM of the dequantized weight. A whole GPT quantized at
tp 1, 2, 4 and tp 2 of 4 ranks (dp 2: a wrong group fails), with KV heads replicated at tp 4,
against the float64 model holding the dequantized weights.
"""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.multirank import ROOT, launch_env, run_ranks

pytestmark = pytest.mark.quick

FORMATS = [("int8", 16), ("int4", 16), ("int4", 32)]
H, FFN = 48, 200  # a row shard of FFN / tp columns: 100, 50: not whole groups of 16 or 32


def _reference(x, w, b=None):
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


def test_quantize_is_within_half_a_step_and_packs_int4():
    from fastpar.nn import qweight

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 100, generator=gen)
    w[3, :32] = 0.5  # a constant group (of 16 and of 32): exact
    for fmt, group in FORMATS:
        bits = qweight.FORMATS[fmt]
        grid = qweight.Grid(group, 0, 100)
        q, scales, offsets = qweight.quantize(w, bits, grid)
        assert q.dtype == (torch.int8 if bits == 8 else torch.uint8)
        assert q.shape == (24, 100 if bits == 8 else 50) and scales.shape == (grid.groups, 24)
        back = qweight.dequantize(q, scales, offsets, bits, grid, torch.float64)
        step = scales.double().t()[:, grid.column_groups()]
        assert ((back - w.double()).abs() <= step / 2 * (1 + 1e-6)).all(), fmt
        assert torch.equal(back[3, :32].float(), w[3, :32]), fmt
        ints = qweight.unpack(q, bits, 100)
        assert ints.min() >= (-127 if bits == 8 else 0) and ints.max() <= (127 if bits == 8
                                                                          else 15)


@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 9, 40])
@pytest.mark.parametrize("lead", [0, 6])
def test_qmatmul_against_float64(fmt, group, rows, lead):
    """The native kernel (rows <= 16) and the fallback (40 rows), float32 and bfloat16 inputs,
    a shard starting ``lead`` columns into its first group."""
    from fastpar.nn import qweight
    from fastpar.testing import assert_close

    gen = torch.Generator().manual_seed(rows + lead)
    bits = qweight.FORMATS[fmt]
    grid = qweight.Grid(group, 5 * group + lead, 90)
    w = torch.randn(37, 90, generator=gen)
    q, scales, offsets = qweight.quantize(w, bits, grid)
    wq = qweight.dequantize(q, scales, offsets, bits, grid)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(rows, 90, generator=gen).to(dtype)
        got = qweight.qmatmul(x, q, scales, offsets, bits, grid)
        assert got.dtype == dtype
        assert_close(f"{fmt} g{group} {rows} rows {dtype}", got, _reference(x, wq),
                     F.linear(x, wq.to(dtype)))
    x = torch.randn(2, rows, 90, generator=gen, requires_grad=True)
    y = qweight.qmatmul(x, q, scales, offsets, bits, grid)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    assert_close("dx", x.grad, dy.double() @ wq.double(), dy @ wq)


ISA_CHECK = r"""
import torch
import torch.nn.functional as F
from fastpar.nn import qweight
from fastpar.testing import assert_close
gen = torch.Generator().manual_seed(4)
for fmt, group, lead, rows in [("int8", 16, 6, 1), ("int8", 32, 0, 9), ("int4", 16, 6, 3),
                               ("int4", 64, 2, 12)]:
    bits = qweight.FORMATS[fmt]
    grid = qweight.Grid(group, 3 * group + lead, 201)
    w = torch.randn(33, 201, generator=gen)
    q, s, o = qweight.quantize(w, bits, grid)
    wq = qweight.dequantize(q, s, o, bits, grid)
    x = torch.randn(rows, 201, generator=gen)
    assert_close(fmt, qweight.qmatmul(x, q, s, o, bits, grid), x.double() @ wq.double().t(),
                 F.linear(x, wq))
print("ok")
"""


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
def test_the_native_kernel_on_every_instruction_set(isa):
    """The native kernel's AVX2 and scalar loops (this process runs the widest the CPU has),
    capped by FASTPAR_QLINEAR_ISA in a child process; 201 columns: every loop's tail."""
    out = subprocess.run([sys.executable, "-c", ISA_CHECK], cwd=ROOT, capture_output=True,
                         text=True, env=launch_env(env={"FASTPAR_QLINEAR_ISA": isa}),
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_triton_kernel_on_the_interpreter():
    """fastpar.kernels.qlinear (the CUDA path) against float64, run by Triton's interpreter in
    a child process (TRITON_INTERPRET is read when Triton is imported)."""
    pytest.importorskip("triton")
    code = r"""
import torch
from fastpar.kernels.qlinear import qlinear
from fastpar.nn import qweight
from fastpar.testing import assert_close
gen = torch.Generator().manual_seed(1)
for fmt, group, lead, rows in [("int8", 16, 0, 1), ("int8", 32, 6, 20), ("int4", 16, 6, 3),
                               ("int4", 32, 0, 17)]:
    bits = qweight.FORMATS[fmt]
    grid = qweight.Grid(group, lead, 75)
    w = torch.randn(70, 75, generator=gen)
    q, s, o = qweight.quantize(w, bits, grid)
    wq = qweight.dequantize(q, s, o, bits, grid)
    x = torch.randn(rows, 75, generator=gen)
    got = qlinear(x, q, s, o, bits, group, lead)
    assert_close(fmt, got, x.double() @ wq.double().t(), x @ wq.t())
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=launch_env(env={"TRITON_INTERPRET": "1"}), timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_gemm_on_cuda(dtype):
    """The Triton kernel compiled for the GPU (tests/gpu_check.sh), through qmatmul as the layers
    call it: decode and prefill rows, shards starting mid-group, against float64."""
    from fastpar.nn import qweight
    from fastpar.testing import assert_close

    gen = torch.Generator().manual_seed(2)
    dt = getattr(torch, dtype)
    for fmt, group in FORMATS + [("int8", 128), ("int4", 64)]:
        bits = qweight.FORMATS[fmt]
        for lead, rows, n, k in ((0, 1, 4096, 1024), (6, 8, 300, 1376), (0, 512, 1000, 512)):
            grid = qweight.Grid(group, lead, k)
            w = torch.randn(n, k, generator=gen)
            q, s, o = qweight.quantize(w, bits, grid)
            wq = qweight.dequantize(q, s, o, bits, grid)
            x = torch.randn(rows, k, generator=gen).to(dt)
            got = qweight.qmatmul(x.cuda(), q.cuda(), s.cuda(), None if o is None else o.cuda(),
                                  bits, grid)
            assert got.dtype == dt and got.is_cuda
            assert_close(f"{fmt} g{group} {rows}x{k}", got.cpu(), _reference(x, wq),
                         F.linear(x, wq.to(dt)))


def body_layers(tp: int, seed: int) -> list:
    """Column and row layers quantized at ``tp`` in every format: the gathered integers and
    scales are the serial weight's, and forward and the input gradient match float64 of the
    dequantized weight."""
    from torch import nn

    import fastpar
    from fastpar.comm.collectives import all_gather
    from fastpar.nn import ColumnParallelLinear, RowParallelLinear, qweight
    from fastpar.testing import Checks

    topo = fastpar.init(tp=tp)
    checks = Checks()
    for fmt, group in FORMATS:
        data = torch.Generator().manual_seed(seed + 7919 * topo.dp_rank)
        bits = qweight.FORMATS[fmt]
        for cls, (n_in, n_out) in ((ColumnParallelLinear, (H, FFN)),
                                   (RowParallelLinear, (FFN, H))):
            torch.manual_seed(seed + topo.dp_rank)
            serial = nn.Linear(n_in, n_out)
            grid = qweight.Grid(group, 0, n_in)
            q, scales, offsets = qweight.quantize(serial.weight, bits, grid)
            wq = qweight.dequantize(q, scales, offsets, bits, grid)
            layer = fastpar.quantize_weights(cls.from_serial(serial, group=topo.tp_group), fmt,
                                             group)
            name = f"{type(layer).__name__} {fmt} g{group}"
            for key, want in (("qweight", q), ("scales", scales), ("offsets", offsets)):
                got = getattr(layer, key)
                assert (got is None) == (want is None), key
                if got is not None:
                    full = layer.gather_full(key, got)
                    assert torch.equal(full, want), f"{name}.{key} differs from the serial one"
                    assert torch.equal(layer.shard_full(key, want), got), f"{name}.{key} shard"
            for rows in (1, 3, 40):
                x = torch.randn(rows, n_in, generator=data, requires_grad=True)
                x_in = x.detach().chunk(tp, -1)[topo.tp_rank] if cls is RowParallelLinear else \
                    x.detach()
                x_in.requires_grad_(rows == 40)
                y = layer(x_in)
                if cls is ColumnParallelLinear:
                    y = all_gather(y.detach().contiguous(), topo.tp_group, dim=-1)
                ref = _reference(x, wq, serial.bias)
                checks.close(f"{name} {rows} rows", y, ref, F.linear(x, wq, serial.bias))
                if rows == 40:  # the input gradient, through the fallback
                    dy = torch.randn(rows, n_out, generator=data)
                    dy_in = dy.chunk(tp, -1)[topo.tp_rank] if cls is ColumnParallelLinear else dy
                    layer(x_in).backward(dy_in)
                    ref_dx = dy.double() @ wq.double()
                    if cls is RowParallelLinear:
                        ref_dx = ref_dx.chunk(tp, -1)[topo.tp_rank]
                        serial_dx = (dy @ wq).chunk(tp, -1)[topo.tp_rank]
                    else:
                        serial_dx = dy @ wq
                    checks.close(f"{name} dx", x_in.grad, ref_dx, serial_dx)
    return checks.checked


@pytest.mark.parametrize("world,tp", [(1, 1), (2, 2), (4, 4), (4, 2)])
def test_layers_at_every_tp(world, tp):
    checked = run_ranks(world, body_layers, tp=tp, seed=3).values()
    assert all(c == checked[0] for c in checked) and len(checked[0]) == 8 * len(FORMATS)


def _config(**over):
    from fastpar.models.config import GPTConfig

    return GPTConfig(**{**dict(vocab_size=128, hidden=H, heads=8, kv_heads=2, ffn_hidden=FFN,
                               layers=2, seq_len=16), **over})


def body_model(cfg: dict, fmt: str, tp: int, tokens: list) -> dict:
    """The GPT's logits quantized at ``tp`` (vocab shards gathered); at tp 1 also the float64
    model holding the dequantized weights and the float32 quantized model's error."""
    import fastpar
    from fastpar.comm.collectives import all_gather
    from fastpar.models.config import GPTConfig
    from fastpar.models.gpt import gpt_layers
    from fastpar.nn.quantized import QuantizedLinear

    topo = fastpar.init(tp=tp)
    def build():  # the same weights each time (the factories draw from seed 0)
        layers = gpt_layers(GPTConfig(**cfg), seed=0, replicated_kv=True)
        return torch.nn.Sequential(*[make() for make in layers]).eval()

    model = build()
    float64 = build().double() if tp == 1 else None
    fastpar.quantize_weights(model, fmt, 16)
    ids = torch.tensor(tokens)
    with torch.no_grad():
        logits = all_gather(model(ids).contiguous(), topo.tp_group, dim=-1)
        out = {"logits": logits.tolist()}
        if float64 is not None:  # the float64 model holding the dequantized weights
            for name, layer in model.named_modules():
                if isinstance(layer, QuantizedLinear):
                    target = float64.get_submodule(name)
                    target.weight.copy_(layer.linear_weight.double().reshape(
                        target.weight.shape) if target.layout == "linear" else
                        layer.linear_weight.double().t())
            out["ref"] = float64(ids).tolist()
            # the same float layers in float32: the serial error the bound is made of,
            # independent of the quantized kernels
            out["serial"] = float64.float()(ids).tolist()
    return out


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_gpt_logits_at_every_tp(fmt):
    """tp 4 over 2 KV heads replicates them (HeadReplicatedLinear, quantized)."""
    from fastpar.testing import assert_close

    cfg = _config().__dict__
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(5)).tolist()
    one = run_ranks(1, body_model, cfg=cfg, fmt=fmt, tp=1, tokens=tokens).values()[0]
    ref, serial = torch.tensor(one["ref"], dtype=torch.float64), torch.tensor(one["serial"])
    assert_close(f"{fmt} logits tp 1", torch.tensor(one["logits"]), ref, serial)
    for world, tp in ((2, 2), (4, 4), (4, 2)):
        for rank, got in enumerate(run_ranks(world, body_model, cfg=cfg, fmt=fmt, tp=tp,
                                             tokens=tokens).values()):
            assert_close(f"{fmt} logits tp {tp} rank {rank}", torch.tensor(got["logits"]), ref,
                         serial)


def body_checkpoint(cfg: dict, fmt: str, group: int, tp: int, root: str, save: bool) -> dict:
    """The GPT quantized at ``tp``: saved (seed 0), or loaded into one quantized from other
    weights (seed 1); a digest of each tensor of its full state dict either way."""
    import hashlib

    import fastpar
    from fastpar.checkpoint.sharded import ShardedCheckpointer
    from fastpar.models.config import GPTConfig
    from fastpar.models.gpt import gpt_layers
    from fastpar.nn.quantized import quantized_meta

    fastpar.init(tp=tp)
    layers = gpt_layers(GPTConfig(**cfg), seed=0 if save else 1, replicated_kv=True)
    model = fastpar.quantize_weights(torch.nn.Sequential(*[make() for make in layers]), fmt,
                                     group)
    if save:
        ShardedCheckpointer().save(root, 0, model, meta={"weights": quantized_meta(model)})
    else:
        ShardedCheckpointer().load(root, model, None)
    return {k: [str(v.dtype), list(v.shape),
                hashlib.sha256(v.cpu().contiguous().view(torch.uint8).numpy()).hexdigest()]
            for k, v in fastpar.full_state_dict(model).items()}


@pytest.mark.parametrize("fmt,group,saved_at", [("int8", 16, 2), ("int4", 16, 2),
                                                ("int8", 128, 4)])
def test_checkpoint_reshards_exactly(fmt, group, saved_at, tmp_path):
    """Saved at tp 2 (row shards of 100 and 24 columns: edge groups shared) or at tp 4 with
    groups of 128 (shards of 50 and 12 columns: ranks in which no group starts save no scales),
    loaded at tp 1, 4 (its KV heads replicated) and 2 of 4: every tensor bit for bit."""
    cfg, root = _config().__dict__, str(tmp_path / "ckpt")
    saved = run_ranks(saved_at, body_checkpoint, cfg=cfg, fmt=fmt, group=group, tp=saved_at,
                      root=root, save=True).values()
    assert any(k.endswith("down_proj.qweight") for k in saved[0])
    assert any(k.endswith("o_proj.scales") for k in saved[0])
    for world, tp in ((1, 1), (4, 4), (4, 2)):
        for got in run_ranks(world, body_checkpoint, cfg=cfg, fmt=fmt, group=group, tp=tp,
                             root=root, save=False).values():
            assert got == saved[0], (world, tp)


def body_parallelized(path: str, fmt: str, tp: int, tokens: list) -> list:
    """A Hugging Face Llama parallelized at ``tp`` (its own modules, fastpar's linears), its
    linears quantized: the full logits."""
    from transformers import AutoModelForCausalLM

    import fastpar
    from fastpar.comm.collectives import all_gather

    fastpar.init(tp=tp)
    model = fastpar.parallelize(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    fastpar.quantize_weights(model, fmt, 16)
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits
    head = model.lm_head
    if getattr(head, "gather_output", True) is False:  # vocab shards: whole on every rank
        logits = all_gather(logits.contiguous(), head.group, dim=-1)
    return logits.tolist()


def test_a_parallelized_hugging_face_model(tmp_path):
    """``fastpar.parallelize`` then ``quantize_weights`` of Hugging Face's own Llama at tp 2 of
    4 ranks: its logits are those of the serial model holding the serially quantized,
    dequantized weights (float64 reference), within the float32 model's rounding bound."""
    from transformers import AutoModelForCausalLM

    from fastpar.nn import qweight
    from fastpar.testing import assert_close
    from tests.test_hf_models import make_model

    path = str(tmp_path / "llama")
    make_model("llama", path, intermediate_size=200)  # down_proj shards of 100: mid-group
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(3)).tolist()
    for fmt in ("int8", "int4"):
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        with torch.no_grad():
            for module in ref.modules():
                if isinstance(module, torch.nn.Linear):
                    bits, k = qweight.FORMATS[fmt], module.in_features
                    grid = qweight.Grid(16, 0, k)
                    module.weight.copy_(qweight.dequantize(
                        *qweight.quantize(module.weight, bits, grid), bits, grid,
                        torch.float64))
            want = ref(torch.tensor(tokens)).logits
            serial = ref.float()(torch.tensor(tokens)).logits
        for got in run_ranks(4, body_parallelized, path=path, fmt=fmt, tp=2,
                             tokens=tokens).values():
            assert_close(f"parallelized Llama {fmt}", torch.tensor(got), want, serial)


def body_refusals_and_casts() -> dict:
    """At tp 2: an odd int4 row shard and a fused projection refused before any layer
    changes; a cast to bfloat16 leaves the scales' float32 values as they were."""
    from torch import nn

    import fastpar
    from fastpar.nn import ColumnParallelLinear, RowParallelLinear
    from fastpar.nn.fused import FusedColumnParallelLinear
    from fastpar.nn.quantized import QuantizedLinear

    topo = fastpar.init(tp=2)
    said = {}
    column = ColumnParallelLinear(32, 32, group=topo.tp_group, seed=0)
    for key, fmt, bad in (("odd", "int4", RowParallelLinear(34, 32, group=topo.tp_group, seed=0)),
                          ("fused", "int8", FusedColumnParallelLinear(
                              32, 96, parts=[32, 32, 32], group=topo.tp_group, seed=0))):
        model = nn.Sequential(column, bad)
        try:
            fastpar.quantize_weights(model, fmt)
        except ValueError as exc:
            said[key] = str(exc)
        said[key + "_untouched"] = not any(isinstance(m, QuantizedLinear)
                                           for m in model.modules())
    layer = fastpar.quantize_weights(RowParallelLinear(64, 32, group=topo.tp_group, seed=0),
                                     "int4", 16)
    before = [layer.scales.clone(), layer.offsets.clone()]
    layer.to(torch.bfloat16)
    said["cast"] = (layer.scales.dtype == torch.float32 and torch.equal(layer.scales, before[0])
                    and torch.equal(layer.offsets, before[1])
                    and layer.bias.dtype == torch.bfloat16)
    return said


def test_refusals():
    import fastpar
    from fastpar.nn import qweight

    with pytest.raises(ValueError, match="one of"):
        qweight.check_format("int2", None)
    with pytest.raises(ValueError, match="multiple of 16"):
        qweight.check_format("int8", 24)
    layer = torch.nn.Linear(4, 4)
    assert fastpar.quantize_weights(layer, "int8") is layer  # nothing parallel: left as is
    for said in run_ranks(2, body_refusals_and_casts).values():
        assert "17 columns is odd; use int8" in said["odd"] and said["odd_untouched"], said
        assert "a fused projection" in said["fused"] and said["fused_untouched"], said
        assert said["cast"], said
