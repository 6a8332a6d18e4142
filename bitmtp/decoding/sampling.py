"""Sampling that every decoding policy runs exactly: one uniform per position, shared by drafts and targets.

A sampled token is a deterministic function of the step's logits and of one uniform number
``u(seed, position)`` (:func:`position_uniforms`, a counter-based hash: no generator state). The
processed distribution ``p`` of a row (penalties → temperature → top-k → top-p → min-p, the order of
transformers' ``generate``) is sampled by the inverse CDF: the token ``x`` whose cumulative bin
``[F(x − 1), F(x))`` holds ``u``. So

* **AR sampling** draws each token from ``p`` (``u`` is uniform and independent across positions);
* **every verifying policy is lossless and reproducible**: a verify row computes the same ``p`` and the
  same ``u`` as the AR step at that position would, so its "argmax" output — the sampled token — is AR
  sampling's token, and the decode loop's greedy acceptance (guess == the row before's output) commits
  exactly AR's sample, token for token, for any seed and any drafter. The drafts only change how many
  tokens an iteration commits;
* **drafts are coupled to the targets**: a draft row samples its own distribution ``q`` with the *same*
  ``u`` as the target it guesses, so where ``q`` ≈ ``p`` the two land in the same bin and the draft is
  accepted (the acceptance probability is the overlap of the two CDFs' bins, :func:`coupled_acceptance`).

This is the "shared randomness + greedy verification" alternative of the issue (Gumbel-max keyed by
(seed, position) is the other form of it). Gumbel-max needs one hashed noise value per vocabulary
entry and row — ~49k int64 hash evaluations per row, several milliseconds per width-16 step on this
CPU against a ~10 ms step — where the inverse CDF needs one cumulative sum per row and one hash per row.
Rejection sampling (accept with min(1, p/q)) would make a seed's text depend on the drafter and the
block size; here it does not.

What the unverified policies do at T > 0: ``d_1`` is always the AR sample (its row is AR-causal);
``confidence`` and ``hybrid`` commit later drafts ``d_2..`` whose probability under the drafter's
processed distribution is ≥ τ without verifying them — samples from the drafter's ``q``, not the
model's ``p`` (lossy, as at T = 0). Their verify steps stay exact.

Penalties need the text before each row: ``repetition_penalty`` (transformers': prompt and output),
``presence_penalty`` / ``frequency_penalty`` (OpenAI's: output tokens only). The sampler keeps counts of
the committed tokens on the device (:meth:`Sampler.commit`); an AR-causal row of a multi-row step adds
the step's own earlier tokens (guesses) to them, so a verify row sees exactly the history the AR step
would. Draft rows use the committed counts only (any ``q`` is lossless).

Float limits (every accepted parameter value gives finite scores, never inf or NaN — issue 42):

* **temperature** below :data:`GREEDY_TEMPERATURE` (2^-126 ≈ 1.18e-38, float32's smallest normal number)
  *is* greedy decoding, exactly as T = 0: the same tokens (ties broken as the argmax breaks them), the
  same logprobs (the model's probabilities) and no seed. Such a T cannot even be held faithfully by the
  float32 scores (1e-40 is subnormal, 1e-300 rounds to 0: ``s / T`` was inf or NaN, and the sampler
  collapsed to token 0), and at it softmax(s / T) already puts all its mass on the top score(s). Above
  it, the scores are shifted by their row maximum before the division (``(s − max) / T`` ≤ 0, the top
  score exactly 0), so ``s / T`` can no longer overflow to +inf; a score that still overflows towards
  −inf (probability below float32's resolution) saturates at −3.4e38. Huge T (1e38, 1e308: inf in
  float32) gives the uniform distribution over the unfiltered tokens.
* **repetition_penalty** in float32's normal range is computed in float32, bit for bit as transformers
  does; a penalized logit that overflows saturates at ±3.4e38 (float32's largest finite value): such
  tokens then tie, and the argmax / the sampler's CDF order picks among them. A penalty outside that range
  (1e-300, 5e-324, 1e300: 0 or inf in float32, which gave 0/0 and 0·inf = NaN) is applied in float64 with
  its exact value and saturated the same way.
* **presence / frequency penalties** are bounded ([-2, 2] × a count below the KV capacity) and cannot
  leave float32's range; values below float32's smallest subnormal (~1.4e-45: 1e-300, 5e-324) round to 0
  (off), float32 subnormals subtract what they are.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from bitmtp.errors import BitMTPError
from bitmtp.ops.threads import torch_ops_inline

_M32 = 0xFFFFFFFF
#: CPU top-p: candidates sorted per row before falling back to a full sort (a full sort of a 49k
#: vocabulary costs ~2 ms per row here; the top 256 hold p = 0.9 of nearly every LM row)
_TOP_P_CANDIDATES = 256
#: float32's largest finite value: where processed scores saturate instead of overflowing to ±inf
FLOAT32_MAX = torch.finfo(torch.float32).max
#: float32's smallest normal number, 2^-126 ≈ 1.18e-38 (smaller values lose precision, then round to 0)
FLOAT32_TINY = torch.finfo(torch.float32).tiny
#: temperatures below this are greedy decoding (module docstring, "Float limits")
GREEDY_TEMPERATURE = FLOAT32_TINY


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. The defaults are greedy decoding (temperature 0, no penalties).

    Every finite value in the ranges below is accepted and gives finite scores (never inf / NaN; see the
    module docstring's "Float limits"); anything else raises a BitMTPError naming the parameter and range.

    Args:
        temperature: ≥ 0; 0 picks the most likely token (greedy), > 0 samples from softmax(logits / T).
            T below :data:`GREEDY_TEMPERATURE` (2^-126 ≈ 1.18e-38; 1e-40, 1e-300, 5e-324 …) is the greedy
            limit: exactly T = 0 (same tokens, ties and logprobs; no seed). Huge T (up to 1.8e308) samples
            uniformly from the tokens the filters keep.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1: all).
        min_p: keep tokens whose probability is ≥ min_p × the most likely one's (0: all).
        repetition_penalty: > 0; transformers' rule over prompt and output tokens: a seen token's logit
            is divided by it when positive, multiplied when negative (1: off). Extreme values (1e-300,
            1e300, subnormals) saturate a penalized logit at ±3.4e38 (float32's largest) instead of
            overflowing; tokens saturated alike tie, and greedy picks the lowest id among them.
        presence_penalty / frequency_penalty: OpenAI's rule over output tokens: logit −= presence ×
            [count > 0] + frequency × count (0: off), each in [-2, 2].
        seed: the same seed gives the same text under every policy, drafter and block size
            (None: a fresh random seed, reported in the output).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if not _is_num(t) or t < 0:
            raise BitMTPError(f"temperature: must be a number >= 0 (0: greedy), got {t!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise BitMTPError(f"top_k: must be an integer >= 0 (0: no top-k filter), got {self.top_k!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise BitMTPError(f"top_p: must be a number in (0, 1] (1: no nucleus filter), got {self.top_p!r}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise BitMTPError(f"min_p: must be a number in [0, 1] (0: no min-p filter), got {self.min_p!r}")
        rp = self.repetition_penalty
        if not _is_num(rp) or rp <= 0:
            raise BitMTPError(f"repetition_penalty: must be a number > 0 (1: off; 1.1 discourages repeats), "
                              f"got {rp!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                raise BitMTPError(f"{name}: must be a number in [-2, 2] (0: off), got {v!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise BitMTPError(f"seed: must be an integer (or None for a random one), got {self.seed!r}")
        object.__setattr__(self, "temperature", float(t))
        for name in ("top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def samples(self) -> bool:
        """Whether tokens are sampled rather than picked by argmax: T ≥ :data:`GREEDY_TEMPERATURE` (a smaller
        T > 0 is the greedy limit, decoded exactly as T = 0)."""
        return self.temperature >= GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether any penalty changes the logits (they then depend on the text before each row)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        """Plain greedy decoding: the runtime's argmax path, untouched."""
        return not self.samples and not self.penalized

    def program(self) -> SamplingParams:
        """These parameters without the seed: what a captured step bakes in (the seed is a device tensor)."""
        return SamplingParams(**{**asdict(self), "seed": None})

    def with_seed(self) -> SamplingParams:
        """These parameters with a seed: the given one, else a fresh random one (63 bits)."""
        if self.seed is not None:
            return self
        return SamplingParams(**{**asdict(self), "seed": int.from_bytes(os.urandom(8), "little") >> 1})


