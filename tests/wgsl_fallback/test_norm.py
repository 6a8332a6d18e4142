"""norm.wgsl: RMSNorm (bitmtp.ops.reference.rms_norm_reference) within 1e-5.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import pytest
import torch

from bitmtp.model.layers import rms_norm
from tests.support.wgsl import close

pytestmark = pytest.mark.wgpu


@pytest.mark.parametrize("rows,d", [(1, 64), (5, 96), (16 * 4, 16), (3, 2560)])
def test_rms_norm(wg, rows, d, rng):
    r, ops = wg
    x = torch.randn(rows, d, generator=rng) * 3
    weight = 1 + 0.3 * torch.randn(d, generator=rng)
    y = ops.rms_norm(r.upload(x.numpy()), r.upload(weight.numpy()), 1e-5).numpy()
    close(y, rms_norm(x.double(), weight.double(), 1e-5).numpy())
