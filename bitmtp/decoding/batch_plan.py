"""MTP budgeted by batch: which guess rows and mask rows ``auto`` adds to a batched step (``runtime/batch.py``).

A batched step runs one row per decoding sequence (its pending token). :class:`BatchPlanner` adds rows where they
pay: a sequence's guesses — the previous step's mask drafts or prompt-lookup continuations, whichever it expects
more of first — are offered one row at a time, most likely accepted first, while a row's expected accepted tokens
exceed what one more row costs the step in tokens (:class:`StepCost`: the step's expected tokens × the relative
cost of one more row), so a GPU, where a row is nearly free, drafts freely and 2 CPU cores sparingly. Then a
sequence with a mask-block adapter gets mask rows where their drafts' expected accepted tokens next step, times the
chance this step accepts every guess, pay for the rows, or as a periodic re-try. Each sequence's own estimates
(:class:`SeqDrafting`) start from the batch's and learn from its steps (:meth:`BatchPlanner.learn`); a sequence tries
its first lookup match, and again after EXPLORE_EVERY steps per sequence in the batch without lookup guesses (as a
solo generation does), whatever its estimates say — so estimates that other traffic held too low to try recover.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any

from bitmtp.decoding import origins as origin
from bitmtp.decoding.auto import (
    DRAFT_MARGIN,
    EXPLORE_EVERY,
    LOOKUP_PRIOR,
    MASK_MARGIN,
    MASK_PRIOR,
    STEP_TIMES_KEPT_S,
    mask_bucket,
)
from bitmtp.decoding.lookup import LookupIndex

#: the most draft positions a sequence's estimates track (a step has at most 16 rows)
MAX_POSITIONS = 15
#: prior chance that a sequence's j-th mask draft is accepted with the drafts before it (j = 0..14): the middle
#: probability bucket's prior (``decoding.auto.MASK_PRIOR``) compounded, so mask rows are bought on evidence
MASK_POS_PRIOR = tuple(MASK_PRIOR[1] ** (j + 1) for j in range(MAX_POSITIONS))


class StepCost:
    """What one more row costs a decode step, relative to the step: ``marginal(w) = t(w + 1) / t(w) − 1``.

    ``t(w)`` is the seconds the engine's steps of width ``w`` took (a running mean) once it ran three of them and
    the last within :data:`~bitmtp.decoding.auto.STEP_TIMES_KEPT_S` seconds (``clock``), else the line ``a + b·w``
    fitted to all its steps (least squares, older steps fading); until two widths were seen, the prior: a width-8
    step costs 2.7 width-1 steps (SmolLM2 on 2 CPU cores: b / a ≈ 0.24). Per-width
    times see what a line averages away: widths up to a kernel tile cost little more than one row and the next
    one a lot (SmolLM2 on 2 CPU cores, relative to width 2: 1.15 at 3, 1.25 at 4, 1.6 at 5). The solo
    calibration table (``runtime.calibration``) is not used: measured on solo steps, it put width 8 at 1.67
    width-1 steps where batched steps take 2.3 (chat at batch 2 drafted too much: 0.91x batched AR)."""

    PRIOR = 0.24
    #: steps of one width before their own mean replaces the line
    MIN_SEEN = 3

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.clock = clock
        self.n = self.sw = self.st = self.sww = self.swt = 0.0
        #: width -> (running mean seconds, steps, when the last was seen); a width not run for STEP_TIMES_KEPT_S
        #: seconds is priced by the line again and its mean starts over (``decoding.auto.STEP_TIMES_KEPT_S``)
        self.seen: dict[int, tuple[float, int, float]] = {}

    def observe(self, width: int, seconds: float, prompt_rows: int = 0) -> None:
        """A decode step of ``width`` rows took ``seconds``; one that also ran ``prompt_rows`` prompt rows says
        nothing of what decode rows cost (ignored)."""
        if prompt_rows:
            return
        decay = 0.98
        self.n, self.sw, self.st = decay * self.n + 1, decay * self.sw + width, decay * self.st + seconds
        self.sww, self.swt = decay * self.sww + width * width, decay * self.swt + width * seconds
        now = self.clock()
        mean, count, last = self.seen.get(width, (seconds, 0, now))
        if now - last > STEP_TIMES_KEPT_S:
            mean, count = seconds, 0
        self.seen[width] = (mean + (seconds - mean) / min(count + 1, 8), count + 1, now)

    def _line(self) -> tuple[float, float] | None:
        if len(self.seen) >= 2:
            den = self.n * self.sww - self.sw * self.sw
            if den > 0:
                b = max((self.n * self.swt - self.sw * self.st) / den, 0.0)
                a = (self.st - b * self.sw) / self.n
                if a > 0:
                    return a, b
        return None

    def seconds(self, width: int) -> float | None:
        """A width-``width`` step's seconds (None before the line can be fitted and with no steps of it)."""
        mean, count, last = self.seen.get(width, (0.0, 0, 0.0))
        if count >= self.MIN_SEEN and self.clock() - last <= STEP_TIMES_KEPT_S:
            return mean
        line = self._line()
        return line[0] + line[1] * width if line is not None else None

    def marginal(self, width: int) -> float:
        t0, t1 = self.seconds(width), self.seconds(width + 1)
        if t0 is not None and t1 is not None and t0 > 0:
            return max(t1 - t0, 0.0) / t0
        return self.PRIOR / (1 + self.PRIOR * width)


