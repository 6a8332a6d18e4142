"""What a generation gives back: the committed tokens with the stop rules applied (EOS inclusive,
``max_new_tokens``, the KV store's capacity), their log-probabilities, origins and iterations (:class:`Output`), what
the iterations did (:class:`DecodeStats`) and the result (:class:`GenerationResult`).

Every decode loop commits through :meth:`Output.add` — the solo loops (``runtime/decode.py``,
``runtime/two_pass.py``) and each sequence of a batch (``runtime/batch.py``) — so the stop rules are written once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bitmtp.decoding import origins as origin
from bitmtp.decoding.sampling import Sampler


@dataclass
class DecodeStats:
    """What a generation did.

    ``committed``: tokens committed by each iteration (the prefill's first token is not an
    iteration). ``verifier_calls``: iterations that ran a verify step. ``widths``: how many steps ran
    at each width. ``syncs``: device→host reads, prefill included. ``draft_steps``: draft steps run
    (an iteration whose draft was overtaken by a stop found in the previous verify commits nothing
    and is not counted in ``committed``). ``flushes``: verify results read outside an iteration's read.
    """

    policy: str
    block_size: int
    committed: list[int] = field(default_factory=list)
    verified: list[bool] = field(default_factory=list)  # per iteration: did a verify step decide it
    verifier_calls: int = 0
    widths: Counter = field(default_factory=Counter)
    syncs: int = 0
    draft_steps: int = 0
    flushes: int = 0
    seconds: float = 0.0
    tokens: int = 0
    #: the schedule that ran ("two-pass" or "one-pass"; "" for AR)
    schedule: str = ""
    #: one-pass iterations by what they ran: "ar" (no guesses), "lookup", "masks", "oracle", with
    #: "+masks" when mask rows drafted the next guesses
    choices: Counter = field(default_factory=Counter)
    #: guesses verified and accepted (one pass)
    guesses: int = 0
    accepted: int = 0
    #: one pass, guesses drafted by the adapter's mask rows: per guess position j (g_(j+1)), how many steps
    #: checked it (every guess before it accepted) and how many accepted it — the ``top2`` schedule counts
    #: position 0 accepted when g_1 or its runner-up is
    position_checked: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    #: the ``top2`` schedule: runner-up rows verified, and how many of them committed
    runner_ups: int = 0
    runner_ups_accepted: int = 0
    #: what the caller should know about how it decoded (e.g. "auto: no adapter, lookup drafts only")
    notes: list[str] = field(default_factory=list)
    #: prompt tokens whose KV rows the store still held from the previous generation (``Engine.resume``: the
    #: prompt-prefix cache), not prefilled again
    prompt_cached: int = 0

    @property
    def iterations(self) -> int:
        return len(self.committed)

    @property
    def mean_committed(self) -> float:
        """Mean committed tokens per iteration."""
        return sum(self.committed) / len(self.committed) if self.committed else float("nan")

    @property
    def histogram(self) -> dict[int, int]:
        """Committed tokens per iteration → how many iterations committed that many."""
        return dict(sorted(Counter(self.committed).items()))

    @property
    def verifier_rate(self) -> float:
        """Fraction of iterations that ran the verifier."""
        return self.verifier_calls / len(self.committed) if self.committed else float("nan")

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens committed by iterations over the decode time."""
        return sum(self.committed) / self.seconds if self.seconds > 0 else float("nan")

    def record_pass(self, layout: Any, a: int, runner_up: bool, taken: int, fused: str) -> None:
        """A one-pass iteration of ``layout`` (``runtime.pass_layouts``) that accepted ``a`` guesses (or g_1's
        runner-up) and committed ``taken`` tokens."""
        k = layout.k
        self.committed.append(taken)
        self.verified.append(k > 0)
        self.widths[layout.width] += 1
        self.choices[layout.choice(fused)] += 1
        self.verifier_calls += k > 0
        self.guesses += k
        self.accepted += 1 if runner_up else a
        self.runner_ups += layout.alt is not None
        self.runner_ups_accepted += runner_up
        self.draft_steps += layout.plan.masks > 0
        if k and layout.plan.source == "masks":
            self._count_positions(k, 1 if runner_up else a, runner_up)

    def record_batch_step(self, draft: Any, a: int, width: int) -> None:
        """A batched step (``runtime/batch.py``) of ``width`` decode rows in which this sequence's ``draft``
        (``decoding.batch_plan.Draft``: guesses, mask rows) had ``a`` of its rows accepted."""
        guesses = draft.guesses
        self.committed.append(a)
        self.verified.append(bool(guesses))
        self.widths[width] += 1
        self.choices[draft.choice] += 1
        self.verifier_calls += bool(guesses)
        self.guesses += len(guesses)
        self.accepted += a - 1

    def _count_positions(self, k: int, accepted: int, runner_up: bool) -> None:
        """Per guess position (:attr:`position_checked` / :attr:`position_accepted`): a step with ``k`` mask
        guesses of which the first ``accepted`` held checked positions 0..min(accepted, k − 1) — after an
        accepted runner-up the chain's later guesses were drafted after g_1 and are not checked."""
        top = 1 if runner_up else min(accepted + 1, k)
        for lst in (self.position_checked, self.position_accepted):
            lst.extend([0] * (k - len(lst)))
        for j in range(top):
            self.position_checked[j] += 1
            self.position_accepted[j] += j < accepted

    def as_dict(self) -> dict:
        return {"policy": self.policy, "block_size": self.block_size, "iterations": self.iterations,
                "mean_committed": self.mean_committed, "histogram": self.histogram,
                "verifier_calls": self.verifier_calls, "verifier_rate": self.verifier_rate,
                "widths": dict(sorted(self.widths.items())), "syncs": self.syncs, "draft_steps": self.draft_steps,
                "flushes": self.flushes, "tokens_per_second": self.tokens_per_second, "schedule": self.schedule,
                "choices": dict(sorted(self.choices.items())), "guesses": self.guesses, "accepted": self.accepted,
                "position_checked": list(self.position_checked), "position_accepted": list(self.position_accepted),
                "runner_ups": self.runner_ups, "runner_ups_accepted": self.runner_ups_accepted,
                "notes": list(self.notes), "prompt_cached": self.prompt_cached}


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded), why generation stopped, timing and stats."""

    tokens: list[int]
    stop_reason: str  # "eos" | "max_new_tokens" | "capacity"
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stats: DecodeStats
    #: per token, the log-probability of the chosen token under the distribution it was chosen from
    #: (asked for with ``logprobs=True``; see ``bitmtp.runtime.decode.decode``): always finite, ≥
    #: :data:`bitmtp.runtime.output.LOGPROB_FLOOR`
    logprobs: list[float] | None = None
    #: the sampling seed used (None when decoding greedily)
    seed: int | None = None
    #: per token, where it came from (``bitmtp.decoding.origins``: "ar", "lookup", "mask", ...)
    origins: list[str] = field(default_factory=list)
    #: per token, the iteration that committed it (0: the prefill's token; equal steps: one iteration)
    steps: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: generated tokens after the first, over decode time."""
        return max(len(self.tokens) - 1, 0) / self.decode_seconds if self.decode_seconds > 0 else float("nan")


