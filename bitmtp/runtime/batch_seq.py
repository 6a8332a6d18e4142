"""One sequence of a batch (``runtime/batch.py``): its prompt, KV range, sampler and output, and what it does with
the tokens a step commits for it.

A :class:`BatchSeq` is made by ``BatchEngine.submit``, given its KV range and output at admission
(:meth:`BatchSeq.admitted`, ``runtime.batch_schedule``), and fed by the engine's steps: :meth:`BatchSeq.commit`
takes a step's tokens through its :class:`~bitmtp.runtime.output.Output` (the stop rules shared with the solo
loop) and queues them for its reader; :meth:`BatchSeq.finish` builds its result when the output stops.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

from bitmtp.decoding.batch_plan import Room, SeqDrafting
from bitmtp.decoding.sampling import Sampler, SamplingParams
from bitmtp.runtime.output import DecodeStats, GenerationResult, Output


@dataclass(eq=False)
class BatchSeq:
    """One sequence of the batch: its prompt, KV range, sampler and output."""

    ids: list[int]
    max_new_tokens: int
    eos: set[int]
    params: SamplingParams | None  # sampled (with its seed), or None: greedy
    logprobs: bool
    #: auto: its drafting state (prompt lookup, and a mask-block adapter's mask rows: ``decoding.batch_plan``);
    #: None: AR rows only
    drafting: SeqDrafting | None = None
    base: int = -1  # first KV row of its range (-1: waiting for admission)
    rows: int = 0  # rows reserved
    n: int = 0  # prompt rows prefilled / KV rows written (its next row's position)
    pending: int = -1  # the last committed token, whose KV row the next decode step writes
    sampler: Sampler | None = None
    out: Output | None = None
    stats: DecodeStats = field(default_factory=lambda: DecodeStats("ar", 1))
    chunks: collections.deque = field(default_factory=collections.deque)
    result: GenerationResult | None = None
    error: BaseException | None = None
    cancelled: bool = False
    t_start: float = field(default_factory=time.perf_counter)
    t_prefilled: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.report["stats"] = self.stats

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    @property
    def room(self) -> Room:
        """How far it may draft this step: rows left in its KV range after its pending token's, tokens left
        before its ``max_new_tokens`` after the one the step commits."""
        return Room(self.rows - self.n - 1, self.max_new_tokens - len(self.out.tokens) - 1)

    def admitted(self, base: int, rows: int, capacity: int, vocab_size: int, device: Any) -> None:
        """Given its KV range ``[base, base + rows)``: its sampler (seeded with its prompt) and its output, whose
        token room is what ``capacity`` leaves after the prompt (the last token needs no KV row)."""
        self.base, self.rows = base, rows
        if self.params is not None:
            self.sampler = Sampler(self.params, vocab_size, device)
            self.sampler.start(self.params.seed, self.ids)
        self.out = Output(self.max_new_tokens, self.eos, capacity + 1 - len(self.ids), self.sampler, self.logprobs)
        self.report.update(output=self.out, seed=self.params.seed if self.params is not None else None,
                           prompt_tokens=len(self.ids))

    def prefilled(self, now: float) -> None:
        """Its prompt's last row ran (its first token comes with this step)."""
        self.t_prefilled = now
        self.report["prefill_seconds"] = now - self.t_start

    def commit(self, tokens: list[int], probs: list[float], origins: list[str] | None = None) -> list[int]:
        """A step's tokens for it, through its output's stop rules: returns the ones taken (queued for its reader,
        added to its lookup index); the last one is its next step's pending token."""
        taken = self.out.add(tokens, probs, origins)
        self.chunks.append(taken)
        if self.drafting is not None:
            self.drafting.lookup.extend(taken)
        self.pending = tokens[-1]
        return taken

    def finish(self, now: float) -> None:
        """Its output stopped: its :class:`~bitmtp.runtime.output.GenerationResult`."""
        out, st = self.out, self.stats
        st.seconds = now - (self.t_prefilled or now)
        st.tokens = len(out.tokens)
        self.result = GenerationResult(out.tokens, out.reason or "max_new_tokens", len(self.ids),
                                       self.t_prefilled - self.t_start, st.seconds, st, out.logprobs,
                                       self.params.seed if self.params is not None else None, out.origins,
                                       out.steps)


__all__ = ["BatchSeq"]
