"""Decoding policies as small pure functions (DESIGN.md, "One iteration").

A draft step yields D tokens ``d_1..d_D`` with probabilities ``p_1..p_D``: ``d_1`` is the argmax of
the last pending row — exactly the AR prediction — and ``d_2..d_D`` come from the mask rows. A
verify step (AR-causal over ``d_1..d_D``) yields ``v_1..v_D``, where ``v_i`` is the AR argmax after
``d_1..d_i``. Lists here are 0-based: ``draft[i]`` is ``d_(i+1)``, ``verify[i]`` is ``v_(i+1)``.

These functions only decide; the engine executes (KV bookkeeping, pending suffix).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bitmtp.errors import BitMTPError

POLICIES = ("ar", "confidence", "speculative", "hybrid")


@dataclass(frozen=True)
class Commit:
    """What one iteration commits.

    ``tokens``: committed in order. ``exact_rows``: how many leading committed tokens already have
    exact KV rows (their rows came from an AR-causal verify step and stay; the rest become the
    pending suffix and are recomputed). ``verified``: whether a verify step ran.
    """

    tokens: tuple[int, ...]
    exact_rows: int
    verified: bool


def _check_draft(draft: Sequence[int], name: str = "draft") -> None:
    if len(draft) < 1:
        raise BitMTPError(f"{name}: needs at least one token")


def confident_prefix(probs: Sequence[float], tau: float) -> int:
    """h: the length of the longest prefix of the draft whose every probability is ≥ τ.

    A NaN probability (a broken draft: NaN logits) is never confident: the test is ``p >= tau``, which
    is False for NaN, rather than ``p < tau``, which would be False too and count it as confident.
    """
    h = 0
    for p in probs:
        if not p >= tau:  # the first draft token not at the threshold (or NaN) ends the confident prefix
            break
        h += 1
    return h


def confidence_commit(draft: Sequence[int], probs: Sequence[float], tau: float) -> Commit:
    """Commit ``d_1..d_max(1, h)`` without verification.

    ``d_1`` is the AR prediction itself, so at least one token always commits even when nothing
    reaches τ. The committed tokens' KV came from mask rows (not AR-causal), so none of their rows
    is exact: they all become the pending suffix and are recomputed by the next draft step.
    """
    _check_draft(draft)
    if len(probs) != len(draft):
        raise BitMTPError(f"probs: {len(probs)} probabilities for {len(draft)} draft tokens")
    count = max(1, confident_prefix(probs, tau))
    return Commit(tuple(int(t) for t in draft[:count]), exact_rows=0, verified=False)


def speculative_accept(draft: Sequence[int], verify: Sequence[int]) -> int:
    """a = 1 + the longest i with ``d_(i+1) == v_i`` for all of 1..i (the verifier agrees with the draft).

    ``d_1`` is always accepted: it is the AR prediction. ``d_(i+1)`` is accepted only while every
    earlier draft token was, and the verifier's AR argmax after ``d_1..d_i`` equals it.
    """
    _check_draft(draft)
    if len(verify) != len(draft):
        raise BitMTPError(f"verify: {len(verify)} verifier tokens for {len(draft)} draft tokens")
    a = 1
    while a < len(draft) and int(draft[a]) == int(verify[a - 1]):
        a += 1
    return a


def speculative_commit(draft: Sequence[int], verify: Sequence[int]) -> Commit:
    """Commit ``d_1..d_a`` and the verifier's next token ``v_a`` (lossless: exactly AR greedy).

    The verify step ran AR-causally over ``d_1..d_D``, so the rows of ``d_1..d_a`` are exact and stay
    (n += a); ``v_a`` becomes the pending suffix.
    """
    a = speculative_accept(draft, verify)
    return Commit(tuple(int(t) for t in draft[:a]) + (int(verify[a - 1]),), exact_rows=a, verified=True)


def hybrid_uses_verifier(h: int, min_prefix: int) -> bool:
    """Hybrid: commit by confidence when the confident prefix reaches m tokens, otherwise verify.

    The prefix counted is ``max(1, h)``: ``d_1`` is the AR prediction and commits in every policy,
    so it always counts. Hence hybrid with m ≤ 1 is exactly confidence-only, and with m > D (no
    prefix can reach m) exactly speculative-only.
    """
    return max(1, h) < min_prefix


def ar_commit(next_token: int) -> Commit:
    """AR: one step of width 1 commits its argmax; the fed token's row was AR-causal, so it stays."""
    return Commit((int(next_token),), exact_rows=0, verified=False)


def hybrid_commit(draft: Sequence[int], probs: Sequence[float], tau: float, min_prefix: int,
                  verify: Sequence[int] | None) -> Commit:
    """Hybrid: the confidence commit when ``max(1, h) ≥ m``, otherwise the speculative commit.

    ``verify`` (the verifier's argmaxes) is only consulted — and must only be given — when the
    verifier runs; pass ``None`` when the caller has not run it yet and check
    :func:`hybrid_uses_verifier` first.
    """
    if not hybrid_uses_verifier(confident_prefix(probs, tau), min_prefix):
        return confidence_commit(draft, probs, tau)
    if verify is None:
        raise BitMTPError("verify: hybrid needs the verifier's tokens when the confident prefix is shorter than m")
    return speculative_commit(draft, verify)
