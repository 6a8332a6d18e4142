"""Absmean ternarization and per-token int8 activation quantization."""

from __future__ import annotations

import pytest
import torch

from bitmtp.errors import DTypeError, ShapeError
from bitmtp.formats import absmean_ternarize, dequantize_ternary, quantize_activations


def _brute_absmean(w: torch.Tensor, regions):
    """Reference by explicit loops over scale regions (row slice, column slice)."""
    q = torch.empty(w.shape, dtype=torch.int8)
    scales = {}
    for key, (rows, cols) in regions.items():
        block = w[rows, cols].double()
        a = max(block.abs().mean().item(), 1e-5)
        inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(a, dtype=torch.float32)
        q[rows, cols] = (w[rows, cols].float() * inv).round().clamp(-1, 1).to(torch.int8)
        scales[key] = a
    return q, scales


@pytest.mark.parametrize("n,k", [(7, 48), (24, 176), (5, 400)])
def test_absmean_per_tensor_row_group(n, k, rng):
    w = torch.randn(n, k, generator=rng) * 0.05
    q, s = absmean_ternarize(w, "tensor")
    bq, bs = _brute_absmean(w, {0: (slice(None), slice(None))})
    assert s.shape == (1, 1) and s.dtype == torch.float32
    assert torch.equal(q, bq) and s.item() == pytest.approx(bs[0], rel=1e-6)

    q, s = absmean_ternarize(w, "row")
    bq, bs = _brute_absmean(w, {r: (slice(r, r + 1), slice(None)) for r in range(n)})
    assert s.shape == (n, 1)
    assert torch.equal(q, bq)
    assert torch.allclose(s[:, 0].double(), torch.tensor([bs[r] for r in range(n)], dtype=torch.float64), rtol=1e-6)

    g = 32
    q, s = absmean_ternarize(w, "group", g)
    ng = -(-k // g)
    regions = {(r, c): (slice(r, r + 1), slice(c * g, min((c + 1) * g, k))) for r in range(n) for c in range(ng)}
    bq, bs = _brute_absmean(w, regions)
    assert s.shape == (n, ng)
    assert torch.equal(q, bq)
    expect = torch.tensor([[bs[(r, c)] for c in range(ng)] for r in range(n)], dtype=torch.float64)
    assert torch.allclose(s.double(), expect, rtol=1e-6)


def test_dequantize_matches_scales(rng):
    w = torch.randn(6, 64, generator=rng)
    q, s = absmean_ternarize(w, "group", 16)
    d = dequantize_ternary(q, s, 16)
    expect = q.double() * s.double().repeat_interleave(16, dim=1)
    assert torch.allclose(d.double(), expect)


def test_absmean_bad_input():
    with pytest.raises(DTypeError, match="weight"):
        absmean_ternarize(torch.zeros(2, 2, dtype=torch.int8))
    with pytest.raises(ShapeError, match="granularity"):
        absmean_ternarize(torch.randn(2, 16), "column")
    with pytest.raises(ShapeError, match="group_size"):
        absmean_ternarize(torch.randn(2, 48), "group", 24)


def test_act_quant_round_half_even_and_clamp():
    # Row max 127 makes s = 1 exactly, so x·s are the values themselves: ties must go to even.
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 127.0, 3.49]])
    x_q, s = quantize_activations(x)
    assert s.tolist() == [1.0]
    assert x_q.tolist() == [[0, 2, 2, 0, -2, -2, 127, 3]]
    assert x_q.dtype == torch.int8


def test_act_quant_matches_bitnet_formula(rng):
    x = torch.randn(15, 176, generator=rng) * 3
    x_q, s = quantize_activations(x)
    scale = 127 / x.abs().max(dim=-1, keepdim=True).values.clamp(min=1e-5)
    assert torch.equal(x_q, (x * scale).round().clamp(-128, 127).to(torch.int8))
    assert torch.equal(s, scale[:, 0])
    # every row reaches ±127 at its absmax
    assert torch.equal(x_q.abs().amax(dim=1), torch.full((15,), 127, dtype=torch.int8))


def test_act_quant_tiny_rows_and_bf16(rng):
    x = torch.full((2, 8), 1e-9)
    x_q, s = quantize_activations(x)
    assert torch.all(s == 127 / 1e-5) and torch.all(x_q == 0)
    xb = (torch.randn(3, 40, generator=rng)).to(torch.bfloat16)
    q1, s1 = quantize_activations(xb)
    q2, s2 = quantize_activations(xb.float())
    assert torch.equal(q1, q2) and torch.equal(s1, s2)


def test_act_quant_bad_input():
    with pytest.raises(DTypeError, match="x"):
        quantize_activations(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ShapeError, match="x"):
        quantize_activations(torch.zeros(2, 0))
