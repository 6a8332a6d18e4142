"""elementwise.wgsl: gated activations (silu, relu2), residual add, column windows, add-into.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.wgsl import close

pytestmark = pytest.mark.wgpu


@pytest.mark.parametrize("act", ["silu", "relu2"])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_gated_activation_and_add(wg, act, m, rng):
    r, ops = wg
    i = 96
    gu = torch.randn(m, 2 * i, generator=rng) * 3
    y = ops.gated(r.upload(gu.numpy()), act).numpy()
    g, u = gu.double().split(i, dim=1)
    want = (torch.nn.functional.silu(g) if act == "silu" else torch.relu(g).square()) * u
    close(y, want.numpy())
    a, b = torch.randn(m, i, generator=rng), torch.randn(m, i, generator=rng)
    assert np.array_equal(ops.add(r.upload(a.numpy()), r.upload(b.numpy())).numpy(), (a + b).numpy())


def test_cols_and_add_into(wg, rng):
    """``cols`` copies a column window; ``add_into`` adds a delta to the trailing rows only (exact)."""
    r, ops = wg
    x = torch.randn(5, 30, generator=rng)
    assert np.array_equal(ops.cols(r.upload(x.numpy()), 7, 11).numpy(), x[:, 7:18].numpy())
    y = torch.randn(6, 4, generator=rng)
    yd = r.upload(y.numpy())
    delta = torch.randn(2, 4, generator=rng)
    ops.add_into(yd, r.upload(delta.numpy()), 4)
    want = y.clone()
    want[4:] += delta
    assert np.array_equal(yd.numpy(), want.numpy())
