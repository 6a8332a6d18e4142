"""Who runs in a batched step (``runtime/batch.py``): admission by KV rows, the prompt rows a step takes, retiring.

:class:`BatchSchedule` holds the sequences waiting for a place and those admitted (prefilling or decoding). Each
admitted sequence owns a contiguous range of KV rows of the batch's one store, reserved for prompt +
max_new_tokens at admission (:class:`RowAllocator`, first fit in blocks of :data:`ALIGN` rows) and freed when it
ends (finish, error or cancel). :meth:`BatchSchedule.parts` says what the next step runs: the prompt rows it
takes (oldest first, at most ``prefill_rows``) and the sequences that decode.

**Prompt prefixes** (where a KV row's bits do not depend on the pass that wrote it, ``reuse``): a new sequence
takes the range a finished one left when its prompt starts with that one's tokens (those rows stay), and before
its prompt rows run it copies the rows of its next tokens from any range that holds them at the same positions —
a running sequence's, or a finished one's kept range (:meth:`BatchSchedule.share`). Eight chat requests arriving
together share their template's system turn: the first prefills it, the others copy it.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any

from bitmtp.errors import BitMTPError
from bitmtp.runtime.batch_seq import BatchSeq
from bitmtp.runtime.kv import reusable_prefix

#: a sequence's KV range starts at a multiple of this many rows (``runtime/batch.py``'s docstring: batch invariance
#: needs a multiple of the CPU attention's 128-row softmax chunk and of the fused GPU attention's 256-row split)
ALIGN = 256


class RowAllocator:
    """Contiguous KV row ranges in blocks of :data:`ALIGN` rows, first fit."""

    def __init__(self, rows: int):
        self.blocks = rows // ALIGN
        if self.blocks < 1:
            raise BitMTPError(f"kv_rows: the batch store needs at least {ALIGN} rows, got {rows}")
        self._used = bytearray(self.blocks)

    @staticmethod
    def blocks_for(rows: int) -> int:
        return -(-rows // ALIGN)

    def alloc(self, rows: int) -> int | None:
        """The first row of a free range of ``rows`` rows (rounded up to blocks), or None when none is free."""
        need = self.blocks_for(rows)
        run = 0
        for b in range(self.blocks):
            run = run + 1 if not self._used[b] else 0
            if run == need:
                first = b - need + 1
                self._used[first : b + 1] = b"\x01" * need
                return first * ALIGN
        return None

    def alloc_at(self, base: int, rows: int) -> bool:
        """Take the range of ``rows`` rows (rounded up to blocks) at ``base`` when all of it is free."""
        first, need = base // ALIGN, self.blocks_for(rows)
        if first + need > self.blocks or any(self._used[first : first + need]):
            return False
        self._used[first : first + need] = b"\x01" * need
        return True

    def free(self, base: int, rows: int) -> None:
        first = base // ALIGN
        self._used[first : first + self.blocks_for(rows)] = bytes(self.blocks_for(rows))

    @property
    def rows_in_use(self) -> int:
        return sum(self._used) * ALIGN


def attention_depth(args: Any) -> float:
    """The context depth at which a row's attention costs as many multiply-adds as its linear layers (a prompt
    row at depth d costs ~1 + d / this of a row at depth 0): SmolLM2 3070 (measured on 2 CPU cores: a 64-row
    prompt chunk takes 136 ms at depth 0, 327 ms at 3584 — 2.4x, the rule says 2.2x)."""
    h, q, kv = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    linear = 2 * h * q + 2 * h * kv + 3 * h * args.intermediate_size
    return linear / (2 * q)  # QK^T and PV: a multiply-add per head dim per head per KV row each


def rows_within(budget: float, depth: int, left: int, scale: float) -> tuple[int, float]:
    """How many of a prompt's ``left`` next rows, the first at ``depth``, fit a budget of ``budget`` rows at depth 0
    when a row costs 1 + ``depth`` / ``scale`` of them (:func:`attention_depth`; each row of a piece priced at its
    first row's depth), and what they cost. A long prompt's rows come in ever smaller pieces, so a step that takes
    them keeps its time (its running sequences their inter-token latency) from the first piece to the last."""
    each = 1 + depth / scale
    rows = min(left, int(max(budget, 0) / each + 1e-9))
    return rows, rows * each


#: one step's work: the prompt rows it takes ((sequence, rows), oldest first) and the sequences it decodes
Part = tuple[list[tuple[BatchSeq, int]], list[BatchSeq]]


class BatchSchedule:
    """The waiting and admitted sequences of a batch over a store of ``rows`` KV rows (module docstring).

    Args:
        rows: KV rows of the store (whole :data:`ALIGN` blocks are used).
        max_batch: most sequences admitted at once.
        capacity: most committed tokens of one sequence.
        prefill_rows: prompt rows a step takes at most (at depth 0; deeper ones count more).
        depth: :func:`attention_depth` of the model (default: rows count alike at every depth).
        vocab_size, device: what an admitted sequence's sampler is made for.
        copy_rows: copies KV rows between ranges (``KVStore.copy_rows(src, dst, count)`` of the batch's store): the
            prompt prefixes sequences share (:meth:`share`).
    """

    def __init__(self, rows: int, *, max_batch: int, capacity: int, prefill_rows: int, vocab_size: int,
                 device: Any, copy_rows: Callable[[int, int, int], None], reuse: bool = False,
                 depth: float = math.inf):
        self.alloc = RowAllocator(rows)
        self.max_batch, self.capacity, self.prefill_rows, self.depth = max_batch, capacity, prefill_rows, depth
        self.vocab_size, self.device = vocab_size, device
        self.waiting: collections.deque[BatchSeq] = collections.deque()
        self.running: list[BatchSeq] = []  # admitted: prefilling or decoding
        #: the prompt-prefix cache (``reuse``: rows whose bits do not depend on the pass that wrote them): by the
        #: first row of a range a finished sequence held, the tokens whose KV rows it left there
        self._reuse: bool | None = reuse
        self._ask_reuse: Callable[[], bool] = lambda: reuse
        self.kept: dict[int, list[int]] = {}
        self.copy_rows = copy_rows

    @property
    def reuse(self) -> bool:
        """Whether KV rows may be reused by a later prompt (their bits do not depend on the pass that wrote them);
        asked of :meth:`reuse_from` at most once a step, when a prompt or a retiring sequence needs it."""
        if self._reuse is None:
            self._reuse = bool(self._ask_reuse())
        return self._reuse

    def reuse_from(self, ask: Callable[[], bool]) -> None:
        """This step's :attr:`reuse` is ``ask()``, asked when first needed (a decode step that admits, retires and
        prefills nothing never asks: ``rows_width_invariant`` costs ~15 µs of a step's host glue)."""
        self._reuse, self._ask_reuse = None, ask

    def admit(self) -> None:
        """Move waiting sequences into the batch, first come first served, while places and rows are free."""
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if seq.cancelled:
                self.waiting.popleft()
                continue
            # the rows its KV may take: prompt + output, at most the capacity (the last token needs none)
            need = min(len(seq.ids) + seq.max_new_tokens, self.capacity)
            base, cached = self._place(seq.ids, need)
            if base is None:
                return  # waits for a sequence to finish (first come first served: no overtaking)
            self.waiting.popleft()
            seq.admitted(base, need, self.capacity, self.vocab_size, self.device)
            seq.n = seq.stats.prompt_cached = cached
            self.running.append(seq)

    def _place(self, ids: list[int], need: int) -> tuple[int | None, int]:
        """Where a prompt's ``need`` rows go, and how many of its first rows are there already: the free range
        left by a finished sequence that shares the longest prefix with it (its rows reused; the prompt's last row
        always runs), else the first free range. Cached ranges the new one overlaps are forgotten."""
        scored = sorted(((reusable_prefix(ids, toks), b) for b, toks in self.kept.items()), reverse=True)
        for cached, b in scored:
            if cached and self.alloc.alloc_at(b, need):
                self._forget(b, need)
                return b, cached
        base = self.alloc.alloc(need)
        if base is not None:
            self._forget(base, need)
        return base, 0

    def _forget(self, base: int, rows: int) -> None:
        end = base + RowAllocator.blocks_for(rows) * ALIGN
        for b in [b for b, toks in self.kept.items() if b < end and base < b + max(len(toks), 1)]:
            del self.kept[b]

    def retire(self, seq: BatchSeq) -> None:
        """``seq`` leaves the batch (finished, failed or cancelled): its rows are free; unless its step failed, the
        tokens of its rows [0, n) are kept for a later prompt that starts with them (with ``reuse``)."""
        if seq in self.running:
            self.running.remove(seq)
            self.alloc.free(seq.base, seq.rows)
            if self.reuse and seq.error is None and seq.n:
                self.kept[seq.base] = (seq.ids + seq.out.tokens)[: seq.n]

    def drop(self, seq: BatchSeq) -> None:
        """``seq`` was cancelled: out of the queue or the batch."""
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.retire(seq)

    def fail(self, fill: list[tuple[BatchSeq, int]], decoding: list[BatchSeq], exc: BaseException) -> None:
        """A step over ``fill``'s prompt rows and the ``decoding`` sequences failed: they end with ``exc`` (the
        others go on)."""
        for seq in [s for s, _ in fill] + decoding:
            seq.error = exc
            self.retire(seq)

    def parts(self, chunk: int = 0) -> list[Part]:
        """What the next step runs, after retiring cancelled sequences and admitting waiting ones: one part — the
        prompt rows it takes (:meth:`prompt_rows`) and every decoding sequence — or, with ``chunk`` (the fused GPU
        step: its rows' bits depend on how rows are grouped into launches), each whole solo-sized prompt chunk a
        part of its own, then the decoding sequences by themselves. Empty when nothing runs."""
        for seq in [s for s in self.running if s.cancelled]:
            self.retire(seq)
        self.admit()
        filling = [s for s in self.running if s.n < len(s.ids)]
        decoding = [s for s in self.running if s.n >= len(s.ids) and s.out.tokens]
        if not chunk:
            return [(self.prompt_rows(filling), decoding)] if filling or decoding else []
        return [([c], []) for c in self.prompt_rows(filling, chunk)] + ([([], decoding)] if decoding else [])

    def prompt_rows(self, filling: list[BatchSeq], chunk: int = 0) -> list[tuple[BatchSeq, int]]:
        """The prompt rows a step takes: (sequence, rows), oldest first, worth :attr:`prefill_rows` rows at depth 0
        at most (a deeper row costs more: :func:`rows_within`) — any split of a prompt (rows are independent of
        what else is in the pass), or with ``chunk`` whole chunks at the solo engine's offsets (at least one).
        With ``reuse``, a prompt first takes the rows another range holds for its next tokens (:meth:`share`), and
        one whose next rows a sequence planned before it in this step is writing waits a step to copy them
        instead of computing them twice (prompts arriving together behind one chat template's system turn)."""
        budget, plan = self.prefill_rows, []
        for seq in filling:
            if budget <= 0:
                break
            if self.reuse and self.share(seq, plan):
                continue
            left = len(seq.ids) - seq.n
            if chunk:
                rows = cost = min(chunk - seq.n % chunk, left)
            else:
                rows, cost = rows_within(budget, seq.n, left, self.depth)
            if plan and (rows < 1 or cost > budget):
                break
            rows = max(rows, 1)
            plan.append((seq, rows))
            budget -= cost
        return plan

    def share(self, seq: BatchSeq, plan: list[tuple[BatchSeq, int]]) -> bool:
        """Copy into ``seq``'s range the rows of the longest prefix of its prompt past its own written rows that
        another range holds — a running sequence's written rows (its prompt and the tokens committed after it),
        a finished one's kept rows — at the same positions, so exactly the rows a prefill would write (``reuse``:
        a row's bits do not depend on the pass that wrote it). Returns whether ``seq`` should wait a step: a
        sequence in ``plan`` writes more of its prefix in this step."""
        best, src = seq.n, -1
        for base, toks in self._holders(seq):
            k = reusable_prefix(seq.ids, toks)
            if k > best:
                best, src = k, base
        if src >= 0:
            self.copy_rows(src + seq.n, seq.base + seq.n, best - seq.n)
            seq.stats.prompt_cached += best - seq.n
            seq.n = best
        return any(reusable_prefix(seq.ids, s.ids[: s.n + r]) > seq.n for s, r in plan)

    def _holders(self, seq: BatchSeq) -> list[tuple[int, list[int]]]:
        """(first row, tokens whose KV rows it holds from there) of every range but ``seq``'s own."""
        held = [(s.base, (s.ids + s.out.tokens)[: s.n]) for s in self.running if s is not seq and s.n > seq.n]
        return held + list(self.kept.items())

    @property
    def rows_in_use(self) -> int:
        return self.alloc.rows_in_use


__all__ = ["ALIGN", "BatchSchedule", "Part", "RowAllocator", "attention_depth", "rows_within"]
