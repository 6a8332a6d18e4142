"""Random arguments to the public API (issue 21, item 6): each call gives a BitMTPError, or a correct result.

"Correct" is checked against an independent computation, not against "it did not raise":

* every accepted call returns at most ``max_new_tokens`` ids, all inside the vocabulary, and a stop
  reason that matches them (``eos`` ends on an EOS id; ``max_new_tokens`` has exactly that many);
* the lossless policies (``ar``, ``speculative``, and ``hybrid`` with m > D) return exactly the AR
  greedy continuation of the same prompt, computed once per prompt by a plain AR call on the same
  model (:func:`_ar_reference`) and truncated at the first EOS / the length limit;
* the unverified ones (``confidence``, other ``hybrid``) start with the AR token (d₁ is the AR
  prediction) and their stats add up to the tokens returned.

Hypothesis draws mixed valid and invalid values per argument (wrong types, NaN, negatives, huge
numbers, bools, unknown names); the run is derandomized and bounded so it stays a few seconds in CI.

Sampling parameters at their float limits (issue 42, :func:`test_sampling_at_float_limits`): subnormals,
the smallest / largest finite doubles and float32s, and values next to the thresholds (T = 2^-126, the
greedy limit; top_p / min_p at 0 and 1; penalties at ±2). Each call is refused with a BitMTPError that
names a sampling parameter, or returns valid ids with finite logprobs; a lossless policy commits exactly
AR's tokens for the same parameters and seed; every token is the float64 reference rule's pick from the
model's own logits, with its probability (``reference_sample``, step by step); a temperature below the
greedy limit is exactly greedy, one just above it a point mass on the argmax (or uniform over a tie), a
huge one uniform.
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np
import pytest
import torch

import bitmtp
from bitmtp.decoding.sampling import (
    FLOAT32_MAX,
    GREEDY_TEMPERATURE,
    SamplingParams,
    position_uniforms,
    reference_sample,
    seed_words,
)
from bitmtp.errors import BitMTPError
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VOCAB = 97  # tiny_model's vocabulary
CAPACITY = 48
BLOCK = 4  # the adapter's largest D is 8; generate(block_size=...) draws around it
SETTINGS = settings(max_examples=50, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@functools.lru_cache(maxsize=1)
def _model() -> bitmtp.BitMTPModel:
    m = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=CAPACITY, adapter=None,
                    quantize="ternary")
    m.load_adapter(random_adapter(m.args, "mask-block", block_size=8, seed=7))
    return m


@functools.lru_cache(maxsize=256)
def _ar_reference(prompt: tuple[int, ...]) -> tuple[int, ...]:
    """The AR greedy continuation of ``prompt`` until the KV store is full, with no EOS: every accepted
    call's expected tokens are a prefix of it (cut at its own EOS / max_new_tokens)."""
    out = bitmtp.generate(_model(), input_ids=list(prompt), policy="ar", max_new_tokens=CAPACITY + 1,
                          eos_token_id=[])
    return tuple(out.token_ids)


def _expected_prefix(ref: tuple[int, ...], eos: list[int], limit: int) -> list[int]:
    out = []
    for t in ref[:limit]:
        out.append(t)
        if t in eos:
            break
    return out


def mostly(valid, junk, ratio: int = 5):
    """``valid`` about ``ratio`` times as often as ``junk``: with 7 arguments per call, uniform junk
    would refuse nearly every call and the accepted path would go untested."""
    return st.integers(0, ratio).flatmap(lambda k: junk if k == ratio else valid)


valid_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
prompts = mostly(
    st.one_of(valid_ids, valid_ids.map(lambda p: torch.tensor(p)), valid_ids.map(lambda p: torch.tensor([p])),
              valid_ids.map(lambda p: np.array(p, dtype=np.int32))),
    st.one_of(
        st.lists(st.integers(-5, VOCAB + 5), min_size=0, max_size=6),  # out of range or empty
        st.lists(valid_ids, min_size=2, max_size=3).map(lambda rows: [r[:1] * 3 for r in rows]),  # a batch
        valid_ids.map(lambda p: torch.tensor(p, dtype=torch.float32)),
        st.just("text"), st.just(None), st.just(3), st.just([True, False])),
    ratio=8)
