"""mask.wgsl: a step's attention mask from its positions.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.wgpu


def test_mask_rows_reach(wg, rng):
    """Causal rows see KV rows up to their own position; the rows after them (a draft block) up to the
    last position (bidirectional inside the block)."""
    r, ops = wg
    pos = torch.tensor([7, 8, 9, 10, 11])
    mask = ops.mask(r.upload(pos.numpy().astype(np.uint32)), 14, causal_rows=2).numpy()
    reach = torch.where(torch.arange(5) < 2, pos, pos[-1])
    assert np.array_equal(mask.astype(bool), (torch.arange(14)[None, :] <= reach[:, None]).numpy())
