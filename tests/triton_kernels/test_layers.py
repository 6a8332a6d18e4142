"""The GPU step's fused Triton kernels (triton_kernels/layers.py) through the interpreter.

Rules: integer parts (int8 activations, their scales, the int32 accumulators behind every projection) equal
the references bit for bit; float epilogues are compared to a float64 reference (tolerance stated per test);
a row's outputs have the same bits at every width and every split-K; outputs are poisoned first, rows ≥ M and
KV rows not written keep their poison, and the split-K scratch is left zero.
"""

from __future__ import annotations

import os

import pytest
import torch

from bitmtp.formats import pack_t2
from bitmtp.formats.quantize import quantize_activations
from bitmtp.model.layers import apply_rope, relu2, rms_norm, rope_tables, silu
from bitmtp.ops import reference as ref_ops
from bitmtp.ops.choose import argmax_prob
from tests.support.random_inputs import random_ternary

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton interpreter")
layers = pytest.importorskip("bitmtp.triton_kernels.layers")

ROWS = layers.ROWS
WIDTHS = [1, 3, 8, 15, 16]
POISON = float("nan")


def launch(name, kernel, grid, *args, **kwargs):
    kernel[grid](*args, **kwargs)


def _rows(m: int, k: int, g: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """ROWS × k float32 with rows ≥ m zero (what the step's buffers hold there), random rows of varied size."""
    x = torch.zeros(ROWS, k)
    x[:m] = torch.randn(m, k, generator=g) * scale * torch.rand(m, 1, generator=g).add(0.1)
    return x


def _quantized(m: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.zeros(ROWS, k, dtype=torch.int8)
    s = torch.full((ROWS,), 127.0 / 1e-5)
    q[:m], s[:m] = quantize_activations(_rows(m, k, g)[:m])
    return q, s


@pytest.mark.parametrize("m", WIDTHS)
@pytest.mark.parametrize("k", [31, 200])
@pytest.mark.parametrize("norm", [True, False])
def test_norm_quant_bits(m, k, norm, rng):
    x = _rows(m, k, rng)
    w = torch.rand(k, generator=rng) + 0.5 if norm else None
    q = torch.full((ROWS, k), 99, dtype=torch.int8)
    s = torch.full((ROWS,), POISON)
    f = torch.full((ROWS, k), POISON)
    layers.norm_quant(launch, x, w, 1e-5, m=m, q=q, s=s, f=f)
    h = rms_norm(x[:m], w, 1e-5) if norm else x[:m]
    rq, rs = quantize_activations(h)
    assert torch.equal(f[:m], h) and torch.equal(q[:m], rq) and torch.equal(s[:m], rs)
    # rows >= m are not touched (one program per live row; every reader masks the padding rows)
    assert (q[m:] == 99).all() and torch.isnan(f[m:]).all() and torch.isnan(s[m:]).all()


def _project(epilogue, q, s, packed, scales, k, group, m, splits, **kw):
    n = packed.shape[0]
    acc = torch.zeros(ROWS, n, scales.shape[1], dtype=torch.int32)
    units = layers.w2a8_units(n, epilogue, inter=kw.get("inter", 0), heads=kw.get("heads", 0))
    counter = torch.zeros(units, dtype=torch.int32)
    out = kw.pop("out")
    layers.w2a8_fused(launch, q, s, packed, scales, k, group, acc, counter, m=m, epilogue=epilogue, out=out,
                      splits=splits, **{key: v for key, v in kw.items() if key != "heads"})
    assert not acc.any() and not counter.any()  # left zero for the next launch
    return out


def _linear64(q, s, packed, scales, k, group, m):
    return ref_ops.w2a8_linear_q_reference(q[:m], s[:m], packed, scales, k, group, None, torch.float64)


@pytest.mark.parametrize("m", WIDTHS)
@pytest.mark.parametrize("n,k,group", [(150, 200, 200), (70, 192, 64), (33, 136, 16)])
def test_store_and_residual(m, n, k, group, rng):
    packed = pack_t2(random_ternary(n, k, rng))
    scales = torch.rand(n if group < k else 1, -(-k // group), generator=rng) + 0.1
    q, s = _quantized(m, k, rng)
    ref = _linear64(q, s, packed, scales, k, group, m)
    outs = []
    for splits in (1, 3):
        out = _project("store", q, s, packed, scales, k, group, m, splits, out=torch.full((ROWS, n), POISON))
        # float32 epilogue against float64: 1e-5 relative to the summed term magnitudes
        bound = 1e-5 * ref.abs().max().item() + 1e-6
        assert (out[:m].double() - ref).abs().max().item() <= bound
        assert torch.isnan(out[m:]).all()
        outs.append(out[:m])
    assert torch.equal(outs[0], outs[1])  # split-K partials are exact integers: the same bits
    res = torch.randn(ROWS, n, generator=rng)
    out = _project("residual", q, s, packed, scales, k, group, m, 2, out=res.clone())
    assert torch.equal(out[:m], res[:m] + outs[0]) and torch.equal(out[m:], res[m:])


def test_rows_have_the_same_bits_at_every_width(rng):
    n, k = 90, 200
    packed = pack_t2(random_ternary(n, k, rng))
    scales = torch.rand(n, 1, generator=rng) + 0.1
    q, s = _quantized(16, k, rng)
    wide = _project("store", q, s, packed, scales, k, k, 16, 2, out=torch.full((ROWS, n), POISON))
    for m in (1, 3, 8):
        qm, sm = q.clone(), s.clone()
        qm[m:], sm[m:] = 0, 127.0 / 1e-5
        narrow = _project("store", qm, sm, packed, scales, k, k, m, 2, out=torch.full((ROWS, n), POISON))
        assert torch.equal(narrow[:m], wide[:m])


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("activation", ["relu2", "silu"])
def test_glu(m, activation, rng):
    inter, k, group = 70, 192, 64
    packed = pack_t2(random_ternary(2 * inter, k, rng))
    scales = torch.rand(2 * inter, k // group, generator=rng) + 0.1
    q, s = _quantized(m, k, rng)
    out = _project("glu", q, s, packed, scales, k, group, m, 3, out=torch.full((ROWS, inter), POISON), inter=inter,
                   activation=activation)
    y = _linear64(q, s, packed, scales, k, group, m).float()
    act = {"relu2": relu2, "silu": silu}[activation]
    want = act(y[:, :inter]) * y[:, inter:]
    assert torch.allclose(out[:m], want, rtol=2e-5, atol=1e-4 * want.abs().max().item())
    assert torch.isnan(out[m:]).all()


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_qkv_rope_and_kv_write(m, qk_norm, rng):
    """RoPE on q and k, the q rows stored, k and v written at their slots; with ``qk_norm`` (Qwen3) each q and k
    head RMS-normed first (``rms_norm``'s rule: float64 mean of squares)."""
    hq, hkv, hd, k, rows = 4, 2, 16, 192, 48
    n = (hq + 2 * hkv) * hd
    packed = pack_t2(random_ternary(n, k, rng))
    scales = torch.rand(n, 1, generator=rng) + 0.1
    q, s = _quantized(m, k, rng)
    cos, sin = rope_tables(hd, 10000.0, None, 64)
    positions = torch.zeros(ROWS, dtype=torch.long)
    positions[:m] = torch.randperm(40, generator=rng)[:m]
    slots = positions.clone()
    slots[:m] = torch.randperm(rows, generator=rng)[:m]  # a tree step's scratch slots differ from positions
    kc = torch.full((hkv, rows, hd), POISON)
    vc = torch.full((hkv, rows, hd), POISON)
    qn = torch.rand(hd, generator=rng) + 0.5
    kn = torch.rand(hd, generator=rng) + 0.5
    out = _project("qkv", q, s, packed, scales, k, k, m, 2, out=torch.full((ROWS, hq * hd), POISON), heads=hq + 2 * hkv,
                   qkv=(positions, slots, cos, sin, kc, vc, hq, hkv, hd), qk_norm=(qn, kn, 1e-6) if qk_norm else None)
    y = _linear64(q, s, packed, scales, k, k, m).float()
    qr, kr, vr = y.split((hq * hd, hkv * hd, hkv * hd), dim=-1)
    if qk_norm:
        qr = rms_norm(qr.reshape(m, hq, hd), qn, 1e-6).reshape(m, -1)
        kr = rms_norm(kr.reshape(m, hkv, hd), kn, 1e-6).reshape(m, -1)
        y = torch.cat([qr, kr, vr], dim=-1)
    c, sn = cos[positions[:m]], sin[positions[:m]]
    tol = dict(rtol=1e-5, atol=1e-5 * y.abs().max().item())
    assert torch.allclose(out[:m].reshape(m, hq, hd), apply_rope(qr.reshape(m, hq, hd), c, sn), **tol)
    assert torch.allclose(kc[:, slots[:m]].transpose(0, 1), apply_rope(kr.reshape(m, hkv, hd), c, sn), **tol)
    assert torch.allclose(vc[:, slots[:m]].transpose(0, 1), vr.reshape(m, hkv, hd), **tol)
    assert torch.isnan(out[m:]).all() and int(torch.isnan(kc).sum()) == hkv * (rows - m) * hd


@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("sub_norm", [False, True])
def test_split_kv_attention_then_quant(m, sub_norm, rng):
    h, kvh, d, rows, length = 4, 2, 16, 600, 520  # 520 KV rows: three splits of 256, the last partial
    q = torch.zeros(ROWS, h, d)
    q[:m] = torch.randn(m, h, d, generator=rng)
    kc = torch.randn(kvh, rows, d, generator=rng)
    vc = torch.randn(kvh, rows, d, generator=rng)
    positions = torch.randint(0, length, (m,), generator=rng)
    positions[-1] = length - 1
    mask = torch.arange(length)[None, :] <= positions[:, None]
    if m > 1:
        mask[0] = False  # a row that sees no KV row: zeros
    unseen = ~mask.any(0)
    kc[:, :length][:, unseen] = float("nan")  # rows nobody sees may hold anything
    vc[:, :length][:, unseen] = float("inf")
    w = torch.rand(h * d, generator=rng) + 0.5 if sub_norm else None
    parts = layers.attention_scratch(kvh, h, d, rows, "cpu")
    xq = torch.full((ROWS, h * d), 99, dtype=torch.int8)
    xs = torch.full((ROWS,), POISON)
    f = torch.full((ROWS, h * d), POISON)
    layers.attention_split(launch, q, kc, vc, mask, d**-0.5, parts, m=m, nsplit_max=-(-rows // layers.ATTN_SPLIT),
                           sub_norm=w, eps=1e-5, q_out=xq, s_out=xs, f_out=f)
    ref = ref_ops.attention_reference(q[:m].double(), kc[:, :length].double().nan_to_num(0, 0, 0),
                                      vc[:, :length].double().nan_to_num(0, 0, 0), mask, d**-0.5).reshape(m, h * d)
    if sub_norm:
        ref = rms_norm(ref.float(), w, 1e-5).double()
    assert (f[:m].double() - ref).abs().max().item() <= 1e-5 * max(ref.abs().max().item(), 1.0)
    rq, rs = quantize_activations(f[:m])
    assert torch.equal(xq[:m], rq) and torch.equal(xs[:m], rs)
    # the same row in a width-1 step: the same bits
    q1 = torch.zeros_like(q)
    q1[0] = q[m - 1]
    f1 = torch.full((ROWS, h * d), POISON)
    layers.attention_split(launch, q1, kc, vc, mask[m - 1 :], d**-0.5, parts, m=1,
                           nsplit_max=-(-rows // layers.ATTN_SPLIT), sub_norm=w, eps=1e-5, q_out=xq, s_out=xs,
                           f_out=f1)
    assert torch.equal(f1[0], f[m - 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 7, 16])
def test_head_argmax_probability_and_runner_up(dtype, m, rng):
    vocab, k = 1000, 96  # 1000: the last vocabulary block is partial
    weight = torch.randn(vocab, k, generator=rng).to(dtype)
    weight[7] = weight[900]  # a tie across blocks: the first index wins
    hidden = torch.zeros(ROWS, k)
    hidden[:m] = torch.randn(m, k, generator=rng)
    if m > 1:
        hidden[1] = weight[900].float() * 4  # row 1's argmax is the tied pair
    tok = torch.full((ROWS,), -1, dtype=torch.long)
    prob = torch.full((ROWS,), POISON)
    second = torch.full((ROWS,), -1, dtype=torch.long)
    layers.head_argmax(launch, hidden, weight, layers.head_scratch(vocab, "cpu"), tok, prob, second, m=m)
    logits = hidden[:m].to(dtype).double() @ weight.double().T
    want_tok, want_prob = argmax_prob(logits.float())
    assert torch.equal(tok[:m], want_tok)
    # float32 block sums of exp, combined in block order, against softmax over float32 logits: 1e-5
    assert (prob[:m].double() - want_prob.double()).abs().max().item() <= 1e-5
    top2 = logits.topk(2, dim=1)
    runner = torch.where(top2.values[:, 1] == top2.values[:, 0],
                         torch.where(top2.indices[:, 0] == want_tok, top2.indices[:, 1], top2.indices[:, 0]),
                         top2.indices[:, 1])
    assert torch.equal(second[:m], runner)
    if m > 1:
        assert tok[1] == 7 and second[1] == 900
    assert (tok[m:] == -1).all() and torch.isnan(prob[m:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", WIDTHS)
def test_head_logits(dtype, m, rng):
    """The head's float32 logits (what sampled steps choose from) against a float64 reference (the row rounded
    to the weight's dtype first): 1e-5 relative; rows ≥ m keep their poison; the argmax equals head_argmax's."""
    vocab, k = 1000, 96
    weight = torch.randn(vocab, k, generator=rng).to(dtype)
    hidden = torch.zeros(ROWS, k)
    hidden[:m] = torch.randn(m, k, generator=rng)
    out = torch.full((ROWS, vocab), POISON)
    layers.head_logits(launch, hidden, weight, out, m=m)
    want = hidden[:m].to(dtype).double() @ weight.double().T
    assert (out[:m].double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()
    assert torch.isnan(out[m:]).all()
    tok = torch.full((ROWS,), -1, dtype=torch.long)
    layers.head_argmax(launch, hidden, weight, layers.head_scratch(vocab, "cpu"), tok, torch.zeros(ROWS),
                       torch.zeros(ROWS, dtype=torch.long), m=m)
    assert torch.equal(tok[:m], out[:m].argmax(-1))


def test_embed_rows(rng):
    table = torch.randn(50, 40, generator=rng).to(torch.bfloat16)
    tokens = torch.zeros(ROWS, dtype=torch.long)
    tokens[:5] = torch.tensor([1, 49, 0, 7, 7])
    out = torch.full((ROWS, 40), POISON)
    layers.embed_rows(launch, tokens, table, out, m=5)
    assert torch.equal(out[:5], table[tokens[:5]].float()) and torch.isnan(out[5:]).all()


@pytest.mark.parametrize("m", [1, 3, 8, 15, 16, 37])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_quantize_rows_and_the_triton_act_quant(m, dtype, rng):
    from bitmtp.ops import act_quant

    x = (torch.randn(m, 577, generator=rng) * torch.rand(m, 1, generator=rng).mul(20)).to(dtype)
    q, s = layers.quantize_rows(x)
    rq, rs = quantize_activations(x)
    assert torch.equal(q, rq) and torch.equal(s, rs)
    q3, s3 = act_quant(x.reshape(1, m, 577), backend="triton")
    assert torch.equal(q3.reshape(m, 577), rq) and torch.equal(s3.reshape(m), rs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("epilogue", ["store", "residual", "glu"])
def test_dense_projection_split_order_and_bias(dtype, m, epilogue, rng):
    """Dense weights (SmolLM2's kind): float32 accumulation, split-K partials summed in split order (the same
    bits for any number of splits), an optional bias; against a float64 reference."""
    inter, k = 70, 200
    n = 2 * inter if epilogue == "glu" else 90
    weight = torch.randn(n, k, generator=rng).to(dtype)
    bias = torch.randn(n, generator=rng)
    x = _rows(m, k, rng)
    parts = torch.full((4 * ROWS * n,), POISON)  # never needs zeroing
    counter = torch.zeros(8, dtype=torch.int32)
    width = inter if epilogue == "glu" else n
    res = torch.randn(ROWS, width, generator=rng)
    outs = []
    for splits in (1, 2, 4):
        out = res.clone() if epilogue == "residual" else torch.full((ROWS, width), POISON)
        layers.dense_fused(launch, x, weight, bias, parts, counter, m=m, epilogue=epilogue, out=out, splits=splits,
                           inter=inter, activation="silu")
        assert not counter.any()
        outs.append(out)
    xr = x[:m].to(dtype).double() if dtype != torch.float32 else x[:m].double()
    y = xr @ weight.double().T + bias.double()
    if epilogue == "glu":
        want = silu(y[:, :inter].float()).double() * y[:, inter:]
    else:
        want = y + (res[:m].double() if epilogue == "residual" else 0)
    for out in outs:
        assert (out[:m].double() - want).abs().max().item() <= 2e-5 * max(want.abs().max().item(), 1.0)
        if epilogue == "residual":
            assert torch.equal(out[m:], res[m:])
        else:
            assert torch.isnan(out[m:]).all()


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_backend_split_k_path_equals_the_decode_kernels(m, dtype, monkeypatch, rng):
    """``w2a8.SPLITK_UP_TO``: the triton backend's widths run the split-K tensor-core kernel — the decode kernels'
    bits (same integer accumulators, same float epilogue), bf16 rounded to nearest even."""
    from bitmtp.ops import w2a8_linear
    from bitmtp.triton_kernels import w2a8

    n, k = 150, 577
    packed = pack_t2(random_ternary(n, k, rng))
    scales = torch.rand(n, 1, generator=rng) + 0.1
    x = _rows(m, k, rng)[:m]
    want = w2a8_linear(x, packed, scales, backend="triton", out_dtype=dtype)
    monkeypatch.setattr(w2a8, "SPLITK_UP_TO", 16)
    got = w2a8_linear(x, packed, scales, backend="triton", out_dtype=dtype)
    assert got.dtype == dtype and torch.equal(got, want)