junk = st.one_of(st.integers(-3, 0), st.integers(17, 40), st.booleans(), st.floats(allow_nan=True),
                 st.text(max_size=2))
new_tokens = mostly(st.one_of(st.integers(1, 12), st.just(10**12)), junk, ratio=8)
block_sizes = mostly(st.one_of(st.none(), st.integers(2, 8)), st.one_of(junk, st.integers(9, 16)))
min_prefixes = mostly(st.one_of(st.none(), st.integers(0, 10)), junk)
policies = mostly(st.sampled_from(["ar", "speculative", "hybrid", "confidence"]),
                  st.one_of(st.text(max_size=5), st.just(None), st.just(1)))
taus = mostly(st.floats(0.05, 1.0), st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just("0.5"),
                                              st.just(0), st.just(True)))
eos = mostly(st.one_of(st.none(), st.integers(0, VOCAB - 1), st.lists(st.integers(0, VOCAB - 1), max_size=3),
                       st.just(torch.tensor([4, 7]))),
             st.one_of(st.integers(-2, -1), st.just(VOCAB), st.just("x"), st.just([1.5])))


@SETTINGS
@given(input_ids=prompts, max_new_tokens=new_tokens, policy=policies, block_size=block_sizes, tau=taus,
       min_prefix=min_prefixes, eos_token_id=eos)
def test_generate_random_arguments(input_ids, max_new_tokens, policy, block_size, tau, min_prefix, eos_token_id):
    model = _model()
    kw = dict(input_ids=input_ids, max_new_tokens=max_new_tokens, policy=policy, block_size=block_size, tau=tau,
              min_prefix=min_prefix, eos_token_id=eos_token_id)
    try:
        out = bitmtp.generate(model, **kw)
    except BitMTPError as exc:
        assert str(exc).split(":", 1)[0].strip(), "a BitMTPError must name what was wrong"
        event(f"refused: {str(exc).split(':', 1)[0]}")
        return
    event(f"accepted: {policy}")
    # accepted: the arguments were valid, so they can be read back plainly
    prompt = tuple(int(t) for t in torch.as_tensor(np.asarray(input_ids)).reshape(-1).tolist())
    limit = int(max_new_tokens)
    eos_list = (list(model.args.eos_token_id) if eos_token_id is None else
                [int(e) for e in torch.as_tensor(np.asarray(eos_token_id)).reshape(-1).tolist()])
    toks = out.token_ids
    assert 1 <= len(toks) <= limit and all(0 <= t < VOCAB for t in toks)
    assert out.stop_reason in ("eos", "max_new_tokens", "capacity")
    if out.stop_reason == "eos":
        assert toks[-1] in eos_list and not any(t in eos_list for t in toks[:-1])
    elif out.stop_reason == "max_new_tokens":
        assert len(toks) == limit
    assert sum(out.stats.committed) + 1 == len(toks)  # the prefill commits the first token
    ref = _ar_reference(prompt)
    d = block_size if block_size is not None else 8
    lossless = policy in ("ar", "speculative") or (policy == "hybrid" and min_prefix is not None and min_prefix > d)
    if lossless:
        assert toks == _expected_prefix(ref, eos_list, len(toks))
    else:
        assert toks[0] == ref[0]  # d₁ (the prefill's token) is the AR prediction in every policy


@settings(max_examples=30, deadline=None, derandomize=True)
@given(capacity=mostly(st.integers(3, 64), st.one_of(junk, st.just(10**12))),
       m_max=mostly(st.integers(1, 31), st.one_of(junk, st.just(10**12))),
       backend=mostly(st.sampled_from([None, "torch", "cpu"]), st.text(max_size=4)),
       device=mostly(st.just("cpu"), st.sampled_from(["cuda", "cuda:7", "tpu", 3])),
       quantize=mostly(st.sampled_from([None, "ternary"]), st.sampled_from(["int4", 1])))
