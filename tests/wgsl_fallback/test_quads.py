"""quads.wgsl: the token-minor int8 quads layout the W2A8 shaders read, exact.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.wgpu


@pytest.mark.parametrize("m,k", [(1, 4), (3, 72), (16, 2056)])
def test_quads_layout_exact(wg, m, k, rng):
    """quads.wgsl (the rows dense shader's activation layout) is an exact copy: xt[j, m] = x[m, 4j..4j+3]."""
    r, _ = wg
    x = torch.randn(m, k, generator=rng)
    xt = r.upload(np.full((k // 4, m, 4), np.nan, np.float32))  # poisoned
    grid = r.grid(-(-k // 4 * m // 64))
    r.dispatch("quads", "main", {0: r.upload(x.numpy()), 1: xt, 2: r.uniform("4I", m, k, k // 4, grid[0])}, grid)
    assert np.array_equal(xt.numpy(), x.numpy().reshape(m, k // 4, 4).transpose(1, 0, 2))
