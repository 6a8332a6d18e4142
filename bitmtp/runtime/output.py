"""A generation's output: the committed tokens with the stop rules applied (EOS inclusive, ``max_new_tokens``,
the KV store's capacity), their log-probabilities, origins and iterations.

Every decode loop commits through :meth:`Output.add` — the solo loops (``runtime/decode.py``,
``runtime/two_pass.py``) and each sequence of a batch (``runtime/batch.py``) — so the stop rules are written once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bitmtp.decoding import origins as origin
from bitmtp.decoding.sampling import Sampler

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


__all__ = ["LOGPROB_FLOOR", "Output"]
