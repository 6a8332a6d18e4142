"""Sampling parameters at their float limits (issue 42): finite scores, greedy limits, finite logprobs.

Rules (``bitmtp.decoding.sampling``, "Float limits"):

* a temperature below ``GREEDY_TEMPERATURE`` (2^-126) — 1e-38, 1e-40, 1e-300, 5e-324, the smallest
  positive double — *is* greedy: the same tokens as T = 0, ties broken the same way, the same probabilities
  (so the same logprobs), no seed. It used to divide float32 scores by 0 or a subnormal: inf / NaN, and
  the sampler collapsed to token 0 with logprob −inf;
* a tiny temperature above it samples the argmax (probability exactly 1) with finite scores; a huge one
  (1e38, float32's max, 1e308, the largest double) samples uniformly;
* repetition penalties at any finite positive value (1e-300, 1e-38, subnormals, 1e300) give finite scores
  (saturated at ±float32's max), are bit-identical to transformers' float32 rule where that rule is finite,
  and pick what the float64 reference rule picks; presence / frequency penalties at subnormal values are off;
* top_p / min_p at their limits keep the nucleus (at least the top token) and sample it;
* logprobs are finite: ``decode``'s guard maps a probability of 0 (or NaN) to log(2^-149).

End to end (``bitmtp.generate`` on a tiny random model, V = 32): the same rules through ar, auto and
speculative, with every lossless policy committing exactly AR's tokens.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

import bitmtp
from bitmtp.decoding.sampling import (
    FLOAT32_MAX,
    GREEDY_TEMPERATURE,
    Sampler,
    SamplingParams,
    position_uniforms,
    process_scores,
    reference_sample,
    seed_words,
)
from bitmtp.runtime.output import LOGPROB_FLOOR, _logprob
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model

TINY_DOUBLE = 5e-324  # the smallest positive double (subnormal)
assert TINY_DOUBLE == math.nextafter(0.0, 1.0)
#: temperatures that are the greedy limit: below 2^-126
UNDERFLOWED_T = [1e-38, 1e-40, 1e-45, 1e-300, sys.float_info.min, TINY_DOUBLE,
                 math.nextafter(GREEDY_TEMPERATURE, 0.0)]
#: positive temperatures that sample but are so small that only the top score keeps any probability
NEAR_ZERO_T = [GREEDY_TEMPERATURE, math.nextafter(GREEDY_TEMPERATURE, 1.0), 1.2e-38, 1e-37, 1e-30]
#: temperatures so large that softmax(s / T) is uniform in float32
HUGE_T = [1e38, FLOAT32_MAX, math.nextafter(FLOAT32_MAX, math.inf), 1e39, 1e300, 1e308, sys.float_info.max]
EXTREME_RP = [1e-300, 1e-38, 1e-40, TINY_DOUBLE, sys.float_info.min, GREEDY_TEMPERATURE, 1e30, 1e38,
              FLOAT32_MAX, 1e39, 1e300, sys.float_info.max]

V = 40


def _logits(rows: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g) * scale
    x[0, 11] = x[0, 29] = x[0].max() + 1.0  # an exact tie at the top: greedy takes the lower id
    x[1, 5] = 0.0  # a zero logit (0 / rp: NaN when rp rounds to 0 in float32)
    return x


def _select(params: SamplingParams, logits: torch.Tensor, prompt: list[int] = (), output: list[int] = (),
            seed: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    s = Sampler(params, logits.shape[-1], torch.device("cpu"))
    s.start(seed, list(prompt))
    s.commit(list(output))
    return s.select(logits, torch.arange(logits.shape[0]) + 9)


@pytest.mark.parametrize("t", UNDERFLOWED_T, ids=repr)
@pytest.mark.parametrize("penalties", [{}, dict(repetition_penalty=1.4, frequency_penalty=0.5)], ids=["plain", "pen"])
def test_an_underflowed_temperature_is_exactly_greedy(t, penalties):
    params = SamplingParams(temperature=t, top_k=3, top_p=0.5, seed=3, **penalties)
    greedy = SamplingParams(**penalties)
    assert not params.samples and params.greedy == greedy.greedy
    logits = _logits(6, seed=1)
    prompt, output = [1, 5, 29, 7], [11, 3]
    tok, prob = _select(params, logits, prompt, output)
    want_tok, want_prob = _select(greedy, logits, prompt, output)
    assert torch.equal(tok, want_tok) and torch.equal(prob, want_prob)  # bit for bit: ties, probabilities
    if not penalties:
        assert int(tok[0]) == 11  # the tie at the top: the lower id, as the argmax takes it
        assert torch.equal(tok, logits.argmax(-1))
    assert bool((prob > 0).all())


@pytest.mark.parametrize("t", NEAR_ZERO_T, ids=repr)
def test_a_near_zero_temperature_samples_the_argmax_with_finite_scores(t):
    params = SamplingParams(temperature=t)
    assert params.samples
    logits = _logits(6, seed=2)
    scores = process_scores(logits, params)
    assert bool(torch.isfinite(scores).all())
    assert torch.equal(scores.amax(-1), torch.zeros(6))  # the top score is exactly 0
    for seed in range(8):
        tok, prob = _select(params, logits, seed=seed)
        assert int(tok[0]) in (11, 29)  # the tie: either top token, by the position's uniform
        assert torch.equal(tok[1:], logits[1:].argmax(-1))
        assert prob[1:].tolist() == [1.0] * 5 and float(prob[0]) == 0.5


@pytest.mark.parametrize("t", HUGE_T, ids=repr)
def test_a_huge_temperature_is_uniform(t):
    params = SamplingParams(temperature=t)
    logits = _logits(2, seed=3, scale=1e4)[:1].expand(4000, -1)
    scores = process_scores(logits, params)
    assert bool(torch.isfinite(scores).all())
    tok, prob = _select(params, logits)
    assert torch.allclose(prob, torch.full_like(prob, 1 / V))
    counts = torch.bincount(tok, minlength=V)
    assert int(counts.min()) > 50, counts  # every token drawn (4000 draws, 100 expected each)
    u = position_uniforms(seed_words(17), torch.arange(10) + 10).tolist()
    for r in range(10):
        assert int(tok[r]) == reference_sample(logits[r], params, [], 0, u[r])[0]


@pytest.mark.parametrize("rp", EXTREME_RP, ids=repr)
@pytest.mark.parametrize("t", [0.0, 1e-40, 1e-30, 0.8, 1e308], ids=repr)
def test_an_extreme_repetition_penalty_gives_finite_scores_and_the_reference_token(rp, t):
    params = SamplingParams(temperature=t, repetition_penalty=rp)
    logits = _logits(8, seed=4)
    prompt = [0, 5, 11, 13, 29, 31, 2, 38]  # seen: positive and negative logits, a zero, the top tie
    seen = torch.bincount(torch.tensor(prompt), minlength=V).float()
    scores = process_scores(logits, params, seen)
    assert bool(torch.isfinite(scores).all())
    tok, prob = _select(params, logits, prompt)
    assert bool((prob > 0).all()) and bool(torch.isfinite(prob).all())
    u = position_uniforms(seed_words(17), torch.arange(8) + 10).tolist()
    for r in range(8):
        want, want_p = reference_sample(logits[r], params, prompt, len(prompt), u[r])
        assert int(tok[r]) == want, (r, rp, t)
        assert float(prob[r]) == pytest.approx(want_p, rel=1e-5)
    if not params.samples:
        pos_seen = [[x for x in prompt if logits[r, x] > 0] for r in range(8)]
        for r in range(8):
            if rp <= 1e-30 and pos_seen[r]:  # a seen positive logit is pushed to the top
                assert int(tok[r]) in pos_seen[r]
            if rp >= 1e30:  # a seen token is pushed to ≤ 0: never chosen over an unseen positive logit
                assert int(tok[r]) not in prompt or float(logits[r].masked_fill(seen > 0, -1e9).max()) <= 0


@pytest.mark.parametrize("rp", [1.3, 0.7, 1.05, 2.0, 1e-3, 50.0], ids=repr)
def test_an_ordinary_repetition_penalty_is_transformers_float32_rule_bit_for_bit(rp):
    logits = _logits(4, seed=5)
    seen = torch.zeros(V)
    seen[[0, 3, 5, 11, 17]] = 1
    s = logits.float()
    want = torch.where(seen > 0, torch.where(s < 0, s * rp, s / rp), s)  # transformers' processor
    assert torch.equal(process_scores(logits, SamplingParams(repetition_penalty=rp), seen), want)


@pytest.mark.parametrize("value", [TINY_DOUBLE, -TINY_DOUBLE, sys.float_info.min, 1e-300, 1e-45, -1e-40])
def test_subnormal_presence_and_frequency_penalties_are_off_or_tiny(value):
    logits = _logits(3, seed=6)  # row 1 has a zero logit at id 5: the only one a float32 subnormal moves
    gen = torch.zeros(V)
    gen[[2, 5, 11]] = torch.tensor([1.0, 3.0, 40.0])
    params = SamplingParams(presence_penalty=value, frequency_penalty=value)
    scores = process_scores(logits, params, None, gen)
    if abs(value) < 1e-46:  # below float32's smallest subnormal: rounds to 0, off
        assert torch.equal(scores, logits)
    else:
        assert bool(torch.isfinite(scores).all()) and float((scores - logits).abs().max()) <= 50 * abs(value)
    tok, _ = _select(SamplingParams(presence_penalty=value, frequency_penalty=value), logits, output=[2, 5, 11])
    assert torch.equal(tok, logits.argmax(-1))


@pytest.mark.parametrize("edge", [-2.0, 2.0])
def test_the_largest_presence_and_frequency_penalties_stay_finite_on_saturated_scores(edge):
    logits = torch.tensor([[FLOAT32_MAX, -FLOAT32_MAX, 0.0, 1.0]])
    gen = torch.tensor([1000.0, 1000.0, 1.0, 0.0])
    params = SamplingParams(presence_penalty=edge, frequency_penalty=edge)
    assert bool(torch.isfinite(process_scores(logits, params, None, gen)).all())


TOP_P = [TINY_DOUBLE, sys.float_info.min, 1e-300, 1e-45, math.nextafter(1.0, 0.0), 1.0]
MIN_P = [0.0, TINY_DOUBLE, 1e-300, 1e-45, math.nextafter(1.0, 0.0), 1.0]


@pytest.mark.parametrize("t", [1e-30, 1.0, 1e308], ids=repr)
@pytest.mark.parametrize("top_p", TOP_P, ids=repr)
@pytest.mark.parametrize("min_p", MIN_P, ids=repr)
def test_top_p_and_min_p_at_their_limits_keep_the_nucleus(t, top_p, min_p):
    params = SamplingParams(temperature=t, top_p=top_p, min_p=min_p)
    logits = _logits(6, seed=7)
    tok, prob = _select(params, logits)
    assert bool(((tok >= 0) & (tok < V)).all())
    assert bool(((prob > 0) & (prob <= 1 + 1e-6)).all())
    u = position_uniforms(seed_words(17), torch.arange(6) + 10).tolist()
    for r in range(6):
        want, want_p = reference_sample(logits[r], params, [], 0, u[r])
        assert int(tok[r]) == want and float(prob[r]) == pytest.approx(want_p, rel=1e-5)
    if t < 1 and (top_p < 1e-40 or min_p == 1.0):  # only the top token (or the tie) survives
        assert torch.equal(tok[1:], logits[1:].argmax(-1))


def test_the_logprob_guard_is_finite():
    assert _logprob(0.0) == LOGPROB_FLOOR == pytest.approx(-149 * math.log(2))
    assert _logprob(math.nan) == LOGPROB_FLOOR
    assert _logprob(1.0) == 0.0 and _logprob(0.5) == math.log(0.5)


def test_out_of_range_values_are_refused_by_name():
    from bitmtp.errors import BitMTPError

    for name, bad in [("temperature", -TINY_DOUBLE), ("temperature", math.inf), ("repetition_penalty", 0.0),
                      ("repetition_penalty", -TINY_DOUBLE), ("repetition_penalty", math.inf),
                      ("top_p", 0.0), ("top_p", math.nextafter(1.0, 2.0)), ("min_p", -TINY_DOUBLE),
                      ("presence_penalty", math.nextafter(2.0, 3.0)), ("frequency_penalty", -math.inf)]:
        with pytest.raises(BitMTPError, match=f"^{name}: .*got"):
            SamplingParams(**{name: bad})


# -- end to end --------------------------------------------------------------------------------------------

VOCAB = 32
NEW = 12
PROMPT = [3, 9, 4, 20, 7, 9]


@pytest.fixture(scope="module")
def model():
    m = bitmtp.load(tiny_model("llama", seed=5, vocab_size=VOCAB, initializer_range=INIT_RANGE), capacity=96,
                    quantize="ternary")
    m.load_adapter(random_adapter(m.args, "mask-block", seed=9))
    return m


def _gen(model, policy: str, **kw):
    extra = {"block_size": 4} if policy != "ar" else {}
    return bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=NEW, eos_token_id=[], policy=policy,
                           logprobs=True, **extra, **kw)


def _finite(logprobs) -> bool:
    return logprobs is not None and all(isinstance(x, float) and math.isfinite(x) for x in logprobs)


@pytest.mark.parametrize("policy", ["ar", "auto", "speculative"])
def test_generate_with_an_underflowed_temperature_is_greedy(model, policy):
    greedy = _gen(model, policy)
    assert set(greedy.token_ids) != {0}  # so "equals greedy" rules out the old collapse to token 0
    for t in UNDERFLOWED_T:
        out = _gen(model, policy, temperature=t, seed=4)
        assert out.token_ids == greedy.token_ids, t
        assert out.logprobs == greedy.logprobs and _finite(out.logprobs), t
        assert out.seed is None


@pytest.mark.parametrize("policy", ["ar", "speculative"])
def test_generate_with_a_near_zero_temperature_samples_the_argmax(model, policy):
    greedy = _gen(model, "ar")
    for t in NEAR_ZERO_T:
        out = _gen(model, policy, temperature=t, seed=4)
        assert out.token_ids == greedy.token_ids, t
        assert out.logprobs == [0.0] * NEW  # probability 1: a point mass on the top token
        assert out.seed == 4


@pytest.mark.parametrize("policy", ["ar", "speculative"])
def test_generate_with_a_huge_temperature_is_uniform(model, policy):
    for t in (1e38, 1e308):
        out = _gen(model, policy, temperature=t, seed=8)
        assert out.token_ids == _gen(model, "ar", temperature=t, seed=8).token_ids
        assert out.logprobs == pytest.approx([-math.log(VOCAB)] * NEW, abs=1e-5)
        assert len(set(out.token_ids)) >= 6  # 12 uniform draws from 32 ids


@pytest.mark.parametrize("rp", [1e-300, 1e-38, TINY_DOUBLE, 1e300], ids=repr)
@pytest.mark.parametrize("t", [0.0, 0.9], ids=repr)
def test_generate_with_an_extreme_repetition_penalty_follows_the_reference_rule(model, rp, t):
    """Step by step, each token is the float64 reference rule's pick from the model's own logits (as in
    tests/runtime/test_sampling_decode.py), logprobs are finite, and speculative commits AR's tokens."""
    params = SamplingParams(temperature=t, repetition_penalty=rp, seed=21)
    out = _gen(model, "ar", temperature=t, repetition_penalty=rp, seed=21)
    assert _finite(out.logprobs)
    assert _gen(model, "speculative", temperature=t, repetition_penalty=rp, seed=21).token_ids == out.token_ids
    from bitmtp.model.decoder import StepInputs

    kv = model.session().engine.kv
    seq = list(PROMPT)
    for i, tok in enumerate(out.token_ids):
        pos = torch.arange(len(seq))
        with torch.no_grad():
            logits = model.decoder(StepInputs(torch.tensor(seq), pos, pos[None, :] <= pos[:, None]), kv)[-1]
        u = float(position_uniforms(seed_words(21), torch.tensor([len(seq)]))[0])
        want, prob = reference_sample(logits, params, seq, len(PROMPT), u)
        assert tok == want, (i, seq)
        assert out.logprobs[i] == pytest.approx(math.log(prob), abs=1e-5)
        seq.append(tok)
