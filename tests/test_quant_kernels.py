"""fastpar.kernels' int8 codec (Triton) against fastpar.comm.quant's torch definition, bit for
bit: the packed bytes (scales, values, pad), the dequantized values, the error-feedback
residual and the row sums, at odd sizes, sizes off the block, blocks walked in several tiles,
zero / inf / NaN / tiny blocks and ties, float32 and bfloat16 in and out.

As in tests/test_kernels.py, the CPU checks (TestInterpreter) run in one child pytest of this
file with TRITON_INTERPRET=1, started by test_cpu_kernels_under_interpreter; this process never
imports fastpar.kernels on a CPU machine. On a GPU machine TestCompiledOnCuda runs them compiled
(tests/gpu_check.sh), against the torch definition computed on the CPU.

NaN is compared as NaN: its bits are not the codec's (x86 keeps a NaN's payload, a GPU makes
0x7FFFFFFF, and torch's own float -> bfloat16 gives 0x7FC0 or 0xFFFF by code path); every other
value, signed zeros included, must match bit for bit. A NaN scale is a stored constant, so
packed bytes match exactly.
"""

import importlib
import importlib.util
import os
import sys
import types

import pytest
import torch

from fastpar.comm import quant
from tests.multirank import launch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"  # set for the child pytest
HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed "
                                  "(pip install 'fastpar[triton]')")

# (rows, m, block, max_tile), small for the interpreter: m odd, off the block, a multiple of it,
# below it; every special block (_x) in the first two; blocks in one tile and in several (the
# last tile partial in 80 = 32 + 32 + 16)
CASES = [(1, 117, 16, 4096), (3, 100, 64, 4096), (1, 256, 64, 4096), (1, 1, 16, 4096),
         (1, 300, 256, 64), (1, 171, 80, 32)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def kernels():
    return importlib.import_module("fastpar.kernels")


SPECIALS = ["zeros", "inf", "-inf", "nan", "tiny", "ties"]


def _x(rows, m, block, dtype, seed=0, specials=SPECIALS):
    """(rows, m) values of very different magnitudes per row, and from the second block on the
    special blocks: all zeros, one inf, one -inf, one NaN, a tiny amax (its inv overflows),
    exact ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, m, generator=g) * 10.0 ** torch.randint(-3, 4, (rows, 1), generator=g)
    blocks = [x[r, j:j + block] for r in range(rows) for j in range(0, m, block)][1:]
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, 3.5])
    for k, (what, b) in enumerate(zip(specials, blocks)):
        if what == "zeros":
            b.zero_()
        elif what == "tiny":  # amax < 127 / FLT_MAX: inv = inf, the zeros must stay 0
            b.zero_()
            b[-1] = -1e-38
        elif what == "ties":  # amax 127 so inv = 1: x * inv = k + 0.5 exactly, ties to even
            b.copy_(ties.repeat(block // 8)[:b.numel()])
        else:
            b[(7 * k) % b.numel()] = float(what)
    return x.to(dtype)


def same(got, want):
    """Bitwise equal, NaN as NaN (see the module docstring)."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape,
                                                                 got.dtype, want.dtype)
    got, want = got.cpu(), want.cpu()
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN in different places"
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16}[want.dtype]
    g, w = got[~nan].view(ints), want[~nan].view(ints)
    bad = (g != w).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ; first: got {got[~nan][bad[0]]}, " \
                             f"want {want[~nan][bad[0]]}"


def check_pack(k, rows, m, block, max_tile, dtype, device, strided=False):
    """pack_rows (with and without a residual, full and cut) and unpack_rows (float32 and
    bfloat16 out) against comm.quant on the CPU."""
    x = _x(rows, m, block, dtype)
    per = quant.packed_bytes(m, block)
    want = quant.pack_rows(x, block, torch.empty(rows, per, dtype=torch.uint8))
    want_y = quant.unpack_rows(want, m, block)  # (rows, m) float32
    xd = x.to(device)
    if strided:  # (rows, m) with strides (1, rows)
        xd = xd.T.contiguous().T
    for res_len in (rows * m - 1, None):  # cut short (as all_reduce's), none
        out = torch.full((rows, per), 0xAB, dtype=torch.uint8, device=device)  # pad: garbage
        res = None if res_len is None else torch.empty(res_len, device=device)
        k.pack_rows(xd, block, out, residual=res, max_tile=max_tile)
        assert torch.equal(out.cpu(), want), f"{(out.cpu() != want).sum()} bytes differ"
        if res is not None:
            same(res, quant.carried(x, want_y).view(-1)[:res.numel()])
    same(k.unpack_rows(out, m, block, max_tile=max_tile), want_y)
    bf = torch.empty(rows, m, dtype=torch.bfloat16, device=device)
    same(k.unpack_rows(out, m, block, bf, max_tile=max_tile), want_y.to(torch.bfloat16))


