"""RMSNorm (``bitmtp.ops.rms_norm``). Rule: every backend returns the reference's bits exactly (the native norm is
the fused layers' own, a float32 epilogue over a float64 sum); the reference is within 2 float32 ulps of a float64
evaluation; tensors that need gradients take the reference (and get their gradients)."""

from __future__ import annotations

import pytest
import torch

from bitmtp.errors import ShapeError
from bitmtp.ops import rms_norm
from bitmtp.ops.reference import rms_norm_reference
from bitmtp.ops.registry import availability

BACKENDS = [b for b in ("torch", "cpu") if availability(b, "cpu")[0]]


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Outputs the backends allocate start as NaN, so an element a kernel leaves unwritten shows."""
    real_like = torch.empty_like

    def like(t, *a, **kw):
        out = real_like(t, *a, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", like)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m", [1, 3, 8, 15, 16])
@pytest.mark.parametrize("n", [7, 100, 576, 1001])
def test_every_backend_gives_the_references_bits(backend, m, n, rng, poisoned_outputs):
    x = torch.randn(m, n, generator=rng) * torch.rand(m, 1, generator=rng) * 8
    w = torch.randn(n, generator=rng)
    eps = 1e-6
    got = rms_norm(x, w, eps, backend=backend)
    want = rms_norm_reference(x, w, eps)
    assert torch.equal(got, want)
    x64 = x.double()
    exact = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    ulp = torch.finfo(torch.float32).eps * exact.abs().clamp_min(1e-30)
    assert ((want.double() - exact).abs() <= 2 * ulp + 1e-37).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dimensions_and_empty_rows(backend, rng, poisoned_outputs):
    x = torch.randn(2, 3, 33, generator=rng)
    w = torch.randn(33, generator=rng)
    assert torch.equal(rms_norm(x, w, 1e-5, backend=backend), rms_norm_reference(x, w, 1e-5))
    assert rms_norm(torch.randn(0, 33), w, 1e-5, backend=backend).shape == (0, 33)


def test_gradients_and_other_dtypes_take_the_reference(rng):
    x = torch.randn(3, 40, generator=rng, requires_grad=True)
    w = torch.randn(40, generator=rng, requires_grad=True)
    rms_norm(x, w, 1e-6).sum().backward()
    assert x.grad is not None and w.grad is not None
    half = torch.randn(3, 40, generator=rng).bfloat16()
    assert torch.equal(rms_norm(half, w.detach().bfloat16(), 1e-6),
                       rms_norm_reference(half, w.detach().bfloat16(), 1e-6))


def test_bad_shapes_are_refused(rng):
    with pytest.raises(ShapeError, match="rms_norm"):
        rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
