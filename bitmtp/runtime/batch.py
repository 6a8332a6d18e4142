"""Many sequences in one step: a batched AR decode loop over one KV store (continuous batching).

A :class:`BatchEngine` decodes up to ``max_batch`` sequences together. Each step runs ONE forward pass over
one row per decoding sequence — its pending token at its own position — and the prompt rows it takes (at most
:data:`PREFILL_ROWS`: several short prompts in one step, a long one over several, so running sequences keep
decoding while it comes in); the LM head runs only over the rows whose choice is read. One read of every row's
choice, a commit per sequence; sequences join and leave between steps.

**KV rows.** One store; each sequence owns a contiguous range of rows from admission to its end (finish, error
or cancel), reserved for prompt + max_new_tokens (:class:`RowAllocator`). Ranges start at multiples of
:data:`ALIGN` rows, a multiple of both the CPU attention's softmax chunk (``ops.linear.ATTENTION_CHUNK``: a KV
row's weight is summed by its absolute index) and the fused GPU attention's split: a row at position p of a
sequence based at b has exactly the summation structure it has at p in a solo store; every other part of a
step computes each row alone (integer-exact W2A8, row-wise norms and float kernels: a row's bits do not depend on
the other rows of the pass, ``tests/runtime/test_batch.py`` holds it for steps of prompt and decode rows), so
every row of a batch has the bits of the same row decoded alone (batch invariance: greedy outputs equal solo
outputs, a seed gives the same text). Each row attends through its mask to its own range only.

**Who steps.** There is no scheduler thread: a consumer that needs its sequence's next chunk takes the
engine's lock and, if nothing is queued for it yet, runs one step for every sequence (leader/follower). So
``generate(prompts=[...])`` drives the batch from the calling thread, and in ``serve`` whichever request
thread asks first steps for all of them. Closing a :class:`BatchGeneration` frees its rows at once, or when
the step another thread is running ends; dropping one unclosed frees them at the next step (a finalizer takes
no lock).

**Policies.** ``policy="ar"`` and ``"auto"`` decode batched, both exactly AR's output (greedy, or sampled with
the same seed). ``auto`` adds guess rows to a step — prompt-lookup continuations of a sequence, verified in the
same pass, the accepted ones committed with the token after them (the one-pass rule,
``decoding.accept.speculative_accept``) — best expected accepted tokens first, while a row's expected accepted
tokens exceed what one more row costs the step (``decoding.batch_plan``: ``BatchPlanner`` and its ``StepCost``,
fitted to the steps this engine ran): freely
where a row is nearly free (a GPU), sparingly on 2 CPU cores. With a mask-block adapter, a sequence's step may
also end in mask rows (all sequences' mask rows last in the pass, where the gated LoRA applies) that draft its
next guesses, used after a full accept — the solo one-pass step's layout in its own KV range
(``runtime.batch_rows.StepRows``); not
under the fused GPU step, which drafts by lookup only. Other policies run one sequence at a time
(``bitmtp.api.generate``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from bitmtp.decoding import origins as origin
from bitmtp.decoding.accept import speculative_accept
from bitmtp.decoding.batch_plan import BatchPlanner
from bitmtp.decoding.sampling import SamplingParams
from bitmtp.errors import BitMTPError
from bitmtp.runtime.batch_pass import BatchPass
from bitmtp.runtime.batch_rows import Group, StepRows
from bitmtp.runtime.batch_schedule import ALIGN, BatchSchedule, RowAllocator, attention_depth
from bitmtp.runtime.batch_seq import BatchSeq
from bitmtp.runtime.engine import rows_width_invariant
from bitmtp.runtime.gpu_step import ROWS as GPU_ROWS
from bitmtp.runtime.gpu_step import plan_for
from bitmtp.runtime.kv import KVStore
from bitmtp.runtime.output import DecodeStats

#: how long closing a sequence waits for a running step before leaving its rows to the next step (seconds)
CANCEL_WAIT_S = 5.0
#: the most sequences one forward pass decodes (a row each: the width-invariant kernels' widest step)
MAX_BATCH = 16
#: prompt rows one step takes at most (at depth 0; a deeper row counts more: ``batch_schedule.rows_within``),
#: beside its decode rows: on 2 CPU cores prefill runs ~2.1 ms a row at depth 0 and ~5 ms at depth 3.5k (SmolLM2),
#: so a step holds the running sequences' next token back ~150 ms while prompts come in, however deep
PREFILL_ROWS = 64


class BatchEngine:
    """Decodes many sequences together over one KV store (module docstring).

    Who runs in a step is the :class:`~bitmtp.runtime.batch_schedule.BatchSchedule`'s business (admission by KV
    rows, the prompt rows a step takes), the forward pass and its read the
    :class:`~bitmtp.runtime.batch_pass.BatchPass`'s, which rows ``auto`` adds the
    :class:`~bitmtp.decoding.batch_plan.BatchPlanner`'s; the step itself (:meth:`step`) lays the rows out, runs
    the pass and commits per sequence.

    Args:
        decoder: the model (its torch runtime; the steps run eagerly, on the CPU through the native kernels).
        capacity: most committed tokens of one sequence (prompt + output), as the solo engine's.
        max_batch: most sequences decoded at once (1..16); more wait for a free place.
        kv_rows: rows of the shared store (default ``max_batch`` × the rows one sequence may need); a sequence
            reserves prompt + max_new_tokens rows at admission and waits while they are not free.
        prefill_rows: prompt rows a step takes at most (:data:`PREFILL_ROWS`).
        solo_chunk: the solo engine's prefill width: with the fused GPU step on, prompts are prefilled in its
            chunks (that step's bits depend on how rows are grouped into launches).
        kv_dtype: the store's element type (the solo engine's).
    """

    def __init__(self, decoder: Any, *, capacity: int, max_batch: int = 8, kv_rows: int | None = None,
                 prefill_rows: int = PREFILL_ROWS, solo_chunk: int = 64, kv_dtype: torch.dtype | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH:
            raise BitMTPError(f"max_batch: must be an integer in 1..{MAX_BATCH} (one row per sequence in a step of "
                              f"at most {MAX_BATCH} rows), got {max_batch!r}")
        a = decoder.args
        self.decoder, self.capacity, self.max_batch = decoder, int(capacity), max_batch
        self.solo_chunk = int(solo_chunk)
        per_seq = RowAllocator.blocks_for(self.capacity + 1) * ALIGN
        rows = per_seq * max_batch if kv_rows is None else int(kv_rows)
        if rows < per_seq:
            raise BitMTPError(f"kv_rows: {rows} rows cannot hold one sequence of capacity {capacity} "
                              f"({per_seq} rows); give at least that many")
        self.kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, rows // ALIGN * ALIGN, 1,
                          dtype=kv_dtype or decoder.dtype, device=decoder.device)
        #: the waiting and admitted sequences, and the KV rows they own
        self.schedule = BatchSchedule(rows, max_batch=max_batch, capacity=self.capacity,
                                      prefill_rows=int(prefill_rows), vocab_size=a.vocab_size, device=decoder.device,
                                      copy_rows=self.kv.copy_rows, depth=attention_depth(a))
        #: the steps' forward passes and reads
        self.passes = BatchPass(decoder, self.kv)
        self._lock = threading.Lock()
        #: decode steps run, the rows of the latest, the tokens committed (for /metrics)
        self.steps = 0
        self.last_width = 0
        self.tokens_out = 0
        #: auto's row budget: which guess and mask rows a step adds, from what a row costs (``decoding.batch_plan``)
        self.planner = BatchPlanner(GPU_ROWS)
        #: a sequence's decode commits and the tokens they committed (> 1 a commit: accepted guesses)
        self.decode_commits = 0
        self.decode_tokens = 0

    # ------------------------------------------------------------------------------------------ admission
    def submit(self, ids: Sequence[int], *, max_new_tokens: int, eos: Sequence[int] = (),
               sampling: SamplingParams | None = None, logprobs: bool = False, draft: bool = False,
               masks: Any = None, block_size: int | None = None, notes: Sequence[str] = ()) -> BatchGeneration:
        """Queue a sequence; returns its :class:`BatchGeneration` (chunks of committed tokens, then the
        :class:`~bitmtp.runtime.decode.GenerationResult`). ``draft``: ``auto`` — prompt-lookup guesses verified
        in its rows where they pay (the output is AR's either way); ``masks``: with ``draft``, a mask-block
        adapter module (``model.adapters.MaskBlock``) whose mask rows draft guesses too (on the CPU / per-op path;
        the fused GPU step drafts by lookup only); ``block_size``: with ``draft``, D — a step gives the sequence at
        most D − 1 guesses and D − 1 mask rows, as a solo one-pass step (None: up to the widest step's);
        ``notes``: copied into its stats. Validated here: a prompt that is empty or over
        the capacity raises :class:`BitMTPError` before anything is queued."""
        ids = list(ids)
        if not ids:
            raise BitMTPError("input_ids: the prompt is empty")
        if len(ids) > self.capacity:
            raise BitMTPError(f"input_ids: prompt of {len(ids)} tokens exceeds capacity {self.capacity}")
        if max_new_tokens < 1:
            raise BitMTPError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        params = sampling.with_seed() if sampling is not None and not sampling.greedy else None
        drafting = self.planner.start(ids, masks, block_size) if draft else None
        stats = (DecodeStats("auto", 1 + drafting.max_guesses, schedule="one-pass", notes=list(notes)) if draft
                 else DecodeStats("ar", 1, notes=list(notes)))
        seq = BatchSeq(ids, int(max_new_tokens), set(int(e) for e in eos), params, bool(logprobs), drafting,
                       stats=stats)
        with self._lock:
            self.schedule.waiting.append(seq)
        return BatchGeneration(self, seq)

    # ---------------------------------------------------------------------------------------------- steps
    def step(self) -> None:
        """One scheduling step (the caller holds the lock): retire cancelled sequences, admit waiting ones, and
        run ONE forward pass over the prompt rows this step takes and the decoding sequences' rows (with the
        fused GPU step on, each solo-sized prompt chunk a pass of its own: ``BatchSchedule.parts``); a failed
        pass fails the sequences in it, the others go on."""
        fused = plan_for(self.decoder, self.kv)  # the fused GPU step (opt-in), or None
        # a finished sequence's rows are reused by a prompt that starts with its tokens only where a row's bits do
        # not depend on the pass that wrote it (the native CPU layers, not the fused GPU step)
        self.schedule.reuse_from(lambda: rows_width_invariant(self.decoder, self.kv, fused))
        for fill, decoding in self.schedule.parts(self.solo_chunk if fused is not None else 0):
            try:
                self._run_step(fill, decoding, fused)
            except BaseException as exc:
                self.schedule.fail(fill, decoding, exc)
                raise

    def _run_step(self, fill: list[tuple[BatchSeq, int]], decoding: list[BatchSeq], fused: Any = None) -> None:
        """ONE forward pass: the planned prompt rows, then each decoding sequence's rows (its pending token and
        the guesses the planner gives it), then the mask rows drafting some sequences' next guesses
        (``runtime.batch_rows``); one read; a commit per sequence (a prompt whose last row ran commits its first
        token; a sequence with guesses commits the accepted ones and the token after them). ``fused``: the fused
        GPU step's plan when it is on (the step takes it where a solo step of its rows would)."""
        drafts = self.planner.drafts(decoding, sum(r for _, r in fill), masks_ok=fused is None)
        rows = StepRows.build(fill, decoding, drafts)
        t0 = time.perf_counter()
        tl, pl = self.passes.run(rows, len(fill), fused)
        for seq, n in fill:
            seq.n += n
        if decoding:
            self.steps += 1
            self.last_width = rows.decode_rows
            self.planner.cost.observe(rows.decode_rows, time.perf_counter() - t0, prompt_rows=rows.prompt_rows)
        now = time.perf_counter()
        for g in rows.groups:
            self._commit_group(g, tl, pl, rows.decode_rows, now)

    def _commit_group(self, g: Group, tl: list[int], pl: list[float], width: int, now: float) -> None:
        """A sequence's commit after the step: a prompt's first token, or its accepted guesses and the token after
        them (the one-pass rule, ``decoding.accept``), with what its planner learns."""
        seq = g.seq
        seq.stats.syncs += 1
        if not g.ar_rows:  # the prompt's first token
            seq.prefilled(now)
            self._commit(seq, [tl[g.head]], [pl[g.head]])
            return
        outs = tl[g.head : g.head + g.ar_rows]
        a = speculative_accept([outs[0], *g.tokens[1:]], outs)  # the rule, written once (no guess: a = 1)
        seq.n += a
        if seq.drafting is not None:
            m = slice(g.mask_head, g.mask_head + g.draft.mask_rows)
            self.planner.learn(seq.drafting, g.draft, a, tl[m], pl[m])
        seq.stats.record_batch_step(g.draft, a, width)
        self.decode_commits += 1
        self.decode_tokens += a
        self._commit(seq, outs[:a], pl[g.head : g.head + a], [g.draft.origin] * (a - 1) + [origin.AR])

    def _commit(self, seq: BatchSeq, tokens: list[int], probs: list[float], origins: list[str] | None = None) -> None:
        self.tokens_out += len(seq.commit(tokens, probs, origins))
        if seq.out.reason is not None:
            seq.finish(time.perf_counter())
            self.schedule.retire(seq)

    def _wait_for(self, seq: BatchSeq) -> None:
        """Step until ``seq`` has a chunk queued or is done (the leader/follower loop)."""
        while not seq.chunks and not seq.done:
            with self._lock:
                if seq.chunks or seq.done:
                    return
                try:
                    self.step()
                except BaseException:
                    if seq.done:  # this sequence's own step failed: its caller gets the error below
                        return
                    raise

    def cancel(self, seq: BatchSeq) -> None:
        seq.cancelled = True
        # free the rows now, after the step another thread may be running (its pass uses them): a sequence only
        # marked while another thread steps kept its rows until some later step — none, when that thread's own
        # sequence was its last (a serve test saw 256 rows held after every client was answered). A step that
        # takes longer than CANCEL_WAIT_S leaves the mark to the next step.
        if self._lock.acquire(timeout=CANCEL_WAIT_S):
            try:
                self.schedule.drop(seq)
            finally:
                self._lock.release()

    # --------------------------------------------------------------------------------------------- status
    @property
    def running(self) -> int:
        return len(self.schedule.running)

    @property
    def waiting(self) -> int:
        return len(self.schedule.waiting)

    @property
    def forwards(self) -> int:
        """Forward passes run (prefill chunks + decode steps): tests count one decode forward per step whatever
        the batch."""
        return self.passes.forwards

    @property
    def syncs(self) -> int:
        return self.passes.syncs

    @property
    def launcher(self) -> Any:
        """The fused GPU step's launch counter (``runtime.gpu_step``)."""
        return self.passes.launcher

    @property
    def tokens_per_commit(self) -> float:
        """Tokens a decoding sequence commits a step, on average (1: AR steps only)."""
        return self.decode_tokens / self.decode_commits if self.decode_commits else 1.0

    @property
    def rows_in_use(self) -> int:
        return self.schedule.rows_in_use


