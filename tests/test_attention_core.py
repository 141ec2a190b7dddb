"""``fastpar.nn.attention_core.dropout_attention``: selective recomputation's attention core on
the CPU (the dropout mask kept as bits, the probabilities recomputed in backward).

Every case draws the same mask as torch's ``F.scaled_dot_product_attention(dropout_p=p)`` from
the same generator state, so torch's kernel in float64 is the reference (forward and the three
gradients) and torch's kernel in the working dtype gives the rounding bound. A written-out
float64 attention with an explicitly drawn mask checks the reference itself. Single process.
"""

import pytest
import torch
import torch.nn.functional as F

from fastpar.nn.attention_core import dropout_attention, pack_bits, unpack_bits
from fastpar.testing import assert_close

CASES = [  # (B, H, Hkv, T, Tk, D, causal)
    (2, 4, 4, 16, 16, 8, True),  # MHA
    (2, 4, 2, 15, 15, 8, True),  # GQA; B H T T not a multiple of 8 (the packed mask's padding)
    (1, 6, 1, 7, 7, 4, True),  # MQA, odd everything
    (2, 4, 2, 9, 13, 8, False),  # more keys than queries (not causal)
]


def _inputs(case, dtype, seed):
    B, H, hkv, T, tk, D, _ = case
    gen = torch.Generator().manual_seed(seed)
    # q, k, v as the attention layer makes them: (B, T, heads, D) storage seen as (B, heads, T, D)
    q = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(B, tk, hkv, D, generator=gen, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(B, tk, hkv, D, generator=gen, dtype=torch.float64).transpose(1, 2)
    # the output's gradient as the layer passes it: a (B, T, H, D) storage seen transposed
    do = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64).transpose(1, 2)
    return [t.to(dtype) for t in (q, k, v)], do.to(dtype)


def _run(fn, q, k, v, do, seed):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    torch.manual_seed(seed)
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do)
    return [out.detach(), *grads], torch.rand(4)  # the generator's next values


def _sdpa(p, causal, gqa):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal,
                                                          enable_gqa=gqa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16])
@pytest.mark.parametrize("case", CASES, ids=["mha", "gqa", "mqa", "cross"])
def test_equals_torch_kernel_with_the_same_mask(case, dtype):
    """The bound: torch's kernel's own error in ``dtype`` against float64; in float64 that
    error is nil (the reference is that kernel), so float64 results are held to float32's
    (still far below a wrong mask, scale or sum: those are off by O(|ref|))."""
    p, seed = 0.3, 11
    causal, gqa = case[-1], case[1] != case[2]
    (q, k, v), do = _inputs(case, dtype, seed)
    names = ("out", "dq", "dk", "dv")
    ref, ref_next = _run(_sdpa(p, causal, gqa), *(t.double() for t in (q, k, v, do)), seed)
    work = torch.float32 if dtype == torch.float64 else dtype
    serial, _ = _run(_sdpa(p, causal, gqa), *(t.to(work) for t in (q, k, v, do)), seed)
    got, got_next = _run(lambda a, b, c: dropout_attention(a, b, c, p, causal), q, k, v, do,
                         seed)
    for name, g, r, s in zip(names, got, ref, serial):
        assert g.dtype == dtype, (name, g.dtype)
        assert_close(f"{case} {dtype} {name}", g, r, s)
    assert torch.equal(got_next, ref_next), "the generator moved differently from torch's kernel"


@pytest.mark.quick
def test_the_reference_drops_the_drawn_mask():
    """torch's kernel (the reference above) drops exactly the mask bernoulli_(1 - p) draws over
    (B, H, T, Tk) from the same state: a written-out float64 attention with that mask agrees."""
    B, H, hkv, T, tk, D, _ = CASES[1]
    p, seed = 0.3, 5
    (q, k, v), _ = _inputs(CASES[1], torch.float64, seed)
    torch.manual_seed(seed)
    keep = torch.empty(B, H, T, tk, dtype=torch.float64).bernoulli_(1 - p)
    rep = H // hkv
    s = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) * D ** -0.5
    s = s.masked_fill(torch.ones(T, tk, dtype=torch.bool).triu(1), float("-inf"))
    written = (s.softmax(-1) * keep / (1 - p)) @ v.repeat_interleave(rep, 1)
    torch.manual_seed(seed)
    got = dropout_attention(q, k, v, p, True)
    assert (got - written).abs().max() < 1e-12
    assert 0 < (keep == 0).double().mean() < 0.6


@pytest.mark.quick
def test_gradients_only_where_asked_and_no_double_backward():
    q, k, v = torch.randn(1, 2, 8, 4, requires_grad=True), torch.randn(1, 2, 8, 4), \
        torch.randn(1, 2, 8, 4, requires_grad=True)
    out = dropout_attention(q, k, v, 0.2, True)
    dq, dv = torch.autograd.grad(out.sum(), (q, v), create_graph=True)
    assert dq.shape == q.shape and dv.shape == v.shape
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        torch.autograd.grad(dq.sum(), q)


@pytest.mark.quick
def test_keeps_bits_not_probabilities():
    """What the forward keeps: q, k, v, the output (stored (B, T, H, D): the returned view's
    ``transpose(1, 2)`` is contiguous, so the output projection's input is that storage) and
    one bit per probability, nothing of (T, Tk) floats."""
    B, H, T, D = 2, 4, 32, 8
    q, k, v = (torch.randn(B, H, T, D, requires_grad=True) for _ in range(3))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = dropout_attention(q, k, v, 0.1, True)
    assert out.transpose(1, 2).is_contiguous()
    big = [tuple(t.shape) for t in saved if t.numel() > B * H * T * D]
    assert not big, big
    bits = [t for t in saved if t.dtype == torch.uint8]
    assert len(bits) == 1 and bits[0].numel() == B * H * T * T // 8
    assert any(t.data_ptr() == out.data_ptr() for t in saved)  # the output's own storage


@pytest.mark.quick
@pytest.mark.parametrize("n", [1, 7, 8, 63, 64, 1001])
def test_bits_round_trip(n):
    mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < 0.5
    packed = pack_bits(mask.view(1, n))
    assert packed.dtype == torch.uint8 and packed.numel() == -(-n // 8)
    assert torch.equal(unpack_bits(packed, torch.Size([1, n])), mask.view(1, n))
    assert int(packed[0]) == sum(int(mask[j]) << j for j in range(min(8, n)))  # bit j = elem j


@pytest.mark.quick
def test_refuses_bad_arguments_naming_them():
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="p must be in"):
        dropout_attention(q, q, q, 0.0, True)
    with pytest.raises(ValueError, match=r"q \(1, 4, 5, 8\), k \(1, 3, 5, 8\)"):
        dropout_attention(q, k, k, 0.1, True)
    with pytest.raises(ValueError, match="5 queries and 6 keys"):
        dropout_attention(q, torch.randn(1, 4, 6, 8), torch.randn(1, 4, 6, 8), 0.1, True)
