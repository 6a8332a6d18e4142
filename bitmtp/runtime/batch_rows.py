"""A batched step's rows (``runtime/batch.py``): who has which rows, in what order, and what each row sees.

Rows come in three runs: the prompt rows the step takes (several prompts, or part of a long one), then each
decoding sequence's pending token and the guesses its draft gives it (AR-causal rows at its next positions), then
every mask row (the gated LoRA applies to the last rows of a pass). :class:`StepRows` lays them out and records,
per sequence, its :class:`Group`: where its rows sit and which of their choices are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from bitmtp.decoding.batch_plan import NO_DRAFT, Draft


@dataclass(eq=False)
class Group:
    """A sequence's rows in a step: from row ``first``, its ``tokens`` at ``positions``; ``ar_rows``: 0 for a
    prompt's last row (its first token), else 1 + its guesses (rows AR-causal over the step's tokens)."""

    seq: Any
    first: int
    tokens: list[int]
    positions: list[int]
    ar_rows: int
    draft: Draft = NO_DRAFT  # its guesses (tokens[1:]) and mask rows
    head: int = 0  # its first row among the rows whose choices are read
    mask_head: int = 0  # its first mask row among them

    @property
    def read_rows(self) -> int:
        """Its rows whose choices are read: every AR row, or a prompt's last."""
        return self.ar_rows or 1


@dataclass
class StepRows:
    """Every row of one step: token, position and its sequence's first KV row (``bases``); ``reach``: the last
    position each row sees (None: its own — every row AR-causal); ``heads``: the rows whose choices are read."""

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    bases: list[int] = field(default_factory=list)
    groups: list[Group] = field(default_factory=list)
    heads: list[int] = field(default_factory=list)
    reach: list[int] | None = None
    prompt_rows: int = 0
    mask_rows: int = 0
    block: Any = None  # the adapter module of the mask rows

    @classmethod
    def build(cls, fill: list[tuple[Any, int]], decoding: list[Any], drafts: dict[int, Draft]) -> StepRows:
        """The rows of ``fill`` ((sequence, prompt rows) taken this step) and of the ``decoding`` sequences with
        their ``drafts`` (by ``id``)."""
        r = cls()
        for seq, rows in fill:
            r._add(seq, seq.ids[seq.n : seq.n + rows], seq.n)
            if seq.n + rows == len(seq.ids):  # its last prompt row: the first token (prefill rows are not AR rows)
                r.groups.append(Group(seq, len(r.tokens) - 1, [seq.ids[-1]], [len(seq.ids) - 1], 0))
        r.prompt_rows = len(r.tokens)
        for seq in decoding:
            d = drafts.get(id(seq), NO_DRAFT)
            rows = [seq.pending, *d.guesses]
            r.groups.append(Group(seq, len(r.tokens), rows, list(range(seq.n, seq.n + len(rows))), len(rows), d))
            r._add(seq, rows, seq.n)
        for g in r.groups:
            g.head = len(r.heads)
            r.heads += range(g.first, g.first + g.read_rows)
        r._add_mask_rows([g for g in r.groups if g.draft.mask_rows])
        return r

    def _add(self, seq: Any, tokens: list[int], at: int) -> None:
        self.tokens += tokens
        self.positions += range(at, at + len(tokens))
        self.bases += [seq.base] * len(tokens)

    def _add_mask_rows(self, masked: list[Group]) -> None:
        """The mask rows of the ``masked`` groups, after every other row (their choices read). A group's mask rows
        sit at the positions after its last row (the positions after the token its step commits on a full
        accept): each drafts the token one position on, seeing its sequence up to the block's end (the solo
        one-pass step's layout, ``MaskBlockDrafter.block_mask``). Their token ids are ignored (the mask
        embedding) and their KV rows lie in the sequence's own range, rewritten before any row reads them."""
        if not masked:
            return
        reach = list(self.positions)
        for g in masked:
            m, last = g.draft.mask_rows, g.positions[-1]
            g.mask_head = len(self.heads)
            self.heads += range(len(self.tokens), len(self.tokens) + m)
            self.tokens += [0] * m
            self.positions += range(last + 1, last + 1 + m)
            self.bases += [g.seq.base] * m
            reach += [last + m] * m
        self.reach = reach
        self.mask_rows = sum(g.draft.mask_rows for g in masked)
        self.block = masked[0].seq.drafting.block

    @property
    def decode_rows(self) -> int:
        """Rows of decoding sequences (guesses and mask rows included)."""
        return len(self.tokens) - self.prompt_rows


__all__ = ["Group", "StepRows"]