def _mul32(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x · m mod 2^32`` for int64 ``x`` in [0, 2^32) without int64 overflow (16-bit halves of m)."""
    return (x * (m & 0xFFFF) + (((x * (m >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (Wellons' lowbias32): every input bit flips each output bit with p ≈ 1/2."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def seed_words(seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The seed as two 32-bit words in an int64 tensor ``[2]`` (any Python int: taken mod 2^64)."""
    s = int(seed) % (1 << 64)
    return torch.tensor([s & _M32, s >> 32], dtype=torch.long, device=device)


def position_uniforms(seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``u(seed, position)`` in (0, 1) as float64 (53 random bits), elementwise over ``positions``.

    ``seed``: :func:`seed_words`. A pure function of its inputs (no generator): the AR step and a verify
    row that sample the same position draw the same number, on any device, inside a captured graph too.
    """
    x = positions.to(torch.long) & _M32
    h1 = _mix32((_mix32(x ^ seed[0]) + seed[1] + 0x9E3779B9) & _M32)
    h2 = _mix32(h1 ^ 0x68BC21EB)
    bits = (h1 >> 6) * (1 << 27) + (h2 >> 5)  # 26 + 27 bits
    return (bits.to(torch.float64) + 0.5) * (2.0 ** -53)


def process_scores(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                   generated: torch.Tensor | None = None) -> torch.Tensor:
    """Penalties and temperature over float32 ``logits [R, V]``: the scores the filters and softmax see.

    ``seen`` / ``generated``: per-row token counts ``[R, V]`` (or ``[V]``) of the text before each row —
    prompt + output for the repetition penalty, output only for presence / frequency.

    Finite logits give finite scores for every accepted parameter value (the module docstring's "Float
    limits"): penalized logits saturate at ±:data:`FLOAT32_MAX`, and tempered ones are shifted so the
    row's top score is exactly 0.
    """
    s = penalized_scores(logits, params, seen, generated)
    return _tempered(s, params.temperature) if params.samples else s


def penalized_scores(logits: torch.Tensor, params: SamplingParams, seen: torch.Tensor | None = None,
                     generated: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`process_scores` before the temperature: the ranking top-k keeps (a huge T collapses the
    tempered scores to ties in float32 — (s − max) / 1e39 is 0 for every s — without changing the ranking
    it stands for)."""
    s = logits.float()
    if params.repetition_penalty != 1 and seen is not None:
        s = torch.where(seen > 0, _repetition_penalized(s, params.repetition_penalty), s)
    if (params.presence_penalty != 0 or params.frequency_penalty != 0) and generated is not None:
        # |penalty| ≤ 2 times a count below the KV capacity: far below float32's spacing near ±3.4e38
        # (2^104), so even a saturated score cannot be pushed over the edge
        s = s - params.presence_penalty * (generated > 0).float() - params.frequency_penalty * generated
    return s


def _as_float32(x: float) -> float:
    """``x`` rounded to float32, as torch rounds a Python scalar that meets a float32 tensor."""
    return float(torch.tensor(x, dtype=torch.float32))


def _repetition_penalized(s: torch.Tensor, rp: float) -> torch.Tensor:
    """Every entry of float32 ``s`` penalized (divided by ``rp`` when ≥ 0, multiplied when < 0), finite."""
    r32 = _as_float32(rp)
    if FLOAT32_TINY <= r32 <= FLOAT32_MAX:
        # float32 arithmetic with rp rounded to float32: the same bits as transformers' processor (greedy
        # ties against it included). A nonzero finite factor cannot make NaN; only overflow can go wrong
        # (s / rp for rp < 1, s · rp for rp > 1), and it saturates
        return torch.where(s < 0, s * r32, s / r32).clamp_(-FLOAT32_MAX, FLOAT32_MAX)
    # rp is 0, subnormal or inf in float32 (1e-300, 1e-40, 1e300): float32 would compute 0/0 or 0·inf =
    # NaN. float64 holds every finite rp exactly; the result saturates to float32's range
    d = s.double()
    return torch.where(d < 0, d * rp, d / rp).clamp_(-FLOAT32_MAX, FLOAT32_MAX).float()


def _tempered(s: torch.Tensor, t: float) -> torch.Tensor:
    """``s / t`` for the softmax, shifted so each row's top score is exactly 0 (softmax is shift-invariant).

    Plain ``s / t`` overflows to +inf once |s| > t · 3.4e38 — a logit of 4 at t = 1.2e-38, of 340 at
    t = 1e-36 — and softmax then computes inf − inf = NaN. Shifted, every score is ≤ 0; one that overflows
    towards −inf has a probability below float32's resolution (exp(−104) is 0) and saturates at
    −:data:`FLOAT32_MAX`. ``t`` ≥ :data:`GREEDY_TEMPERATURE` is a nonzero float32; a t beyond float32's range
    (1e39 … 1.8e308) rounds to inf and gives zeros (the uniform distribution), never inf / inf.
    """
    shifted = (s - s.amax(dim=-1, keepdim=True)).clamp_(min=-FLOAT32_MAX)
    return (shifted / t).clamp_(min=-FLOAT32_MAX)


def filtered_probs(scores: torch.Tensor, params: SamplingParams, ranks: torch.Tensor | None = None) -> torch.Tensor:
    """Probabilities ``[R, V]`` after top-k, top-p and min-p (unnormalized: filtered entries are 0, the rest
    keep their softmax value; the sampler divides by the row total).

    ``ranks``: the scores top-k ranks by, the untempered :func:`penalized_scores` (default ``scores``; the
    temperature preserves the ranking in exact arithmetic, but a huge one turns it into ties in float32)."""
    if params.top_k and params.top_k < scores.shape[-1]:
        r = scores if ranks is None else ranks
        kth = r.topk(params.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(r < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        probs = probs.masked_fill(probs < _top_p_threshold(probs, params.top_p), 0.0)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _top_p_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Per row ``[R, 1]``: the probability of the token at which the descending cumulative sum first
    reaches ``top_p`` (every token at least that likely is kept: the nucleus, ties included)."""
    v = probs.shape[-1]
    k = min(v, _TOP_P_CANDIDATES)
    if probs.device.type == "cpu" and k < v:
        vals = probs.topk(k, dim=-1).values  # sorted descending
        cum = vals.cumsum(-1)
        if bool((cum[:, -1] >= top_p).all()):
            at = (cum < top_p).sum(-1, keepdim=True).clamp_(max=k - 1)
            return vals.gather(-1, at)
    # a full sort: CUDA always (no host-side branch inside a captured graph), the CPU for flat rows
    vals = probs.sort(dim=-1, descending=True).values
    cum = vals.cumsum(-1)
    at = (cum < top_p).sum(-1, keepdim=True).clamp_(max=v - 1)
    return vals.gather(-1, at)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample each row of unnormalized ``probs [R, V]`` with its uniform ``u [R]``: the token whose
    cumulative bin holds ``u · total``; returns (token ids, their normalized probabilities)."""
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    target = (u.to(cdf.dtype).unsqueeze(-1) * total)
    tok = (cdf < target).sum(-1).clamp_(max=probs.shape[-1] - 1)
    prob = probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1) / total.squeeze(-1)
    return tok, prob


def coupled_acceptance(p: torch.Tensor, q: torch.Tensor) -> float:
    """The probability that the inverse-CDF samples of ``p`` and ``q`` with one shared uniform agree (a
    draft from ``q`` accepted against a target from ``p``): the summed overlap of each token's two bins."""
    p = p.double() / p.double().sum()
    q = q.double() / q.double().sum()
    zero = torch.zeros(1, dtype=torch.float64)
    fp, fq = torch.cat([zero, p.cumsum(0)]), torch.cat([zero, q.cumsum(0)])
    lo = torch.maximum(fp[:-1], fq[:-1])
    hi = torch.minimum(fp[1:], fq[1:])
    return float((hi - lo).clamp(min=0).sum())


class Sampler:
    """One pool's sampling state: the parameters a step bakes in, the seed (a device tensor) and the
    committed-token counts, reset per generation by :meth:`start` and kept current by :meth:`commit`."""

    def __init__(self, params: SamplingParams, vocab_size: int, device: torch.device):
        self.params = params.program()
        self.vocab_size = int(vocab_size)
        self.seed = torch.zeros(2, dtype=torch.long, device=device)
        pen = self.params
        with torch_ops_inline():  # vocabulary-wide fills: no OpenMP region (bitmtp.ops.threads)
            self.seen = torch.zeros(vocab_size, device=device) if pen.repetition_penalty != 1 else None
            self.generated = (torch.zeros(vocab_size, device=device)
                              if pen.presence_penalty != 0 or pen.frequency_penalty != 0 else None)

    @property
    def needs_history(self) -> bool:
        """Whether a row's distribution depends on the committed text (penalties): the decode loop must then
        commit tokens on the host before the next step samples (no verify resolved unseen on the device)."""
        return self.params.penalized

    def start(self, seed: int, prompt: list[int]) -> None:
        """A new generation: its seed; the prompt counts for the repetition penalty."""
        self.seed.copy_(seed_words(seed))
        with torch_ops_inline():  # vocabulary-wide fills: no OpenMP region (bitmtp.ops.threads)
            if self.seen is not None:
                self.seen.zero_()
                self._count(self.seen, prompt)
            if self.generated is not None:
                self.generated.zero_()

    def commit(self, tokens: list[int]) -> None:
        """Committed output tokens (counted for every penalty)."""
        if not tokens:
            return
        for counts in (self.seen, self.generated):
            if counts is not None:
                self._count(counts, tokens)

    def _count(self, counts: torch.Tensor, tokens: list[int]) -> None:
        ids = torch.as_tensor(tokens, dtype=torch.long).to(counts.device)
        counts.index_add_(0, ids, torch.ones(ids.numel(), device=counts.device))

    def _row_counts(self, counts: torch.Tensor, rows: int, tokens: torch.Tensor | None, ar_rows: int,
                    fresh_from: int | torch.Tensor) -> torch.Tensor:
        """``[rows, V]``: the committed counts, plus for AR row r < ``ar_rows`` the step's tokens
        ``tokens[fresh_from..r]`` (guesses before that row: not committed yet, but its history)."""
        if tokens is None or ar_rows == 0:
            return counts.expand(rows, -1)
        j = torch.arange(ar_rows, device=counts.device)
        inc = ((j[None, :] <= j[:, None]) & (j[None, :] >= fresh_from)).float()
        extra = torch.zeros(ar_rows, counts.shape[0], device=counts.device)
        extra.scatter_add_(1, tokens[:ar_rows].unsqueeze(0).expand(ar_rows, -1), inc)
        full = counts.expand(rows, -1).clone()
        full[:ar_rows] += extra
        return full

    def select(self, logits: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor | None = None,
               ar_rows: int = 0, fresh_from: int | torch.Tensor = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens and their probabilities for ``logits [R, V]`` whose rows sit at ``positions [R]`` (row r
        chooses the token at position ``positions[r] + 1``).

        ``tokens``, ``ar_rows``, ``fresh_from``: rows ``[0, ar_rows)`` are AR-causal over the step's input
        ``tokens``, of which ``tokens[fresh_from:]`` are not committed yet (guesses): their penalties count
        them (see :meth:`_row_counts`). Other rows (drafts) see the committed counts only.
        """
        p = self.params
        rows = logits.shape[0]
        seen = self._row_counts(self.seen, rows, tokens, ar_rows, fresh_from) if self.seen is not None else None
        gen = (self._row_counts(self.generated, rows, tokens, ar_rows, fresh_from)
               if self.generated is not None else None)
        pen = penalized_scores(logits, p, seen, gen)
        if not p.samples:
            prob, tok = torch.softmax(pen, dim=-1).max(dim=-1)
            return tok, prob
        probs = filtered_probs(_tempered(pen, p.temperature), p, pen)
        return inverse_cdf(probs, position_uniforms(self.seed, positions + 1))


def reference_sample(logits: torch.Tensor, params: SamplingParams, history: list[int], prompt_len: int,
                     u: float) -> tuple[int, float]:
    """One token the slow, obvious way (float64, a full sort, Python loops): the rule :class:`Sampler`
    implements, for tests. ``history``: prompt + output so far (the first ``prompt_len`` are the prompt)."""
    s = logits.double().clone()
    v = s.shape[0]
    if params.repetition_penalty != 1:
        rp = params.repetition_penalty
        r32 = _as_float32(rp)
        rp = r32 if FLOAT32_TINY <= r32 <= FLOAT32_MAX else rp  # the factor the sampler uses
        for t in set(history):
            x = float(s[t]) * rp if s[t] < 0 else float(s[t]) / rp
            s[t] = min(max(x, -FLOAT32_MAX), FLOAT32_MAX)  # saturated, as the sampler does
    out = history[prompt_len:]
    for t in set(out):
        s[t] -= params.presence_penalty + params.frequency_penalty * out.count(t)
    if not params.samples:
        probs = torch.softmax(s, 0)
        return int(probs.argmax()), float(probs.max())
    ranks = s.float()  # what the sampler ranks by: the float32 penalized scores
    s = ((s - s.max()).clamp(min=-FLOAT32_MAX) / params.temperature).clamp(min=-FLOAT32_MAX)
    if params.top_k and params.top_k < v:
        kth = sorted(ranks.tolist(), reverse=True)[params.top_k - 1]
        s = torch.where(ranks < kth, torch.tensor(float("-inf"), dtype=s.dtype), s)
    probs = torch.softmax(s, 0)
    if params.top_p < 1:
        desc = sorted(probs.tolist(), reverse=True)
        acc, thr = 0.0, desc[-1]
        for x in desc:
            acc += x
            if acc >= params.top_p:
                thr = x
                break
        probs = torch.where(probs < thr, torch.zeros_like(probs), probs)
    if params.min_p > 0:
        probs = torch.where(probs < params.min_p * probs.max(), torch.zeros_like(probs), probs)
    probs = probs / probs.sum()
    acc = 0.0
    for t in range(v):
        acc += float(probs[t])
        if u < acc and probs[t] > 0:
            return t, float(probs[t])
    last = int(torch.nonzero(probs).max())
    return last, float(probs[last])
