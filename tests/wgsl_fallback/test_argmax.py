"""argmax.wgsl: each row's argmax id and its softmax probability.

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


@pytest.mark.parametrize("m,v", [(1, 97), (8, 1000), (16, 4099)])
def test_argmax_and_probability(wg, m, v, rng):
    r, ops = wg
    logits = torch.randn(m, v, generator=rng) * 4
    logits[0, 5] = logits[0, 50] = logits[0].max() + 1  # a tie: the first index wins, as torch.argmax
    out = r.upload(np.full(2 * (m + 3), 0xFFFFFFFF, np.uint32))  # poisoned; rows land at offset 2 of width m + 3
    ops.argmax(r.upload(logits.numpy()), out, offset=2)
    raw = out.numpy()
    ids, probs = ops.split_argmax(raw)
    assert np.array_equal(ids[2:2 + m], logits.argmax(-1).numpy())
    close(probs[2:2 + m], torch.softmax(logits.double(), -1).max(-1).values.numpy())
    assert (raw[:2] == 0xFFFFFFFF).all() and (raw[m + 3:m + 5] == 0xFFFFFFFF).all()  # other slots untouched
