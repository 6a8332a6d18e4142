"""Masked attention ignores masked KV rows exactly, on every backend (issue 21).

KV rows past the committed length inside a step's read segment hold whatever rejected drafts or an
earlier, longer sequence wrote; the store is never cleared. Rules:

* op level, every backend available here (torch reference, the native ``cpu`` kernel on each ISA
  path, Triton through its interpreter, the WGSL shader on a Vulkan adapter): KV rows that the mask
  hides — rows past the step (``≥ n``) and, row by row, every position a query row's mask excludes —
  are poisoned with NaN, +Inf, -Inf and ±3e38; the output equals a clean run's bit for bit
  (``torch.equal``), and the clean run matches an independent float64 computation over the
  visible rows only. Awkward shapes: M = 1, 3, 8, 15, 16; head dims and KV-head counts that are not
  powers of two.
* a non-finite V or K entry in a *visible* row still shows as non-finite output (never hidden).
* end to end: a model object whose KV store holds garbage beyond n (poison, or an earlier longer
  sequence) generates the same tokens as a fresh object — the torch backend and the cpu backend's
  fused layers, AR and speculative decoding with a mask-block adapter (rejected draft rows).
* the greedy pick's probability is never confident for a NaN logit row (NaN, not a number ≥ tau).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import bitmtp
from bitmtp.ops.registry import availability
from tests.support.backend_variants import attention_on
from tests.support.hf_models import tiny_model

# Rows that legitimately see a poisoned position (other rows of the per-row tests, the visible-row
# tests) overflow in numpy-backed code (the Triton interpreter, wgpu readbacks): expected there.
IGNORE_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
IGNORE_INVALID = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
POISONS = {"nan": float("nan"), "+inf": float("inf"), "-inf": float("-inf"), "+huge": 3e38, "-huge": -3e38}
WIDTHS = [1, 3, 8, 15, 16]
# (heads, kv heads, head dim): GQA groups of 1, 3 and 2; KV-head counts 3 and 5; head dims 18 and 70
HEADS = [(4, 4, 16), (9, 3, 64), (10, 5, 18), (6, 3, 70)]


def _backends() -> list:
    out = [pytest.param("torch", id="torch")]
    if availability("cpu", "cpu")[0]:
        from bitmtp.ops.backends import cpu_backend

        out += [pytest.param(f"cpu:{isa}", id=f"cpu-{isa}") for isa in cpu_backend.supported_isas()]
    if availability("triton", "cpu")[0]:
        out.append(pytest.param("triton", id="triton", marks=pytest.mark.triton))
    return out


BACKENDS = _backends()


def _heads(backend: str, h: int, kvh: int, d: int) -> tuple[int, int, int]:
    # the Triton interpreter runs one Python program per (row, head): keep it to 2 heads there
    return (2, 1, d) if backend == "triton" else (h, kvh, d)


def _float64(q, k, v, mask, scale) -> torch.Tensor:
    """Independent reference: each row over its visible KV rows only (gathered), in float64."""
    m, h, d = q.shape
    kvh = k.shape[0]
    out = torch.empty(m, h, d, dtype=torch.float64)
    for i in range(m):
        idx = mask[i].nonzero()[:, 0]
        qi = q[i].double().view(kvh, h // kvh, d)
        s = torch.einsum("xgd,xnd->xgn", qi, k[:, idx].double()) * scale
        out[i] = torch.einsum("xgn,xnd->xgd", torch.softmax(s, -1), v[:, idx].double()).reshape(h, d)
    return out


def _poison_values(g: torch.Generator, shape) -> torch.Tensor:
    """Every poison kind, scattered over the tensor (so one poisoned run meets all of them)."""
    kinds = torch.tensor(list(POISONS.values()))
    return kinds[torch.randint(0, len(kinds), shape, generator=g)]


def _step_mask(g: torch.Generator, m: int, n: int, length: int) -> torch.Tensor:
    """A draft/verify-like mask: row i sees the committed rows [0, n) and its block up to itself, plus
    random extra block rows (a mask-block draft's rows see the whole block); nothing past n + m."""
    pos = n + torch.arange(m)
    mask = torch.arange(length)[None, :] <= pos[:, None]
    extra = (torch.rand(m, length, generator=g) < 0.3) & (torch.arange(length) < n + m)[None, :]
    return mask | extra


def _beyond_cases() -> list:
    """Per backend: every width and head layout with all poison kinds mixed in one run, and each kind
    alone on one layout. The Triton interpreter (one Python program per row and head) gets one layout."""
    cases = []
    for b in BACKENDS:
        name = b.values[0]
        layouts = HEADS if name != "triton" else HEADS[2:3]
        combos = [(w, heads, "mixed") for heads in layouts for w in WIDTHS]
        combos += [(8, layouts[-1], poison) for poison in POISONS]
        for w, heads, poison in combos:
            cases.append(pytest.param(name, w, heads, poison, marks=b.marks,
                                      id=f"{b.id}-m{w}-h{heads[0]}-kv{heads[1]}-d{heads[2]}-{poison}"))
    return cases


@pytest.mark.parametrize("backend,width,heads,poison", _beyond_cases())
def test_rows_beyond_the_step_never_matter(backend, width, heads, poison, rng):
    h, kvh, d = _heads(backend, *heads)
    n = int(torch.randint(1, 40, (1,), generator=rng))
    length = n + width + int(torch.randint(1, 20, (1,), generator=rng))  # the segment reads past the step
    s = length + 7  # the store holds rows past the segment too
    q = torch.randn(width, h, d, generator=rng)
    k, v = torch.randn(kvh, s, d, generator=rng), torch.randn(kvh, s, d, generator=rng)
    mask = _step_mask(rng, width, n, length)
    clean = attention_on(backend, q, k, v, mask, d**-0.5)
    assert torch.isfinite(clean).all()
    assert (clean.double() - _float64(q, k, v, mask, d**-0.5)).abs().max().item() <= 1e-5
    kp, vp = k.clone(), v.clone()
    for t in (kp, vp):
        rows = t[:, n + width :]
        rows.copy_(_poison_values(rng, rows.shape) if poison == "mixed" else torch.full_like(rows, POISONS[poison]))
    assert torch.equal(attention_on(backend, q, kp, vp, mask, d**-0.5), clean)


@IGNORE_OVERFLOW
@IGNORE_INVALID
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("heads", HEADS[1:3], ids=lambda t: "h{}-kv{}-d{}".format(*t))
def test_each_rows_masked_positions_never_matter(backend, width, heads, rng):
    """Row by row: every KV position that row's mask excludes (inside the segment too) holds poison of
    every kind; that row's output equals the clean run's. Other rows may see those positions."""
    h, kvh, d = _heads(backend, *heads)
    length, s = 37, 45
    q = torch.randn(width, h, d, generator=rng)
    k, v = torch.randn(kvh, s, d, generator=rng), torch.randn(kvh, s, d, generator=rng)
    mask = torch.rand(width, length, generator=rng) < 0.5
    mask[torch.arange(width), torch.randint(0, length, (width,), generator=rng)] = True  # >= 1 visible per row
    clean = attention_on(backend, q, k, v, mask, 0.3)
    assert torch.isfinite(clean).all()
    rows = range(width) if backend != "triton" else [int(torch.randint(0, width, (1,), generator=rng))]
    for i in rows:
        hidden = torch.ones(s, dtype=torch.bool)
        hidden[:length] = ~mask[i]
        kp, vp = k.clone(), v.clone()
        for t in (kp, vp):
            t[:, hidden] = _poison_values(rng, t[:, hidden].shape)
        out = attention_on(backend, q, kp, vp, mask, 0.3)
        assert torch.equal(out[i], clean[i]), f"row {i}"


@IGNORE_OVERFLOW
@IGNORE_INVALID
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which,value", [("k", "nan"), ("v", "nan"), ("v", "+inf"), ("v", "-inf")])
def test_visible_non_finite_rows_still_show(backend, which, value, rng):
    """Ignoring masked rows must not hide corruption in a visible one: its rows' outputs turn non-finite.
    (An infinite K entry is left out: IEEE makes its score ±inf, and a -inf score weighs 0 on every
    backend alike.)"""
    h, kvh, d = _heads(backend, 6, 3, 24)
    m, length = 3, 20
    q = torch.randn(m, h, d, generator=rng)
    k, v = torch.randn(kvh, length, d, generator=rng), torch.randn(kvh, length, d, generator=rng)
    mask = torch.arange(length)[None, :] <= torch.tensor([9, 12, 19])[:, None]
    (k if which == "k" else v)[kvh - 1, 11, 5] = POISONS[value]  # seen by rows 1 and 2 only
    out = attention_on(backend, q, k, v, mask, 0.25)
    g = h // kvh
    assert torch.isfinite(out[0]).all() and torch.isfinite(out[:, : (kvh - 1) * g]).all()
    for i in (1, 2):
        assert not torch.isfinite(out[i, (kvh - 1) * g :]).all(), f"row {i} hides a visible non-finite {which}"


@IGNORE_OVERFLOW
@IGNORE_INVALID
@pytest.mark.wgpu
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda t: "h{}-kv{}-d{}".format(*t))
def test_wgsl_attention_ignores_masked_rows(width, heads, rng):
    """The WGSL shader (wgsl_fallback/attention.wgsl): rows past the step and each row's masked positions
    hold poison of every kind; outputs equal the clean run's bit for bit, and NaN in a visible V row shows."""
    from bitmtp.wgsl_fallback.ops import Ops
    from tests.support.wgpu_device import device_runner_or_skip

    r = device_runner_or_skip()
    ops = Ops(r)
    h, kvh, d = heads
    n = int(torch.randint(1, 40, (1,), generator=rng))
    length = n + width + 9
    s = length + 5
    q = torch.randn(width, h, d, generator=rng)
    k, v = torch.randn(kvh, s, d, generator=rng), torch.randn(kvh, s, d, generator=rng)
    mask = _step_mask(rng, width, n, length)

    def run(kk, vv) -> np.ndarray:
        return ops.attention(r.upload(q.numpy()), r.upload(kk.numpy()), r.upload(vv.numpy()),
                             r.upload(mask.numpy().astype(np.uint32)), d**-0.5).numpy()

    clean = run(k, v)
    assert np.isfinite(clean).all()
    want = _float64(q, k, v, mask, d**-0.5).numpy()
    assert np.abs(clean - want).max() <= 1e-5 * max(np.abs(want).max(), 1.0)
    kp, vp = k.clone(), v.clone()
    for t in (kp, vp):
        t[:, n + width :] = _poison_values(rng, t[:, n + width :].shape)
    assert np.array_equal(run(kp, vp), clean)
    i = int(torch.randint(0, width, (1,), generator=rng))  # one row: every position it does not see
    hidden = torch.ones(s, dtype=torch.bool)
    hidden[:length] = ~mask[i]
    kp, vp = k.clone(), v.clone()
    for t in (kp, vp):
        t[:, hidden] = _poison_values(rng, t[:, hidden].shape)
    assert np.array_equal(run(kp, vp)[i], clean[i])
    vp = v.clone()
    vp[:, 0] = float("nan")  # row 0 is visible to every query row
    assert np.isnan(run(k, vp)).any(axis=(1, 2)).all()


