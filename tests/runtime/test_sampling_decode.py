"""Sampled decoding end to end on a tiny random model (vocabulary 32).

Rules: with the same seed, every verifying policy, drafter, schedule and block size D ∈ {2, 4, 8} commits
exactly the tokens AR sampling commits (``bitmtp.decoding.sampling``: one uniform per position shared by
drafts and targets, verified greedily), with penalties and filters too; so their output distribution is
AR sampling's, which ``tests/decoding/test_sampling.py`` checks against the model's probabilities. A seed
reproduces the text; another seed changes it; temperature 0 is greedy unchanged; logprobs are the
chosen tokens' log-probabilities under the processed distribution; stop strings end the text.
"""

from __future__ import annotations

import math

import pytest
import torch

import bitmtp
from bitmtp.decoding.drafters import OracleDrafter
from bitmtp.decoding.sampling import SamplingParams, position_uniforms, reference_sample, seed_words
from bitmtp.errors import BitMTPError
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model
from tests.support.stats import chi2_rejects

pytest.importorskip("transformers")

VOCAB = 32
NEW = 14
SEEDS = range(12)


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=5, vocab_size=VOCAB, initializer_range=INIT_RANGE), capacity=128,
                       quantize="ternary")


PROMPTS = ([3, 9, 4, 20, 7], [5, 6, 7, 8] * 4, [30])
#: (policy, drafter, schedule, adapter kind): every verifying configuration
CONFIGS = [
    ("ar", None, None, None),
    ("speculative", "adapter", "two-pass", "mask-block"),
    ("speculative", "adapter", "one-pass", "mask-block"),
    ("speculative", "adapter", "tree", "mask-block"),
    ("speculative", "adapter", "two-pass", "heads"),
    ("speculative", "adapter", "one-pass", "heads"),
    ("speculative", "lookup", "two-pass", None),
    ("speculative", "lookup", "one-pass", None),
    ("speculative", "lookup+adapter", "one-pass", "mask-block"),
    ("speculative", "oracle", "one-pass", None),
    ("auto", None, None, "mask-block"),
    ("hybrid-verify", "adapter", None, "mask-block"),
]

PARAMS = {
    "t1": dict(temperature=1.0),
    "t07-top-p": dict(temperature=0.7, top_p=0.9, top_k=20),
    "penalties": dict(temperature=0.9, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.5,
                      frequency_penalty=0.4),
}


def _gen(model, prompt, seed, policy="ar", drafter=None, schedule=None, block=None, **kw):
    extra = {}
    if policy == "hybrid-verify":  # hybrid with m > D: every block verified (lossless), through hybrid's loop
        policy, extra = "hybrid", {"min_prefix": 17}
    if drafter == "oracle":
        # the oracle guesses the AR sample itself: every guess accepted
        ar = bitmtp.generate(model, input_ids=prompt, max_new_tokens=NEW + 16, eos_token_id=[], seed=seed, **kw)
        drafter = OracleDrafter(model.decoder, prompt + ar.token_ids)
    return bitmtp.generate(model, input_ids=prompt, max_new_tokens=NEW, eos_token_id=[], seed=seed, policy=policy,
                           drafter=drafter, schedule=schedule, block_size=block, **kw, **extra)


def _cases():
    """Every verifying configuration × block × sampling program; lookup's and the oracle's one-pass D = 8 at t1 /
    top-p take 6-25 s each (wide steps): in the slow set, their penalties cases stay in CI."""
    for config in CONFIGS[1:]:
        for block in (2, 4, 8):
            for params in PARAMS:
                slow = (config[1] in ("lookup", "oracle") and config[2] == "one-pass" and block == 8
                        and params != "penalties")
                yield pytest.param(config, block, params, marks=[pytest.mark.slow] if slow else [],
                                   id="-".join(x or "default" for x in config) + f"-{block}-{params}")


@pytest.mark.parametrize("config,block,params", list(_cases()))
def test_every_verifying_policy_samples_exactly_ar(model, config, block, params):
    policy, drafter, schedule, kind = config
    if kind is not None:
        model.load_adapter(random_adapter(model.args, kind, seed=block + 7))
    else:
        model.load_adapter(None)
    kw = PARAMS[params]
    for prompt in PROMPTS:
        for seed in SEEDS:
            ar = _gen(model, prompt, seed, logprobs=True, **kw)
            mtp = _gen(model, prompt, seed, policy, drafter, schedule, block, logprobs=True, **kw)
            assert mtp.token_ids == ar.token_ids, (config, block, params, prompt, seed)
            assert mtp.logprobs == pytest.approx(ar.logprobs, abs=1e-5), (config, block, params, prompt, seed)
            assert mtp.seed == seed


def test_the_oracle_commits_whole_blocks_when_sampling(model):
    """Coupling: a drafter that guesses the sample itself is accepted every time (D tokens per iteration)."""
    model.load_adapter(None)
    out = _gen(model, [3, 9, 4], 7, "speculative", "oracle", "one-pass", 4, temperature=1.0)
    assert out.stats.committed[1:-1] and set(out.stats.committed[1:-1]) == {4}


def test_a_seed_reproduces_and_another_changes_the_text(model):
    model.load_adapter(None)
    a = _gen(model, [3, 9, 4, 20], 11, temperature=1.0)
    assert _gen(model, [3, 9, 4, 20], 11, temperature=1.0).token_ids == a.token_ids
    others = {tuple(_gen(model, [3, 9, 4, 20], s, temperature=1.0).token_ids) for s in range(12, 20)}
    assert len(others - {tuple(a.token_ids)}) >= 6
    drawn = _gen(model, [3, 9, 4, 20], None, temperature=1.0)
    assert isinstance(drawn.seed, int)
    assert _gen(model, [3, 9, 4, 20], drawn.seed, temperature=1.0).token_ids == drawn.token_ids


