"""Decoding policies against brute-force references (hypothesis), and the hybrid limits."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmtp.decoding import (
    ARPolicy,
    ConfidencePolicy,
    HybridPolicy,
    Plan,
    Policy,
    SpeculativePolicy,
    Verify,
    accept_length,
    confidence_commit,
    confident_prefix,
    get_policy,
    hybrid_uses_verifier,
    policy_names,
    register_policy,
    resolve_policy,
    speculative_accept,
    speculative_commit,
    unregister_policy,
)
from bitmtp.errors import BitMTPError
from bitmtp.runtime.verify_prep import resolve_verify

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
    if tau > 0:  # the policy objects (τ = 0 is not a valid parameter)
        assert ConfidencePolicy(tau=tau).commit(draft, probs, None) == c
        assert SpeculativePolicy().commit(draft, probs, verify) == s
        # hybrid against a brute-force hybrid: verify exactly when fewer than m tokens are confident
        hyb = HybridPolicy(tau=tau, min_prefix=m)
        uses = max(1, brute_h(probs, tau)) < m
        assert hyb.wants_verify(draft, probs) == uses
        assert hyb.commit(draft, probs, verify if uses else None) == (s if uses else c)
        assert HybridPolicy(tau=tau, min_prefix=1).commit(draft, probs, None) == c


@given(st.integers(0, 10**6))
def test_ar_commit(tok):
    c = ARPolicy().commit([tok], [], None)
    assert c.tokens == (tok,) and not c.verified and c.exact_rows == 0


def test_bad_input():
    with pytest.raises(BitMTPError, match="draft"):
        speculative_accept([], [])
    with pytest.raises(BitMTPError, match="verify"):
        speculative_accept([1, 2], [1])
    with pytest.raises(BitMTPError, match="probs"):
        confidence_commit([1, 2], [0.5], 0.9)
    with pytest.raises(BitMTPError, match="verify"):
        HybridPolicy(tau=0.9, min_prefix=2).commit([1, 2], [0.1, 0.1], None)
    with pytest.raises(BitMTPError, match="verify"):
        SpeculativePolicy().commit([1, 2], [0.1, 0.1], None)
    with pytest.raises(BitMTPError, match="verify"):
        ConfidencePolicy().commit([1, 2], [0.1, 0.1], [1, 2])


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
    hyb = HybridPolicy(tau=0.5, min_prefix=2)
    uses = hyb.wants_verify([7, 7, 7, 7], probs)
    assert uses == (max(1, want) < 2)
    assert hyb.commit([7, 7, 7, 7], probs, verify if uses else None).verified == uses


@pytest.mark.parametrize("tau", [0.25, 0.5, 0.9, 1.0])
def test_a_probability_equal_to_tau_is_confident(tau):
    """DESIGN.md: h is the longest prefix with probability ≥ τ — the boundary counts as confident."""
    below = math.nextafter(tau, 0.0)
    assert confident_prefix([tau, tau, below, tau], tau) == 2
    assert confidence_commit([4, 5, 6, 7], [tau, tau, below, tau], tau).tokens == (4, 5)
    assert confident_prefix([below, tau], tau) == 0


# --- one acceptance rule: host and device use accept_length (issue 22) -----------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("d", [1, 2, 3, 8, 16])
def test_accept_length_equals_an_independent_loop(seed, d):
    """Random drafts over a 3-token vocabulary (so agreements run long), batched and one by one, on
    the tensor rule, the host wrapper and the speculative commit, against ``brute_a``."""
    g = torch.Generator().manual_seed(seed * 100 + d)
    draft = torch.randint(0, 3, (64, d), generator=g)
    verify = torch.randint(0, 3, (64, d), generator=g)
    verify[:8, : d - 1] = draft[:8, 1:]  # some rows agree fully: a = D
    want = [brute_a(x, y) for x, y in zip(draft.tolist(), verify.tolist(), strict=True)]
    assert accept_length(draft, verify).tolist() == want
    for x, y, a in zip(draft.tolist(), verify.tolist(), want, strict=True):
        assert int(accept_length(torch.tensor(x), torch.tensor(y))) == a
        assert speculative_accept(x, y) == a
        assert speculative_commit(x, y).tokens == (*x[:a], y[a - 1])
    assert len(set(want)) >= min(d, 3)  # several acceptance lengths occurred


class _Runner:
    """The static buffers ``resolve_verify`` reads and writes (a torch pool's runner, without a model)."""

    def __init__(self, tokens, out_token, positions):
        self.tokens, self.out_token, self.positions = tokens, out_token, positions


@pytest.mark.parametrize("seed", range(20))
def test_device_resolve_uses_the_same_rule(seed):
    """``verify_prep.resolve_verify`` (the on-device resolve) starts the next draft from v_a at
    position (position of d_1) + a, with a from the independent loop."""
    g = torch.Generator().manual_seed(seed)
    d = int(torch.randint(2, 17, (1,), generator=g))
    w = int(torch.randint(2, 17, (1,), generator=g))
    draft = torch.randint(0, 3, (d,), generator=g)
    out = torch.randint(0, 3, (d,), generator=g)
    pos0 = int(torch.randint(0, 400, (1,), generator=g))
    verify = _Runner(draft.clone(), out.clone(), torch.arange(pos0, pos0 + d))
    nxt = _Runner(torch.full((w,), -1), torch.zeros(w, dtype=torch.long), torch.full((w,), -1))
    resolve_verify(verify, nxt, torch.arange(32))
    a = brute_a(draft.tolist(), out.tolist())
    assert nxt.tokens[0].item() == out[a - 1].item() and torch.all(nxt.tokens[1:] == -1)
    assert nxt.positions.tolist() == list(range(pos0 + a, pos0 + a + w))
    # a policy's own rule (the sampling hook) is what the resolve runs when given
    resolve_verify(verify, nxt, torch.arange(32), accept=lambda dr, ve: torch.tensor(d))
    assert nxt.tokens[0].item() == out[d - 1].item() and nxt.positions[0].item() == pos0 + d


# --- the registry and the parameters ----------------------------------------------------------------


def test_registry_holds_the_builtins():
    assert policy_names()[:4] == ("ar", "confidence", "speculative", "hybrid")
    table = {n: (get_policy(n).drafts, get_policy(n).needs_verify, get_policy(n).lossless) for n in policy_names()[:4]}
    assert table == {"ar": (False, False, True), "confidence": (True, False, False),
                     "speculative": (True, True, True), "hybrid": (True, True, False)}
    for name in policy_names()[:4]:
        assert get_policy(name).name == name and resolve_policy(name).name == name


@pytest.mark.parametrize("bad", ["beam", "", "AR", None, 1, ["ar"]])
def test_unknown_policy_lists_the_registered_names(bad):
    with pytest.raises(BitMTPError, match=r"policy: expected one of \('ar', 'confidence'") as err:
        resolve_policy(bad)
    assert repr(bad) in str(err.value)


@pytest.mark.parametrize("tau", [0, -0.5, 1.0001, math.nan, math.inf, "0.9", None])
def test_tau_is_validated(tau):
    for make in (lambda: ConfidencePolicy(tau=tau), lambda: HybridPolicy(tau=tau)):
        with pytest.raises(BitMTPError, match=r"tau: the confidence threshold must be a number in \(0, 1\]"):
            make()
    if tau is not None:  # None is the loose argument's "default"
        for name in ("ar", "speculative", "hybrid"):  # a bad loose τ is an error whatever the policy
            with pytest.raises(BitMTPError, match="tau"):
                resolve_policy(name, tau=tau)


@pytest.mark.parametrize("m", [-1, 2.0, "2", True])
def test_min_prefix_is_validated(m):
    with pytest.raises(BitMTPError, match=r"min_prefix: m must be an integer >= 0 .*leave it out"):
        HybridPolicy(min_prefix=m)
    with pytest.raises(BitMTPError, match="min_prefix"):
        resolve_policy("hybrid", min_prefix=m)


@pytest.mark.parametrize("d", range(2, 17))
def test_hybrid_default_m_is_resolved_once_d_is_known(d):
    unbound = HybridPolicy(tau=0.5)
    assert unbound.params.min_prefix is None
    with pytest.raises(BitMTPError, match="min_prefix: .*bind"):
        unbound.wants_verify([1] * d, [0.1] * d)
    bound = unbound.bind(d)
    assert bound.params.min_prefix == max(2, d // 2) and bound.params.tau == 0.5
    assert HybridPolicy(min_prefix=0).bind(d).params.min_prefix == 0  # an explicit m stays
    assert resolve_policy("hybrid", tau=0.5).bind(d) == bound
    for other in (ARPolicy(), ConfidencePolicy(), SpeculativePolicy()):
        assert other.bind(d) is other


def test_policy_objects_and_loose_arguments():
    assert resolve_policy("confidence", tau=0.25) == ConfidencePolicy(tau=0.25)
    assert resolve_policy("hybrid") == HybridPolicy(tau=0.9, min_prefix=None)
    pol = HybridPolicy(tau=0.5)
    assert resolve_policy(pol) is pol
    for arg in ("tau", "min_prefix"):
        with pytest.raises(BitMTPError, match=f"{arg}: give it to the policy object"):
            resolve_policy(pol, **{arg: 0.5 if arg == "tau" else 3})
    with pytest.raises(BitMTPError, match=r"min_prefix: not a parameter of policy 'confidence'"):
        ConfidencePolicy(min_prefix=3)
    with pytest.raises(BitMTPError, match="HybridParams"):
        HybridPolicy(ConfidencePolicy.Params(0.5))
    assert repr(HybridPolicy(tau=0.5, min_prefix=3)) == "HybridPolicy(tau=0.5, min_prefix=3)"


class _Nameless(Policy):
    pass


class _Clash(Policy):
    name = "hybrid"


@pytest.mark.parametrize("cls, match", [(_Nameless, "name must be"), (_Clash, "already registered"),
                                        (int, "subclass of bitmtp.decoding.Policy")])
def test_register_refuses_bad_classes(cls, match):
    with pytest.raises(BitMTPError, match=match):
        register_policy(cls)
    assert policy_names()[:4] == ("ar", "confidence", "speculative", "hybrid")


class _Probe(Policy):
    """A test-only policy that never drafts beyond d_1: registered and removed by the test."""

    name = "probe-unit"

    def commit(self, draft, probs, verify):
        return ConfidencePolicy(tau=1.0).commit(draft[:1], probs[:1], None)


def test_register_and_unregister():
    register_policy(_Probe)
    try:
        assert policy_names()[-1] == "probe-unit" and get_policy("probe-unit") is _Probe
        register_policy(_Probe)  # registering the same class again is harmless
        pol = resolve_policy("probe-unit", tau=0.5)  # loose arguments it does not declare are ignored
        assert pol.plan(4, None) == Plan(4, Verify.NEVER)
        assert pol.commit([5, 6, 7], [0.2, 1.0, 1.0], None).tokens == (5,)
    finally:
        unregister_policy("probe-unit")
    assert "probe-unit" not in policy_names()
    with pytest.raises(BitMTPError, match="not registered"):
        unregister_policy("probe-unit")