def check_sum(k, n, m, block, max_tile, dtype, device):
    """sum_packed_rows of n pieces (float32 and bfloat16 out) against the float32 sum in row
    order of comm.quant's dequantized pieces; the data is such that another order would differ."""
    # each row's specials from its second block on, starting at a different one; its first
    # blocks finite in every row
    x = torch.cat([_x(1, m, block, dtype, r, SPECIALS[r:] + SPECIALS[:r]) for r in range(n)])
    per = quant.packed_bytes(m, block)
    buf = quant.pack_rows(x, block, torch.empty(n, per, dtype=torch.uint8))
    ys = quant.unpack_rows(buf, m, block)  # (n, m)
    acc = ys[0].clone()
    for r in range(1, n):
        acc += ys[r]
    if n >= 3 and m >= 100:  # the test can tell the order: summed backwards, some bits differ
        back = ys[n - 1].clone()
        for r in range(n - 2, -1, -1):
            back += ys[r]
        fin = acc.isfinite()
        assert not torch.equal(back[fin], acc[fin])
    for out_dtype in DTYPES:
        out = torch.full((m,), 7.0, dtype=out_dtype, device=device)
        k.sum_packed_rows(buf.to(device), m, block, out, max_tile=max_tile)
        same(out, acc.to(out_dtype))


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy's, for
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the NaN products
class TestInterpreter:  # (inf * 0, 0 * inf) and infinite inv the kernels compute then discard
    """On CPU through Triton's interpreter; collected only in the child pytest."""

    __test__ = INTERPRETER

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("rows, m, block, max_tile", CASES)
    def test_pack_and_unpack(self, kernels, rows, m, block, max_tile, dtype):
        check_pack(kernels, rows, m, block, max_tile, dtype, "cpu")

    def test_strided_input_and_the_ieee_division(self, kernels):
        check_pack(kernels, 2, 40, 16, 4096, torch.float32, "cpu", strided=True)
        # 127 / a rounded once gives q = 28 here; reciprocal(a) * 127 would give 27
        a, x = torch.tensor([1057455871, 1038792629], dtype=torch.int32).view(torch.float32)
        out = torch.empty(1, quant.packed_bytes(2, 16), dtype=torch.uint8)
        kernels.pack_rows(torch.stack([a, x]).view(1, 2), 16, out)
        assert out[0, 4:6].view(torch.int8).tolist() == [127, 28]

    @pytest.mark.parametrize("n, m, block, max_tile", [(1, 37, 16, 4096), (4, 300, 256, 4096),
                                                       (3, 171, 80, 32)])
    def test_sum(self, kernels, n, m, block, max_tile):
        check_sum(kernels, n, m, block, max_tile, torch.float32, "cpu")

    def test_packed_bytes_and_empty(self, kernels):
        kq = importlib.import_module("fastpar.kernels.quant")
        for m in range(0, 70):
            for block in (16, 48):
                assert kq.packed_bytes(m, block) == quant.packed_bytes(m, block)
        out = torch.empty(2, 0, dtype=torch.uint8)
        kernels.pack_rows(torch.empty(2, 0), 16, out)
        assert kernels.unpack_rows(out, 0, 16).shape == (2, 0)

    def test_the_collectives_codec_steps_through_the_kernels(self, kernels, monkeypatch):
        """comm.quantized's three steps, made to take the kernel path for CPU tensors (as for
        CUDA ones), against their torch path: the residual of a padded all_reduce is cut."""
        from fastpar.comm import quantized

        n, m, block = 2, 45, 16
        x = _x(n, m, block, torch.float32)
        per = quant.packed_bytes(m, block)
        carried = torch.randn(n * m - 7, generator=torch.Generator().manual_seed(3)) * 1e-3
        results = {}
        monkeypatch.setattr(quantized, "_native_codec", lambda t: None)  # (CPU: the torch ops)
        for path in ("torch", "kernels"):
            monkeypatch.setattr(quantized, "_kernels_for",
                                lambda t, path=path: kernels if path == "kernels" else None)
            buf = torch.empty(n, per, dtype=torch.uint8)
            res = carried.clone()  # quantized with x, then replaced by what is carried on
            quantized._pack_rows(x, block, buf, res)
            gathered = torch.empty(n, m, dtype=torch.bfloat16)
            quantized._unpack_rows(buf, m, block, gathered)
            total = quantized._sum_packed_rows(buf, m, block, torch.empty(m))
            results[path] = (buf, res, gathered, quantized._unpack_rows(buf, m, block), total)
        assert torch.equal(results["torch"][0], results["kernels"][0])
        for want, got in zip(results["torch"][1:], results["kernels"][1:]):
            same(got, want)

    @pytest.mark.parametrize("call, match", [
        (lambda k: k.pack_rows(torch.ones(2, 40), 100, torch.empty(2, 0, dtype=torch.uint8)),
         "block must be a multiple of 16 from 16 to 65536, got 100"),
        (lambda k: k.pack_rows(torch.ones(2, 40), 16, torch.empty(2, 51, dtype=torch.uint8)),
         r"contiguous uint8 tensor of shape \(rows, packed_bytes\(m, block\)\) = \(2, 52\)"),
        (lambda k: k.pack_rows(torch.ones(2, 40).double(), 16, None),
         "x must be a 2-D float32 or bfloat16 tensor, got torch.float64"),
        (lambda k: k.pack_rows(torch.ones(2, 40), 16, torch.empty(2, 52, dtype=torch.uint8),
                               residual=torch.empty(81)),
         "residual must be a contiguous float32 tensor of at most rows \\* m = 80 elements"),
        (lambda k: k.sum_packed_rows(torch.empty(2, 52, dtype=torch.uint8), 40, 16,
                                     torch.empty(40).half()),
         r"out must be a float32 or bfloat16 tensor of shape \(40,\)"),
    ])
    def test_errors_name_the_numbers(self, kernels, call, match):
        with pytest.raises(ValueError, match=match):
            call(kernels)


