"""Sampling and stop strings on the real model (SmolLM2-135M-Instruct GGUF, with its shipped adapter).

Rules: a stop string is matched in the text, across token boundaries: the text ends right before its first
occurrence, ``stop_reason`` is "stop", the token ids are the fewest whose text contains it, logprobs match
them; a stream yields exactly that text and never text past the stop; the earliest of several stops wins;
a stop that never appears changes nothing. On the real model's native kernels, auto and speculative
sampling commit exactly AR sampling's tokens for a seed.
"""

from __future__ import annotations

import pytest

import bitmtp
from tests.support.smollm2 import smollm2_or_skip

PROMPT = "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_or_skip()
    return bitmtp.load(path, capacity=512)


@pytest.fixture(scope="module")
def full(smollm2):
    return bitmtp.generate(smollm2, PROMPT, max_new_tokens=48, policy="ar")


def _stop_inside(text: str) -> tuple[str, int]:
    """A stop string from the middle of ``text`` (6 characters from its second quarter) and where it first occurs."""
    at = len(text) // 4
    s = text[at : at + 6]
    return s, text.index(s)


@pytest.mark.parametrize("policy", ("ar", "auto", "speculative"))
def test_stop_string_cuts_the_text_before_it(smollm2, full, policy):
    stop, at = _stop_inside(full.text)
    out = bitmtp.generate(smollm2, PROMPT, max_new_tokens=48, policy=policy, stop=[stop], logprobs=True)
    assert out.stop_reason == "stop"
    assert out.text == full.text[:at]
    ids = out.token_ids
    assert ids == full.token_ids[: len(ids)]
    tok = smollm2.tokenizer
    assert stop in tok.decode(ids, skip_special_tokens=True)
    assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)
    assert len(out.logprobs) == len(ids)


def test_a_stream_stops_at_the_stop_string_and_holds_back_its_start(smollm2, full):
    stop, at = _stop_inside(full.text)
    pieces = []
    with bitmtp.generate(smollm2, PROMPT, max_new_tokens=48, policy="ar", stop=stop, stream=True) as s:
        for piece in s:
            pieces.append(piece)
            assert stop[0] not in "".join(pieces)[at:], "text past the stop's start was sent"
    assert "".join(pieces) == full.text[:at]
    assert s.result.stop_reason == "stop" and s.result.text == full.text[:at]
    # the model is free again
    assert bitmtp.generate(smollm2, PROMPT, max_new_tokens=4, policy="ar").token_ids == full.token_ids[:4]


def test_the_earliest_stop_wins_and_an_absent_stop_changes_nothing(smollm2, full):
    stop, at = _stop_inside(full.text)
    later = full.text[at + 10 : at + 16]
    out = bitmtp.generate(smollm2, PROMPT, max_new_tokens=48, policy="ar", stop=[later, stop])
    assert out.text == full.text[:at]
    none = bitmtp.generate(smollm2, PROMPT, max_new_tokens=48, policy="ar", stop=["\u2603never\u2603"])
    assert none.text == full.text and none.token_ids == full.token_ids and none.stop_reason == full.stop_reason


@pytest.mark.parametrize("policy", ("auto", "speculative"))
def test_real_model_sampling_is_ar_sampling(smollm2, policy):
    kw = dict(max_new_tokens=40, temperature=0.7, top_p=0.9, logprobs=True)
    for seed in (1, 2):
        ar = bitmtp.generate(smollm2, PROMPT, policy="ar", seed=seed, **kw)
        mtp = bitmtp.generate(smollm2, PROMPT, policy=policy, seed=seed, **kw)
        assert mtp.token_ids == ar.token_ids, seed
        assert mtp.logprobs == pytest.approx(ar.logprobs, abs=1e-4)
    assert bitmtp.generate(smollm2, PROMPT, policy="ar", seed=3, **kw).token_ids != ar.token_ids
