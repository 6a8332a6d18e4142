"""Prompt lookup: drafts from the context (n-gram drafting; ``drafter="lookup"``).

The continuation of the longest recent match of the sequence's suffix in the prompt and the output so
far is a free draft: it costs no model work, and it is right whenever the text repeats itself —
answers that quote a document, summaries, code edits, lists with a fixed pattern.

:class:`LookupIndex` keeps, for every n-gram of the sequence (n = 1..``ngram_max``), where its latest
occurrence was followed, and updates that map as tokens are appended: O(``ngram_max``) dictionary
operations per token, so proposing costs a few microseconds per iteration whatever the context length
(a step of SmolLM2 costs ~10 ms). The longest n-gram that matches wins; among its occurrences, the
latest (recent text predicts the next tokens best).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bitmtp.errors import BitMTPError


class LookupIndex:
    """An n-gram index over a growing token sequence (prompt, then committed output).

    Args:
        tokens: the sequence so far.
        ngram_max: the longest suffix matched (longer matches draft better, shorter ones match more).
        ngram_min: the shortest suffix matched.
    """

    def __init__(self, tokens: Iterable[int] = (), *, ngram_max: int = 3, ngram_min: int = 1):
        for name, v in (("ngram_max", ngram_max), ("ngram_min", ngram_min)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BitMTPError(f"{name}: must be an integer >= 1, got {v!r}")
        if ngram_min > ngram_max:
            raise BitMTPError(f"ngram_min: {ngram_min} exceeds ngram_max {ngram_max}")
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.tokens: list[int] = []
        # n → {n-gram: index of the token that followed its latest occurrence}
        self._next: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram_max + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens. The n-gram ending just before each new token is recorded as followed by it."""
        seq = self.tokens
        maps = self._next
        lo, hi = self.ngram_min, self.ngram_max
        for t in tokens:
            i = len(seq)
            for n in range(lo, min(hi, i) + 1):
                maps[n][tuple(seq[i - n : i])] = i
            seq.append(int(t))

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens continuing the sequence, and the length of the suffix match they come from
        (0 and no tokens when no suffix of length ≥ ``ngram_min`` occurred before)."""
        if k <= 0:
            return [], 0
        seq = self.tokens
        size = len(seq)
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            at = self._next[n].get(tuple(seq[size - n :]))
            if at is not None:
                return seq[at : at + k], n
        return [], 0


def lookup_proposal(tokens: Sequence[int], k: int, *, ngram_max: int = 3, ngram_min: int = 1) -> list[int]:
    """One-shot :meth:`LookupIndex.propose` over ``tokens`` (tests and simulations)."""
    return LookupIndex(tokens, ngram_max=ngram_max, ngram_min=ngram_min).propose(k)[0]