@dataclass(frozen=True)
class Draft:
    """What :meth:`BatchPlanner.drafts` gives a decoding sequence for a step."""

    guesses: list[int] = field(default_factory=list)
    source: str = ""  # where the guesses come from: "lookup" or "masks" ("": none)
    p_all: float = 1.0  # the chance every guess is accepted
    mask_rows: int = 0  # mask rows drafting its next guesses
    ngram: int = 1  # lookup guesses: the length of the n-gram match they came from

    @property
    def choice(self) -> str:
        """The step's kind in ``DecodeStats.choices`` (as a solo step's: ``"ar"`` without guesses, ``+masks``
        with mask rows)."""
        return (self.source or "ar") + ("+masks" if self.mask_rows else "")

    @property
    def origin(self) -> str:
        """Where its accepted guesses came from (``decoding.origins``)."""
        return origin.MASK if self.source == "masks" else origin.LOOKUP


NO_DRAFT = Draft()


@dataclass
class SeqDrafting:
    """A drafting sequence's state: its lookup index, the mask drafts of its last step, and its own acceptance
    estimates (started from the batch's)."""

    lookup: LookupIndex
    lookup_alpha: dict[int, float]  # its lookup guesses' acceptance (each given the ones before it) by n-gram length
    mask_alpha: list[float]  # its mask drafts' acceptance by probability bucket (``decoding.auto.mask_bucket``)
    mask_pos: list[float]  # the chance its j-th mask draft is accepted with every draft before it
    block: Any = None  # the mask-block adapter module whose mask rows draft for it (None: lookup only)
    #: most guesses (and mask rows) a step gives it: D − 1, as a solo one-pass step of block size D
    max_guesses: int = MAX_POSITIONS
    mask_drafts: list[int] = field(default_factory=list)  # the last step's mask drafts (valid after a full accept)
    mask_probs: list[float] = field(default_factory=list)
    since_masks: int = 0  # decode steps since its last mask rows (a re-try every EXPLORE_EVERY)
    #: decode steps since its last lookup guesses (a re-try every EXPLORE_EVERY): a new sequence tries its first
    #: match whatever its estimates say (they start from the batch's, which other traffic may hold too low to try)
    since_lookup: int = EXPLORE_EVERY * 16


@dataclass
class Room:
    """How far a decoding sequence may draft this step: rows left in its KV range after its pending token's, and
    tokens left before its ``max_new_tokens`` after the one this step commits."""

    rows: int
    tokens: int


def _chain(alpha: list[float], probs: list[float]) -> list[float]:
    """Each guess's chance to be accepted with every guess before it, for mask drafts of these probabilities."""
    out, p = [], 1.0
    for q in probs:
        p *= alpha[mask_bucket(q)]
        out.append(p)
    return out