# ---- end to end ------------------------------------------------------------------------------------------

SHAPE = dict(hidden_size=72, intermediate_size=100, num_attention_heads=6, num_key_value_heads=3, head_dim=12,
             num_hidden_layers=2, initializer_range=0.2)


def _load(backend: str, adapter: bool):
    from tests.support.adapters import random_adapter

    m = bitmtp.load(tiny_model("llama", seed=11, **SHAPE), capacity=128, adapter=None,
                    backend=None if backend == "cpu" else backend)
    if adapter:
        m.load_adapter(random_adapter(m.args, "mask-block", block_size=4))
    return m


@pytest.fixture(scope="module")
def fresh_outputs():
    cache: dict = {}

    def get(backend: str, policy: str, prompt: tuple[int, ...]) -> list[int]:
        key = (backend, policy, prompt)
        if key not in cache:
            m = _load(backend, policy != "ar")
            cache[key] = bitmtp.generate(m, input_ids=list(prompt), max_new_tokens=20, policy=policy,
                                         eos_token_id=[]).token_ids
        return cache[key]

    return get


@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=pytest.mark.skipif(
    not availability("cpu", "cpu")[0], reason="native CPU extension not built"))])
@pytest.mark.parametrize("policy", ["ar", "speculative"])
@pytest.mark.parametrize("garbage", ["nan", "+inf", "-inf", "+huge", "longer-sequence"])
def test_generation_ignores_garbage_beyond_n(backend, policy, garbage, fresh_outputs):
    g = torch.Generator().manual_seed(5)
    prompt = tuple(torch.randint(3, 97, (9,), generator=g).tolist())
    want = fresh_outputs(backend, policy, prompt)
    assert len(set(want)) > 3, "a degenerate tiny model would let a wrong row pass"
    m = _load(backend, policy != "ar")
    dec = m.decoder
    kv = m.engine.kv
    if garbage == "longer-sequence":  # every row the short generation reads past n holds old, real K/V
        long_prompt = torch.randint(3, 97, (60,), generator=g).tolist()
        bitmtp.generate(m, input_ids=long_prompt, max_new_tokens=40, policy=policy, eos_token_id=[])
    else:
        for t in kv.k + kv.v:
            t.fill_(POISONS[garbage])
    before = dict(dec.path_counts)
    got = bitmtp.generate(m, input_ids=list(prompt), max_new_tokens=20, policy=policy, eos_token_id=[]).token_ids
    assert got == want
    fused = dec.path_counts["fused"] - before["fused"]
    if backend == "cpu":  # the native fused layers ran every step
        assert fused > 0 and dec.path_counts["per-op"] == before["per-op"], dec.fused_reason
    else:
        assert fused == 0


