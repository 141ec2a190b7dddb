"""The zero-bubble split backward (I then W) against a plain backward, on module structures
where a parameter does not reach the loss only through its own module's output: weights used
twice or tied, a weight used outside its module (attention's out_proj), in-place updates, an
LSTM's nested tuple, a branch that does not depend on the input, a scalar loss, inputs with and
without grad. Single process: the split is a property of one stage's autograd graph."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fastpar.pipeline.split_backward import SplitBackward

pytestmark = pytest.mark.quick  # every test here: the quick tier

D = 6


class Twice(nn.Module):  # one Linear applied twice
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(torch.tanh(self.fc(x)))


class Tied(nn.Module):  # a head that uses the embedding-like layer's weight directly
    def __init__(self):
        super().__init__()
        self.inp, self.mid = nn.Linear(D, D, bias=False), nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.mid(self.inp(x)))
        return F.linear(h, self.inp.weight.t())


class InPlace(nn.Module):  # an output used, then changed in place
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        a = h * 3
        h.mul_(2)
        return h + a


class Nested(nn.Module):  # a module with its own parameter and a child with parameters
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(D))
        self.child = nn.Linear(D, D)

    def forward(self, x):
        return self.child(x * self.scale) * self.scale


class Branch(nn.Module):  # part of the output does not depend on the input
    def __init__(self):
        super().__init__()
        self.fc, self.bias_net = nn.Linear(D, D), nn.Linear(D, D)
        self.const = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return self.fc(x) + self.bias_net(self.const)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(D, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


class Lstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(D, D, batch_first=True), nn.Linear(D, D)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return self.fc(out) + h.transpose(0, 1) + c.transpose(0, 1)


class TupleOut(nn.Module):  # two outputs, one of them through a shared weight
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        y = self.fc(x)
        return y, torch.tanh(y) @ self.fc.weight


MODELS = {
    "twice": Twice, "tied": Tied, "inplace": InPlace, "nested": Nested, "branch": Branch,
    "attention": Attention, "lstm": Lstm, "tuple": TupleOut,
    "encoder": lambda: nn.TransformerEncoderLayer(D, 2, 12, dropout=0.0, batch_first=True),
    "sequential": lambda: nn.Sequential(nn.Linear(D, D), nn.LayerNorm(D), nn.GELU(),
                                        nn.Linear(D, D)),
}


def _outputs(y):
    return list(y) if isinstance(y, tuple) else [y]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("input_grad", [True, False])
@pytest.mark.parametrize("scalar_loss", [False, True])
def test_split_equals_plain_backward(name, input_grad, scalar_loss):
    torch.manual_seed(0)
    model = MODELS[name]().double()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, D, dtype=torch.float64)
    seeds = torch.Generator().manual_seed(1)

    def run(m):
        xi = x.clone().requires_grad_(input_grad)
        outs = _outputs(m(xi))
        if scalar_loss:
            outs = [sum((o * o).sum() for o in outs)]
            gs = [None]
        else:
            gs = [torch.randn(o.shape, dtype=o.dtype, generator=seeds) for o in outs]
        return xi, outs, gs

    x_ref, outs, gs = run(ref)
    torch.autograd.backward(outs, [g for g in gs] if not scalar_loss else None)
    seeds.manual_seed(1)
    xi, outs, gs = run(model)
    params = [p for p in model.parameters() if p.requires_grad]
    split = SplitBackward(outs, gs, [xi] if input_grad else [], params)
    got = split.input_grads()
    for p in params:
        assert p.grad is None, "I must not touch parameter gradients"
    split.weight_grads()
    if input_grad:
        assert torch.allclose(got[0], x_ref.grad, rtol=1e-10, atol=1e-12), name
    for (key, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, f"{name}: {key} got no gradient"
        assert torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12), \
            f"{name}: {key} off by {(p.grad - q.grad).abs().max():.3g}"


def test_frozen_parameter_gets_nothing_and_late_unfreeze_counts():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D)).double()
    model[0].weight.requires_grad_(False)
    x = torch.randn(4, D, dtype=torch.float64, requires_grad=True)
    y = model(x)
    params = [p for p in model.parameters() if p.requires_grad]
    split = SplitBackward([y], [torch.ones_like(y)], [x], params)
    split.input_grads()
    split.weight_grads()
    assert model[0].weight.grad is None and model[0].bias.grad is not None