def test_load_random_arguments(capacity, m_max, backend, device, quantize):
    hf = _hf()
    try:
        m = bitmtp.load(hf, capacity=capacity, m_max=m_max, backend=backend, device=device, quantize=quantize,
                        adapter=None)
    except BitMTPError as exc:
        assert str(exc).split(":", 1)[0].strip()
        event(f"refused: {str(exc).split(':', 1)[0]}")
        return
    event("accepted")
    # accepted: a model that decodes, with the capacity it was asked for
    assert m.engine.capacity == capacity and m.engine.kv.m_max == m_max
    out = bitmtp.generate(m, input_ids=[5, 9, 11], max_new_tokens=3, policy="ar", eos_token_id=[])
    assert len(out.token_ids) == min(3, capacity + 1 - 3)  # committed tokens may reach capacity + 1
    assert all(0 <= t < VOCAB for t in out.token_ids)


@functools.lru_cache(maxsize=1)
def _hf():
    return tiny_model("llama", seed=3, initializer_range=INIT_RANGE)


def test_the_fuzzer_reaches_both_outcomes():
    """The strategies above must produce accepted calls and refused ones (else the test checks nothing)."""
    model = _model()
    ok = bitmtp.generate(model, input_ids=[5, 6, 7], max_new_tokens=5, policy="speculative", block_size=BLOCK,
                         eos_token_id=[])
    assert ok.token_ids == _expected_prefix(_ar_reference((5, 6, 7)), [], 5)
    with pytest.raises(BitMTPError, match="tau"):
        bitmtp.generate(model, input_ids=[5, 6, 7], tau=math.nan, policy="hybrid")


# -- sampling parameters at their float limits (issue 42) ---------------------------------------------------

_T = GREEDY_TEMPERATURE
_UP, _DOWN = math.inf, -math.inf
#: the edges of the float formats (subnormal and normal doubles and float32s, the largest finite ones) and
#: the values on either side of the parameters' thresholds (T = 2^-126, the greedy limit)
TINY = [5e-324, 1e-323, sys.float_info.min, 1e-300, 1.4e-45, 1e-45, 1e-40, math.nextafter(_T, 0.0), _T,
        math.nextafter(_T, 1.0), 1e-38, 1e-30, 1e-6]
HUGE = [1e30, 1e38, FLOAT32_MAX, math.nextafter(FLOAT32_MAX, _UP), 1e39, 1e300, sys.float_info.max]
NOT_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def _edges(values, lo: float, hi: float):
    """``values`` plus any double in [lo, hi] (subnormals included)."""
    return st.one_of(st.sampled_from(values), st.floats(lo, hi, allow_subnormal=True))


def _param(default: float, valid, junk, defaults: int = 1):
    """The default ``defaults`` times in ``defaults + 1`` (most calls then test one or two limits at once),
    else mostly a valid value at a limit, sometimes an invalid one next to the accepted range."""
    return st.integers(0, defaults).flatmap(
        lambda k: st.just(default) if k else mostly(valid, st.one_of(junk, NOT_FINITE), ratio=6))


#: each branch about equally often: greedy and plain sampling (where the other parameters' limits show),
#: the tiny and huge edges, anywhere in the double range, and a few refusals
temperatures = st.one_of(st.sampled_from([0.0, -0.0]), st.sampled_from([0.7, 1.0]), st.sampled_from(TINY),
                         st.sampled_from(HUGE), st.floats(0.0, sys.float_info.max, allow_subnormal=True),
                         st.floats(0.0, 1e-30, allow_subnormal=True),
                         st.sampled_from([-5e-324, -sys.float_info.min, -1.0, -sys.float_info.max, math.nan,
                                          math.inf]))
top_ps = _param(1.0, _edges([*TINY, 0.5, math.nextafter(1.0, 0.0), 1.0], 5e-324, 1.0),
                st.sampled_from([0.0, -0.0, -5e-324, math.nextafter(1.0, 2.0), 1e308]))