#: the logprob of a probability that underflowed float32 to 0: log(2^-149), the smallest positive float32
#: (an upper bound of the true value). The sampler's chosen tokens always have a probability > 0 (the top
#: score of a finite row gives ≥ 1/V; an inverse-CDF pick lands in a nonempty bin): this is a guard, so that
#: a logprob is always a finite float (JSON has no -Infinity: the server returns these as they are)
LOGPROB_FLOOR = math.log(2.0 ** -149)


def _logprob(p: float) -> float:
    """``log(p)`` of a chosen token's probability, finite: :data:`LOGPROB_FLOOR` for 0 (or a NaN)."""
    return math.log(p) if p > 0 else LOGPROB_FLOOR


class Output:
    """Committed tokens with the stop rules applied (EOS inclusive, max_new_tokens, capacity)."""

    def __init__(self, max_new_tokens: int, eos: set[int], limit: int, sampler: Sampler | None = None,
                 logprobs: bool = False):
        self.tokens: list[int] = []
        self.max_new, self.eos, self.limit = max_new_tokens, eos, limit
        self.reason: str | None = None
        self.sampler = sampler  # counts the committed tokens for its penalties
        self.logprobs: list[float] | None = [] if logprobs else None
        #: per token, where it came from (``bitmtp.decoding.origins``) and the iteration that committed it
        self.origins: list[str] = []
        self.steps: list[int] = []
        self._step = 0

    def add(self, tokens: Sequence[int], probs: Sequence[float] | None = None,
            origins: Sequence[str] | None = None) -> list[int]:
        """Commit ``tokens`` (one iteration's) up to the first stop; ``origins``: one per token (None: all
        the model's own, ``ar``). Returns the tokens taken."""
        taken = []
        for i, t in enumerate(tokens):
            if self.reason is not None:
                break
            self.tokens.append(int(t))
            taken.append(int(t))
            self.origins.append(origins[i] if origins is not None else origin.AR)
            self.steps.append(self._step)
            if self.logprobs is not None and probs is not None:
                self.logprobs.append(_logprob(probs[i]))
            if int(t) in self.eos:
                self.reason = "eos"
            elif len(self.tokens) >= self.max_new:
                self.reason = "max_new_tokens"
            elif len(self.tokens) >= self.limit:
                self.reason = "capacity"
        if taken:  # an iteration overtaken by a stop commits nothing and is no step (as in DecodeStats)
            self._step += 1
        if self.sampler is not None:
            self.sampler.commit(taken)
        return taken


__all__ = ["LOGPROB_FLOOR", "DecodeStats", "GenerationResult", "Output"]
