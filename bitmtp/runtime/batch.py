"""Many sequences in one step: a batched AR decode loop over one KV store (continuous batching).

A :class:`BatchEngine` decodes up to ``max_batch`` sequences together. Each step runs ONE forward pass over
one row per decoding sequence — its pending token at its own position — reads every row's choice in one
transfer and commits per sequence; sequences join and leave between steps. A new sequence's prompt is
prefilled in chunks of the solo engine's width (forward passes of their own, so its rows have the solo bits),
so running sequences keep decoding while a long prompt comes in.

**KV rows.** One store; each sequence owns a contiguous range of rows from admission to its end (finish, error
or cancel), reserved for prompt + max_new_tokens (:class:`RowAllocator`). Ranges start at multiples of
:data:`ALIGN` rows, a multiple of both the CPU attention's softmax chunk (``ops.linear.ATTENTION_CHUNK``: a KV
row's weight is summed by its absolute index) and the fused GPU attention's split: a row at position p of a
sequence based at b has exactly the summation structure it has at p in a solo store, so every row of a batch
has the bits of the same row decoded alone (batch invariance: greedy outputs equal solo outputs, a seed gives
the same text). Each row attends through its mask to its own range only.

**Prefill.** Prompt chunks go before the step's decode row set, oldest first, up to one chunk's rows a step (at
least one chunk): several short prompts join in one step, a long one comes in one chunk a step.

**Who steps.** There is no scheduler thread: a consumer that needs its sequence's next chunk takes the
engine's lock and, if nothing is queued for it yet, runs one step for every sequence (leader/follower). So
``generate(prompts=[...])`` drives the batch from the calling thread, and in ``serve`` whichever request
thread asks first steps for all of them. Dropping or closing a :class:`BatchGeneration` frees its rows at the
next step.

**Policies.** Steps are AR: ``policy="ar"`` and ``"auto"`` (whose output is exactly AR's, greedy or sampled
with the same seed) decode batched; draft rows inside a batched step are not built yet (the batching issue's
"MTP budgeted by batch"), so ``auto`` in a batch never drafts. Other policies run one sequence at a time
(``bitmtp.api.generate``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bitmtp.decoding.sampling import Sampler, SamplingParams
from bitmtp.errors import BitMTPError
from bitmtp.model.decoder import StepInputs
from bitmtp.ops.choose import argmax_prob
from bitmtp.ops.threads import step_threads
from bitmtp.runtime.decode import DecodeStats, GenerationResult, _Output
from bitmtp.runtime.kv import KVStore

#: a sequence's KV range starts at a multiple of this many rows (module docstring: batch invariance needs a
#: multiple of the CPU attention's 128-row softmax chunk and of the fused GPU attention's 256-row split)
ALIGN = 256
#: the most sequences one forward pass takes (a row each: the width-invariant kernels' widest step)
MAX_BATCH = 16


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

    def free(self, base: int, rows: int) -> None:
        first = base // ALIGN
        self._used[first : first + self.blocks_for(rows)] = bytes(self.blocks_for(rows))

    @property
    def rows_in_use(self) -> int:
        return sum(self._used) * ALIGN


@dataclass(eq=False)
class _Seq:
    """One sequence of the batch: its prompt, KV range, sampler and output."""

    ids: list[int]
    max_new_tokens: int
    eos: set[int]
    params: SamplingParams | None  # sampled (with its seed), or None: greedy
    logprobs: bool
    base: int = -1  # first KV row of its range (-1: waiting for admission)
    rows: int = 0  # rows reserved
    n: int = 0  # prompt rows prefilled / KV rows written (its next row's position)
    pending: int = -1  # the last committed token, whose KV row the next decode step writes
    sampler: Sampler | None = None
    out: _Output | None = None
    stats: DecodeStats = field(default_factory=lambda: DecodeStats("ar", 1))
    chunks: collections.deque = field(default_factory=collections.deque)
    result: GenerationResult | None = None
    error: BaseException | None = None
    cancelled: bool = False
    t_start: float = 0.0
    t_prefilled: float = 0.0
    report: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class BatchEngine:
    """Decodes many sequences together over one KV store (module docstring).

    Args:
        decoder: the model (its torch runtime; the steps run eagerly, on the CPU through the native kernels).
        capacity: most committed tokens of one sequence (prompt + output), as the solo engine's.
        max_batch: most sequences decoded at once (1..16); more wait for a free place.
        kv_rows: rows of the shared store (default ``max_batch`` × the rows one sequence may need); a sequence
            reserves prompt + max_new_tokens rows at admission and waits while they are not free.
        prefill_chunk: prompt rows per prefill step (the solo engine's, so prompt rows have its bits).
        kv_dtype: the store's element type (the solo engine's).
    """

    def __init__(self, decoder: Any, *, capacity: int, max_batch: int = 8, kv_rows: int | None = None,
                 prefill_chunk: int = 64, kv_dtype: torch.dtype | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= MAX_BATCH:
            raise BitMTPError(f"max_batch: must be an integer in 1..{MAX_BATCH} (one row per sequence in a step of "
                              f"at most {MAX_BATCH} rows), got {max_batch!r}")
        a = decoder.args
        self.decoder, self.capacity, self.max_batch = decoder, int(capacity), max_batch
        self.prefill_chunk = int(prefill_chunk)
        per_seq = RowAllocator.blocks_for(self.capacity + 1) * ALIGN
        rows = per_seq * max_batch if kv_rows is None else int(kv_rows)
        if rows < per_seq:
            raise BitMTPError(f"kv_rows: {rows} rows cannot hold one sequence of capacity {capacity} "
                              f"({per_seq} rows); give at least that many")
        self.alloc = RowAllocator(rows)
        self.kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, self.alloc.blocks * ALIGN, 1,
                          dtype=kv_dtype or decoder.dtype, device=decoder.device)
        self.kv_index = torch.arange(self.kv.rows, device=decoder.device)
        self._lock = threading.Lock()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._running: list[_Seq] = []  # admitted: prefilling or decoding
        #: forward passes run (prefill chunks + decode steps) and decode steps: tests count one decode
        #: forward per step whatever the batch
        self.forwards = 0
        self.steps = 0
        self.syncs = 0
        #: rows of the latest decode step, and the sequences decoded in steps so far (for /metrics)
        self.last_width = 0
        self.tokens_out = 0

    # ------------------------------------------------------------------------------------------ admission
    def submit(self, ids: Sequence[int], *, max_new_tokens: int, eos: Sequence[int] = (),
               sampling: SamplingParams | None = None, logprobs: bool = False) -> BatchGeneration:
        """Queue a sequence; returns its :class:`BatchGeneration` (chunks of committed tokens, then the
        :class:`~bitmtp.runtime.decode.GenerationResult`). Validated here: a prompt that is empty or over the
        capacity raises :class:`BitMTPError` before anything is queued."""
        ids = list(ids)
        if not ids:
            raise BitMTPError("input_ids: the prompt is empty")
        if len(ids) > self.capacity:
            raise BitMTPError(f"input_ids: prompt of {len(ids)} tokens exceeds capacity {self.capacity}")
        if max_new_tokens < 1:
            raise BitMTPError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        params = sampling.with_seed() if sampling is not None and not sampling.greedy else None
        seq = _Seq(ids, int(max_new_tokens), set(int(e) for e in eos), params, bool(logprobs))
        seq.report["stats"] = seq.stats
        seq.t_start = time.perf_counter()
        with self._lock:
            self._waiting.append(seq)
        return BatchGeneration(self, seq)

    def _admit(self) -> None:
        """Move waiting sequences into the batch, first come first served, while places and rows are free."""
        while self._waiting and len(self._running) < self.max_batch:
            seq = self._waiting[0]
            if seq.cancelled:
                self._waiting.popleft()
                continue
            # the rows its KV may take: prompt + output, at most the capacity (the last token needs none)
            need = min(len(seq.ids) + seq.max_new_tokens, self.capacity)
            base = self.alloc.alloc(need)
            if base is None:
                return  # waits for a sequence to finish (first come first served: no overtaking)
            self._waiting.popleft()
            seq.base, seq.rows = base, need
            if seq.params is not None:
                seq.sampler = Sampler(seq.params, self.decoder.args.vocab_size, self.decoder.device)
                seq.sampler.start(seq.params.seed, seq.ids)
            seq.out = _Output(seq.max_new_tokens, seq.eos, self.capacity + 1 - len(seq.ids), seq.sampler,
                              seq.logprobs)
            seq.report.update(output=seq.out, seed=seq.params.seed if seq.params is not None else None,
                              prompt_tokens=len(seq.ids))
            self._running.append(seq)

    def _retire(self, seq: _Seq) -> None:
        if seq in self._running:
            self._running.remove(seq)
            self.alloc.free(seq.base, seq.rows)

    # ---------------------------------------------------------------------------------------------- steps
    def _forward(self, tokens: list[int], positions: list[int], bases: list[int]) -> torch.Tensor:
        """One forward pass over rows (token, position, its sequence's first KV row): each row writes its KV at
        base + position and attends to its own sequence's rows [base, base + position]; returns the logits."""
        dev = self.decoder.device
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        base = torch.tensor(bases, dtype=torch.long, device=dev)
        slots = base + pos
        seg = self.kv.segment_for(max(b + p for b, p in zip(bases, positions, strict=True)) + 1)
        kv = self.kv_index[None, :seg]
        mask = (kv >= base[:, None]) & (kv <= slots[:, None])
        self.forwards += 1
        with torch.no_grad(), step_threads(dev):
            return self.decoder(StepInputs(tok, pos, mask, slots=slots), self.kv)

    def _choose(self, seq: _Seq, logits: torch.Tensor, position: int, token: int,
                ar_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's token and probability: argmax, or its sequence's sampler (as the solo runner calls it)."""
        if seq.sampler is None:
            return argmax_prob(logits)
        dev = logits.device
        return seq.sampler.select(logits, torch.tensor([position], device=dev),
                                  torch.tensor([token], device=dev), ar_rows, 1)

    def _prefill_chunk(self, seq: _Seq) -> None:
        """The next prompt chunk of ``seq``; after the last one, its first token."""
        lo = seq.n
        chunk = seq.ids[lo : lo + self.prefill_chunk]
        logits = self._forward(chunk, list(range(lo, lo + len(chunk))), [seq.base] * len(chunk))
        seq.n += len(chunk)
        if seq.n < len(seq.ids):
            return
        # prefill rows are not AR rows over this step's tokens (their history is the prompt, counted already)
        tok, prob = self._choose(seq, logits[-1:], seq.n - 1, chunk[-1], 0)
        self.syncs += 1
        (t,), (p,) = tok.tolist(), prob.tolist()
        seq.t_prefilled = time.perf_counter()
        seq.report["prefill_seconds"] = seq.t_prefilled - seq.t_start
        seq.stats.syncs += 1
        self._commit(seq, t, p)

    def _decode_step(self, seqs: list[_Seq]) -> None:
        """One forward over one row per decoding sequence, one read, a commit per sequence."""
        logits = self._forward([s.pending for s in seqs], [s.n for s in seqs], [s.base for s in seqs])
        greedy = [i for i, s in enumerate(seqs) if s.sampler is None]
        toks = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        probs = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
        if greedy:
            at = torch.tensor(greedy, device=logits.device) if len(greedy) < len(seqs) else None
            t, p = argmax_prob(logits if at is None else logits[at])
            if at is None:
                toks, probs = t, p
            else:
                toks[at], probs[at] = t, p
        for i, s in enumerate(seqs):
            if s.sampler is not None:
                t, p = self._choose(s, logits[i : i + 1], s.n, s.pending, 1)
                toks[i : i + 1], probs[i : i + 1] = t, p
        self.syncs += 1
        tl, pl = toks.tolist(), probs.tolist()
        self.steps += 1
        self.last_width = len(seqs)
        for s, t, p in zip(seqs, tl, pl, strict=True):
            s.n += 1
            s.stats.committed.append(1)
            s.stats.verified.append(False)
            s.stats.widths[len(seqs)] += 1
            s.stats.syncs += 1
            self._commit(s, t, p)

    def _commit(self, seq: _Seq, token: int, prob: float) -> None:
        taken = seq.out.add([token], [prob])
        self.tokens_out += len(taken)
        seq.chunks.append(taken)
        seq.pending = token
        if seq.out.reason is not None:
            self._finish(seq)

    def _finish(self, seq: _Seq) -> None:
        now = time.perf_counter()
        out = seq.out
        st = seq.stats
        st.seconds = now - (seq.t_prefilled or now)
        st.tokens = len(out.tokens)
        seq.result = GenerationResult(out.tokens, out.reason or "max_new_tokens", len(seq.ids),
                                      seq.t_prefilled - seq.t_start, st.seconds, st, out.logprobs,
                                      seq.params.seed if seq.params is not None else None, out.origins, out.steps)
        self._retire(seq)

    def step(self) -> None:
        """One scheduling step (the caller holds the lock): retire cancelled sequences, admit waiting ones,
        prefill one chunk of the oldest sequence still prefilling, and decode one token for every sequence
        that is decoding — one forward pass for all of them."""
        for seq in [s for s in self._running if s.cancelled]:
            self._retire(seq)
        self._admit()
        filling = [s for s in self._running if s.n < len(s.ids)]
        decoding = [s for s in self._running if s.n >= len(s.ids) and s.out.tokens]
        seq = None
        try:
            # prompt chunks, oldest first, up to one chunk's rows a step (at least one chunk): several short
            # prompts join in one step, a long one comes in a chunk a step while the others keep decoding
            budget = self.prefill_chunk
            for seq in filling:
                rows = min(self.prefill_chunk, len(seq.ids) - seq.n)
                if rows > budget and budget < self.prefill_chunk:
                    break
                self._prefill_chunk(seq)
                budget -= rows
                if budget <= 0:
                    break
            seq = None
            if decoding:
                self._decode_step(decoding)
        except BaseException as exc:  # a failed step fails the sequences in it; the others go on
            for s in ([seq] if seq is not None else decoding):
                s.error = exc
                self._retire(s)
            raise

    def _wait_for(self, seq: _Seq) -> None:
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

    def cancel(self, seq: _Seq) -> None:
        seq.cancelled = True
        if self._lock.acquire(blocking=False):  # free the rows now if no step is running; else the next step
            try:
                if seq in self._waiting:
                    self._waiting.remove(seq)
                self._retire(seq)
            finally:
                self._lock.release()

    # --------------------------------------------------------------------------------------------- status
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def rows_in_use(self) -> int:
        return self.alloc.rows_in_use


class BatchGeneration:
    """One sequence of a :class:`BatchEngine`: an iterator of committed token chunks whose
    ``StopIteration.value`` is the :class:`~bitmtp.runtime.decode.GenerationResult` — the interface of the
    solo engine's ``Generation`` (``bitmtp.api.TextStream`` reads either). Reading it steps the whole batch
    when nothing is queued for it; :meth:`close` (or dropping it) gives its KV rows back."""

    def __init__(self, engine: BatchEngine, seq: _Seq):
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
        if not getattr(self, "_closed", True) and not self._seq.done:
            self._seq.cancelled = True  # the next step frees its rows (no lock taken in a finalizer)


__all__ = ["ALIGN", "MAX_BATCH", "BatchEngine", "BatchGeneration", "RowAllocator"]