min_ps = _param(0.0, _edges([0.0, *TINY, 0.5, math.nextafter(1.0, 0.0), 1.0], 0.0, 1.0),
                st.sampled_from([-5e-324, math.nextafter(1.0, 2.0), 2.0, -sys.float_info.max]))
rep_penalties = _param(1.0, _edges([*TINY, 0.5, 1.0, 1.3, *HUGE], 5e-324, sys.float_info.max),
                       st.sampled_from([0.0, -0.0, -5e-324, -1.0]), defaults=2)
_PENALTY_EDGES = [0.0, 5e-324, sys.float_info.min, 1e-300, 1e-45, 1e-40, 0.5, math.nextafter(2.0, 0.0), 2.0]
add_penalties = _param(0.0, _edges(_PENALTY_EDGES + [-x for x in _PENALTY_EDGES], -2.0, 2.0),
                       st.sampled_from([math.nextafter(2.0, 3.0), -math.nextafter(2.0, 3.0), 1e308, -1e308]),
                       defaults=3)
SAMPLING_NAMES = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed")


def _in_range(name: str, v) -> bool:
    """The documented accepted range of each sampling parameter, written out independently of the code."""
    if name in ("top_k", "seed"):
        return isinstance(v, int) and (name == "seed" or v >= 0)
    if not isinstance(v, float) or not math.isfinite(v):
        return False
    return {"temperature": v >= 0, "top_p": 0 < v <= 1, "min_p": 0 <= v <= 1, "repetition_penalty": v > 0,
            "presence_penalty": -2 <= v <= 2, "frequency_penalty": -2 <= v <= 2}[name]


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(temperature=temperatures, top_k=st.sampled_from([0, 0, 0, 1, 2, VOCAB - 1, VOCAB, 10**9]),
       top_p=top_ps, min_p=min_ps, repetition_penalty=rep_penalties, presence_penalty=add_penalties,
       frequency_penalty=add_penalties,
       seed=st.one_of(st.integers(0, 2**64), st.integers(-(2**70), 2**70)),
       policy=st.sampled_from(["ar", "ar", "speculative", "auto"]), prompt=valid_ids, new=st.integers(1, 6))
# found once in a longer run: every logit ties after [0], and top_k=1 keeps the whole tie
@example(temperature=1e30, top_k=1, top_p=5e-324, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
         frequency_penalty=0.0, seed=0, policy="ar", prompt=[0], new=1)