class TestParent:
    """In the ordinary pytest process, which never imports fastpar.kernels on a CPU machine."""

    __test__ = not INTERPRETER

    @needs_triton
    def test_cpu_kernels_under_interpreter(self):
        proc = launch([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       os.path.abspath(__file__)], env={"TRITON_INTERPRET": "1"}, timeout=300)
        print(proc.stdout[-4000:])  # the child's results, shown with -s or on failure
        assert proc.returncode == 0, proc.stdout[-12000:] + proc.stderr[-3000:]
        assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-2000:]

    def test_collectives_take_the_kernels_for_cuda_tensors_only(self, monkeypatch):
        from fastpar.comm import quantized

        codec = object()  # what the kernels would be (not imported here)
        monkeypatch.setattr(quantized, "_triton_codec", lambda: codec)
        for device, want in (("cpu", None), ("cuda", codec), ("meta", None)):
            tensor = types.SimpleNamespace(device=torch.device(device))
            assert quantized._kernels_for(tensor) is want, device


@pytest.mark.gpu
@needs_triton
class TestCompiledOnCuda:
    """The same checks compiled for the GPU (run by tests/gpu_check.sh), plus sizes and blocks
    too slow for the interpreter: blocks of 4096 and 65536 (16 tiles of 4096), a million-element
    row."""

    __test__ = not INTERPRETER

    @pytest.mark.parametrize("dtype", DTYPES)
    def test_pack_and_unpack(self, kernels, dtype):
        for rows, m, block, max_tile in CASES + [(2, 1_000_003, 256, 4096),
                                                 (2, 300_001, 4096, 4096),
                                                 (3, 200_000, 65536, 4096)]:
            check_pack(kernels, rows, m, block, max_tile, dtype, "cuda")
        check_pack(kernels, 3, 70, 16, 4096, dtype, "cuda", strided=True)

    def test_sum(self, kernels):
        for n, m, block, max_tile in [(1, 37, 16, 4096), (4, 300, 256, 4096), (3, 171, 80, 32),
                                      (4, 1_000_003, 256, 4096), (3, 200_000, 65536, 4096)]:
            check_sum(kernels, n, m, block, max_tile, torch.float32, "cuda")

    def test_the_collectives_take_the_kernels(self, kernels):
        """comm.quantized's steps on CUDA tensors: the kernel path, equal to the CPU's."""
        from fastpar.comm import quantized

        assert quantized._kernels_for(torch.ones(1, device="cuda")) is kernels
        n, m, block = 4, 10_001, 256
        x = _x(n, m, block, torch.float32)
        per = quant.packed_bytes(m, block)
        outs = {}
        for device in ("cpu", "cuda"):
            buf = torch.empty(n, per, dtype=torch.uint8, device=device)
            res = torch.empty(n * m - 5, device=device)
            quantized._pack_rows(x.to(device), block, buf, res)
            total = quantized._sum_packed_rows(buf, m, block, torch.empty(m, device=device))
            outs[device] = (buf, res, quantized._unpack_rows(buf, m, block), total)
        assert torch.equal(outs["cuda"][0].cpu(), outs["cpu"][0])
        for got, want in zip(outs["cuda"][1:], outs["cpu"][1:]):
            same(got, want)
