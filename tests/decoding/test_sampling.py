"""The sampling rule (``bitmtp.decoding.sampling``) on its own.

Rules: the device hash equals the same hash in Python integers; its uniforms are uniform (KS) and
uncorrelated; :meth:`Sampler.select` picks exactly the token the slow float64 reference rule picks, for
awkward shapes and every filter / penalty, with penalties counting the guesses before each AR row.
Lossless, proved two ways on a vocabulary of ≤ 32: exactly (the output law of the shared-uniform rule
is the target p whatever the draft; the coupled acceptance equals the integral of [draft == target]
over u; the issue's known-lossy pairing — argmax drafts accepted with min(1, p/q) of a softmax q —
has a law ≠ p) and empirically with 20,000 samples (a chi-square test that passes for our rule and for
rejection sampling done right, and rejects the known-lossy rule).
"""

from __future__ import annotations

import math

import pytest
import torch

from bitmtp.decoding.sampling import (
    Sampler,
    SamplingParams,
    coupled_acceptance,
    inverse_cdf,
    position_uniforms,
    reference_sample,
    seed_words,
)
from bitmtp.errors import BitMTPError
from tests.support.stats import chi2_rejects

M32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def _uniform(seed: int, pos: int) -> float:
    s = seed % (1 << 64)
    lo, hi = s & M32, s >> 32
    h1 = _mix32((_mix32((pos & M32) ^ lo) + hi + 0x9E3779B9) & M32)
    h2 = _mix32(h1 ^ 0x68BC21EB)
    return (((h1 >> 6) << 27) + (h2 >> 5) + 0.5) * 2.0 ** -53


@pytest.mark.parametrize("seed", [0, 1, 2**31 + 5, 2**63 - 1, -7, 123456789012345])
def test_device_hash_equals_python_integers(seed):
    pos = torch.tensor([0, 1, 2, 77, 4095, 2**20 + 3, 2**31 + 9])
    got = position_uniforms(seed_words(seed), pos).tolist()
    assert got == [_uniform(seed, int(p)) for p in pos]


def test_uniforms_are_uniform_and_uncorrelated():
    n = 20_000
    u = position_uniforms(seed_words(2024), torch.arange(n)).double()
    assert bool(((u > 0) & (u < 1)).all())
    srt = u.sort().values
    grid = torch.arange(1, n + 1, dtype=torch.float64) / n
    ks = float(torch.maximum(grid - srt, srt - (grid - 1 / n)).max())
    assert ks < 1.95 / math.sqrt(n), ks  # KS at alpha = 0.001
    r = float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])
    assert abs(r) < 4 / math.sqrt(n), r
    other = position_uniforms(seed_words(2025), torch.arange(n))
    assert float(torch.corrcoef(torch.stack([u, other]))[0, 1]) < 4 / math.sqrt(n)


PARAMS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=0.7, top_k=9, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=-0.4),
    SamplingParams(repetition_penalty=0.8, frequency_penalty=1.2),  # greedy over penalized logits
]


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: repr(p)[15:60])
@pytest.mark.parametrize("rows", [1, 3, 8, 15, 16])
@pytest.mark.parametrize("vocab", [37, 50])
def test_select_equals_the_reference_rule(params, rows, vocab):
    g = torch.Generator().manual_seed(rows * 100 + vocab)
    logits = torch.randn(rows, vocab, generator=g) * 3
    prompt = torch.randint(0, vocab, (6,), generator=g).tolist()
    output = torch.randint(0, vocab, (4,), generator=g).tolist()
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    positions = torch.arange(rows) + 40
    s = Sampler(params, vocab, torch.device("cpu"))
    s.start(31337, prompt)
    s.commit(output)
    fresh = 1
    tok, prob = s.select(logits, positions, tokens, rows, fresh)
    u = position_uniforms(seed_words(31337), positions + 1).tolist()
    for r in range(rows):
        history = prompt + output + tokens[fresh : r + 1].tolist()
        want, want_p = reference_sample(logits[r], params, history, len(prompt), u[r])
        assert int(tok[r]) == want, (r, params)
        assert float(prob[r]) == pytest.approx(want_p, rel=1e-5)


@pytest.mark.parametrize("scale", [3.0, 0.05], ids=["peaked", "flat"])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_top_p_over_a_large_vocabulary_equals_the_reference(scale, rows):
    """V = 600 > the CPU's 256 top-p candidates: peaked rows take the candidates path, flat rows (the top 256
    hold < top_p) the full sort."""
    params = SamplingParams(temperature=1.0, top_p=0.8)
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 600, generator=g) * scale
    positions = torch.arange(rows) * 7 + 3
    s = Sampler(params, 600, torch.device("cpu"))
    s.start(5, [])
    tok, prob = s.select(logits, positions)
    u = position_uniforms(seed_words(5), positions + 1).tolist()
    for r in range(rows):
        want, want_p = reference_sample(logits[r], params, [], 0, u[r])
        assert int(tok[r]) == want
        assert float(prob[r]) == pytest.approx(want_p, rel=1e-4)


