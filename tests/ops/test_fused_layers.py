"""Fused CPU decoder layers (bitmtp/ops/fused_layers.py, csrc/cpu/layers.cpp).

Rules stated per test:
* a fused step equals the per-op step bit for bit, hidden states and the KV rows it writes
  (``torch.equal``): the projections, attention and activation quantization are the same kernels,
  and RMSNorm / SiLU evaluate in float64 and round to float32 on both paths, so neither depends on a
  summation order or an exp implementation — in ternary models one ulp would flip an int8;
* a row's result is bit-identical whatever the step's width: a width-M step equals M one-row
  steps, hidden states and KV rows compared with ``torch.equal`` (the lossless-speculative invariant);
* greedy generation through the fused path equals the per-op path token for token;
* the gated LoRA of a mask-block draft step changes only the mask rows, as the per-op path does;
* the fused path is off (and says why) for BITMTP_FUSED=0, another backend, an overridden cpu op
  or a non-float32 model; bad input raises BitMTPError;
* every comparison asserts which path each side actually ran (``Decoder.last_path`` / ``path_counts``):
  a fused step that silently fell back to the per-op layers would compare per-op with per-op. A
  fallback records its reason in ``fused_reason`` and logs it once at debug level.
Outputs are poisoned first (KV rows to be written hold NaN) so an unwritten element shows.
"""

from __future__ import annotations

import logging

import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.model.adapters import MaskBlock
from bitmtp.model.decoder import FUSED, PER_OP, Decoder, StepInputs
from bitmtp.model.layers import silu
from bitmtp.ops import registry
from bitmtp.ops.fused_layers import FusedUnsupported
from bitmtp.runtime.kv import KVStore
from tests.support.adapters import random_adapter
from tests.support.cpu_native import ISAS, cpu_backend  # the ISA paths this CPU can run
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")

pytestmark = pytest.mark.skipif(not ISAS, reason="native CPU extension not built")

FAMILIES = ["llama", "qwen3", "bitnet"]
WIDTHS = [1, 3, 8, 15, 16]
KV_DTYPES = [torch.float32, torch.float16]
# hidden 72 (not a power of two), intermediate 100, head_dim 18, 4 heads over 2 KV heads
SHAPE = dict(hidden_size=72, intermediate_size=100, num_attention_heads=4, num_key_value_heads=2, head_dim=18,
             num_hidden_layers=3, initializer_range=0.2)


@pytest.fixture(scope="module", params=[(f, q) for f in FAMILIES for q in (None, "ternary")],
                ids=lambda p: f"{p[0]}-{p[1] or 'dense'}")
def model(request):
    family, quantize = request.param
    shape = dict(SHAPE)
    if family == "bitnet":
        quantize = None  # BitNet checkpoints are ternary already
    return bitmtp.load(tiny_model(family, seed=5, **shape), capacity=300, quantize=quantize, adapter=None)


def _kv(model, dtype=torch.float32) -> KVStore:
    a = model.args
    return KVStore(a.num_layers, a.num_kv_heads, a.head_dim, capacity=300, m_max=16, dtype=dtype)


def _step(dec, kv, tokens, start, *, mask_rows=0, block=None, segment=None, path=None):
    """One step; with ``path`` ("fused" / "per-op"), assert that the step really ran that path."""
    m = len(tokens)
    pos = torch.arange(start, start + m)
    seg = segment or kv.segment_for(start + m)
    reach = pos.clone()
    if mask_rows:
        reach[m - mask_rows :] = pos[-1]  # mask rows see the whole block
    mask = torch.arange(seg)[None, :] <= reach[:, None]
    before = dict(dec.path_counts)
    out = dec.hidden_states(StepInputs(torch.tensor(tokens), pos, mask, mask_rows, block), kv)
    if path is not None:
        assert dec.last_path == path, f"expected the {path} path, ran {dec.last_path}: {dec.fused_reason}"
        assert dec.path_counts[path] == before[path] + 1
        assert (dec.fused_reason == "") == (path == FUSED), dec.fused_reason
    return out


def _counts(dec) -> dict[str, int]:
    """The CPU paths' step counts (the fused GPU step's count is tests/runtime/test_gpu_step.py's business)."""
    return {k: dec.path_counts[k] for k in (FUSED, PER_OP)}


def _delta(dec, before: dict[str, int]) -> dict[str, int]:
    return {k: dec.path_counts[k] - before[k] for k in before}


