"""dense.wgsl (tiled) and the rows shader of dense_rows.py: float32 / bf16 / f16 dense linear against a
float64 matmul.

Shared fixtures (``wg``: the device runner and its ops) and helpers: tests/wgsl_fallback/conftest.py,
tests/support/wgsl.py. Runs on any Vulkan adapter (Mesa lavapipe in CI); skipped without one unless
BITMTP_REQUIRE_WGPU=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.wgpu_device import device_runner_or_skip
from tests.support.wgsl import MS, close, dispatched

pytestmark = pytest.mark.wgpu


@pytest.mark.parametrize("m", MS)
def test_dense_linear(wg, m, rng):
    r, ops = wg
    n, k = 103, 72
    w = torch.randn(n, k, generator=rng)
    b = torch.randn(n, generator=rng)
    x = torch.randn(m, k, generator=rng)
    y = ops.dense(r.upload(x.numpy()), r.upload(w.numpy(), chunk_rows=40), r.upload(b.numpy())).numpy()
    close(y, (x.double() @ w.double().T + b.double()).numpy())


@pytest.fixture(params=["rows", "rows-lane", "tiled"])
def dense_kernel(request, monkeypatch):
    """Both dense shaders: ``rows`` (dense_rows.py, CPU adapters' default; activation loads shared over the
    subgroup where there is one; ``rows-lane``: each lane loads its own) and ``tiled`` (dense.wgsl)."""
    from bitmtp.wgsl_fallback import w2a8_rows

    kernel = request.param.split("-")[0]
    monkeypatch.setenv("BITMTP_WGPU_DENSE", kernel)
    if request.param == "rows-lane":
        monkeypatch.setattr(w2a8_rows, "SHARE_ACTIVATIONS", False)
    return kernel


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k,dtype,chunk,bias", [
    (103, 72, torch.float32, 40, True),     # several weight chunks, one partly filled workgroup
    (513, 200, torch.bfloat16, None, True),  # one row past eight full row slots
    (300, 2056, torch.float16, 128, False),  # three activation windows at M = 16, chunks of 128 rows
    (200, 1032, torch.float32, None, False),  # two windows at M = 16, rows 192..199 of row slot 3
])
def test_dense_shaders(wg, dense_kernel, m, n, k, dtype, chunk, bias, rng):
    """Either dense shader against the float64 reference (within 1e-5 of the largest output), with float32,
    bf16 and f16 weights, row chunks, several activation windows and every row slot of an invocation."""
    from bitmtp.wgsl_fallback import dense_rows
    from bitmtp.wgsl_fallback.ops import DenseWeight
    from bitmtp.wgsl_fallback.runner import Runner

    device_runner_or_skip()
    r = Runner()  # a fresh runner: its pipeline cache shows which shader ran
    from bitmtp.wgsl_fallback.ops import Ops

    ops = Ops(r)
    w = (torch.randn(n, k, generator=rng) * (torch.rand(n, 1, generator=rng) + 0.5)).to(dtype)
    b = torch.randn(n, generator=rng) if bias else None
    x = torch.randn(m, k, generator=rng) * 3
    dw = DenseWeight.upload(r, w, chunk_rows=chunk)
    y = ops.dense(r.upload(x.numpy()), dw, r.upload(b.numpy()) if bias else None).numpy()
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    close(y, want.numpy())
    rows_ran = dispatched(r, "dense_rows")
    assert rows_ran == (dense_kernel == "rows") and dispatched(r, "dense") != rows_ran
    if rows_ran:
        assert dense_rows.windows_needed(m, k) >= (3 if (k, m) == (2056, 16) else 1)


def test_dense_rows_falls_back_where_it_cannot_run(monkeypatch, rng):
    """K not a multiple of the weight unit (4 float32, 8 bf16/f16), or activations wider than the
    shader's windows: dense.wgsl runs (same results within the tolerance)."""
    from bitmtp.wgsl_fallback import dense_rows
    from bitmtp.wgsl_fallback.ops import DenseWeight, Ops
    from bitmtp.wgsl_fallback.runner import Runner

    monkeypatch.setenv("BITMTP_WGPU_DENSE", "rows")
    device_runner_or_skip()
    wide = dense_rows.MAX_WINDOWS * dense_rows.window_quads(16) * 4 + 8
    for k, dtype, m in ((70, torch.float32, 3), (76, torch.bfloat16, 3), (wide, torch.float32, 16)):
        assert not dense_rows.usable(m, k, "f32" if dtype == torch.float32 else "bf16")
        r = Runner()
        ops = Ops(r)
        w = torch.randn(9, k, generator=rng).to(dtype)
        x = torch.randn(m, k, generator=rng)
        close(ops.dense(r.upload(x.numpy()), DenseWeight.upload(r, w)).numpy(), (x.double() @ w.double().T).numpy())
        assert dispatched(r, "dense") and not dispatched(r, "dense_rows")
    assert dense_rows.usable(16, wide - 8, "f32") and dense_rows.usable(1, wide, "f32")


def test_dense_kernel_choice_and_source_arguments(monkeypatch):
    """CPU adapters default to the rows dense shader, GPUs to dense.wgsl; the variable overrides and a typo
    is refused; the generator refuses what it cannot build."""
    from bitmtp.errors import BitMTPError
    from bitmtp.wgsl_fallback import dense_rows

    r = device_runner_or_skip()
    monkeypatch.delenv("BITMTP_WGPU_DENSE", raising=False)
    assert r.dense_kernel == ("rows" if str(r.info.get("adapter_type", "")).upper() == "CPU" else "tiled")
    monkeypatch.setenv("BITMTP_WGPU_DENSE", "tiled")
    assert r.dense_kernel == "tiled"
    monkeypatch.setenv("BITMTP_WGPU_DENSE", "fast")
    with pytest.raises(BitMTPError, match="rows' or 'tiled"):
        _ = r.dense_kernel
    for bad in (dict(tokens=0, windows=1, kind="f32"), dict(tokens=4, windows=9, kind="f32"),
                dict(tokens=4, windows=1, kind="f64"), dict(tokens=4, windows=1, kind="bf16", share=6)):
        with pytest.raises(ValueError):
            dense_rows.source(**bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 16])
def test_dense_and_gather_with_16_bit_weights(wg, dtype, m, rng):
    """bf16 / f16 dense weights stay 16-bit on the device (packed pairs, K odd included) and widen exactly."""
    from bitmtp.wgsl_fallback.ops import DenseWeight

    r, ops = wg
    n, k = 37, 71
    w = torch.randn(n, k, generator=rng).to(dtype)
    x = torch.randn(m, k, generator=rng)
    dw = DenseWeight.upload(r, w, chunk_rows=10)
    assert dw.kind == {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]
    assert dw.data.nbytes == n * (k + 1) // 2 * 4 if dtype != torch.float32 else n * k * 4
    close(ops.dense(r.upload(x.numpy()), dw).numpy(), (x.double() @ w.double().T).numpy())
    tokens = np.array([36, 0, 5], np.uint32)
    got = ops.gather(dw, r.upload(tokens)).numpy()
    assert np.array_equal(got, w.float().numpy()[tokens])  # exact widening
