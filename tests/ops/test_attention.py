"""Attention op: every backend against the float64 reference; the cpu kernel's rows are bitwise
independent of the step's width and of the segment length."""

from __future__ import annotations

import pytest
import torch

from bitmtp.errors import ShapeError
from bitmtp.ops import attention
from bitmtp.ops.registry import availability
from tests.support.attention_replay import CHUNK, attn_exp
from tests.support.backend_variants import attention_on

BACKENDS = [b for b in ("torch", "cpu", "triton") if availability(b, "cpu")[0]]
DETERMINISTIC = [b for b in ("cpu", "triton") if b in BACKENDS]


def _inputs(g, m=5, h=6, kvh=2, d=24, s=300, length=200):
    q = torch.randn(m, h, d, generator=g)
    k = torch.randn(kvh, s, d, generator=g)
    v = torch.randn(kvh, s, d, generator=g)
    pos = torch.randint(0, length, (m,), generator=g)
    mask = torch.arange(length)[None, :] <= pos[:, None]
    mask[0, -1] = True  # a non-causal pattern too (draft rows see their block)
    return q, k, v, mask


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("m,h,kvh,d", [(1, 4, 4, 16), (3, 6, 2, 24), (16, 9, 3, 64), (8, 20, 5, 128)])
def test_matches_float64_reference(backend, m, h, kvh, d, rng):
    q, k, v, mask = _inputs(rng, m, h, kvh, d)
    out = attention(q, k, v, mask, d**-0.5, backend=backend)
    g = h // kvh
    ref = torch.empty(m, h, d, dtype=torch.float64)
    for i in range(m):
        for j in range(h):
            idx = mask[i].nonzero()[:, 0]
            s = (k[j // g, idx].double() @ q[i, j].double()) * d**-0.5
            ref[i, j] = torch.softmax(s, 0) @ v[j // g, idx].double()
    assert (out.double() - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", DETERMINISTIC)
def test_rows_independent_of_width_and_segment(backend, rng):
    q, k, v, mask = _inputs(rng, m=7, length=200)
    together = attention(q, k, v, mask, 0.2, backend=backend)
    for i in range(7):
        for length in (200, 256, 300):  # wider segments: extra columns masked off
            wide = torch.zeros(1, length, dtype=torch.bool)
            wide[0, :200] = mask[i]
            alone = attention(q[i : i + 1], k, v, wide, 0.2, backend=backend)
            assert torch.equal(alone[0], together[i])


def test_lane_and_chunk_constants_match_the_kernel():
    """``bitmtp.ops.linear.ATTENTION_LANES`` / ``ATTENTION_CHUNK`` (what the top2 schedule's runner-up slot is
    built from) are the CPU kernel's score lanes and softmax chunk (csrc/cpu/attention.h)."""
    import re

    from bitmtp.ops.linear import ATTENTION_CHUNK, ATTENTION_LANES
    from tests.support.paths import REPO_ROOT

    header = (REPO_ROOT / "csrc" / "cpu" / "attention.h").read_text()
    assert int(re.search(r"kAttnTile = (\d+);", header).group(1)) == ATTENTION_LANES
    assert int(re.search(r"kAttnChunk = (\d+);", header).group(1)) == ATTENTION_CHUNK == CHUNK


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the native CPU extension is not built")
def test_lane_and_chunk_constants_are_the_extensions(monkeypatch):
    """The planner's layout constants come from the extension itself (its exported ``ATTENTION_LANES`` /
    ``ATTENTION_CHUNK``), not from a copy: a changed kernel constant changes what ``ops.linear`` says."""
    import importlib
    import types

    import bitmtp._cpu_w2a8 as ext
    from bitmtp.ops import linear

    assert (ext.ATTENTION_LANES, ext.ATTENTION_CHUNK) == (linear.ATTENTION_LANES, linear.ATTENTION_CHUNK)
    fake = types.SimpleNamespace(ATTENTION_LANES=8, ATTENTION_CHUNK=64)
    monkeypatch.setattr(importlib, "import_module", lambda name: fake)
    assert linear._attention_layout() == (8, 64)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the native CPU extension is not built")
@pytest.mark.parametrize("at", (1, 37, 130, 255))
@pytest.mark.parametrize("kv_dtype", (torch.float32, torch.float16))
def test_a_row_moved_by_lanes_inside_its_chunk_gives_the_same_bits(at, kv_dtype, rng):
    """The top2 schedule's premise (``bitmtp.decoding.onepass.runner_up_slot``): a query row that sees KV rows
    [0, at) and its own row gets the same bits whether its row sits at ``at`` or at ``at + 16·j`` in the same
    128-row chunk, the rows between hidden (they hold other data, even NaN)."""
    from bitmtp.ops.linear import ATTENTION_CHUNK, ATTENTION_LANES

    d, kvh, h, s = 64, 3, 9, 400
    q = torch.randn(1, h, d, generator=rng)
    k = torch.randn(kvh, s, d, generator=rng).to(kv_dtype)
    v = torch.randn(kvh, s, d, generator=rng).to(kv_dtype)
    length = 384
    base = torch.zeros(1, length, dtype=torch.bool)
    base[0, : at + 1] = True
    ref = attention(q, k, v, base, d**-0.5, backend="cpu")
    moved = 0
    for j in range(1, 8):
        to = at + ATTENTION_LANES * j
        if to // ATTENTION_CHUNK != at // ATTENTION_CHUNK:
            break
        k2, v2 = k.clone(), v.clone()
        k2[:, to], v2[:, to] = k[:, at], v[:, at]
        k2[:, at : to] = float("nan")
        v2[:, at : to] = float("nan")
        mask = torch.zeros(1, length, dtype=torch.bool)
        mask[0, :at] = True
        mask[0, to] = True
        assert torch.equal(attention(q, k2, v2, mask, d**-0.5, backend="cpu"), ref), (at, to)
        moved += 1
    assert moved >= (1 if at != 255 else 0)


def test_bad_shapes(rng):
    q, k, v, mask = _inputs(rng)
    with pytest.raises(ShapeError, match="mask"):
        attention(q, k, v, mask.float(), 0.1)
    with pytest.raises(ShapeError, match="mask"):
        attention(q, k, v, torch.ones(5, 400, dtype=torch.bool), 0.1)
    with pytest.raises(ShapeError, match="k"):
        attention(q, k[:, :, :5], v[:, :, :5], mask, 0.1)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="native CPU extension not built")
@pytest.mark.parametrize("d", [16, 24, 64, 70])  # lanes: whole 16-blocks, a tail, odd head dims
def test_cpu_isa_paths_give_the_same_bits(d, rng):
    """The scalar, AVX2 and AVX-512 builds of the attention loop run the same float operations in the
    same order (no contraction), so their outputs are bitwise equal (poisoned output first)."""
    from bitmtp.ops.backends import cpu_backend

    q, k, v, mask = _inputs(rng, m=15, h=9, kvh=3, d=d)
    outs = []
    for isa in cpu_backend.supported_isas():
        with cpu_backend.forced_isa(isa):
            out = attention(q, k, v, mask, d**-0.5, backend="cpu")
        assert torch.isfinite(out).all()
        outs.append(out)
    assert len(outs) >= 2
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


# --- the cpu kernel's exact operation sequence -------------------------------------------------------



def _kernel_sequence(q, k, v, mask, scale):
    """What the cpu kernel computes for every (row, head), operation by operation, in numpy float32
    (attention_body.inc): the 16 partial sums of the dot product (lane j sums d = j, j + 16, ... from 0),
    added in lane order to 0 and times scale; per chunk of CHUNK KV rows the pair sees: the max m_c over
    its allowed rows, w = attn_exp(score - m_c) (0 where not allowed), the total in 16 lanes (lane i sums
    rows i, i + 16, ... of the chunk) added in lane order, acc_c = sum of w * v in increasing row; then
    over the chunks in order: M = max m_c, e_c = attn_exp(m_c - M), T = sum t_c e_c, A = sum acc_c e_c,
    out = A * (1 / T); zeros for a row that sees nothing. Each numpy operation rounds to float32 on its
    own (no fused multiply-add)."""
    import numpy as np

    f = np.float32
    m, h, d = q.shape
    kvh = k.shape[0]
    length = mask.shape[1]
    group = h // kvh
    sc = f(scale)
    out = np.zeros((m, h, d), np.float32)
    msk = mask.numpy()
    with np.errstate(all="ignore"):  # lanes of rows a pair may not see can hold NaN/Inf: never used
        for g in range(kvh):
            qg = q[:, g * group:(g + 1) * group].reshape(m * group, d).numpy()  # pair = row * group + head
            allowed = np.repeat(msk, group, axis=0)
            keys, values = k[g, :length].numpy(), v[g, :length].numpy()
            s = np.zeros((m * group, length), np.float32)
            for j in range(16):
                part = np.zeros((m * group, length), np.float32)
                for e in range(j, d, 16):
                    part = part + qg[:, e:e + 1] * keys[None, :, e]
                s = s + part
            s = np.where(allowed, s * sc, f(-np.inf))
            parts = []  # per chunk: (seen, m_c, t_c, acc_c)
            for c0 in range(0, length, CHUNK):
                c1 = min(c0 + CHUNK, length)
                seen = allowed[:, c0:c1].any(axis=1)
                mc = np.where(seen, s[:, c0:c1].max(axis=1), f(0))
                w = attn_exp(s[:, c0:c1] - mc[:, None])
                lanes = np.zeros((m * group, 16), np.float32)
                for x in range(c1 - c0):
                    lanes[:, x % 16] = lanes[:, x % 16] + w[:, x]
                tc = np.zeros(m * group, np.float32)
                for i in range(16):
                    tc = tc + lanes[:, i]
                acc = np.zeros((m * group, d), np.float32)
                for x in range(c1 - c0):  # KV rows in increasing order
                    acc = np.where(allowed[:, c0 + x, None], acc + w[:, x, None] * values[None, c0 + x], acc)
                parts.append((seen, mc, tc, acc))
            big = np.stack([np.where(p[0], p[1], f(-np.inf)) for p in parts])
            mx = big.max(axis=0)
            total = np.zeros(m * group, np.float32)
            res = np.zeros((m * group, d), np.float32)
            for seen, mc, tc, acc in parts:
                e = attn_exp(mc - mx)
                total = np.where(seen, total + tc * e, total)
                res = np.where(seen[:, None], res + acc * e[:, None], res)
            any_seen = allowed.any(axis=1)
            inv = np.where(any_seen, f(1) / np.where(any_seen, total, f(1)), f(0)).astype(np.float32)
            res = np.where(any_seen[:, None], res * inv[:, None], f(0))
            out[:, g * group:(g + 1) * group] = res.reshape(m, group, d)
    return torch.from_numpy(out)


def _holey_inputs(g, m, h, kvh, d, length):
    """Decode-like masks (row i sees [0, n + i]) with random holes, a block a row above it cannot see,
    one row that sees nothing; KV rows nobody sees and rows past the segment hold NaN/Inf."""
    s = length + 7
    q = torch.randn(m, h, d, generator=g) * 2
    k = torch.randn(kvh, s, d, generator=g)
    v = torch.randn(kvh, s, d, generator=g)
    n = max(length - m, 1)
    pos = (n + torch.arange(m)).clamp(max=length - 1)
    mask = torch.arange(length)[None, :] <= pos[:, None]
    mask &= torch.rand(m, length, generator=g) > 0.2
    mask[:, length // 3: length // 3 + 5] = False
    if m > 2:
        mask[1] = False
        mask[2, -1] = True  # non-causal: sees a row past its position
    hidden = ~mask.any(0)
    k[:, :length][:, hidden] = float("nan")
    v[:, :length][:, hidden] = float("inf")
    k[:, length:] = float("nan")
    v[:, length:] = float("-inf")
    return q, k, v, mask


# (rows, heads, kv heads, head dim, KV rows): decode and verify widths, the prefill chunk (64), GQA groups
# of 1, 3 and 4, head dims with a 16-lane tail and below one vector, long segments
SEQUENCE_SHAPES = [(1, 9, 3, 64, 1000), (16, 9, 3, 64, 300), (64, 8, 2, 24, 130), (5, 4, 4, 70, 200),
                   (3, 12, 3, 5, 33), (2, 9, 3, 64, 2000), (9, 6, 2, 17, 77)]


@pytest.mark.skipif("cpu" not in BACKENDS, reason="native CPU extension not built")
@pytest.mark.parametrize("m,h,kvh,d,length", SEQUENCE_SHAPES)
def test_cpu_bits_are_the_lone_pair_sequence(m, h, kvh, d, length, rng):
    """Every ISA path and thread count gives, bit for bit, the per-(row, head) operation sequence the
    kernel promises (attention_body.inc): however the rows, heads and KV tiles are batched, a pair's
    bits are those of that pair computed alone. Unseen KV rows hold NaN/Inf (poisoned output first)."""
    from bitmtp.ops.backends import cpu_backend

    q, k, v, mask = _holey_inputs(rng, m, h, kvh, d, length)
    want = _kernel_sequence(q, k, v, mask, d**-0.5)
    assert torch.isfinite(want).all()
    threads = torch.get_num_threads()
    try:
        for isa in cpu_backend.supported_isas():
            for t in (1, 2):
                torch.set_num_threads(t)
                with cpu_backend.forced_isa(isa):
                    out = attention(q, k, v, mask, d**-0.5, backend="cpu")
                assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (isa, t)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="native CPU extension not built")
@pytest.mark.parametrize("m,h,kvh,d,length", [(64, 9, 3, 64, 100), (40, 8, 2, 24, 300), (33, 4, 4, 70, 90)])
def test_cpu_rows_independent_of_width_wide_steps(m, h, kvh, d, length, rng):
    """Wide steps (the prefill chunk): any slice of the rows, run as its own step, gives the bits those
    rows got in the full step, on every ISA path."""
    from bitmtp.ops.backends import cpu_backend

    q, k, v, mask = _holey_inputs(rng, m, h, kvh, d, length)
    for isa in cpu_backend.supported_isas():
        with cpu_backend.forced_isa(isa):
            together = attention(q, k, v, mask, 0.3, backend="cpu")
            for a, b in ((0, 1), (1, 4), (5, 21), (m - 3, m)):
                part = attention(q[a:b], k, v, mask[a:b], 0.3, backend="cpu")
                assert torch.equal(part, together[a:b]), (isa, a, b)


# --- edges: no query rows, fully masked rows (issue 42) ----------------------------------------------------
# Definition (bitmtp.ops.reference.attention_reference): a query row whose mask allows no KV row outputs
# zeros on every head (every row when L = 0); M = 0 gives an empty [0, H, D] output. Every backend agrees.


def _backend_variants() -> list:
    """Each backend available here; the cpu backend once per ISA path (each is its own compiled loop)."""
    out = [b for b in BACKENDS if b != "cpu"]
    if "cpu" in BACKENDS:
        from bitmtp.ops.backends import cpu_backend

        out += [f"cpu:{isa}" for isa in cpu_backend.supported_isas()]
    return out


VARIANTS = _backend_variants()


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Outputs the backends allocate start as NaN, so an element a kernel leaves unwritten shows."""
    real_like, real_empty = torch.empty_like, torch.empty

    def like(t, *a, **kw):
        out = real_like(t, *a, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    def empty(*a, **kw):
        out = real_empty(*a, **kw)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch, "empty_like", like)
    monkeypatch.setattr(torch, "empty", empty)


# the Triton interpreter (numpy) divides 0 by 0 in a fully masked row before the backend zeroes it: expected
IGNORE_INVALID = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


@IGNORE_INVALID
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv_dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("m,h,kvh,d,length", [(1, 4, 2, 16, 9), (5, 6, 2, 24, 200), (7, 9, 3, 70, 300),
                                               (3, 5, 5, 5, 1)])
def test_fully_masked_rows_are_zeros_and_leave_other_rows_alone(variant, kv_dtype, m, h, kvh, d, length, rng,
                                                                poisoned_outputs):
    """Rows that see no KV row output exact zeros (finite, not NaN) on every backend and ISA path; the
    other rows are bit for bit what they are when no row is fully masked (the same call with the blank
    rows given a visible KV row), and within 1e-5 of an independent float64 computation. KV rows that no
    row sees hold NaN/Inf: a blank row must not read them."""
    if variant == "triton":  # the interpreter runs one Python program per (row, head): 2 heads there
        h, kvh = 2, 1
    s = length + 5
    q = torch.randn(m, h, d, generator=rng)
    k = torch.randn(kvh, s, d, generator=rng).to(kv_dtype)
    v = torch.randn(kvh, s, d, generator=rng).to(kv_dtype)
    mask = torch.rand(m, length, generator=rng) < 0.4
    mask[torch.arange(m), torch.randint(0, length, (m,), generator=rng)] = True
    blank = torch.zeros(m, dtype=torch.bool)
    blank[torch.randint(0, m, (max(1, m // 2),), generator=rng)] = True  # the first or last row too, at times
    filled = mask.clone()
    mask[blank] = False
    hidden = ~mask.any(0)
    k[:, :length][:, hidden] = float("nan")
    v[:, :length][:, hidden] = float("inf")
    k[:, length:], v[:, length:] = float("nan"), float("-inf")
    # the comparison run: blank rows see one KV row that some kept row sees (so it holds real data)
    seen_by_kept = mask[~blank].any(0) if (~blank).any() else torch.zeros(length, dtype=torch.bool)
    filled[blank] = False
    if seen_by_kept.any():
        filled[blank, int(seen_by_kept.nonzero()[0])] = True
    scale = d**-0.5
    out = attention_on(variant, q, k, v, mask, scale)
    assert out.shape == (m, h, d) and out.dtype == q.dtype
    assert torch.equal(out[blank], torch.zeros_like(out[blank])), "a fully masked row is not zeros"
    keep = ~blank
    if keep.any():
        assert torch.isfinite(out[keep]).all()
        assert torch.equal(out[keep], attention_on(variant, q, k, v, filled, scale)[keep])
        g = h // kvh
        for i in keep.nonzero()[:, 0].tolist():
            idx = mask[i].nonzero()[:, 0]
            for j in range(h):
                sc = (k[j // g, idx].double() @ q[i, j].double()) * scale
                want = torch.softmax(sc, 0) @ v[j // g, idx].double()
                assert (out[i, j].double() - want).abs().max().item() <= 1e-5, (i, j)


@IGNORE_INVALID
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_row_fully_masked_and_empty_segment(variant, rng, poisoned_outputs):
    """A mask with no True (and one with no columns, L = 0, over an empty or a full KV store): all zeros."""
    m, h, kvh, d = 4, 6, 3, 20
    q = torch.randn(m, h, d, generator=rng)
    for s in (0, 11):
        k, v = torch.full((kvh, s, d), float("nan")), torch.full((kvh, s, d), float("nan"))
        for length in {0, min(s, 7)}:
            out = attention_on(variant, q, k, v, torch.zeros(m, length, dtype=torch.bool), 0.3)
            assert out.shape == (m, h, d) and torch.equal(out, torch.zeros(m, h, d)), (s, length)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("h,kvh,d,length", [(4, 2, 16, 9), (9, 3, 70, 0), (6, 6, 5, 300)])
def test_no_query_rows_give_an_empty_output(variant, h, kvh, d, length, rng, poisoned_outputs):
    """M = 0 (no query rows): an empty [0, H, D] output of q's dtype on every backend (the cpu kernel
    refused it with a raw ValueError)."""
    q = torch.randn(0, h, d, generator=rng)
    k, v = torch.randn(kvh, length + 3, d, generator=rng), torch.randn(kvh, length + 3, d, generator=rng)
    out = attention_on(variant, q, k, v, torch.zeros(0, length, dtype=torch.bool), d**-0.5)
    assert out.shape == (0, h, d) and out.dtype == q.dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_kv_heads_and_a_non_tensor_mask_are_refused(backend, rng):
    """K/V without a KV head cannot serve any query head: a ShapeError naming k (it was a
    ZeroDivisionError); a mask that is not a tensor: a DTypeError naming mask (it was an AttributeError)."""
    from bitmtp.errors import DTypeError

    q = torch.randn(3, 4, 8, generator=rng)
    empty = torch.randn(0, 5, 8, generator=rng)
    with pytest.raises(ShapeError, match=r"k: has no KV heads"):
        attention(q, empty, empty, torch.ones(3, 5, dtype=torch.bool), 0.3, backend=backend)
    k = torch.randn(2, 5, 8, generator=rng)
    with pytest.raises(DTypeError, match="mask"):
        attention(q, k, k, [[True] * 5] * 3, 0.3, backend=backend)


@pytest.mark.skipif("cpu" not in BACKENDS, reason="native CPU extension not built")
@pytest.mark.parametrize("m", [1, 3, 8, 15])
def test_rows_over_their_own_ranges_of_a_long_store(m, rng):
    """A batch's rows: each sees only its own range of a long store (ranges 256 rows apart, most chunks and tiles
    seen by no row, whose K/V hold NaN): each row equals the float64 reference over its range (1e-5) and has the
    bits it has alone over the same mask row (the CPU kernel skips what lies outside the rows' bounds)."""
    h, kvh, d = 6, 2, 32
    length = 256 * m + 100
    q = torch.randn(m, h, d, generator=rng)
    k = torch.full((kvh, length, d), float("nan"))
    v = torch.full((kvh, length, d), float("nan"))
    mask = torch.zeros(m, length, dtype=torch.bool)
    # (first row, rows) inside each 256-row range: ranges that end on a chunk's first row (128), start on a
    # chunk's last, span a tile boundary (16) by one row, a whole chunk plus one, one row, and random ones
    edges = [(127, 2), (0, 129), (15, 2), (16, 1), (128, 1), (5, 200)]
    for i in range(m):
        first, rows = edges[i] if i < len(edges) else (int(torch.randint(0, 60, (1,), generator=rng)),
                                                        int(torch.randint(1, 190, (1,), generator=rng)))
        lo = 256 * i + first
        hi = lo + rows - 1
        mask[i, lo : hi + 1] = True
        k[:, lo : hi + 1] = torch.randn(kvh, hi + 1 - lo, d, generator=rng)
        v[:, lo : hi + 1] = torch.randn(kvh, hi + 1 - lo, d, generator=rng)
    out = attention(q, k, v, mask, d**-0.5, backend="cpu")
    g = h // kvh
    for i in range(m):
        idx = mask[i].nonzero()[:, 0]
        for j in range(h):
            s = (k[j // g, idx].double() @ q[i, j].double()) * d**-0.5
            ref = torch.softmax(s, 0) @ v[j // g, idx].double()
            assert (out[i, j].double() - ref).abs().max().item() <= 1e-5
        alone = attention(q[i : i + 1], k, v, mask[i : i + 1], d**-0.5, backend="cpu")
        assert torch.equal(alone[0], out[i])