def test_nan_logits_are_never_confident():
    """The greedy pick's probability (drafters, CUDA graph runners): a row with a NaN logit gives a NaN
    probability, which ``p >= tau`` never accepts — never a confident-looking number."""
    from bitmtp.decoding.drafters import _argmax_prob

    logits = torch.randn(4, 50)
    logits[1, 7] = float("nan")
    logits[2] = float("nan")
    logits[3, 3] = float("inf")
    logits[3, 9] = float("nan")
    tok, prob = _argmax_prob(logits)
    assert torch.isfinite(prob[0]) and 0 < prob[0] <= 1
    assert torch.isnan(prob[1:]).all()
    assert not (prob[1:] >= 0.5).any()


@IGNORE_INVALID
@pytest.mark.wgpu
def test_wgsl_argmax_nan_rows_are_never_confident():
    """wgsl_fallback/argmax.wgsl: the probability of a row holding NaN (or +Inf, where the softmax is
    NaN too) is NaN, never a confident-looking number; a clean row is unaffected."""
    from bitmtp.wgsl_fallback.ops import Ops
    from tests.support.wgpu_device import device_runner_or_skip

    r = device_runner_or_skip()
    ops = Ops(r)
    logits = torch.randn(4, 300)
    logits[1, 7] = float("nan")
    logits[2] = float("nan")
    logits[3, 3] = float("inf")
    ids, probs = ops.split_argmax(ops.argmax(r.upload(logits.numpy())).numpy())
    assert ids[0] == int(logits[0].argmax())
    assert abs(probs[0] - float(torch.softmax(logits[0].double(), 0).max())) <= 1e-6
    assert np.isnan(probs[1:]).all()
    assert ids[2] == 0  # an all-NaN row: id 0 (as torch.argmax), never an id outside the vocabulary
    assert all(0 <= i < 300 for i in ids)
