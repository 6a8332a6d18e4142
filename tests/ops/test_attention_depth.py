"""The cpu attention kernel at decode depth (issue 24 item 3): decode and verify widths over long KV
stores, the softmax chunks (``kAttnChunk`` rows at fixed positions) and the threads' split of a KV
head's rows between them.

Rules: against a float64 computation over the visible rows; a row's bits are the same whatever the
step's width (1, 3, 8, 15, 16 rows), the segment it runs in, the thread count and the ISA path; the
kernel writes every output element (outputs poisoned with NaN first); KV rows nobody may see hold
NaN/Inf and never matter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitmtp.ops.registry import availability
from tests.support.attention_replay import attn_exp

pytestmark = pytest.mark.skipif(not availability("cpu", "cpu")[0], reason="native CPU extension not built")

WIDTHS = (1, 3, 8, 15, 16)
# (heads, kv heads, head dim): SmolLM2-135M, a GQA group of 4 with a head dim that is not whole vectors
SHAPES = [(9, 3, 64), (8, 2, 40)]


def _run(q, k, v, mask, scale, isa, threads):
    """The extension called directly, into an output poisoned with NaN (float16 K/V: kv_half)."""
    from bitmtp.ops.backends import cpu_backend

    ext = cpu_backend._load_extension()
    m, h, d = q.shape
    kvh, s_rows, _ = k.shape
    q = q.contiguous()
    mask_u8 = mask.contiguous().view(torch.uint8)
    out = torch.full_like(q, float("nan"))
    ext.attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), mask_u8.data_ptr(), out.data_ptr(), m, h, kvh, d,
                  s_rows, mask.shape[1], float(scale), threads, cpu_backend.ISA_NAMES[isa],
                  kv_half=k.dtype == torch.float16)
    return out


def _decode_inputs(g, width, h, kvh, d, n, segment, s_rows=None):
    """A verify/decode step at depth n: row i sees KV rows [0, n + i] (the step's own rows included);
    rows past the step up to the segment and the store's spare rows hold NaN/Inf."""
    s_rows = s_rows or segment + 9
    q = torch.randn(width, h, d, generator=g) * 2
    k = torch.randn(kvh, s_rows, d, generator=g)
    v = torch.randn(kvh, s_rows, d, generator=g)
    k[:, n + width:] = float("nan")
    v[:, n + width:] = float("inf")
    mask = torch.arange(segment)[None, :] <= (n + torch.arange(width))[:, None]
    return q, k, v, mask


def _float64(q, k, v, mask, scale):
    m, h, d = q.shape
    g = h // k.shape[0]
    ref = torch.empty(m, h, d, dtype=torch.float64)
    for i in range(m):
        idx = mask[i].nonzero()[:, 0]
        for j in range(h):
            s = (k[j // g, idx].double() @ q[i, j].double()) * scale
            ref[i, j] = torch.softmax(s, 0) @ v[j // g, idx].double()
    return ref


@pytest.mark.parametrize("h,kvh,d", SHAPES)
@pytest.mark.parametrize("n", [1000, 1024, 1409])  # chunk-aligned and not, not powers of two
def test_depth_matches_float64_and_is_width_independent(h, kvh, d, n, rng):
    from bitmtp.ops.backends import cpu_backend

    scale = d**-0.5
    q, k, v, mask = _decode_inputs(rng, 16, h, kvh, d, n, n + 16, s_rows=2 * n + 100)
    ref = _float64(q, k, v, mask, scale)
    for isa in cpu_backend.supported_isas():
        full = _run(q, k, v, mask, scale, isa, 2)
        assert torch.isfinite(full).all(), isa
        assert (full.double() - ref).abs().max().item() <= 1e-5, isa
        for width in WIDTHS:  # the first `width` rows as their own step: the same bits
            part = _run(q[:width], k, v, mask[:width], scale, isa, 1)
            assert torch.equal(part, full[:width]), (isa, width)
        # a row alone in a wider segment (the runtime's doubling segments): masked tail, same bits
        for i in (0, 7, 15):
            wide = torch.zeros(1, 2 * n + 100, dtype=torch.bool)
            wide[0, : n + 16] = mask[i]
            alone = _run(q[i : i + 1], k, v, wide, scale, isa, 2)
            assert torch.equal(alone[0], full[i]), (isa, i)


@pytest.mark.parametrize("width", WIDTHS)
def test_bits_independent_of_isa_and_threads(width, rng):
    """Every ISA path and thread count (the threads split the chunks of a KV head's rows) gives the same
    bits; n = 2333 leaves a partial last chunk."""
    from bitmtp.ops.backends import cpu_backend

    q, k, v, mask = _decode_inputs(rng, width, 9, 3, 64, 2333, 2333 + width + 21)
    mask[0, 5:300] = False  # a hole in the first row: a whole chunk and parts of two
    if width == 1:  # nobody sees those rows: poison
        k[:, 5:300] = float("nan")
        v[:, 5:300] = float("-inf")
    outs = [(isa, t, _run(q, k, v, mask, 0.125, isa, t)) for isa in cpu_backend.supported_isas() for t in (1, 2, 3)]
    for isa, t, out in outs:
        assert torch.isfinite(out).all(), (isa, t)
        assert torch.equal(out, outs[0][2]), (isa, t)


def _finite_halves(g, shape):
    """float16 values from random bit patterns: every finite binade, subnormals and signed zeros included."""
    bits = torch.randint(0, 1 << 16, shape, generator=g, dtype=torch.int32)
    bits = torch.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # Inf/NaN exponents -> subnormals
    return bits.to(torch.int16).view(torch.float16)


@pytest.mark.parametrize("h,kvh,d", SHAPES + [(4, 4, 70)])
@pytest.mark.parametrize("width", WIDTHS)
def test_float16_kv_gives_the_bits_of_float32_kv(h, kvh, d, width, rng):
    """float16 K/V are widened exactly on load: the output is bit for bit that of float32 K/V holding the
    same values, on every ISA path and thread count. V covers every binade (random finite bit patterns);
    KV rows nobody sees hold float16 NaN/Inf."""
    from bitmtp.ops.backends import cpu_backend

    n = 777
    q, k32, _, mask = _decode_inputs(rng, width, h, kvh, d, n, n + width + 5)
    k = k32.half()
    v = _finite_halves(rng, k.shape)
    k[:, n + width:] = float("nan")
    v[:, n + width:] = float("inf")
    want = None
    for isa in cpu_backend.supported_isas():
        for t in (1, 2):
            out = _run(q, k, v, mask, d**-0.5, isa, t)
            ref = _run(q, k.float(), v.float(), mask, d**-0.5, isa, t)
            assert torch.isfinite(out).all(), (isa, t)
            assert torch.equal(out, ref), (isa, t)
            want = out if want is None else want
            assert torch.equal(out, want), (isa, t)


def test_kernel_exponential_is_accurate():
    """attn_exp (replayed operation by operation in tests/ops/test_attention.py, where the kernel's bits
    are checked against the replay) is within 2 ulp of exp over the softmax range, exactly 1 at 0 and 0
    below the float range."""

    x = np.linspace(-87.0, 0.0, 200_001, dtype=np.float32)
    got = attn_exp(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert (np.abs(got - want) / ulp).max() <= 2.0
    assert attn_exp(np.float32(0.0)) == 1.0
    assert attn_exp(np.float32(-np.inf)) == 0.0 and attn_exp(np.float32(-100.0)) == 0.0
    assert np.isnan(attn_exp(np.float32(np.nan)))


def _half_boundaries() -> torch.Tensor:
    """float32 values at and around every kind of float16 rounding boundary: the midpoints between
    neighbouring halves (ties to even, both parities) and one float32 ulp either side, over normal and
    subnormal halves; the overflow threshold (65520) and its neighbours; zeros, Inf, NaN; both signs."""
    halves = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()  # finite >= 0
    mids = (halves[:-1].double() + halves[1:].double()) / 2  # exact in float32 (one more bit than a half)
    mids = mids.float()
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    special = torch.tensor([0.0, 65504.0, 65519.996, 65520.0, 65536.0, 1e30, float("inf"), float("nan"),
                            2.0**-25, 2.0**-26, 3 * 2.0**-26, 2.0**-24, 2.0**-14, 1e-45])
    pos = torch.cat([halves, mids, below, above, special])
    return torch.cat([pos, -pos])


def test_kv_rounding_to_half_equals_torch():
    """The fused layers' float32 -> float16 K/V rounding (csrc/cpu/half.h) gives torch's ``.to(float16)``
    bits for every boundary case (NaN: any NaN, as torch's sign and payload are not a contract)."""
    from bitmtp.ops.backends import cpu_backend

    ext = cpu_backend._load_extension()
    x = _half_boundaries().contiguous()
    out = torch.full(x.shape, 0x1234, dtype=torch.int16)  # poisoned: not a value any input rounds to twice
    ext.round_to_half(x.data_ptr(), out.data_ptr(), x.numel())
    want = x.to(torch.float16)
    got = out.view(torch.float16)
    nan = torch.isnan(x)
    assert torch.isnan(got[nan]).all()
    bad = (got[~nan].view(torch.int16) != want[~nan].view(torch.int16)).nonzero().flatten()
    assert bad.numel() == 0, [(x[~nan][i].item(), got[~nan][i].item(), want[~nan][i].item()) for i in bad[:5]]


@pytest.mark.parametrize("width", WIDTHS)
def test_backend_attention_takes_float16_kv(width, rng):
    """``cpu`` backend attention with float16 K/V and float32 q runs the kernel (kv_half), and equals the
    float32 kernel on the widened K/V bit for bit."""
    from bitmtp.ops.registry import backend

    be = backend("cpu")
    h, kvh, d, n = 9, 3, 64, 300
    q, k, v, mask = _decode_inputs(rng, width, h, kvh, d, n, 512)
    k16, v16 = k.half(), v.half()
    got = be.attention(q, k16, v16, mask, 0.125)
    want = be.attention(q, k16.float(), v16.float(), mask, 0.125)
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
