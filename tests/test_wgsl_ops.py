"""WGSL shaders (wgsl_fallback/*.wgsl) through wgpu, against the pure-torch references.

Rules: integer results (x_q, the W2A8 accumulators, argmax ids, KV writes, gathers) equal the reference
exactly; float ops are compared with a float64 reference within 1e-5 relative (fp32 shaders). Outputs
are poisoned with NaN first where an op writes into a given buffer. Runs on any Vulkan adapter (Mesa
lavapipe in CI); skipped without one unless BITMTP_REQUIRE_WGPU=1 (CI sets it, so it cannot skip there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitmtp.errors import BackendUnavailableError, ShapeError
from bitmtp.formats import pack_t2
from bitmtp.model.layers import apply_rope, rms_norm, rope_tables
from bitmtp.ops.reference import (
    act_quant_reference,
    attention_reference,
    w2a8_accumulate_reference,
    w2a8_linear_q_reference,
)
from tests.wgpu_device import device_runner_or_skip

pytestmark = pytest.mark.wgpu
MS = [1, 3, 8, 15, 16]


@pytest.fixture(scope="module")
def wg():
    from bitmtp.wgsl_fallback.ops import Ops

    runner = device_runner_or_skip()
    return runner, Ops(runner)


def _close(got, want, rel=1e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), 1e-30)
    err = np.abs(got - want).max() / scale
    assert err <= rel, f"max error {err:.3g} of max |ref| (allowed {rel})"


# ---- activation quantization and W2A8 --------------------------------------------------------------------

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


W2A8_CASES = [  # (N, K, scale layout, group size)
    (37, 100, "tensor", None), (64, 256, "row", None), (33, 512, "group", 128), (20, 96, "group", 32),
]


def _ternary(rng, n, k, layout, group):
    from bitmtp.wgsl_fallback.ops import TernaryWeight

    w = torch.randint(-1, 2, (n, k), generator=rng, dtype=torch.int8)
    cols = 1 if layout != "group" else k // group
    scales = torch.rand(1 if layout == "tensor" else n, cols, generator=rng) + 0.05
    return w, pack_t2(w), scales, (lambda r, **kw: TernaryWeight.upload(r, pack_t2(w).numpy(), scales.numpy(), k,
                                                                         group, **kw))


@pytest.fixture(params=["rows", "rows-lane", "rows-dot4-r1", "tiled"])
def w2a8_kernel(request, monkeypatch):
    """Both W2A8 shaders: ``rows`` (w2a8_rows.py, CPU adapters' default: hi16 arithmetic, ROWS rows per
    invocation, activation loads shared over the subgroup where the adapter has one; ``rows-lane``: every
    lane loads its own; ``rows-dot4-r1``: its dot4I8Packed variant with one row) and ``tiled``
    (w2a8.wgsl, GPUs')."""
    from bitmtp.wgsl_fallback import w2a8_rows

    kernel = request.param.split("-")[0]
    monkeypatch.setenv("BITMTP_WGPU_W2A8", kernel)
    if request.param == "rows-lane":
        monkeypatch.setattr(w2a8_rows, "SHARE_ACTIVATIONS", False)
    if request.param == "rows-dot4-r1":
        monkeypatch.setattr(w2a8_rows, "ARITH", "dot4")
        monkeypatch.setattr(w2a8_rows, "ROWS", 1)
    return kernel


@pytest.fixture(params=[True, False], ids=["shared", "lane"])
def share_activations(request, monkeypatch):
    """The rows shader with activation loads shared over the subgroup (where the adapter has one) and
    with every lane loading its own."""
    from bitmtp.wgsl_fallback import w2a8_rows

    monkeypatch.setattr(w2a8_rows, "SHARE_ACTIVATIONS", request.param)
    return request.param


def _dispatched(r, shader: str) -> bool:
    return any(key[0] == shader for key in r._pipelines)


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("n,k,layout,group", W2A8_CASES)
def test_w2a8_accumulators_exact_and_epilogue(wg, w2a8_kernel, m, n, k, layout, group, rng):
    r, ops = wg
    assert r.w2a8_kernel == w2a8_kernel
    _, packed, scales, upload = _ternary(rng, n, k, layout, group)
    w = upload(r, chunk_rows=7)  # several row chunks: exercises the per-chunk dispatch offsets
    assert len(w.words.chunks) == -(-n // 7)
    x = torch.randn(m, k, generator=rng)
    bias = torch.randn(n, generator=rng)
    xq, s, xsum = ops.act_quant(r.upload(x.numpy()), w.group_size)
    acc = ops.w2a8_accumulate(xq, xsum, w).numpy()
    x_q, act_s = act_quant_reference(x)
    want_acc = w2a8_accumulate_reference(x_q, packed, k, w.group_size)
    assert np.array_equal(acc, want_acc.numpy())
    out = r.upload(np.full((m, n), np.nan, np.float32))  # poisoned
    y = ops.w2a8(xq, s, xsum, w, r.upload(bias.numpy()), out=out).numpy()
    want = w2a8_linear_q_reference(x_q, act_s, packed, scales, k, w.group_size, bias)
    _close(y, want.numpy())


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("n,layout,group", [(200, "row", None), (300, "group", 64), (513, "tensor", None)])
def test_w2a8_rows_every_row_of_an_invocation(wg, monkeypatch, share_activations, m, n, layout, group, rng):
    """The rows shader computes rows n, n + 64, … (ROWS of them) per invocation: unchunked N that
    fill some of those rows in the last workgroup (200: rows 192..199 of row slot 3; 300: a second
    workgroup; 513: one row past eight full slots), per-row / per-group / per-tensor scales, bias."""
    from bitmtp.wgsl_fallback import w2a8_rows

    monkeypatch.setenv("BITMTP_WGPU_W2A8", "rows")
    r, ops = wg
    k = 192
    assert n % (w2a8_rows.WG * w2a8_rows.ROWS) != 0
    _, packed, scales, upload = _ternary(rng, n, k, layout, group)
    w = upload(r)
    x = torch.randn(m, k, generator=rng)
    bias = torch.randn(n, generator=rng)
    xq, s, xsum = ops.act_quant(r.upload(x.numpy()), w.group_size)
    x_q, act_s = act_quant_reference(x)
    acc = r.upload(np.full((m, n, w.n_groups), -7, np.int32))  # poisoned
    ops._w2a8("accumulate", xq, None, xsum, w, None, acc)
    assert np.array_equal(acc.numpy(), w2a8_accumulate_reference(x_q, packed, k, w.group_size).numpy())
    y = ops.w2a8(xq, s, xsum, w, r.upload(bias.numpy()), out=r.upload(np.full((m, n), np.nan, np.float32))).numpy()
    _close(y, w2a8_linear_q_reference(x_q, act_s, packed, scales, k, w.group_size, bias).numpy())
    assert _dispatched(r, "w2a8_rows")


@pytest.mark.parametrize("m,windows", [(16, 3), (8, 2), (3, 1)])
def test_w2a8_rows_activation_windows(wg, monkeypatch, share_activations, m, windows, rng):
    """The rows shader binds x_q as several 64 KiB uniform windows when K is wide (scale groups of 3 T2
    words straddle the window boundaries); exact accumulators and the epilogue as the reference."""
    from bitmtp.wgsl_fallback import w2a8_rows

    monkeypatch.setenv("BITMTP_WGPU_W2A8", "rows")
    r, ops = wg
    n, k, group = 21, 9024, 48
    assert w2a8_rows.windows_needed(m, k // 16) == windows
    _, packed, scales, upload = _ternary(rng, n, k, "group", group)
    w = upload(r)
    x = torch.randn(m, k, generator=rng)
    xq, s, xsum = ops.act_quant(r.upload(x.numpy()), w.group_size)
    x_q, act_s = act_quant_reference(x)
    acc = r.upload(np.full((m, n, w.n_groups), -7, np.int32))  # poisoned
    ops._w2a8("accumulate", xq, None, xsum, w, None, acc)
    assert np.array_equal(acc.numpy(), w2a8_accumulate_reference(x_q, packed, k, group).numpy())
    y = ops.w2a8(xq, s, xsum, w, out=r.upload(np.full((m, n), np.nan, np.float32))).numpy()
    _close(y, w2a8_linear_q_reference(x_q, act_s, packed, scales, k, group).numpy())
    assert _dispatched(r, "w2a8_rows")


@pytest.mark.parametrize("code", [-1, 1])
def test_w2a8_extreme_values_do_not_carry(wg, w2a8_kernel, code, rng):
    """The largest products (|x_q| = 127 on every element, all codes equal) are where the rows shader's
    16-bit halves would overflow or carry; accumulators stay exact."""
    from bitmtp.wgsl_fallback.ops import TernaryWeight

    r, ops = wg
    n, k, m = 70, 1040, 16
    w = torch.full((n, k), code, dtype=torch.int8)
    w[::7, ::3] = -code  # a few of the other sign
    x = torch.ones(m, k) * torch.tensor([1.0, -1.0] * 8)[:, None]  # x_q = +127 / -127 per token
    dev = TernaryWeight.upload(r, pack_t2(w).numpy(), np.ones((1, 1), np.float32), k)
    xq, _, xsum = ops.act_quant(r.upload(x.numpy()), dev.group_size)
    x_q, _ = act_quant_reference(x)
    assert int(x_q.abs().min()) == 127
    assert np.array_equal(ops.w2a8_accumulate(xq, xsum, dev).numpy(),
                          w2a8_accumulate_reference(x_q, pack_t2(w), k, k).numpy())


def test_w2a8_rows_falls_back_past_its_windows(monkeypatch, rng):
    """Activations wider than MAX_WINDOWS windows run through w2a8.wgsl (same integers)."""
    from bitmtp.wgsl_fallback import w2a8_rows
    from bitmtp.wgsl_fallback.ops import Ops
    from bitmtp.wgsl_fallback.runner import Runner

    monkeypatch.setenv("BITMTP_WGPU_W2A8", "rows")
    device_runner_or_skip()
    r = Runner()  # a fresh runner: its pipeline cache shows which shader ran
    ops = Ops(r)
    k = w2a8_rows.MAX_WINDOWS * w2a8_rows.window_words(16) * 16 + 48
    assert w2a8_rows.windows_needed(16, -(-k // 16)) > w2a8_rows.MAX_WINDOWS
    _, packed, _, upload = _ternary(rng, 5, k, "row", None)
    w = upload(r)
    x = torch.randn(16, k, generator=rng)
    xq, _, xsum = ops.act_quant(r.upload(x.numpy()), w.group_size)
    x_q, _ = act_quant_reference(x)
    assert np.array_equal(ops.w2a8_accumulate(xq, xsum, w).numpy(),
                          w2a8_accumulate_reference(x_q, packed, k, k).numpy())
    assert _dispatched(r, "w2a8") and not _dispatched(r, "w2a8_rows")


def _rows_share_defines(r) -> set[str]:
    return {d for key in r._pipelines if key[0] == "w2a8_rows" for d in key[2] if d.startswith("SHARE=")}


@pytest.mark.parametrize("subgroups", ["1", "0"])
def test_w2a8_rows_shares_activation_loads_over_the_subgroup(monkeypatch, subgroups, rng):
    """Where the adapter has subgroups the rows shader shares activation loads over the probed subgroup
    size (lavapipe: its SIMD width); with BITMTP_WGPU_SUBGROUPS=0 every lane loads its own. Both exact."""
    from bitmtp.wgsl_fallback import w2a8_rows
    from bitmtp.wgsl_fallback.ops import Ops
    from bitmtp.wgsl_fallback.runner import Runner

    monkeypatch.setenv("BITMTP_WGPU_W2A8", "rows")
    monkeypatch.setenv("BITMTP_WGPU_SUBGROUPS", subgroups)
    device_runner_or_skip()
    r = Runner()  # a fresh runner: its pipeline cache shows which variant ran
    size = r.subgroup_size
    if subgroups == "0" or "subgroup" not in r.features:
        assert size == 0
    elif str(r.info.get("adapter_type", "")).upper() == "CPU":
        assert size >= 4 and size & (size - 1) == 0, size  # lavapipe: 4, 8 or 16 lanes
    share = w2a8_rows.share_size(size)
    ops = Ops(r)
    _, packed, _, upload = _ternary(rng, 70, 336, "group", 48)
    w = upload(r)
    for m in (1, 3, 16):
        x = torch.randn(m, 336, generator=rng)
        xq, _, xsum = ops.act_quant(r.upload(x.numpy()), w.group_size)
        x_q, _ = act_quant_reference(x)
        assert np.array_equal(ops.w2a8_accumulate(xq, xsum, w).numpy(),
                              w2a8_accumulate_reference(x_q, packed, 336, 48).numpy())
    assert _rows_share_defines(r) == {f"SHARE={share}"}
    src = w2a8_rows.source(16, 1, share=share)
    assert ("subgroupBroadcast" in src) == bool(share)


def test_w2a8_rows_source_arguments():
    """The generator refuses a token count, window count, arithmetic or share size it cannot build, and
    shares only over power-of-two subgroups of 4..64 lanes."""
    from bitmtp.wgsl_fallback import w2a8_rows

    for bad in (dict(tokens=0, windows=1), dict(tokens=17, windows=1), dict(tokens=4, windows=5),
                dict(tokens=4, windows=1, arith="dp4"), dict(tokens=4, windows=1, share=2),
                dict(tokens=4, windows=1, share=12), dict(tokens=4, windows=1, share=128)):
        with pytest.raises(ValueError):
            w2a8_rows.source(**bad)
    assert [w2a8_rows.share_size(s) for s in (0, 1, 2, 4, 8, 12, 16, 32, 64, 128)] == [0, 0, 0, 4, 8, 0, 16, 32, 64, 0]
    one = w2a8_rows.source(1, 1, share=8)  # 4 words per T2 word, 8 lanes: lanes 4..7 load word 3 again
    assert "min(0u + lane, 3u)" in one and one.count("subgroupBroadcast(") == 8  # 4 words × (ue, uo)


def test_w2a8_kernel_choice(monkeypatch):
    """CPU adapters default to the rows shader, GPUs to the tiled one; the variable overrides; a typo is
    refused with the accepted values."""
    from bitmtp.errors import BitMTPError

    r = device_runner_or_skip()
    monkeypatch.delenv("BITMTP_WGPU_W2A8", raising=False)
    want = "rows" if str(r.info.get("adapter_type", "")).upper() == "CPU" else "tiled"
    assert r.w2a8_kernel == want
    monkeypatch.setenv("BITMTP_WGPU_W2A8", "tiled")
    assert r.w2a8_kernel == "tiled"
    monkeypatch.setenv("BITMTP_WGPU_W2A8", "row")
    with pytest.raises(BitMTPError, match="rows' or 'tiled"):
        _ = r.w2a8_kernel


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


def test_ternary_linear_wider_than_one_tile(wg, rng):
    """31 rows (a D = 16 verify step) run as 16-row tiles with device-side copies."""
    r, ops = wg
    _, packed, scales, upload = _ternary(rng, 45, 160, "row", None)
    x = torch.randn(31, 160, generator=rng)
    y = ops.ternary_linear(r.upload(x.numpy()), upload(r)).numpy()
    x_q, s = act_quant_reference(x)
    _close(y, w2a8_linear_q_reference(x_q, s, packed, scales, 160, 160).numpy())


@pytest.mark.parametrize("m", MS)
def test_dense_linear(wg, m, rng):
    r, ops = wg
    n, k = 103, 72
    w = torch.randn(n, k, generator=rng)
    b = torch.randn(n, generator=rng)
    x = torch.randn(m, k, generator=rng)
    y = ops.dense(r.upload(x.numpy()), r.upload(w.numpy(), chunk_rows=40), r.upload(b.numpy())).numpy()
    _close(y, (x.double() @ w.double().T + b.double()).numpy())


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
    _close(y, want.numpy())
    rows_ran = _dispatched(r, "dense_rows")
    assert rows_ran == (dense_kernel == "rows") and _dispatched(r, "dense") != rows_ran
    if rows_ran:
        assert dense_rows.windows_needed(m, k) >= (3 if (k, m) == (2056, 16) else 1)


@pytest.mark.parametrize("m,k", [(1, 4), (3, 72), (16, 2056)])
def test_quads_layout_exact(wg, m, k, rng):
    """quads.wgsl (the rows dense shader's activation layout) is an exact copy: xt[j, m] = x[m, 4j..4j+3]."""
    r, _ = wg
    x = torch.randn(m, k, generator=rng)
    xt = r.upload(np.full((k // 4, m, 4), np.nan, np.float32))  # poisoned
    grid = r.grid(-(-k // 4 * m // 64))
    r.dispatch("quads", "main", {0: r.upload(x.numpy()), 1: xt, 2: r.uniform("4I", m, k, k // 4, grid[0])}, grid)
    assert np.array_equal(xt.numpy(), x.numpy().reshape(m, k // 4, 4).transpose(1, 0, 2))


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
        _close(ops.dense(r.upload(x.numpy()), DenseWeight.upload(r, w)).numpy(), (x.double() @ w.double().T).numpy())
        assert _dispatched(r, "dense") and not _dispatched(r, "dense_rows")
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


# ---- norms, RoPE, KV, attention ----------------------------------------------------------------------------

@pytest.mark.parametrize("rows,d", [(1, 64), (5, 96), (16 * 4, 16), (3, 2560)])
def test_rms_norm(wg, rows, d, rng):
    r, ops = wg
    x = torch.randn(rows, d, generator=rng) * 3
    weight = 1 + 0.3 * torch.randn(d, generator=rng)
    y = ops.rms_norm(r.upload(x.numpy()), r.upload(weight.numpy()), 1e-5).numpy()
    _close(y, rms_norm(x.double(), weight.double(), 1e-5).numpy())


@pytest.mark.parametrize("m,heads,dh", [(1, 4, 16), (8, 3, 64), (15, 2, 128)])
def test_rope(wg, m, heads, dh, rng):
    r, ops = wg
    cos, sin = rope_tables(dh, 10000.0, None, 300)
    pos = torch.randint(0, 300, (m,), generator=rng)
    x = torch.randn(m, heads, dh, generator=rng)
    xd = r.upload(x.numpy())
    ops.rope_(xd, r.upload(cos.numpy()), r.upload(sin.numpy()), r.upload(pos.numpy().astype(np.uint32)))
    want = apply_rope(x.double(), cos[pos].double(), sin[pos].double())
    _close(xd.numpy(), want.numpy())


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
    _close(out, attention_reference(q.double(), k.double(), v.double(), mask, scale).numpy())


# ---- element-wise, argmax, gather -----------------------------------------------------------------------------

@pytest.mark.parametrize("act", ["silu", "relu2"])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_gated_activation_and_add(wg, act, m, rng):
    r, ops = wg
    i = 96
    gu = torch.randn(m, 2 * i, generator=rng) * 3
    y = ops.gated(r.upload(gu.numpy()), act).numpy()
    g, u = gu.double().split(i, dim=1)
    want = (torch.nn.functional.silu(g) if act == "silu" else torch.relu(g).square()) * u
    _close(y, want.numpy())
    a, b = torch.randn(m, i, generator=rng), torch.randn(m, i, generator=rng)
    assert np.array_equal(ops.add(r.upload(a.numpy()), r.upload(b.numpy())).numpy(), (a + b).numpy())


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
    _close(probs[2:2 + m], torch.softmax(logits.double(), -1).max(-1).values.numpy())
    assert (raw[:2] == 0xFFFFFFFF).all() and (raw[m + 3:m + 5] == 0xFFFFFFFF).all()  # other slots untouched


def test_gather(wg, rng):
    r, ops = wg
    table = torch.randn(50, 24, generator=rng)
    tokens = np.array([9, 3, 0, 49, 3], np.uint32)
    for chunk_rows in (None, 7):  # a table split into row chunks is gathered chunk by chunk
        got = ops.gather(r.upload(table.numpy(), chunk_rows=chunk_rows), r.upload(tokens), count=4, offset=1)
        assert np.array_equal(got.numpy(), table.numpy()[tokens[1:]])


# ---- runner ------------------------------------------------------------------------------------------------------

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


def test_cols_add_into_and_mask(wg, rng):
    r, ops = wg
    x = torch.randn(5, 30, generator=rng)
    assert np.array_equal(ops.cols(r.upload(x.numpy()), 7, 11).numpy(), x[:, 7:18].numpy())
    y = torch.randn(6, 4, generator=rng)
    yd = r.upload(y.numpy())
    delta = torch.randn(2, 4, generator=rng)
    ops.add_into(yd, r.upload(delta.numpy()), 4)
    want = y.clone()
    want[4:] += delta
    assert np.array_equal(yd.numpy(), want.numpy())
    pos = torch.tensor([7, 8, 9, 10, 11])
    mask = ops.mask(r.upload(pos.numpy().astype(np.uint32)), 14, causal_rows=2).numpy()
    reach = torch.where(torch.arange(5) < 2, pos, pos[-1])
    assert np.array_equal(mask.astype(bool), (torch.arange(14)[None, :] <= reach[:, None]).numpy())


def test_verify_prepare_and_resolve_on_device(wg):
    """The device versions of runtime/verify_prep.py against the torch ones."""
    from bitmtp.runtime.states import ReplayState
    from bitmtp.runtime.verify_prep import prepare_verify, resolve_verify

    r, ops = wg

    class R:  # a torch runner's tensors
        def __init__(self, w, role="verify", block=0):
            self.tokens, self.positions = torch.zeros(w, dtype=torch.long), torch.zeros(w, dtype=torch.long)
            self.out_token = torch.zeros(w, dtype=torch.long)
            self.state = ReplayState(w, 64, role, block)

    d, p = 4, 2
    draft, verify, nxt = R(p + d - 1, "draft", d), R(d), R(d, "draft", d)
    draft.positions[:] = torch.arange(20, 20 + p + d - 1)
    draft.out_token[:] = torch.tensor([0, 5, 6, 7, 8])
    arange = torch.arange(32)
    prepare_verify(draft, verify, arange)
    u = lambda t: r.upload(t.numpy().astype(np.uint32))  # noqa: E731
    out = u(torch.cat([draft.out_token, torch.zeros(p + d - 1, dtype=torch.long)]))
    vt, vp = r.empty((d,), "u32"), r.empty((d,), "u32")
    ops.prepare_verify(out, u(draft.positions), p, d, vt, vp)
    assert np.array_equal(vt.numpy(), verify.tokens.numpy()) and np.array_equal(vp.numpy(), verify.positions.numpy())
    for accepted in ([6, 7, 8, 9], [6, 1, 8, 9], [2, 7, 8, 9]):
        verify.out_token[:] = torch.tensor(accepted)
        resolve_verify(verify, nxt, arange)
        nt, np_ = r.empty((d,), "u32"), r.empty((d,), "u32")
        vout = u(torch.cat([verify.out_token, torch.zeros(d, dtype=torch.long)]))
        ops.resolve_verify(vout, u(verify.positions), u(verify.tokens), nt, np_)
        assert nt.numpy()[0] == nxt.tokens[0] and np.array_equal(np_.numpy(), nxt.positions.numpy())


@pytest.mark.parametrize("subgroups", ["1", "0"])
def test_w2a8_reduction_variants(wg, subgroups, monkeypatch, rng):
    """Subgroup reduction (when the adapter offers it) and the workgroup tree give the same exact integers."""
    from bitmtp.wgsl_fallback.ops import Ops
    from bitmtp.wgsl_fallback.runner import Runner

    monkeypatch.setenv("BITMTP_WGPU_SUBGROUPS", subgroups)
    monkeypatch.setenv("BITMTP_WGPU_W2A8", "tiled")  # the reductions belong to w2a8.wgsl
    r = Runner()
    uses = r.subgroups
    assert uses == (subgroups == "1" and "subgroup" in r.features)
    assert ("subgroupAdd(acc" in r.source("w2a8")) == uses
    ops = Ops(r)
    _, packed, _, upload = _ternary(rng, 29, 384, "group", 128)
    x = torch.randn(13, 384, generator=rng)
    w = upload(r)
    xq, _, xsum = ops.act_quant(r.upload(x.numpy()), w.group_size)
    x_q, _ = act_quant_reference(x)
    assert np.array_equal(ops.w2a8_accumulate(xq, xsum, w).numpy(),
                          w2a8_accumulate_reference(x_q, packed, 384, 128).numpy())


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
    _close(ops.dense(r.upload(x.numpy()), dw).numpy(), (x.double() @ w.double().T).numpy())
    tokens = np.array([36, 0, 5], np.uint32)
    got = ops.gather(dw, r.upload(tokens)).numpy()
    assert np.array_equal(got, w.float().numpy()[tokens])  # exact widening
