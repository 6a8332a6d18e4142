"""gather.wgsl: embedding rows gathered by token id, exact.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.wgpu


def test_gather(wg, rng):
    r, ops = wg
    table = torch.randn(50, 24, generator=rng)
    tokens = np.array([9, 3, 0, 49, 3], np.uint32)
    for chunk_rows in (None, 7):  # a table split into row chunks is gathered chunk by chunk
        got = ops.gather(r.upload(table.numpy(), chunk_rows=chunk_rows), r.upload(tokens), count=4, offset=1)
        assert np.array_equal(got.numpy(), table.numpy()[tokens[1:]])
