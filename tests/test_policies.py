"""Decoding policies against brute-force references (hypothesis), and the hybrid limits."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmtp.decoding import (
    ar_commit,
    confidence_commit,
    confident_prefix,
    hybrid_commit,
    hybrid_uses_verifier,
    speculative_accept,
    speculative_commit,
)
from bitmtp.errors import BitMTPError

VOCAB = 4  # a small vocabulary makes draft/verifier agreements frequent


@st.composite
def iteration(draw):
    d = draw(st.integers(2, 16))
    draft = draw(st.lists(st.integers(0, VOCAB - 1), min_size=d, max_size=d))
    verify = draw(st.lists(st.integers(0, VOCAB - 1), min_size=d, max_size=d))
    probs = draw(st.lists(st.floats(0, 1), min_size=d, max_size=d))
    tau = draw(st.floats(0, 1))
    m = draw(st.integers(0, 18))
    return draft, verify, probs, tau, m


def brute_h(probs, tau):
    return max([k for k in range(len(probs) + 1) if all(p >= tau for p in probs[:k])])


def brute_a(draft, verify):
    # the largest a such that every d_(i+1), i < a, equals v_i
    return max(a for a in range(1, len(draft) + 1) if all(draft[i] == verify[i - 1] for i in range(1, a)))


def ar_greedy_reference(draft, verify):
    """What AR greedy would emit, given that verify[i] is the AR argmax after draft[:i+1] and draft[0]
    is the AR argmax itself: follow the draft while AR agrees, then AR's own token."""
    out = [draft[0]]
    for i in range(1, len(draft)):
        if verify[i - 1] != draft[i]:
            out.append(verify[i - 1])
            return out
        out.append(draft[i])
    out.append(verify[-1])
    return out


@settings(max_examples=300, deadline=None)
@given(iteration())
def test_policies_match_brute_force(it):
    draft, verify, probs, tau, m = it
    h = confident_prefix(probs, tau)
    assert h == brute_h(probs, tau)
    c = confidence_commit(draft, probs, tau)
    assert list(c.tokens) == draft[: max(1, h)] and c.exact_rows == 0 and not c.verified
    a = speculative_accept(draft, verify)
    assert a == brute_a(draft, verify)
    s = speculative_commit(draft, verify)
    # lossless: speculative commits exactly the AR greedy continuation
    assert list(s.tokens) == ar_greedy_reference(draft, verify)
    assert s.exact_rows == a and s.verified and len(s.tokens) == a + 1
    # hybrid limits: m > D behaves as speculative, m <= 1 as confidence
    assert hybrid_uses_verifier(h, len(draft) + 1 + m)
    assert not hybrid_uses_verifier(h, min(m, 1))
    assert hybrid_uses_verifier(h, m) == (max(1, h) < m)
    # hybrid_commit against a brute-force hybrid: verify exactly when fewer than m tokens are confident
    brute = s if max(1, brute_h(probs, tau)) < m else c
    assert hybrid_commit(draft, probs, tau, m, verify) == brute
    assert hybrid_commit(draft, probs, tau, len(draft) + 1, verify) == s
    assert hybrid_commit(draft, probs, tau, 1, None) == c


@given(st.integers(0, 10**6))
def test_ar_commit(tok):
    c = ar_commit(tok)
    assert c.tokens == (tok,) and not c.verified


def test_bad_input():
    with pytest.raises(BitMTPError, match="draft"):
        speculative_accept([], [])
    with pytest.raises(BitMTPError, match="verify"):
        speculative_accept([1, 2], [1])
    with pytest.raises(BitMTPError, match="probs"):
        confidence_commit([1, 2], [0.5], 0.9)
    with pytest.raises(BitMTPError, match="verify"):
        hybrid_commit([1, 2], [0.1, 0.1], 0.9, 2, None)


# --- NaN probabilities are never confident (issue 21) ----------------------------------------------


def brute_h_nan(probs, tau):
    """h with NaN spelled out: a token counts only when its probability is a number at least τ."""
    h = 0
    for p in probs:
        if math.isnan(p) or p < tau:
            break
        h += 1
    return h


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_nan_probabilities_are_never_confident(data):
    d = data.draw(st.integers(2, 16))
    probs = data.draw(st.lists(st.one_of(st.floats(0, 1), st.just(math.nan)), min_size=d, max_size=d))
    tau = data.draw(st.floats(0.01, 1))
    at = data.draw(st.integers(0, d - 1))
    probs[at] = math.nan  # at least one NaN, anywhere
    h = confident_prefix(probs, tau)
    assert h == brute_h_nan(probs, tau) and h <= at
    draft = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=d, max_size=d))
    commit = confidence_commit(draft, probs, tau)
    assert commit.tokens == tuple(draft[: max(1, h)])  # nothing past a NaN commits unverified
    m = data.draw(st.integers(2, d))
    if h < m:  # a NaN before the m-th token sends hybrid to the verifier
        assert hybrid_uses_verifier(h, m)


@pytest.mark.parametrize("probs, want", [([math.nan] * 4, 0), ([0.99, math.nan, 0.99, 0.99], 1),
                                         ([0.99, 0.99, 0.99, math.nan], 3), ([math.nan, 1.0, 1.0, 1.0], 0)])
def test_nan_cuts_the_confident_prefix(probs, want):
    assert confident_prefix(probs, 0.5) == want
    verify = [7, 7, 7, 7]
    # hybrid with m = 2: a NaN at d_2 means verification, never a confident commit of it
    commit = hybrid_commit([7, 7, 7, 7], probs, 0.5, 2, verify)
    assert commit.verified == (max(1, want) < 2)


@pytest.mark.parametrize("tau", [0.25, 0.5, 0.9, 1.0])
def test_a_probability_equal_to_tau_is_confident(tau):
    """DESIGN.md: h is the longest prefix with probability ≥ τ — the boundary counts as confident."""
    below = math.nextafter(tau, 0.0)
    assert confident_prefix([tau, tau, below, tau], tau) == 2
    assert confidence_commit([4, 5, 6, 7], [tau, tau, below, tau], tau).tokens == (4, 5)
    assert confident_prefix([below, tau], tau) == 0