def test_sampling_at_float_limits(temperature, top_k, top_p, min_p, repetition_penalty, presence_penalty,
                                  frequency_penalty, seed, policy, prompt, new):
    model = _model()
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                    repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                    frequency_penalty=frequency_penalty, seed=seed)
    kw = dict(input_ids=prompt, max_new_tokens=new, eos_token_id=[], logprobs=True, **sampling)
    try:
        out = bitmtp.generate(model, policy=policy, block_size=BLOCK if policy != "ar" else None, **kw)
    except BitMTPError as exc:
        name = str(exc).split(":", 1)[0].strip()
        assert name in SAMPLING_NAMES, f"refused, but not by a sampling parameter's name: {exc}"
        assert not _in_range(name, sampling[name]), f"{name}={sampling[name]!r} is in range but refused"
        assert "got" in str(exc), "the message shows the value it refused"
        event(f"refused: {name}")
        return
    bad = [n for n in SAMPLING_NAMES if not _in_range(n, sampling[n])]
    assert not bad, f"accepted out-of-range {bad}"
    toks, lps = out.token_ids, out.logprobs
    assert len(toks) == new and all(0 <= t < VOCAB for t in toks)
    assert lps is not None and len(lps) == new
    assert all(isinstance(x, float) and math.isfinite(x) and x <= 1e-6 for x in lps), lps
    penalized = repetition_penalty != 1 or presence_penalty != 0 or frequency_penalty != 0
    if policy != "ar":  # auto and speculative are lossless: exactly AR's tokens for the parameters and seed
        ar = bitmtp.generate(model, policy="ar", **kw)
        assert toks == ar.token_ids
        assert lps == pytest.approx(ar.logprobs, abs=1e-5)
    # every token is the slow float64 reference rule's pick from the model's own logits, with its probability
    # (an independent check of the numerics: NaN scores, the old failure, picked token 0 with logprob −inf).
    # Not above T = 100: there float32 probabilities tie where float64 ones still differ by < 1e-7 — the
    # sampler's resolution, not a fault — and top-p / min-p keep every tie (T ≥ 1e30 is checked below)
    params = SamplingParams(**{**sampling, "seed": None})
    seq = list(prompt)
    for i, tok in enumerate(toks if temperature <= 100 else ()):
        u = float(position_uniforms(seed_words(out.seed or 0), torch.tensor([len(seq)]))[0])
        want, prob = reference_sample(_next_logits(tuple(seq)), params, seq, len(prompt), u)
        assert tok == want, (i, seq)
        assert lps[i] == pytest.approx(math.log(prob), abs=1e-4)
        seq.append(tok)
    if temperature < GREEDY_TEMPERATURE:
        event("T = 0" if temperature == 0 else "greedy limit: 0 < T < 2^-126")
        assert out.seed is None or penalized
        if not penalized:  # exactly greedy, ties and logprobs included
            assert toks == list(_ar_reference(tuple(prompt))[:new])
    elif temperature <= 1e-30 and not penalized:
        # only the top score(s) keep any probability, and every filter keeps them: a point mass on the
        # argmax, or uniform over a tie at the top (the prompt [0] — token 0's embedding is zero: every
        # logit ties)
        event("2^-126 <= T <= 1e-30, no penalties: the argmax")
        assert all(abs(math.exp(-x) - round(math.exp(-x))) < 1e-4 for x in lps), lps
    elif temperature >= 1e30 and not penalized:
        # uniform over what top-k keeps (exp((s − max) / T) is exactly 1 in float32 for every score, so
        # top-p and min-p keep every tie, i.e. everything); top-k keeps every score tied with its k-th (as
        # transformers' does: the prompt [0] ties every logit, so top_k=1 keeps the whole vocabulary)
        event("T >= 1e30: uniform")
        kept = []
        for i in range(new):
            scores = _next_logits(tuple(prompt) + tuple(toks[:i]))
            kth = scores.topk(min(top_k, VOCAB)).values[-1] if top_k else scores.min()
            kept.append(int((scores >= kth).sum()))
        assert lps == pytest.approx([-math.log(k) for k in kept], abs=1e-5)
    else:
        event("sampled" if temperature >= GREEDY_TEMPERATURE else "greedy over penalized scores")


@functools.lru_cache(maxsize=1024)
def _next_logits(seq: tuple[int, ...]) -> torch.Tensor:
    """The model's logits after ``seq``: one full forward into a scratch KV store (rows [0, len(seq)))."""
    from bitmtp.model.decoder import StepInputs

    pos = torch.arange(len(seq))
    with torch.no_grad():
        return _model().decoder(StepInputs(torch.tensor(seq), pos, pos[None, :] <= pos[:, None]), _scratch_kv())[-1]


@functools.lru_cache(maxsize=1)
def _scratch_kv():
    return _model().session().engine.kv


def test_the_limit_fuzzer_has_a_greedy_text_that_is_not_all_zeros():
    """The greedy-limit checks above rule out the token-0 collapse only if greedy itself is not all zeros."""
    assert set(_ar_reference((5, 6, 7))) != {0}
    out = bitmtp.generate(_model(), input_ids=[5, 6, 7], max_new_tokens=6, eos_token_id=[], temperature=1e-300,
                          logprobs=True)
    assert out.token_ids == list(_ar_reference((5, 6, 7))[:6]) and all(math.isfinite(x) for x in out.logprobs)
