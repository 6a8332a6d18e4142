"""Attention op: every backend against the float64 reference; the cpu kernel's rows are bitwise
independent of the step's width and of the segment length."""

from __future__ import annotations

import pytest
import torch

from bitmtp.errors import ShapeError
from bitmtp.ops import attention
from bitmtp.ops.registry import availability

BACKENDS = [b for b in ("torch", "cpu", "triton") if availability(b, "cpu")[0]]
DETERMINISTIC = [b for b in ("cpu", "triton") if b in BACKENDS]


def _inputs(g, m=5, h=6, kvh=2, d=24, s=300, length=200):
    q = torch.randn(m, h, d, generator=g)
    k = torch.randn(kvh, s, d, generator=g)
    v = torch.randn(kvh, s, d, generator=g)
    pos = torch.randint(0, length, (m,), generator=g)
    mask = torch.arange(length)[None, :] <= pos[:, None]
    mask[0, -1] = True  # a non-causal pattern too (draft rows see their block)
    return q, k, v, mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,h,kvh,d", [(1, 4, 4, 16), (3, 6, 2, 24), (16, 9, 3, 64), (8, 20, 5, 128)])
def test_matches_float64_reference(backend, m, h, kvh, d, rng):
    q, k, v, mask = _inputs(rng, m, h, kvh, d)
    out = attention(q, k, v, mask, d**-0.5, backend=backend)
    g = h // kvh
    ref = torch.empty(m, h, d, dtype=torch.float64)
    for i in range(m):
        for j in range(h):
            idx = mask[i].nonzero()[:, 0]
            s = (k[j // g, idx].double() @ q[i, j].double()) * d**-0.5
            ref[i, j] = torch.softmax(s, 0) @ v[j // g, idx].double()
    assert (out.double() - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", DETERMINISTIC)
def test_rows_independent_of_width_and_segment(backend, rng):
    q, k, v, mask = _inputs(rng, m=7, length=200)
    together = attention(q, k, v, mask, 0.2, backend=backend)
    for i in range(7):
        for length in (200, 256, 300):  # wider segments: extra columns masked off
            wide = torch.zeros(1, length, dtype=torch.bool)
            wide[0, :200] = mask[i]
            alone = attention(q[i : i + 1], k, v, wide, 0.2, backend=backend)
            assert torch.equal(alone[0], together[i])


def test_bad_shapes(rng):
    q, k, v, mask = _inputs(rng)
    with pytest.raises(ShapeError, match="mask"):
        attention(q, k, v, mask.float(), 0.1)
    with pytest.raises(ShapeError, match="mask"):
        attention(q, k, v, torch.ones(5, 400, dtype=torch.bool), 0.1)
    with pytest.raises(ShapeError, match="k"):
        attention(q, k[:, :, :5], v[:, :, :5], mask, 0.1)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="native CPU extension not built")
@pytest.mark.parametrize("d", [16, 24, 64, 70])  # lanes: whole 16-blocks, a tail, odd head dims
def test_cpu_isa_paths_give_the_same_bits(d, rng):
    """The scalar, AVX2 and AVX-512 builds of the attention loop run the same float operations in the
    same order (no contraction), so their outputs are bitwise equal (poisoned output first)."""
    from bitmtp.ops.backends import cpu_backend

    q, k, v, mask = _inputs(rng, m=15, h=9, kvh=3, d=d)
    outs = []
    for isa in cpu_backend.supported_isas():
        with cpu_backend.forced_isa(isa):
            out = attention(q, k, v, mask, d**-0.5, backend="cpu")
        assert torch.isfinite(out).all()
        outs.append(out)
    assert len(outs) >= 2
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