class BatchPlanner:
    """``auto``'s row budget in a batch (module docstring). ``max_rows``: the widest step (16)."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.cost = StepCost()
        #: the batch's running estimates over every sequence (a new sequence's priors)
        self.lookup_alpha = dict(LOOKUP_PRIOR)
        self.mask_alpha = list(MASK_PRIOR)
        self.mask_pos = list(MASK_POS_PRIOR)

    def start(self, ids: list[int], block: Any = None, block_size: int | None = None) -> SeqDrafting:
        """A new drafting sequence's state (``block``: the mask-block adapter module whose mask rows draft;
        ``block_size``: D, so that a step gives it at most D − 1 guesses and D − 1 mask rows, as a solo one-pass
        step; None: up to the widest step's)."""
        most = MAX_POSITIONS if block_size is None else max(1, int(block_size) - 1)
        return SeqDrafting(LookupIndex(ids, ngram_max=5), dict(self.lookup_alpha), list(self.mask_alpha),
                           list(self.mask_pos), block, most)

    def drafts(self, decoding: list[Any], prompt_rows: int, masks_ok: bool = True) -> dict[int, Draft]:
        """Guess rows and mask rows for a step of ``prompt_rows`` prompt rows and the ``decoding`` sequences (each
        with its ``drafting`` state — None for one that does not draft — and its :class:`Room`), by ``id`` of the
        sequence (module docstring); ``masks_ok``: mask rows may run (not under the fused GPU step). At most
        ``max_rows`` rows a step."""
        seqs = [(id(s), s.drafting, s.room) for s in decoding]
        width = prompt_rows + len(seqs)
        expected = float(len(seqs))
        offers = []  # (expected tokens of the row, sequence, its draft up to its j-th guess)
        for key, sd, room in seqs:
            if sd is None:
                continue
            left = min(room.rows, room.tokens, self.max_rows - 1, sd.max_guesses)
            if left <= 0:
                continue
            chains = []
            if sd.mask_drafts:
                chains.append(("masks", sd.mask_drafts[:left], _chain(sd.mask_alpha, sd.mask_probs[:left])))
            guesses, ngram = sd.lookup.propose(left)
            if guesses:
                alpha = sd.lookup_alpha[ngram]
                chains.append(("lookup", guesses, [alpha ** (j + 1) for j in range(len(guesses))]))
            if chains:
                source, guesses, gains = max(chains, key=lambda c: c[2][0])
                # a lookup re-try, as a solo generation's: its first guess row whatever it is expected to pay
                probe = source == "lookup" and sd.since_lookup >= EXPLORE_EVERY * len(seqs)
                offers += [(math.inf if probe and j == 0 else gains[j], key,
                            Draft(guesses[: j + 1], source, gains[j], 0, ngram)) for j in range(len(guesses))]
        offers.sort(key=lambda o: -o[0])
        chosen: dict[int, Draft] = {}
        for gain, key, draft in offers:  # a chain's j-th guess comes after its (j-1)-th: gains fall along it
            if width >= self.max_rows or gain <= DRAFT_MARGIN * expected * self.cost.marginal(width):
                break
            if len(draft.guesses) != len(chosen.get(key, NO_DRAFT).guesses) + 1:
                continue
            chosen[key] = draft
            width += 1
            expected += draft.p_all
        if masks_ok:
            self._mask_offers(seqs, chosen, width, expected)
        return chosen

    def _mask_offers(self, seqs: list[tuple[int, SeqDrafting | None, Room]], chosen: dict[int, Draft], width: int,
                     expected: float) -> None:
        """Add mask rows to ``chosen``. A sequence's j-th mask row is worth the chance this step accepts all its
        guesses × the chance its draft is accepted next step (``mask_pos[j]``), over two rows (it and the guess
        row that verifies its draft): offered like the guesses, best first, a sequence's rows in order, while
        worth more than a row costs (by :data:`~bitmtp.decoding.auto.MASK_MARGIN`); a sequence without mask rows
        for EXPLORE_EVERY steps per sequence in the batch gets one (the batch re-tries about once per
        EXPLORE_EVERY steps, as a solo generation does)."""
        block = next((sd.block for _, sd, _ in seqs if sd is not None and sd.block is not None), None)
        if block is None:
            return
        offers = []
        for key, sd, room in seqs:
            d = chosen.get(key, NO_DRAFT)
            if sd is None or sd.block is not block:
                continue
            m = min(block.block_size - 1, sd.max_guesses, room.rows - len(d.guesses), room.tokens - len(d.guesses))
            if m < 1:
                continue
            explore = sd.since_masks >= EXPLORE_EVERY * len(seqs)  # one re-try per EXPLORE_EVERY steps
            offers += [(math.inf if explore and j == 0 else d.p_all * sd.mask_pos[j] / 2, key, j + 1)
                       for j in range(m)]
        offers.sort(key=lambda o: -o[0])
        for gain, key, rows in offers:
            if width >= self.max_rows or gain <= MASK_MARGIN * expected * self.cost.marginal(width):
                break
            d = chosen.get(key, NO_DRAFT)
            if rows != d.mask_rows + 1:
                continue
            chosen[key] = dataclasses.replace(d, mask_rows=rows)
            width += 1

    def learn(self, sd: SeqDrafting, draft: Draft, a: int, drafts: list[int], draft_probs: list[float]) -> None:
        """A drafting sequence's step accepted ``a`` of its 1 + len(guesses) rows: the acceptance of the guess
        source it verified (its own and the batch's), and its next guesses from its mask rows (``drafts``, valid
        only when every row was accepted: they assumed so)."""
        guesses = draft.guesses
        if guesses:
            # each checked guess (those before it accepted): a mask draft by its probability bucket, a lookup guess
            # by the length of the match it came from
            if draft.source == "masks":
                own, shared, keys = sd.mask_alpha, self.mask_alpha, [mask_bucket(p) for p in sd.mask_probs]
            else:
                own, shared, keys = sd.lookup_alpha, self.lookup_alpha, [draft.ngram] * len(guesses)
            for i in range(min(a, len(guesses))):
                ok = float(i < a - 1)
                own[keys[i]] = 0.85 * own[keys[i]] + 0.15 * ok
                shared[keys[i]] = 0.97 * shared[keys[i]] + 0.03 * ok
        sd.since_masks = 0 if draft.mask_rows else sd.since_masks + 1
        sd.since_lookup = 0 if draft.source == "lookup" else sd.since_lookup + 1
        for j, value in enumerate(_chain(sd.mask_alpha, draft_probs)):
            sd.mask_pos[j] = 0.7 * sd.mask_pos[j] + 0.3 * value
            self.mask_pos[j] = 0.95 * self.mask_pos[j] + 0.05 * value
        full = bool(draft.mask_rows) and a == 1 + len(guesses)
        sd.mask_drafts, sd.mask_probs = (drafts, draft_probs) if full else ([], [])


__all__ = ["MASK_POS_PRIOR", "NO_DRAFT", "BatchPlanner", "Draft", "Room", "SeqDrafting", "StepCost"]
