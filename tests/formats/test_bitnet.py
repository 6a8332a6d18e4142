"""transformers' BitNet packed layout → T2, and the pinned weight_scale convention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmtp import TernaryLinear
from bitmtp.errors import FormatError, ShapeError
from bitmtp.formats import (
    absmean_ternarize,
    bitnet_scale_to_multiplier,
    bitnet_to_t2,
    pack_bitnet,
    quantize_activations,
    unpack_bitnet,
    unpack_t2,
)
from tests.support.random_inputs import random_ternary

bitnet = pytest.importorskip("transformers.integrations.bitnet", reason="transformers (extra 'hf') not installed")
pytestmark = pytest.mark.usefixtures("no_dynamo")  # transformers' BitNet helpers are torch.compile'd


def _hf_pack(w: torch.Tensor) -> torch.Tensor:
    return bitnet.pack_weights(w.clone().to(torch.int16))  # pack_weights adds 1 in place


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 23), k=st.integers(1, 50), seed=st.integers(0, 2**31 - 1))
def test_bitnet_layout_to_t2_equals_bitnet_dequant(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = random_ternary(n, k, g)
    packed = _hf_pack(w)
    assert packed.shape == (-(-n // 4), k)
    if n % 4 == 0:  # transformers leaves the pad rows of a partial byte row as code 0; we write code 1
        assert torch.equal(pack_bitnet(w), packed)  # our writer produces transformers' bytes
    assert torch.equal(unpack_bitnet(pack_bitnet(w), n), w)
    weight_scale = torch.tensor([0.5 + torch.rand(1, generator=g).item() * 40])
    t2, scale = bitnet_to_t2(packed, weight_scale, out_features=n)
    hf = bitnet.unpack_weights(packed, dtype=torch.float32)[:n]  # transformers' own dequantization
    ours = unpack_t2(t2, k).double() * scale.double()
    assert torch.allclose(ours, hf.double() / weight_scale.double(), rtol=1e-6, atol=0)
    assert torch.equal(unpack_bitnet(packed, n), w)


def test_weight_scale_convention_pinned_from_float_weight(rng):
    """Build a BitLinear the way BitNet checkpoints are made from a float weight, and check that
    bitmtp's conversion (scale = 1 / weight_scale for linear_class "bitlinear") reproduces it."""
    n, k = 40, 176
    w_float = torch.randn(n, k, generator=rng) * 0.02
    q, absmean = absmean_ternarize(w_float, "tensor")
    # BitNet's WeightQuant: scale = 1 / mean|W|; the checkpoint stores that as weight_scale.
    inv = 1.0 / w_float.abs().mean().clamp(min=1e-5)
    assert torch.equal(q, (w_float * inv).round().clamp(-1, 1).to(torch.int8))

    layer = bitnet.BitLinear(k, n, bias=False, dtype=torch.float32)
    layer.weight.copy_(_hf_pack(q))
    layer.weight_scale.copy_(inv.reshape(1))
    x = torch.randn(5, k, generator=rng)
    y_hf = layer(x).double()

    t2, scale = bitnet_to_t2(layer.weight, layer.weight_scale, out_features=n, linear_class="bitlinear")
    assert scale.item() == pytest.approx(absmean.item(), rel=1e-6)  # scale is the absmean itself
    ours = TernaryLinear(k, n, t2, scale, backend="torch")(x).double()
    assert torch.allclose(ours, y_hf, rtol=1e-5, atol=1e-6 * y_hf.abs().max().item())

    # And both equal the float layer run on its own ternarized weight and quantized activations.
    x_q, s = quantize_activations(x)
    expect = (x_q.double() / s.double()[:, None]) @ (q.double() * absmean.double()).T
    assert torch.allclose(y_hf, expect, rtol=1e-5, atol=1e-6 * expect.abs().max().item())

    # AutoBitLinear (offline) multiplies by weight_scale: the opposite sense.
    auto = bitnet.AutoBitLinear(k, n, bias=False, dtype=torch.float32)
    with torch.no_grad():
        auto.weight.copy_(q.float())
        auto.weight_scale.copy_(absmean.reshape(1))
    t2a, scale_a = bitnet_to_t2(pack_bitnet(q), auto.weight_scale, linear_class="autobitlinear")
    y_auto = auto(x).double()
    ours_a = TernaryLinear(k, n, t2a, scale_a, backend="torch")(x).double()
    assert torch.allclose(ours_a, y_auto, rtol=1e-5, atol=1e-6 * y_auto.abs().max().item())


def test_bitnet_bad_input():
    with pytest.raises(FormatError, match="linear_class"):
        bitnet_scale_to_multiplier(torch.ones(1), "dense")
    with pytest.raises(FormatError, match="weight_scale"):
        bitnet_scale_to_multiplier(torch.zeros(1))
    with pytest.raises(ShapeError, match="weight_scale"):
        bitnet_scale_to_multiplier(torch.ones(3))
    with pytest.raises(ShapeError, match="out_features"):
        unpack_bitnet(torch.zeros(2, 4, dtype=torch.uint8), out_features=12)
    with pytest.raises(FormatError, match="code 3"):
        unpack_bitnet(torch.full((1, 4), 0xFF, dtype=torch.uint8))