def test_draft_rows_see_only_the_committed_text():
    params = SamplingParams(temperature=1.0, frequency_penalty=2.0)
    logits = torch.zeros(4, 8)
    s = Sampler(params, 8, torch.device("cpu"))
    s.start(1, [0])
    s.commit([3])
    tokens = torch.tensor([3, 5, 5, 6])
    # AR rows 0..1 count tokens[1..r]; rows 2, 3 (drafts) only the committed [3]
    _, prob = s.select(logits, torch.arange(4), tokens, 2, 1)
    scores = [torch.zeros(8) for _ in range(4)]
    for r in range(4):
        scores[r][3] -= 2.0
    scores[1][5] -= 2.0
    want = [torch.softmax(x, 0) for x in scores]
    tok, _ = s.select(logits, torch.arange(4), tokens, 2, 1)
    for r in range(4):
        assert float(prob[r]) == pytest.approx(float(want[r][int(tok[r])]), rel=1e-6)


def test_greedy_params_are_greedy_and_bad_ones_name_themselves():
    assert SamplingParams().greedy and SamplingParams(top_k=3, top_p=0.5).greedy
    assert not SamplingParams(repetition_penalty=1.1).greedy
    with pytest.raises(BitMTPError, match="^temperature: "):
        SamplingParams(temperature=-1)
    with pytest.raises(BitMTPError, match="^seed: "):
        SamplingParams(seed="7")


# -- lossless: exactly ----------------------------------------------------------------------------------


def _dists(vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, 0)
    q = torch.softmax(torch.log(p) + 0.8 * torch.randn(vocab, generator=g, dtype=torch.float64), 0)
    return p, q


def _inv(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    return inverse_cdf(probs.expand(u.numel(), -1), u)[0]


@pytest.mark.parametrize("vocab,seed", [(2, 0), (5, 1), (17, 2), (32, 3), (32, 4)])
def test_exact_acceptance_integral_and_output_law(vocab, seed):
    """Over a fine midpoint grid of u: P(draft == target) is :func:`coupled_acceptance` (the bins' overlap),
    and the committed token (the target's pick, whatever the draft) has law p."""
    p, q = _dists(vocab, seed)
    n = 400_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tp, tq = _inv(p, u), _inv(q, u)
    assert float((tp == tq).double().mean()) == pytest.approx(coupled_acceptance(p, q), abs=3 * vocab / n)
    law = torch.bincount(tp, minlength=vocab).double() / n
    assert float((law - p).abs().max()) <= 2 / n
    # and the draft still helps: the coupled acceptance is at least the maximal coupling's (1 - TV) minus
    # what the vocabulary order costs, and is 1 when q == p
    assert coupled_acceptance(p, p) == pytest.approx(1.0)


def _rejection_law(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The output law of one rejection-sampling step (accept x with min(1, p/q), else draw from
    norm(max(0, p − q))) when the draft is x with probability ``drafts[x]``."""
    resid = (p - q).clamp(min=0)
    resid = resid / resid.sum()
    acc = torch.minimum(torch.ones_like(p), p / q)
    return drafts * acc + (drafts * (1 - acc)).sum() * resid


@pytest.mark.parametrize("vocab,seed", [(5, 1), (17, 2), (32, 3)])
def test_known_lossy_rule_has_another_law(vocab, seed):
    p, q = _dists(vocab, seed)
    right = _rejection_law(p, q, q)  # x drawn from q: lossless (Leviathan et al. 2023)
    assert float((right - p).abs().max()) < 1e-12
    argmax = torch.zeros_like(q)
    argmax[q.argmax()] = 1.0
    lossy = _rejection_law(p, q, argmax)  # argmax draft judged with a softmax q: lossy
    assert 0.5 * float((lossy - p).abs().sum()) > 0.05


# -- lossless: empirically, 20,000 samples --------------------------------------------------------------

N_EMPIRICAL = 20_000


@pytest.mark.parametrize("vocab,seed", [(5, 1), (17, 2), (32, 3)])
def test_empirical_lossless_and_the_lossy_rule_rejected(vocab, seed):
    p, q = _dists(vocab, seed)
    logits_p = torch.log(p).float().expand(N_EMPIRICAL, -1)
    logits_q = torch.log(q).float().expand(N_EMPIRICAL, -1)
    sampler = Sampler(SamplingParams(temperature=1.0), vocab, torch.device("cpu"))
    sampler.start(seed, [])
    positions = torch.arange(N_EMPIRICAL)  # one position per sample: independent uniforms
    target, _ = sampler.select(logits_p, positions)
    draft, _ = sampler.select(logits_q, positions)  # the coupled draft (same uniform)
    committed = torch.where(draft == target, draft, target)  # greedy verification commits the target
    assert not chi2_rejects(torch.bincount(committed, minlength=vocab), p)
    assert float((draft == target).double().mean()) == pytest.approx(coupled_acceptance(p, q), abs=0.02)
    # rejection sampling, right and wrong, with a seeded generator
    g = torch.Generator().manual_seed(seed)

    def rejection(drafts: torch.Tensor) -> torch.Tensor:
        acc = torch.minimum(torch.ones(()), (p / q)[drafts].float())
        resid = (p - q).clamp(min=0)
        fallback = torch.multinomial(resid.float(), N_EMPIRICAL, replacement=True, generator=g)
        ok = torch.rand(N_EMPIRICAL, generator=g) < acc
        return torch.where(ok, drafts, fallback)

    right = rejection(torch.multinomial(q.float(), N_EMPIRICAL, replacement=True, generator=g))
    assert not chi2_rejects(torch.bincount(right, minlength=vocab), p)
    lossy = rejection(torch.full((N_EMPIRICAL,), int(q.argmax())))
    assert chi2_rejects(torch.bincount(lossy, minlength=vocab), p)
