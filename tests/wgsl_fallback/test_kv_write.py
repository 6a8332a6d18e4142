"""kv_write.wgsl: K/V rows written at their positions, nothing else touched.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.wgpu


def test_kv_write_touches_only_its_rows(wg, rng):
    r, ops = wg
    kvh, s, dh, m = 2, 40, 16, 5
    cache = r.upload(np.full((kvh, s, dh), np.nan, np.float32))
    rows = torch.randn(m, kvh, dh, generator=rng)
    pos = np.array([3, 4, 5, 17, 39], np.uint32)
    ops.kv_write(r.upload(rows.numpy()), cache, r.upload(pos))
    got = cache.numpy()
    for i, p in enumerate(pos):
        assert np.array_equal(got[:, p], rows[i].numpy())
    untouched = np.delete(got, pos, axis=1)
    assert np.isnan(untouched).all()
