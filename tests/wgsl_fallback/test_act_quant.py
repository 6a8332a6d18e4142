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


def test_act_quant_scale_is_the_correctly_rounded_reciprocal(wg, rng):
    """The scale 127 / absmax bit for bit over 4099 absmax values spread across 2^-17 .. 2^100 (plus powers of
    two, the 1e-5 clamp, and the neighbours of 1 and 2): the shader's integer reciprocal, not the driver's
    division (2.5 ulp allowed by WGSL; an ulp off on NVIDIA's Vulkan driver)."""
    r, ops = wg
    amax = torch.exp2(torch.rand(4096, generator=rng, dtype=torch.float64) * 117 - 17).float()
    specials = torch.tensor([1e-6, 1.0, 2.0 ** 40, torch.nextafter(torch.tensor(2.0), torch.tensor(0.0)).item()])
    amax = torch.cat([amax, specials, torch.nextafter(torch.tensor([1.0]), torch.tensor([2.0]))])
    x = torch.stack([amax, -amax * torch.rand(amax.shape, generator=rng)], 1)  # [M, 2]: absmax first
    x = x * torch.where(torch.rand(amax.shape, generator=rng) < 0.5, -1.0, 1.0)[:, None]
    xq, s, _ = ops.act_quant(r.upload(x.numpy()), 2)
    want_q, want_s = act_quant_reference(x)
    assert want_s.dtype == torch.float32 and np.array_equal(s.numpy(), want_s.numpy())
    got_q = np.ascontiguousarray(xq.numpy().T).view(np.int8).reshape(x.shape[0], -1)
    assert np.array_equal(got_q[:, :2], want_q.numpy())
