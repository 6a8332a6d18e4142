"""W2A8 linear on every available backend against the reference.

Rules: integer accumulators equal the int64 reference bit for bit; float outputs satisfy
|y − ref| ≤ 1e-5·|ref| + 1e-6·Σ_g|acc_g·scale_g/s| against the float64 reference (the second term
bounds float32 rounding of the per-group sum, which can cancel); bf16 outputs within bf16 rounding.
Outputs are poisoned first so an element a kernel never writes shows up.
"""

from __future__ import annotations

import pytest
import torch

from bitmtp.formats import pack_t2, quantize_activations
from bitmtp.ops import reference, w2a8_accumulate, w2a8_linear
from bitmtp.ops.registry import availability, select
from tests.support.random_inputs import POISON_INT, random_int8, random_ternary
from tests.support.w2a8 import BACKENDS, check_float

WIDTHS = [1, 3, 8, 15, 16, 40]
SHAPES = [(24, 48), (200, 176), (24, 400), (200, 400), (7, 33)]  # (N, K); K = 33 is not a multiple of 16


def _scales(kind: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, int]:
    if kind == "tensor":
        return torch.rand(1, 1, generator=g) + 0.1, k
    if kind == "row":
        return torch.rand(n, 1, generator=g) + 0.1, k
    group = 16 if kind == "group16" else 32  # group32: K = 48/176/400 leave a partial last group
    if k % 16:
        group = 16
    return torch.rand(n, -(-k // group), generator=g) + 0.1, group


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", WIDTHS)
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("scale_kind", ["tensor", "row", "group16", "group32"])
def test_accumulators_exact_and_epilogue(backend, m, n, k, scale_kind, rng):
    w = random_ternary(n, k, rng)
    packed = pack_t2(w)
    scales, group = _scales(scale_kind, n, k, rng)
    x_q = random_int8(m, k, rng)
    ng = -(-k // group)

    acc = torch.full((m, n, ng), POISON_INT, dtype=torch.int32)
    w2a8_accumulate(x_q, packed, group_size=group, backend=backend, out=acc)
    ref = reference.w2a8_accumulate_reference(x_q, packed, k, group)
    assert torch.equal(acc.to(torch.int64), ref)
    # independent check of the fold: Σ c·x − Σ x == Σ w·x
    assert torch.equal(ref.sum(-1), x_q.long() @ w.long().T)

    s = torch.rand(m, generator=rng) * 50 + 0.5
    out = torch.full((m, n), float("nan"))
    impl = select("w2a8_linear_q", torch.device("cpu"), backend)
    impl(x_q, s, packed, scales, k, group, None, torch.float32, out=out)
    check_float(out, x_q, s, packed, scales, k, group)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 8, 40])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_w2a8_linear_float_input_bias_dtype(backend, m, out_dtype, rng):
    n, k = 200, 176
    packed = pack_t2(random_ternary(n, k, rng))
    scales = torch.rand(n, 11, generator=rng) + 0.1  # per-group, G = 16
    bias = torch.randn(n, generator=rng)
    x = torch.randn(2, m, k, generator=rng) * 4  # leading dims are flattened and restored
    y = w2a8_linear(x, packed, scales, bias=bias, out_dtype=out_dtype, backend=backend)
    assert y.shape == (2, m, n) and y.dtype == out_dtype
    x_q, s = quantize_activations(x.reshape(-1, k))
    ref = reference.w2a8_linear_q_reference(x_q, s, packed, scales, k, 16, bias)
    if out_dtype == torch.float32:
        check_float(y.reshape(-1, n), x_q, s, packed, scales, k, 16, bias)
    else:  # bf16: one rounding of the float32 result (8 mantissa bits)
        assert torch.allclose(y.reshape(-1, n).double(), ref, rtol=2**-8, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_activations(backend, rng):
    n, k = 24, 48
    packed = pack_t2(random_ternary(n, k, rng))
    scales = torch.rand(1, 1, generator=rng) + 0.1
    x = torch.randn(3, k, generator=rng).to(torch.bfloat16)
    y = w2a8_linear(x, packed, scales, backend=backend, out_dtype=torch.float32)
    x_q, s = quantize_activations(x)
    check_float(y, x_q, s, packed, scales, k, k)


def test_torch_and_triton_agree_bitwise_on_integers(rng):
    if not availability("triton", "cpu")[0]:
        pytest.skip("triton not available here")
    n, k, m = 64, 400, 16
    packed = pack_t2(random_ternary(n, k, rng))
    x_q = random_int8(m, k, rng)
    a = w2a8_accumulate(x_q, packed, group_size=16, backend="triton")
    b = w2a8_accumulate(x_q, packed, group_size=16, backend="torch")
    assert torch.equal(a, b)