def test_temperature_zero_is_greedy_unchanged(model):
    model.load_adapter(None)
    g = _gen(model, [3, 9, 4, 20], None)
    assert g.seed is None and g.logprobs is None
    assert _gen(model, [3, 9, 4, 20], 5, temperature=0.0, top_k=3, top_p=0.5).token_ids == g.token_ids


def test_tokens_follow_the_reference_rule_step_by_step(model):
    """Each AR-sampled token is the slow float64 rule's pick (penalties over the history, filters, the
    position's uniform) from the model's own logits, and its logprob is that rule's probability."""
    model.load_adapter(None)
    p = SamplingParams(temperature=0.8, top_k=12, top_p=0.95, min_p=0.01, repetition_penalty=1.2,
                       presence_penalty=0.3, frequency_penalty=0.2, seed=99)
    prompt = [3, 9, 4, 20, 9]
    kw = {k: v for k, v in p.__dict__.items()}
    out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=10, eos_token_id=[], logprobs=True, **kw)
    kv = model.session().engine.kv  # a scratch store: each full forward rewrites rows [0, len(seq))
    seq = list(prompt)
    for i, tok in enumerate(out.token_ids):
        with torch.no_grad():
            logits = model.decoder(_step(seq), kv)[-1]
        u = float(position_uniforms(seed_words(99), torch.tensor([len(seq)]))[0])
        want, prob = reference_sample(logits, p, seq, len(prompt), u)
        assert tok == want, (i, seq)
        assert out.logprobs[i] == pytest.approx(math.log(prob), abs=1e-5)
        seq.append(tok)


def _step(seq):
    from bitmtp.model.decoder import StepInputs

    pos = torch.arange(len(seq))
    return StepInputs(torch.tensor(seq), pos, torch.arange(len(seq))[None, :] <= pos[:, None])


@pytest.mark.parametrize("policy", ("ar", "speculative", "auto"))
def test_stop_strings_need_a_tokenizer(model, policy):
    model.load_adapter(random_adapter(model.args, "mask-block", seed=2))
    with pytest.raises(BitMTPError, match="^stop: .*tokenizer"):
        bitmtp.generate(model, input_ids=[3, 4], max_new_tokens=4, policy=policy, stop=["x"])


@pytest.mark.parametrize("bad", [dict(temperature=-0.5), dict(temperature=float("nan")), dict(top_p=0.0),
                                 dict(top_p=1.5), dict(top_k=-1), dict(top_k=2.5), dict(min_p=-0.1),
                                 dict(repetition_penalty=0.0), dict(presence_penalty=3.0),
                                 dict(frequency_penalty="1"), dict(seed=1.5), dict(seed=True),
                                 dict(stop=""), dict(stop=[1]), dict(logprobs="yes")])
def test_bad_sampling_arguments_name_the_argument(model, bad):
    (name,) = bad
    with pytest.raises(BitMTPError, match=f"^{name}: "):
        bitmtp.generate(model, input_ids=[3, 4], max_new_tokens=2, policy="ar", **bad)


N_EMPIRICAL = 20_000


def _exact_two_token_law(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """``[V, V]``: the exact probability of each first-two-token continuation under ``params`` (the float64
    reference rule's distribution, from the model's own logits; penalties see the first token)."""
    from bitmtp.decoding.sampling import filtered_probs, process_scores

    kv = model.session().engine.kv

    def dist(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model.decoder(_step(seq), kv)[-1:].double()
        seen = torch.bincount(torch.tensor(seq), minlength=VOCAB).double()
        gen = torch.bincount(torch.tensor(seq[len(prompt):], dtype=torch.long), minlength=VOCAB).double()
        probs = filtered_probs(process_scores(logits, params, seen, gen), params)[0]
        return probs / probs.sum()

    first = dist(prompt)
    return torch.stack([first[x] * dist(prompt + [x]) for x in range(VOCAB)])


@pytest.mark.slow
@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[1], CONFIGS[5], CONFIGS[10]],
                         ids=lambda c: "-".join(x or "default" for x in c))
def test_sampled_two_token_law_matches_the_model(model, config):
    """20,000 seeds, two new tokens each: the joint distribution of (x1, x2) passes a chi-square test against
    the exact law computed from the model (cells with expected count < 5 pooled), for AR and for MTP
    (two-pass mask-block, one-pass heads, auto; D = 4). The other drafters and D commit the same tokens
    as AR for every seed (test_every_verifying_policy_samples_exactly_ar), hence the same law."""
    policy, drafter, schedule, kind = config
    model.load_adapter(random_adapter(model.args, kind, seed=11) if kind else None)
    prompt = [3, 9, 4, 20, 7]
    kw = dict(temperature=0.9, top_p=0.95, repetition_penalty=1.3)
    law = _exact_two_token_law(model, prompt, SamplingParams(**kw)).reshape(-1)
    counts = torch.zeros(VOCAB * VOCAB, dtype=torch.long)
    for seed in range(N_EMPIRICAL):
        out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=2, eos_token_id=[], seed=seed, policy=policy,
                              drafter=drafter, schedule=schedule, block_size=4 if kind else None, **kw)
        counts[out.token_ids[0] * VOCAB + out.token_ids[1]] += 1
    assert not chi2_rejects(counts, law)
    # and the test has power: the law at another temperature is rejected
    hot = _exact_two_token_law(model, prompt, SamplingParams(**{**kw, "temperature": 1.2})).reshape(-1)
    assert chi2_rejects(counts, hot)
