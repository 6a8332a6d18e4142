"""act_quant.wgsl: per-token absmax int8 quantization (bitmtp.ops.reference.act_quant_reference), exact.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitmtp.ops.reference import act_quant_reference
from tests.support.wgsl import MS

pytestmark = pytest.mark.wgpu


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k,group", [(48, 48), (100, 112), (300, 32), (640, 128)])
def test_act_quant_exact(wg, m, k, group, rng):
    r, ops = wg
    x = torch.randn(m, k, generator=rng) * (torch.rand(m, 1, generator=rng) * 20 + 0.01)
    xq, s, xsum = ops.act_quant(r.upload(x.numpy()), group)
    want_q, want_s = act_quant_reference(x)
    got_q = np.ascontiguousarray(xq.numpy().T).view(np.int8).reshape(m, -1)  # stored token-minor [K/4, M]
    assert np.array_equal(got_q[:, :k], want_q.numpy()) and not got_q[:, k:].any()  # padding is zero
    assert np.array_equal(s.numpy(), want_s.numpy())
    groups = [want_q[:, lo:lo + group].to(torch.int64).sum(1) for lo in range(0, k, group)]
    assert np.array_equal(xsum.numpy(), torch.stack(groups, 1).numpy())
