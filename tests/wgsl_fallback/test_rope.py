"""rope.wgsl: rotary embeddings in place (bitmtp.model.layers.apply_rope) within 1e-5.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitmtp.model.layers import apply_rope, rope_tables
from tests.support.wgsl import close

pytestmark = pytest.mark.wgpu


@pytest.mark.parametrize("m,heads,dh", [(1, 4, 16), (8, 3, 64), (15, 2, 128)])
def test_rope(wg, m, heads, dh, rng):
    r, ops = wg
    cos, sin = rope_tables(dh, 10000.0, None, 300)
    pos = torch.randint(0, 300, (m,), generator=rng)
    x = torch.randn(m, heads, dh, generator=rng)
    xd = r.upload(x.numpy())
    ops.rope_(xd, r.upload(cos.numpy()), r.upload(sin.numpy()), r.upload(pos.numpy().astype(np.uint32)))
    want = apply_rope(x.double(), cos[pos].double(), sin[pos].double())
    close(xd.numpy(), want.numpy())
