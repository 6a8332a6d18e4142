"""attention.wgsl: masked attention over a step's KV window (bitmtp.ops.reference.attention_reference).

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitmtp.ops.reference import attention_reference
from tests.support.wgsl import close

pytestmark = pytest.mark.wgpu


@pytest.mark.parametrize("m,heads,kvh,dh,length", [(1, 4, 2, 16, 9), (8, 4, 4, 32, 40), (15, 6, 2, 16, 100),
                                                   (16, 2, 1, 64, 300)])
def test_attention_with_step_masks(wg, m, heads, kvh, dh, length, rng):
    r, ops = wg
    s = length + 8
    q = torch.randn(m, heads, dh, generator=rng)
    k = torch.randn(kvh, s, dh, generator=rng)
    v = torch.randn(kvh, s, dh, generator=rng)
    mask = torch.rand(m, length, generator=rng) < 0.6  # arbitrary structure (draft / verify masks are special cases)
    mask[:, 0] = True
    scale = dh ** -0.5
    out = ops.attention(r.upload(q.numpy()), r.upload(k.numpy()), r.upload(v.numpy()),
                        r.upload(mask.numpy().astype(np.uint32)), scale).numpy()
    close(out, attention_reference(q.double(), k.double(), v.double(), mask, scale).numpy())
