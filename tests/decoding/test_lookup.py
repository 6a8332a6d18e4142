"""Prompt lookup (``bitmtp.decoding.lookup``): the incremental index equals a brute-force search.

Rule: ``propose(k)`` returns the continuation after the LATEST earlier occurrence of the LONGEST suffix
(n = ngram_max down to ngram_min) that occurred before, and the match length; nothing when none did.
"""

from __future__ import annotations

import pytest
import torch

from bitmtp.decoding.lookup import LookupIndex, lookup_proposal
from bitmtp.errors import BitMTPError


def brute_force(seq: list[int], k: int, ngram_max: int, ngram_min: int) -> tuple[list[int], int]:
    size = len(seq)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        suffix = seq[size - n :]
        for start in range(size - n - 1, -1, -1):  # latest earlier occurrence first
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k], n
    return [], 0


@pytest.mark.parametrize("vocab", (2, 5, 40))
@pytest.mark.parametrize("bounds", ((3, 1), (4, 2), (1, 1)))
def test_incremental_index_equals_brute_force(rng, vocab, bounds):
    hi, lo = bounds
    seq = torch.randint(0, vocab, (150,), generator=rng).tolist()
    idx = LookupIndex(seq[:1], ngram_max=hi, ngram_min=lo)
    for i in range(1, len(seq)):
        for k in (1, 3, 8):
            assert idx.propose(k) == brute_force(seq[:i], k, hi, lo), (i, k)
        idx.extend(seq[i : i + 1])
    assert len(idx) == len(seq)


def test_chunks_and_one_shot_agree(rng):
    seq = torch.randint(0, 6, (90,), generator=rng).tolist()
    a = LookupIndex(seq)
    b = LookupIndex()
    for i in range(0, 90, 7):
        b.extend(seq[i : i + 7])
    assert a.propose(5) == b.propose(5) and lookup_proposal(seq, 5) == a.propose(5)[0]


def test_examples():
    assert LookupIndex([1, 2, 3, 9, 1, 2]).propose(3) == ([3, 9, 1], 2)
    assert LookupIndex([7, 8, 9]).propose(2) == ([], 0)
    assert LookupIndex([]).propose(2) == ([], 0)
    assert LookupIndex([4, 4]).propose(2) == ([4], 1)
    assert LookupIndex([1, 2]).propose(0) == ([], 0)


@pytest.mark.parametrize("bad", (dict(ngram_max=0), dict(ngram_min=0), dict(ngram_max=2, ngram_min=3),
                                 dict(ngram_max=True), dict(ngram_max=2.0)))
def test_bad_bounds(bad):
    with pytest.raises(BitMTPError, match="ngram"):
        LookupIndex([1, 2], **bad)