class BatchGeneration:
    """One sequence of a :class:`BatchEngine`: an iterator of committed token chunks whose
    ``StopIteration.value`` is the :class:`~bitmtp.runtime.decode.GenerationResult` — the interface of the
    solo engine's ``Generation`` (``bitmtp.api.TextStream`` reads either). Reading it steps the whole batch
    when nothing is queued for it; :meth:`close` (or dropping it) gives its KV rows back."""

    _closed = True  # until __init__ has run (what a finalizer of a half-made one reads)

    def __init__(self, engine: BatchEngine, seq: BatchSeq):
        self._engine, self._seq = engine, seq
        self._closed = False

    @property
    def stats(self) -> DecodeStats:
        return self._seq.stats

    @property
    def report(self) -> dict[str, Any]:
        return self._seq.report

    def __iter__(self) -> BatchGeneration:
        return self

    def __next__(self) -> list[int]:
        seq = self._seq
        if self._closed:
            raise StopIteration
        self._engine._wait_for(seq)
        if seq.chunks:
            return seq.chunks.popleft()
        self._closed = True
        if seq.error is not None:
            raise seq.error
        raise StopIteration(seq.result)

    def close(self) -> None:
        """Stop this sequence and free its KV rows (idempotent)."""
        if not self._closed:
            self._closed = True
            if not self._seq.done:
                self._engine.cancel(self._seq)

    def __del__(self) -> None:
        if not self._closed and not self._seq.done:
            self._seq.cancelled = True  # the next step frees its rows (no lock taken in a finalizer)


__all__ = ["ALIGN", "MAX_BATCH", "BatchEngine", "BatchGeneration", "RowAllocator"]
