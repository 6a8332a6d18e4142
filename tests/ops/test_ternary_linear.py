"""TernaryLinear: from_float matches the float layer run on its own ternarized weights and
quantized activations (exact integers; float epilogue within 1e-5 relative of float64)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bitmtp import TernaryLinear
from bitmtp.errors import DTypeError, ShapeError
from bitmtp.formats import absmean_ternarize, quantize_activations, unpack_t2
from bitmtp.ops import w2a8_accumulate
from tests.support.w2a8 import BACKENDS


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("granularity,group_size", [("tensor", None), ("row", None), ("group", 32)])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_from_float_matches_float_layer_on_quantized_operands(backend, granularity, group_size, m, bias, rng):
    k, n = 176, 40
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=rng) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=rng))
    tl = TernaryLinear.from_float(lin, granularity=granularity, group_size=group_size, backend=backend)
    q, scales = absmean_ternarize(lin.weight, granularity, group_size)
    assert torch.equal(unpack_t2(tl.weight, k), q)
    assert torch.equal(tl.scales, scales)

    x = torch.randn(m, k, generator=rng) * 2
    x_q, s = quantize_activations(x)
    # exact integers: the layer's accumulators summed over groups equal x_q · q
    acc = w2a8_accumulate(x_q, tl.weight, group_size=tl.group_size, backend=backend)
    assert torch.equal(acc.sum(-1).long(), x_q.long() @ q.long().T)

    # float: the float layer on its ternarized weights and dequantized activations, in float64
    float_layer = tl.to_float(torch.float64)
    expect = float_layer(x_q.double() / s.double()[:, None])
    y = tl(x)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    terms = (x_q.double().abs() / s.double()[:, None]) @ tl.dequantized_weight(torch.float64).abs().T
    assert ((y.double() - expect).abs() <= 1e-5 * expect.abs() + 1e-6 * terms + 1e-6 * bias).all()


def test_state_dict_round_trip_and_repr(rng):
    lin = nn.Linear(48, 24)
    tl = TernaryLinear.from_float(lin, granularity="row")
    tl2 = TernaryLinear(48, 24, torch.zeros_like(tl.weight), torch.ones_like(tl.scales), bias=torch.zeros(24))
    tl2.load_state_dict(tl.state_dict())
    x = torch.randn(3, 48, generator=rng)
    assert torch.equal(tl(x), tl2(x))
    assert "scales=row" in repr(tl)
    assert tl.to_float().weight.shape == (24, 48)


def test_leading_dims(rng):
    tl = TernaryLinear.from_float(nn.Linear(33, 7), backend="torch")
    x = torch.randn(2, 5, 33, generator=rng)
    assert torch.equal(tl(x), tl(x.reshape(10, 33)).reshape(2, 5, 7))


def test_constructor_rejects_bad_input():
    with pytest.raises(ShapeError, match="weight"):
        TernaryLinear(48, 24, torch.zeros(24, 2, dtype=torch.int32), torch.ones(1, 1))
    with pytest.raises(DTypeError, match="weight"):
        TernaryLinear(48, 24, torch.zeros(24, 3, dtype=torch.int64), torch.ones(1, 1))
    with pytest.raises(ShapeError, match="scales"):
        TernaryLinear(48, 24, torch.zeros(24, 3, dtype=torch.int32), torch.ones(5, 1))
    with pytest.raises(DTypeError, match="linear"):
        TernaryLinear.from_float(nn.Conv1d(3, 3, 1))
