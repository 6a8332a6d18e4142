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
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
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
