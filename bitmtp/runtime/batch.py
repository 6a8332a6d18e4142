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

import collections
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bitmtp.decoding import origins as origin
from bitmtp.decoding.accept import speculative_accept
from bitmtp.decoding.batch_plan import BatchPlanner, Room, SeqDrafting
from bitmtp.decoding.sampling import Sampler, SamplingParams
from bitmtp.errors import BitMTPError
from bitmtp.model.decoder import GPU_STEP, StepInputs
from bitmtp.ops.choose import argmax_prob
from bitmtp.ops.threads import step_threads
from bitmtp.runtime.batch_rows import Group, StepRows
from bitmtp.runtime.gpu_step import ROWS as GPU_ROWS
from bitmtp.runtime.gpu_step import Launcher, plan_for
from bitmtp.runtime.kv import KVStore
from bitmtp.runtime.output import DecodeStats, GenerationResult, Output

#: a sequence's KV range starts at a multiple of this many rows (module docstring: batch invariance needs a
#: multiple of the CPU attention's 128-row softmax chunk and of the fused GPU attention's 256-row split)
ALIGN = 256
#: how long closing a sequence waits for a running step before leaving its rows to the next step (seconds)
CANCEL_WAIT_S = 5.0
#: the most sequences one forward pass decodes (a row each: the width-invariant kernels' widest step)
MAX_BATCH = 16
#: prompt rows one step takes at most, beside its decode rows: on 2 CPU cores prefill runs ~2.3 ms a token
#: (SmolLM2), so 64 rows hold the running sequences' next token back ~150 ms while prompts come in
PREFILL_ROWS = 64

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
        #: prompt rows a step takes at most (several prompts' rows in one step; a long prompt over several)
        self.prefill_rows = int(prefill_rows)
        self.solo_chunk = int(solo_chunk)
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
        #: counts the fused GPU step's launches (``runtime.gpu_step``) when a step takes it
        self.launcher = Launcher()
        #: auto's row budget: which guess and mask rows a step adds, from what a row costs (``decoding.batch_plan``)
        self.planner = BatchPlanner(GPU_ROWS)
        #: a sequence's decode commits and the tokens they committed (> 1 a commit: accepted guesses)
        self.decode_commits = 0
        self.decode_tokens = 0

    # ------------------------------------------------------------------------------------------ admission
    def submit(self, ids: Sequence[int], *, max_new_tokens: int, eos: Sequence[int] = (),
               sampling: SamplingParams | None = None, logprobs: bool = False, draft: bool = False,
               masks: Any = None) -> BatchGeneration:
        """Queue a sequence; returns its :class:`BatchGeneration` (chunks of committed tokens, then the
        :class:`~bitmtp.runtime.decode.GenerationResult`). ``draft``: ``auto`` — prompt-lookup guesses verified
        in its rows where they pay (the output is AR's either way); ``masks``: with ``draft``, a mask-block
        adapter module (``model.adapters.MaskBlock``) whose mask rows draft guesses too (on the CPU / per-op path;
        the fused GPU step drafts by lookup only). Validated here: a prompt that is empty or over
        the capacity raises :class:`BitMTPError` before anything is queued."""
        ids = list(ids)
        if not ids:
            raise BitMTPError("input_ids: the prompt is empty")
        if len(ids) > self.capacity:
            raise BitMTPError(f"input_ids: prompt of {len(ids)} tokens exceeds capacity {self.capacity}")
        if max_new_tokens < 1:
            raise BitMTPError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        params = sampling.with_seed() if sampling is not None and not sampling.greedy else None
        seq = _Seq(ids, int(max_new_tokens), set(int(e) for e in eos), params, bool(logprobs))
        if draft:
            seq.drafting = self.planner.start(ids, masks)
            seq.stats = DecodeStats("auto", 1, schedule="one-pass")
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
            seq.out = Output(seq.max_new_tokens, seq.eos, self.capacity + 1 - len(seq.ids), seq.sampler,
                              seq.logprobs)
            seq.report.update(output=seq.out, seed=seq.params.seed if seq.params is not None else None,
                              prompt_tokens=len(seq.ids))
            self._running.append(seq)

    def _retire(self, seq: _Seq) -> None:
        if seq in self._running:
            self._running.remove(seq)
            self.alloc.free(seq.base, seq.rows)

    # ---------------------------------------------------------------------------------------------- steps
    def _rows(self, tokens: list[int], positions: list[int], bases: list[int],
              reach: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step's device inputs: tokens, positions, KV slots (base + position) and the mask — each row sees
        its own sequence's rows [base, base + reach] of the store's smallest covering segment (``reach``: its
        position, except a mask row's, which sees its whole block: the block's last position)."""
        # one host tensor for every per-row list, one copy to the device: each torch op costs tens of µs with the
        # caches cold after a step's layers (bench/glue.py)
        slots = [b + p for b, p in zip(bases, positions, strict=True)]
        last = slots if reach is None else [b + r for b, r in zip(bases, reach, strict=True)]
        rows = torch.tensor([tokens, positions, slots, bases, last], dtype=torch.long).to(self.decoder.device)
        tok, pos, slot, base, end = rows
        kv = self.kv_index[None, : self.kv.segment_for(max(slots) + 1)]
        mask = (kv >= base[:, None]) & (kv <= end[:, None])
        return tok, pos, slot, mask

    def _forward(self, tokens: list[int], positions: list[int], bases: list[int],
                 heads: list[int] | None = None, reach: list[int] | None = None, mask_rows: int = 0,
                 block: Any = None) -> torch.Tensor:
        """One forward pass over rows (token, position, its sequence's first KV row): each row writes its KV at
        base + position and attends to its own sequence's rows [base, base + position] (``reach``: see
        :meth:`_rows`); the last ``mask_rows`` rows are ``block``'s mask rows (its mask embedding and gated
        LoRA); returns the logits of rows ``heads`` (default all: the LM head runs only over the rows whose
        choice is read)."""
        dev = self.decoder.device
        tok, pos, slots, mask = self._rows(tokens, positions, bases, reach)
        self.forwards += 1
        with torch.no_grad(), step_threads(dev):
            step = StepInputs(tok, pos, mask, slots=slots, mask_rows=mask_rows, mask_block=block)
            hidden = self.decoder.hidden_states(step, self.kv)
            if heads is not None and heads != list(range(len(tokens))):  # (every row in order: no gather)
                if not heads:  # prompt rows only, none a prompt's last: nothing to choose
                    return hidden.new_zeros((0, self.decoder.args.vocab_size), dtype=torch.float32)
                hidden = hidden[torch.tensor(heads, dtype=torch.long, device=dev)]
            return self.decoder.logits(hidden)

    def _fused(self, plan: Any, tokens: list[int], positions: list[int], bases: list[int], heads: list[int],
               sampled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step through the fused GPU kernels: the argmax tokens, probabilities and (only when some row
        samples) logits of rows ``heads``. The rows attend to their own KV ranges (the mask); the split-KV
        attention splits at absolute multiples of 256 rows, which :data:`ALIGN` keeps, so a row has its solo
        bits."""
        dev = self.decoder.device
        m = len(tokens)
        tok, pos, slots, mask = self._rows(tokens, positions, bases)
        out_tok = torch.empty(GPU_ROWS, dtype=torch.long, device=dev)
        out_prob = torch.empty(GPU_ROWS, dtype=torch.float32, device=dev)
        logits = plan.logits_rows(m) if sampled else None
        self.forwards += 1
        with torch.no_grad():
            plan.step(self.launcher, tok, pos, slots, mask, out_tok, out_prob, m=m, logits=logits)
        self.decoder._took(GPU_STEP, "")
        at = torch.tensor(heads, dtype=torch.long, device=dev)
        return out_tok[at], out_prob[at], logits[at] if logits is not None else out_prob[:0]

    def _prompt_rows(self, filling: list[_Seq], chunk: int = 0) -> list[tuple[_Seq, int]]:
        """The prompt rows this step takes: (sequence, rows), oldest first, :attr:`prefill_rows` at most — any
        split of a prompt (rows are independent of what else is in the pass), or with ``chunk`` whole chunks at
        the solo engine's offsets (at least one)."""
        budget, plan = self.prefill_rows, []
        for seq in filling:
            if budget <= 0:
                break
            left = len(seq.ids) - seq.n
            rows = min(chunk - seq.n % chunk, left) if chunk else min(budget, left)
            if plan and rows > budget:
                break
            plan.append((seq, rows))
            budget -= rows
        return plan

    def _run_step(self, fill: list[tuple[_Seq, int]], decoding: list[_Seq], fused: Any = None) -> None:
        """ONE forward pass: the planned prompt rows, then each decoding sequence's rows (its pending token and
        the guesses the planner gives it), then the mask rows drafting some sequences' next guesses
        (``runtime.batch_rows``); one read; a commit per sequence (a prompt whose last row ran commits its first
        token; a sequence with guesses commits the accepted ones and the token after them). ``fused``: the fused
        GPU step's plan when it is on (the step takes it where a solo step of its rows would)."""
        room = [(id(s), s.drafting, Room(s.rows - s.n - 1, s.max_new_tokens - len(s.out.tokens) - 1))
                for s in decoding]
        drafts = self.planner.drafts(room, sum(r for _, r in fill), masks_ok=fused is None) if decoding else {}
        rows = StepRows.build(fill, decoding, drafts)
        t0 = time.perf_counter()
        toks, probs, logits = self._pass(rows, fill, fused)
        for seq, n in fill:
            seq.n += n
        tl, pl = self._read(rows, toks, probs, logits)
        if decoding:
            self.steps += 1
            self.last_width = rows.decode_rows
            if not fill:
                self.planner.cost.observe(rows.decode_rows, time.perf_counter() - t0)
        now = time.perf_counter()
        for g in rows.groups:
            self._commit_group(g, tl, pl, rows.decode_rows, now)

    def _pass(self, rows: StepRows, fill: list[tuple[_Seq, int]], fused: Any) -> tuple[torch.Tensor, ...]:
        """The step's forward pass: the chosen tokens and probabilities of the rows read, and their logits."""
        # the fused step takes a pass of decode rows only or one solo prefill chunk, of ≤ 16 rows (as solo)
        if fused is not None and len(rows.tokens) <= GPU_ROWS and not (fill and (rows.decode_rows or len(fill) > 1)):
            sampled = any(g.seq.sampler is not None for g in rows.groups)
            return self._fused(fused, rows.tokens, rows.positions, rows.bases, rows.heads, sampled=sampled)
        # with the fused step on, a solo prefill chunk's logits over all its rows (a solo step's head)
        solo_like = bool(fill) and fused is not None
        logits = self._forward(rows.tokens, rows.positions, rows.bases, None if solo_like else rows.heads, rows.reach,
                               rows.mask_rows, rows.block)
        logits = logits[rows.heads] if solo_like else logits
        toks, probs = argmax_prob(logits)  # every row: row-independent, each row's bits alone
        return toks, probs, logits

    def _read(self, rows: StepRows, toks: torch.Tensor, probs: torch.Tensor,
              logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """The step's one read; sampled sequences first choose from their rows' logits (the solo runner's call)."""
        for g in rows.groups:
            if g.seq.sampler is not None:
                at, r, dev = g.head, g.read_rows, logits.device
                t, p = g.seq.sampler.select(logits[at : at + r], torch.tensor(g.positions[:r], device=dev),
                                            torch.tensor(g.tokens[:r], device=dev), g.ar_rows, 1)
                toks[at : at + r], probs[at : at + r] = t, p
        self.syncs += 1
        return toks.tolist(), probs.tolist()

    def _commit_group(self, g: Group, tl: list[int], pl: list[float], width: int, now: float) -> None:
        """A sequence's commit after the step: a prompt's first token, or its accepted guesses and the token after
        them (the one-pass rule, ``decoding.accept``), with what its planner learns."""
        seq = g.seq
        seq.stats.syncs += 1
        if not g.ar_rows:  # the prompt's first token
            seq.t_prefilled = now
            seq.report["prefill_seconds"] = now - seq.t_start
            self._commit(seq, [tl[g.head]], [pl[g.head]])
            return
        outs = tl[g.head : g.head + g.ar_rows]
        guesses = g.tokens[1:]
        a = speculative_accept([outs[0], *guesses], outs) if guesses else 1  # the rule, written once
        seq.n += a
        if seq.drafting is not None:
            m = slice(g.mask_head, g.mask_head + g.draft.mask_rows)
            self.planner.learn(seq.drafting, g.draft, a, tl[m], pl[m])
        seq.stats.record_batch_step(g.draft, a, width)
        self.decode_commits += 1
        self.decode_tokens += a
        kind = origin.MASK if g.draft.source == "masks" else origin.LOOKUP
        self._commit(seq, outs[:a], pl[g.head : g.head + a], [kind] * (a - 1) + [origin.AR])

    def _commit(self, seq: _Seq, tokens: list[int], probs: list[float], origins: list[str] | None = None) -> None:
        taken = seq.out.add(tokens, probs, origins)
        self.tokens_out += len(taken)
        seq.chunks.append(taken)
        if seq.drafting is not None:
            seq.drafting.lookup.extend(taken)
        seq.pending = tokens[-1]
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
        """One scheduling step (the caller holds the lock): retire cancelled sequences, admit waiting ones, and
        run ONE forward pass over the prompt rows this step takes (:meth:`_prompt_rows`) and the decoding
        sequences' rows."""
        for seq in [s for s in self._running if s.cancelled]:
            self._retire(seq)
        self._admit()
        filling = [s for s in self._running if s.n < len(s.ids)]
        decoding = [s for s in self._running if s.n >= len(s.ids) and s.out.tokens]
        if not filling and not decoding:
            return
        plan = plan_for(self.decoder, self.kv)  # the fused GPU step (opt-in), or None
        if plan is not None:
            # its rows' bits are its own, so prompts are prefilled as a solo engine does — whole solo chunks,
            # each a pass of its own (fused up to 16 rows, per op above) — and the decode rows take it by
            # themselves
            parts = [([c], []) for c in self._prompt_rows(filling, self.solo_chunk)]
            parts += [([], decoding)] if decoding else []
        else:
            parts = [(self._prompt_rows(filling), decoding)]
        for f, d in parts:
            try:
                self._run_step(f, d, plan)
            except BaseException as exc:  # a failed step fails the sequences in it; the others go on
                for s in [x[0] for x in f] + d:
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
        # free the rows now, after the step another thread may be running (its pass uses them): a sequence only
        # marked while another thread steps kept its rows until some later step — none, when that thread's own
        # sequence was its last (a serve test saw 256 rows held after every client was answered). A step that
        # takes longer than CANCEL_WAIT_S leaves the mark to the next step.
        if self._lock.acquire(timeout=CANCEL_WAIT_S):
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
    def tokens_per_commit(self) -> float:
        """Tokens a decoding sequence commits a step, on average (1: AR steps only)."""
        return self.decode_tokens / self.decode_commits if self.decode_commits else 1.0

    @property
    def rows_in_use(self) -> int:
        return self.alloc.rows_in_use


class BatchGeneration:
    """One sequence of a :class:`BatchEngine`: an iterator of committed token chunks whose
    ``StopIteration.value`` is the :class:`~bitmtp.runtime.decode.GenerationResult` — the interface of the
    solo engine's ``Generation`` (``bitmtp.api.TextStream`` reads either). Reading it steps the whole batch
    when nothing is queued for it; :meth:`close` (or dropping it) gives its KV rows back."""

    _closed = True  # until __init__ has run (what a finalizer of a half-made one reads)

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
        if not self._closed and not self._seq.done:
            self._seq.cancelled = True  # the next step frees its rows (no lock taken in a finalizer)


__all__ = ["ALIGN", "MAX_BATCH", "BatchEngine", "BatchGeneration", "RowAllocator"]
