"""The wgpu runner (wgsl_fallback/runner.py): recorded command replay, tensors split over bindings,
the missing-adapter message.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitmtp.errors import BackendUnavailableError, ShapeError

pytestmark = pytest.mark.wgpu


def test_record_and_replay(wg, rng):
    """A recorded block re-encodes the same dispatches (the same bind groups, so the same buffers) on
    replay: new inputs written into its input buffer give the outputs of running its ops again.
    Recordings with other uniform values differ; one that read host memory cannot be replayed; recordings
    do not nest."""
    from bitmtp.errors import BitMTPError

    r, ops = wg
    x0, x1 = torch.randn(5, 96, generator=rng), torch.randn(5, 96, generator=rng)
    w = r.upload(torch.rand(96, generator=rng).numpy() + 0.5)
    x = r.upload(x0.numpy())

    def body(eps):
        h = ops.rms_norm(x, w, eps)
        return ops.add(h, x)

    key = object()
    recs = []
    for eps in (1e-5, 1e-5, 1e-3):
        with r.arena(key), r.record() as rec:
            y = body(eps)
        recs.append(rec)
    assert recs[0].same_as(recs[1]) and not recs[1].same_as(recs[2])  # eps lives in a uniform
    assert len(recs[0].commands) == 2 and not recs[0].host_work
    with r.arena(key):
        y = body(1e-5)
    want = y.numpy()
    r.write(x, x1.numpy())
    out = r.upload(np.full((5, 96), np.nan, np.float32))  # poisoned: the replay's output is copied here
    with r.arena(key):
        r.replay(recs[1])
        r.copy(y.buffer, 0, out.buffer, 0, 5 * 96 * 4)
    got = out.numpy()
    with r.arena(key):
        y = body(1e-5)
    assert np.array_equal(got, y.numpy()) and not np.array_equal(got, want)
    with r.record() as rec:
        ops.rms_norm(x, w, 1e-5).numpy()  # a host read inside the block
    assert rec.host_work and not rec.same_as(rec)
    with pytest.raises(BitMTPError, match="host memory"):
        r.replay(rec)
    with r.record(), pytest.raises(BitMTPError, match="do not nest"):
        with r.record():
            pass


def test_tensors_beyond_one_binding_are_split(wg, rng):
    from bitmtp.wgsl_fallback.runner import Runner

    small = Runner(max_binding_bytes=1024)  # 256 floats per binding
    x = torch.randn(70, 10, generator=rng).numpy()
    t = small.upload(x)
    assert len(t.chunks) == 3 and t.rows_per_chunk == 25
    assert np.array_equal(t.numpy(), x)
    with pytest.raises(ShapeError, match="cannot be split by rows"):
        small.empty((2, 300))


def test_no_adapter_names_the_system_package(monkeypatch):
    wgpu = pytest.importorskip("wgpu")
    from bitmtp.wgsl_fallback.runner import Runner

    monkeypatch.setattr(wgpu.gpu, "request_adapter_sync", lambda **kw: None)
    with pytest.raises(BackendUnavailableError, match="mesa-vulkan-drivers"):
        Runner()