def _prefilled(model, fused: bool, monkeypatch, n=21, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist()
    kv = _kv(model, dtype)
    with monkeypatch.context() as mp:
        mp.setenv("BITMTP_FUSED", "1" if fused else "0")
        _step(model.decoder, kv, prompt, 0)
    return kv, prompt


def _clone(kv: KVStore) -> KVStore:
    out = KVStore(len(kv.k), kv.k[0].shape[0], kv.k[0].shape[2], kv.capacity, kv.m_max, dtype=kv.k[0].dtype)
    for a, b in zip(out.k + out.v, kv.k + kv.v, strict=True):
        a.copy_(b)
    return out


def _poison(kv: KVStore, rows: range) -> None:
    for t in kv.k + kv.v:
        t[:, rows.start : rows.stop] = float("nan")


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(a, b), f"max |difference| {(a - b).abs().max().item():.3g}"


def test_fused_plan_is_used(model, monkeypatch):
    dec = model.decoder
    assert dec.fused_plan() is not None, dec.fused_reason
    calls = []
    plan = dec.fused_plan()
    real = plan.run
    monkeypatch.setattr(plan, "run", lambda *a, **k: calls.append(1) or real(*a, **k))
    bitmtp.generate(model, input_ids=[5, 6, 7], max_new_tokens=3, policy="ar", eos_token_id=[])
    assert calls  # prefill and each AR step go through the native call


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("width", WIDTHS)
def test_fused_step_matches_per_op_step(model, monkeypatch, width, isa, kv_dtype):
    """With float16 K/V too: the native layers round K/V rows to float16 exactly as torch's ``.to(float16)``
    in ``KVStore.write`` does (the stored halves are compared bit for bit)."""
    kv_f, prompt = _prefilled(model, False, monkeypatch, dtype=kv_dtype)
    kv_p = _clone(kv_f)
    n = len(prompt)
    tokens = torch.randint(3, model.args.vocab_size, (width,), generator=torch.Generator().manual_seed(width)).tolist()
    _poison(kv_f, range(n, n + width))
    _poison(kv_p, range(n, n + width))
    with cpu_backend.forced_isa(isa):
        monkeypatch.setenv("BITMTP_FUSED", "1")
        fused = _step(model.decoder, kv_f, tokens, n, path=FUSED)
        monkeypatch.setenv("BITMTP_FUSED", "0")
        per_op = _step(model.decoder, kv_p, tokens, n, path=PER_OP)
        assert "BITMTP_FUSED=0" in model.decoder.fused_reason
    assert torch.isfinite(fused).all()
    _same(fused, per_op)
    for a, b in zip(kv_f.k + kv_f.v, kv_p.k + kv_p.v, strict=True):
        assert torch.isfinite(a[:, : n + width]).all()  # every written row was written
        _same(a[:, : n + width], b[:, : n + width])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("width", [3, 8, 15, 16])
def test_fused_rows_do_not_depend_on_width(model, monkeypatch, width, kv_dtype):
    monkeypatch.setenv("BITMTP_FUSED", "1")
    kv_wide, prompt = _prefilled(model, True, monkeypatch, seed=1, dtype=kv_dtype)
    kv_one = _clone(kv_wide)
    n = len(prompt)
    tokens = torch.randint(3, model.args.vocab_size, (width,), generator=torch.Generator().manual_seed(7)).tolist()
    _poison(kv_wide, range(n, n + width))
    _poison(kv_one, range(n, n + width))
    # a larger segment for the wide step: the read length must not matter either
    wide = _step(model.decoder, kv_wide, tokens, n, segment=kv_wide.rows, path=FUSED)
    rows = torch.cat([_step(model.decoder, kv_one, [t], n + i, path=FUSED) for i, t in enumerate(tokens)])
    assert torch.equal(wide, rows)
    for a, b in zip(kv_wide.k + kv_wide.v, kv_one.k + kv_one.v, strict=True):
        assert torch.equal(a[:, : n + width], b[:, : n + width])


def test_fused_greedy_equals_per_op_greedy(model, monkeypatch):
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        ids = torch.randint(3, model.args.vocab_size, (9,), generator=g).tolist()
        dec = model.decoder
        monkeypatch.setenv("BITMTP_FUSED", "1")
        before = _counts(dec)
        fused = bitmtp.generate(model, input_ids=ids, max_new_tokens=24, policy="ar", eos_token_id=[]).token_ids
        assert _delta(dec, before) == {FUSED: 24, PER_OP: 0}  # the prefill and 23 AR steps, all fused
        monkeypatch.setenv("BITMTP_FUSED", "0")
        before = _counts(dec)
        per_op = bitmtp.generate(model, input_ids=ids, max_new_tokens=24, policy="ar", eos_token_id=[]).token_ids
        assert _delta(dec, before) == {FUSED: 0, PER_OP: 24}
        assert fused == per_op


@pytest.mark.parametrize("mask_rows", [1, 7, 15])
def test_fused_gated_lora_matches_per_op(model, monkeypatch, mask_rows):
    cfg, tensors = random_adapter(model.args, "mask-block", block_size=16)
    block = MaskBlock(cfg, tensors)
    kv_f, prompt = _prefilled(model, False, monkeypatch, seed=2)
    kv_p = _clone(kv_f)
    n = len(prompt)
    tokens = [11] + [0] * mask_rows  # one pending row, then mask rows (their ids are ignored)
    monkeypatch.setenv("BITMTP_FUSED", "1")
    fused = _step(model.decoder, kv_f, tokens, n, mask_rows=mask_rows, block=block, path=FUSED)
    monkeypatch.setenv("BITMTP_FUSED", "0")
    per_op = _step(model.decoder, kv_p, tokens, n, mask_rows=mask_rows, block=block, path=PER_OP)
    plain = _step(model.decoder, _clone(kv_p), tokens, n, mask_rows=mask_rows, block=MaskBlock(
        cfg, {k: (v * 0 if "lora_B" in k else v) for k, v in tensors.items()}), path=PER_OP)
    _same(fused, per_op)
    assert not torch.allclose(per_op[1:], plain[1:], atol=1e-3)  # the deltas matter on mask rows …
    monkeypatch.setenv("BITMTP_FUSED", "1")
    pending = _step(model.decoder, _clone(kv_p), tokens[:1], n, path=FUSED)
    assert torch.equal(fused[:1], pending)  # … and the pending row is the base model's, bit for bit


def test_fallback_is_recorded_and_logged_once(model, monkeypatch, caplog):
    """A step the plan cannot take (here: a mask block whose LoRA the native table refuses) runs the
    per-op layers, equal to them, with the reason in ``fused_reason`` and one debug line per reason."""
    cfg, tensors = random_adapter(model.args, "mask-block", block_size=16)
    block = MaskBlock(cfg, tensors)
    kv_f, prompt = _prefilled(model, True, monkeypatch, seed=4)
    kv_p = _clone(kv_f)
    n = len(prompt)
    tokens = [13, 0, 0, 0]
    dec = model.decoder
    reason = "lora 0.qkv: refused by this test"

    def refuse(plan, blk):
        raise FusedUnsupported(reason)

    monkeypatch.setenv("BITMTP_FUSED", "0")
    want = _step(dec, kv_p, tokens, n, mask_rows=3, block=block, path=PER_OP)
    monkeypatch.setenv("BITMTP_FUSED", "1")
    monkeypatch.setattr(Decoder, "_fused_lora", staticmethod(refuse))
    dec._logged_reasons.discard(reason)
    with caplog.at_level(logging.DEBUG, logger="bitmtp"):
        got = _step(dec, _clone(kv_f), tokens, n, mask_rows=3, block=block, path=PER_OP)
        assert dec.fused_reason == reason
        _step(dec, _clone(kv_f), tokens, n, mask_rows=3, block=block, path=PER_OP)
        _step(dec, _clone(kv_f), tokens[:1], n, path=FUSED)  # a step without mask rows still fuses
    _same(got, want)
    logged = [r for r in caplog.records if reason in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.DEBUG


def test_switches_turn_the_fused_path_off(model, monkeypatch):
    dec = model.decoder
    monkeypatch.setenv("BITMTP_FUSED", "0")
    assert dec.fused_plan() is None and "BITMTP_FUSED=0" in dec.fused_reason
    monkeypatch.delenv("BITMTP_FUSED")
    monkeypatch.setenv("BITMTP_BACKEND", "torch")
    assert dec.fused_plan() is None and "'torch'" in dec.fused_reason
    monkeypatch.delenv("BITMTP_BACKEND")
    with registry.override("cpu", "dense_linear", lambda *a, **k: None):
        assert dec.fused_plan() is None and "overridden" in dec.fused_reason
    assert dec.fused_plan() is not None


def test_non_float32_model_takes_the_per_op_path():
    m = bitmtp.load(tiny_model("llama", seed=1, **SHAPE), capacity=64, dtype=torch.bfloat16, adapter=None)
    assert m.decoder.fused_plan() is None
    assert "float32" in m.decoder.fused_reason
    out = bitmtp.generate(m, input_ids=[4, 5, 6], max_new_tokens=4, policy="ar", eos_token_id=[])
    assert len(out.token_ids) == 4


def test_bad_input(model):
    dec = model.decoder
    plan = dec.fused_plan()
    a = model.args
    kv = _kv(model)
    x = torch.randn(2, a.hidden_size)
    cos, sin = dec.rope_cos[:2], dec.rope_sin[:2]
    mask = torch.ones(2, 256, dtype=torch.bool)
    with pytest.raises(BitMTPError, match="position"):
        plan.run(x, torch.tensor([0, kv.rows]), cos, sin, mask, kv.k, kv.v, [0], attn_scale=0.25)
    with pytest.raises(BitMTPError, match="mask"):
        plan.run(x, torch.tensor([0, 1]), cos, sin, torch.ones(3, 256, dtype=torch.bool), kv.k, kv.v, [0],
                 attn_scale=0.25)
    with pytest.raises(BitMTPError, match="layers"):
        plan.run(x, torch.tensor([0, 1]), cos, sin, mask, kv.k, kv.v, [a.num_layers], attn_scale=0.25)
    with pytest.raises(BitMTPError, match="layers' buffers"):
        plan.run(x, torch.tensor([0, 1]), cos, sin, mask, kv.k[:1], kv.v[:1], [0], attn_scale=0.25)
    with pytest.raises(BitMTPError, match="hidden|shape"):
        plan.run(torch.randn(2, a.hidden_size + 1), torch.tensor([0, 1]), cos, sin, mask, kv.k, kv.v, [0],
                 attn_scale=0.25)


@pytest.mark.parametrize("n", [1, 3, 4, 7, 1536, 4099])
def test_silu_paths_equal_the_scalar_path_and_the_reference(n):
    """The fused layers' SiLU·up (csrc/cpu/layers.cpp, act_avx2.cpp): every ISA path bitwise equal to the
    scalar one (same IEEE operations per lane; tails of 1-3), and equal to float64 SiLU rounded to float32
    times up (bitmtp.model.layers.silu) except at a float32 rounding tie: at most 1 element in 10^4 and
    1 ulp. Gates span the clamp (|g| up to 800), tiny and zero values; outputs poisoned first."""
    ext = cpu_backend.CpuBackend()._ext
    g = torch.Generator().manual_seed(n)
    scale = torch.tensor([0.01, 1.0, 8.0, 40.0, 800.0])[torch.randint(0, 5, (n,), generator=g)]
    gate = torch.randn(n, generator=g) * scale
    gate[:: max(1, n // 5)] = 0.0
    if n > 8:
        gate[1], gate[2], gate[3] = -745.0, 710.0, -0.0
    up = torch.randn(n, generator=g) + 0.5
    outs = {}
    for isa in ISAS:
        out = torch.full((n,), float("nan"))
        ext.silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), n, cpu_backend.ISA_NAMES[isa])
        outs[isa] = out
    for isa, out in outs.items():
        assert torch.equal(out.view(torch.int32), outs["scalar"].view(torch.int32)), isa
    ref = silu(gate) * up
    off = (outs["scalar"] != ref).sum().item()
    assert off <= max(1, n // 10_000)
    assert torch.allclose(outs["scalar"], ref, rtol=2.5e-7, atol=0)


def test_checks_are_kept_only_with_the_tensors_they_checked(model):
    """``FusedPlan.run`` keeps a step's checked inputs while the next step brings the same tensors (a runner's
    buffers): a new tensor, other layers or another width is checked again, and what the native call checks itself
    (positions inside the store) is checked every call, whatever is kept."""
    dec = model.decoder
    plan = dec.fused_plan()
    a = model.args
    kv = _kv(model)
    pos = torch.tensor([0, 1])
    cos, sin = dec.rope_cos[:2].contiguous(), dec.rope_sin[:2].contiguous()
    mask = torch.tril(torch.ones(2, 256, dtype=torch.bool))
    x = torch.randn(2, a.hidden_size)
    first = plan.run(x, pos, cos, sin, mask, kv.k, kv.v, [0, 1], attn_scale=0.25)
    again = plan.run(x, pos, cos, sin, mask, kv.k, kv.v, [0, 1], attn_scale=0.25)  # the kept checks
    assert torch.equal(first, again)
    with pytest.raises(BitMTPError, match="layers"):
        plan.run(x, pos, cos, sin, mask, kv.k, kv.v, [0, a.num_layers], attn_scale=0.25)
    with pytest.raises(BitMTPError, match="mask"):
        plan.run(x, pos, cos, sin, mask.float(), kv.k, kv.v, [0, 1], attn_scale=0.25)
    with pytest.raises(BitMTPError, match=r"mask: expected \[3,"):  # another width, the same other tensors
        plan.run(torch.randn(3, a.hidden_size), pos, cos, sin, mask, kv.k, kv.v, [0, 1], attn_scale=0.25)
    plan.run(x, pos, cos, sin, mask, kv.k, kv.v, [0, 1], attn_scale=0.25)
    pos[1] = kv.rows  # refilled in place, past the store
    with pytest.raises(BitMTPError, match="position"):
        plan.run(x, pos, cos, sin, mask, kv.k, kv.v, [0, 1], attn_scale=0.25)
