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
thread asks first steps for all of them. Dropping or closing a :class:`BatchGeneration` frees its rows at the
next step.

**Policies.** ``policy="ar"`` and ``"auto"`` decode batched, both exactly AR's output (greedy, or sampled with
the same seed). ``auto`` adds guess rows to a step — prompt-lookup continuations of a sequence, verified in the
same pass, the accepted ones committed with the token after them (the one-pass rule,
``decoding.accept.speculative_accept``) — best expected accepted tokens first, while a row's expected accepted
tokens exceed what one more row costs the step (``_StepCost``, fitted to the steps this engine ran): freely
where a row is nearly free (a GPU), sparingly on 2 CPU cores. With a mask-block adapter, a sequence's step may
also end in mask rows (all sequences' mask rows last in the pass, where the gated LoRA applies) that draft its
next guesses, used after a full accept — the solo one-pass step's layout in its own KV range (``_drafts``); not
under the fused GPU step, which drafts by lookup only. Other policies run one sequence at a time
(``bitmtp.api.generate``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bitmtp.decoding import origins as origin
from bitmtp.decoding.accept import speculative_accept
from bitmtp.decoding.auto import DRAFT_MARGIN, EXPLORE_EVERY, LOOKUP_PRIOR, MASK_MARGIN, MASK_PRIOR, mask_bucket
from bitmtp.decoding.lookup import LookupIndex
from bitmtp.decoding.sampling import Sampler, SamplingParams
from bitmtp.errors import BitMTPError
from bitmtp.model.decoder import GPU_STEP, StepInputs
from bitmtp.ops.choose import argmax_prob
from bitmtp.ops.threads import step_threads
from bitmtp.runtime.decode import DecodeStats, GenerationResult
from bitmtp.runtime.gpu_step import ROWS as GPU_ROWS
from bitmtp.runtime.gpu_step import Launcher, plan_for
from bitmtp.runtime.kv import KVStore
from bitmtp.runtime.output import Output

#: a sequence's KV range starts at a multiple of this many rows (module docstring: batch invariance needs a
#: multiple of the CPU attention's 128-row softmax chunk and of the fused GPU attention's 256-row split)
ALIGN = 256
#: the most sequences one forward pass decodes (a row each: the width-invariant kernels' widest step)
MAX_BATCH = 16
#: prompt rows one step takes at most, beside its decode rows: on 2 CPU cores prefill runs ~2.3 ms a token
#: (SmolLM2), so 64 rows hold the running sequences' next token back ~150 ms while prompts come in
PREFILL_ROWS = 64
#: prior chance that a sequence's j-th mask draft is accepted with the drafts before it (j = 0..14): the
#: middle probability bucket's prior (``decoding.auto.MASK_PRIOR``) compounded, so mask rows are bought on
#: evidence
MASK_POS_PRIOR = tuple(MASK_PRIOR[1] ** (j + 1) for j in range(MAX_BATCH - 1))


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
class _Group:
    """A sequence's rows in a step: from row ``first``, its ``tokens`` at ``positions``; ``ar_rows``: 0 for a
    prompt's last row (its first token), else 1 + its guesses (rows AR-causal over the step's tokens)."""

    seq: _Seq
    first: int
    tokens: list[int]
    positions: list[int]
    ar_rows: int
    head: int = 0  # its first row among the rows whose logits were computed
    source: str = ""  # where its guesses came from: "lookup" or "masks" ("": none)
    mask_rows: int = 0  # mask rows drafting its next guesses (at the end of the step's rows)
    mask_head: int = 0  # the first of them among the rows whose logits were computed
    ngram: int = 1  # lookup guesses: the length of the n-gram match they came from


@dataclass
class _Draft:
    """What :meth:`BatchEngine._drafts` gives a decoding sequence for a step."""

    guesses: list[int] = field(default_factory=list)
    source: str = ""  # where the guesses come from: "lookup" or "masks" ("": none)
    p_all: float = 1.0  # the chance every guess is accepted
    mask_rows: int = 0  # mask rows drafting its next guesses
    ngram: int = 1  # lookup guesses: the length of the n-gram match they came from


_NO_DRAFT = _Draft()


class _StepCost:
    """What one more row costs a decode step, relative to the step: ``marginal(w) = t(w + 1) / t(w) − 1``.

    ``t(w)`` is the seconds this engine's steps of width ``w`` took (a running mean) once it ran three of them,
    else the line ``a + b·w`` fitted to all its steps (least squares, older steps fading); until two widths were
    seen, the prior: a width-8 step costs 2.7 width-1 steps (SmolLM2 on 2 CPU cores: b / a ≈ 0.24). Per-width
    times see what a line averages away: widths up to a kernel tile cost little more than one row and the next
    one a lot (SmolLM2 on 2 CPU cores, relative to width 2: 1.15 at 3, 1.25 at 4, 1.6 at 5). The solo
    calibration table (``runtime.calibration``) is not used: measured on solo steps, it put width 8 at 1.67
    width-1 steps where this engine's steps take 2.3 (chat at batch 2 drafted too much: 0.91x batched AR)."""

    PRIOR = 0.24
    #: steps of one width before their own mean replaces the line
    MIN_SEEN = 3

    def __init__(self) -> None:
        self.n = self.sw = self.st = self.sww = self.swt = 0.0
        self.seen: dict[int, tuple[float, int]] = {}  # width -> (running mean seconds, steps)

    def observe(self, width: int, seconds: float) -> None:
        decay = 0.98
        self.n, self.sw, self.st = decay * self.n + 1, decay * self.sw + width, decay * self.st + seconds
        self.sww, self.swt = decay * self.sww + width * width, decay * self.swt + width * seconds
        mean, count = self.seen.get(width, (seconds, 0))
        self.seen[width] = (mean + (seconds - mean) / min(count + 1, 8), count + 1)

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
        mean, count = self.seen.get(width, (0.0, 0))
        if count >= self.MIN_SEEN:
            return mean
        line = self._line()
        return line[0] + line[1] * width if line is not None else None

    def marginal(self, width: int) -> float:
        t0, t1 = self.seconds(width), self.seconds(width + 1)
        if t0 is not None and t1 is not None and t0 > 0:
            return max(t1 - t0, 0.0) / t0
        return self.PRIOR / (1 + self.PRIOR * width)


def _chain(alpha: list[float], probs: list[float]) -> list[float]:
    """Each guess's chance to be accepted with every guess before it, for mask drafts of these probabilities
    (``alpha``: acceptance by probability bucket, ``decoding.auto.mask_bucket``)."""
    out, p = [], 1.0
    for q in probs:
        p *= alpha[mask_bucket(q)]
        out.append(p)
    return out


@dataclass(eq=False)
class _Seq:
    """One sequence of the batch: its prompt, KV range, sampler and output."""

    ids: list[int]
    max_new_tokens: int
    eos: set[int]
    params: SamplingParams | None  # sampled (with its seed), or None: greedy
    logprobs: bool
    draft: bool = False  # auto: prompt-lookup guess rows when they pay (BatchEngine._drafts)
    lookup: LookupIndex | None = None
    #: its lookup guesses' running acceptance (each given the ones before it) by the length of the n-gram match
    lookup_alpha: dict[int, float] = field(default_factory=lambda: dict(LOOKUP_PRIOR))
    block: Any = None  # auto with a mask-block adapter: the adapter module whose mask rows draft (_drafts)
    mask_drafts: list[int] = field(default_factory=list)  # the last step's mask drafts (after a full accept)
    mask_probs: list[float] = field(default_factory=list)
    mask_alpha: list[float] = field(default_factory=lambda: list(MASK_PRIOR))  # acceptance by probability bucket
    #: the chance its j-th mask draft is accepted with every draft before it (running, over the drafts made)
    mask_pos: list[float] = field(default_factory=lambda: list(MASK_POS_PRIOR))
    since_masks: int = 0  # decode steps since its last mask rows (a re-try every EXPLORE_EVERY)
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
        self._cost = _StepCost()
        #: a sequence's decode commits and the tokens they committed (> 1 a commit: accepted guesses)
        self.decode_commits = 0
        self.decode_tokens = 0
        #: prompt-lookup guesses' running acceptance over every sequence (a new sequence's prior)
        self.lookup_alpha = dict(LOOKUP_PRIOR)
        #: mask drafts' running acceptance by probability bucket and by draft position, over every sequence (a
        #: new sequence's priors)
        self.mask_alpha = list(MASK_PRIOR)
        self.mask_pos = list(MASK_POS_PRIOR)

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
        seq = _Seq(ids, int(max_new_tokens), set(int(e) for e in eos), params, bool(logprobs), bool(draft))
        if seq.draft:
            seq.lookup = LookupIndex(ids, ngram_max=5)
            seq.lookup_alpha = dict(self.lookup_alpha)
            seq.block = masks
            seq.mask_alpha, seq.mask_pos = list(self.mask_alpha), list(self.mask_pos)
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
        dev = self.decoder.device
        tok = torch.tensor(tokens, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        base = torch.tensor(bases, dtype=torch.long, device=dev)
        slots = base + pos
        seg = self.kv.segment_for(max(b + p for b, p in zip(bases, positions, strict=True)) + 1)
        kv = self.kv_index[None, :seg]
        last = slots if reach is None else base + torch.tensor(reach, dtype=torch.long, device=dev)
        mask = (kv >= base[:, None]) & (kv <= last[:, None])
        return tok, pos, slots, mask

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
            if heads is not None:
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
        the guesses :meth:`_drafts` gives it), then the mask rows drafting some sequences' next guesses; one
        read; a commit per sequence (a prompt whose last row ran commits its first token; a sequence with
        guesses commits the accepted ones and the token after them). ``fused``: the fused GPU step's plan when
        it is on (the step takes it where a solo step of its rows would)."""
        tokens, positions, bases, groups = [], [], [], []
        for seq, rows in fill:
            tokens += seq.ids[seq.n : seq.n + rows]
            positions += range(seq.n, seq.n + rows)
            bases += [seq.base] * rows
            if seq.n + rows == len(seq.ids):  # its last prompt row: the first token (prefill rows are not AR
                groups.append(_Group(seq, len(tokens) - 1, [seq.ids[-1]], [len(seq.ids) - 1], 0))  # rows)
        drafts = self._drafts(decoding, len(tokens), masks_ok=fused is None) if decoding else {}
        for seq in decoding:
            d = drafts.get(id(seq), _NO_DRAFT)
            rows = 1 + len(d.guesses)
            groups.append(_Group(seq, len(tokens), [seq.pending, *d.guesses], list(range(seq.n, seq.n + rows)), rows,
                                 source=d.source, mask_rows=d.mask_rows, ngram=d.ngram))
            tokens += [seq.pending, *d.guesses]
            positions += range(seq.n, seq.n + rows)
            bases += [seq.base] * rows
        heads = [g.first + i for g in groups for i in range(len(g.tokens) if g.ar_rows else 1)]
        masked = [g for g in groups if g.mask_rows]
        reach = self._add_mask_rows(masked, tokens, positions, bases, heads) if masked else None
        greedy = all(g.seq.sampler is None for g in groups)
        decode_rows = len(tokens) - sum(r for _, r in fill)
        # the fused step takes a pass of decode rows only or one solo prefill chunk, of ≤ 16 rows (as solo)
        takes = fused is not None and len(tokens) <= GPU_ROWS and not (fill and (decode_rows or len(fill) > 1))
        t0 = time.perf_counter()
        if takes:  # argmax rows chosen in its head kernels, as a solo step's
            toks, probs, logits = self._fused(fused, tokens, positions, bases, heads, sampled=not greedy)
        else:
            # with the fused step on, a solo prefill chunk's logits over all its rows (a solo step's head)
            solo_like = bool(fill) and fused is not None
            logits = self._forward(tokens, positions, bases, None if solo_like else heads, reach,
                                   sum(g.mask_rows for g in masked), masked[0].seq.block if masked else None)
            if solo_like:
                logits = logits[heads]
            toks, probs = argmax_prob(logits)  # every row: row-independent, each row's bits alone
        for seq, rows in fill:
            seq.n += rows
        at = 0
        for g in groups:  # sampled sequences choose from their rows' logits (the solo runner's call)
            r = len(g.tokens) if g.ar_rows else 1
            if g.seq.sampler is not None:
                dev = logits.device
                t, p = g.seq.sampler.select(logits[at : at + r], torch.tensor(g.positions[:r], device=dev),
                                            torch.tensor(g.tokens[:r], device=dev), g.ar_rows, 1)
                toks[at : at + r], probs[at : at + r] = t, p
            g.head = at
            at += r
        self.syncs += 1
        tl, pl = toks.tolist(), probs.tolist()
        if decoding:
            self.steps += 1
            self.last_width = decode_rows
            if not fill:
                self._cost.observe(decode_rows, time.perf_counter() - t0)
        now = time.perf_counter()
        for g in groups:
            seq = g.seq
            seq.stats.syncs += 1
            if not g.ar_rows:  # the prompt's first token
                seq.t_prefilled = now
                seq.report["prefill_seconds"] = now - seq.t_start
                self._commit(seq, [tl[g.head]], [pl[g.head]])
                continue
            outs = tl[g.head : g.head + g.ar_rows]
            guesses = g.tokens[1:]
            a = speculative_accept([outs[0], *guesses], outs) if guesses else 1  # the rule, written once
            seq.n += a
            self._learn(g, a, tl[g.mask_head : g.mask_head + g.mask_rows], pl[g.mask_head : g.mask_head + g.mask_rows],
                        decode_rows)
            self.decode_commits += 1
            self.decode_tokens += a
            kind = origin.MASK if g.source == "masks" else origin.LOOKUP
            self._commit(seq, outs[:a], pl[g.head : g.head + a], [kind] * (a - 1) + [origin.AR])

    @staticmethod
    def _add_mask_rows(masked: list[_Group], tokens: list[int], positions: list[int], bases: list[int],
                       heads: list[int]) -> list[int]:
        """Append the mask rows of the ``masked`` groups to the step's rows (in place; their choices read: added
        to ``heads``) and return every row's reach: its position, or for a mask row its block's last position.
        A group's mask rows sit at the positions after its last row (the positions after the token its step
        commits on a full accept): each drafts the token one position on, seeing its sequence up to the block's
        end (the solo one-pass step's layout, ``MaskBlockDrafter.block_mask``). Their token ids are ignored (the
        mask embedding) and their KV rows lie in the sequence's own range, rewritten before any row reads them."""
        reach = list(positions)
        for g in masked:
            last = g.positions[-1]
            g.mask_head = len(heads)
            heads += range(len(tokens), len(tokens) + g.mask_rows)
            tokens += [0] * g.mask_rows
            positions += range(last + 1, last + 1 + g.mask_rows)
            bases += [g.seq.base] * g.mask_rows
            reach += [last + g.mask_rows] * g.mask_rows
        return reach

    def _learn(self, g: _Group, a: int, drafts: list[int], draft_probs: list[float], width: int) -> None:
        """A decoding sequence's statistics and draft estimates after its step accepted ``a`` of its rows:
        the acceptance of the guess source it verified, and its next guesses from its mask rows (``drafts``,
        valid only when every row was accepted: they assumed so)."""
        seq, st = g.seq, g.seq.stats
        guesses = g.tokens[1:]
        st.committed.append(a)
        st.verified.append(bool(guesses))
        st.widths[width] += 1
        if guesses or g.mask_rows:
            st.choices[(g.source or "ar") + ("+masks" if g.mask_rows else "")] += 1
        if guesses:
            st.verifier_calls += 1
            st.guesses += len(guesses)
            st.accepted += a - 1
            # each checked guess (those before it accepted): a mask draft by its probability bucket, a lookup guess
            # by the length of the match it came from
            if g.source == "masks":
                own, shared, keys = seq.mask_alpha, self.mask_alpha, [mask_bucket(p) for p in seq.mask_probs]
            else:
                own, shared, keys = seq.lookup_alpha, self.lookup_alpha, [g.ngram] * len(guesses)
            for i in range(min(a, len(guesses))):
                ok = float(i < a - 1)
                own[keys[i]] = 0.85 * own[keys[i]] + 0.15 * ok
                shared[keys[i]] = 0.97 * shared[keys[i]] + 0.03 * ok
        seq.since_masks = 0 if g.mask_rows else seq.since_masks + 1
        for j, value in enumerate(_chain(seq.mask_alpha, draft_probs)):
            seq.mask_pos[j] = 0.7 * seq.mask_pos[j] + 0.3 * value
            self.mask_pos[j] = 0.95 * self.mask_pos[j] + 0.05 * value
        full = bool(g.mask_rows) and a == g.ar_rows
        seq.mask_drafts, seq.mask_probs = (drafts, draft_probs) if full else ([], [])

    def _drafts(self, decoding: list[_Seq], prompt_rows: int, masks_ok: bool = True) -> dict[int, _Draft]:
        """Guess rows and mask rows for the drafting sequences (``auto``), by id (:class:`_Draft`).

        Guesses — the previous step's mask drafts or prompt-lookup continuations, whichever a sequence expects
        more of first — are taken most likely accepted first, while a row's expected accepted tokens exceed what
        one more row costs this step in tokens (:class:`_StepCost`: the step's expected tokens × the relative cost
        of one more row), so a GPU, where a row is nearly free, drafts freely and 2 CPU cores sparingly. Then a
        sequence with a mask-block adapter (``masks_ok``: not under the fused GPU step) gets mask rows where their
        drafts' expected accepted tokens next step, times the chance this step accepts every guess, pay for the
        rows (by :data:`MASK_MARGIN`), or as a periodic re-try (:meth:`_mask_offers`). At most 16 rows a step."""
        width = prompt_rows + len(decoding)
        expected = float(len(decoding))
        offers = []  # (expected tokens of the row, sequence, its draft up to its j-th guess)
        for seq in decoding:
            room = min(seq.rows - seq.n - 1, seq.max_new_tokens - len(seq.out.tokens) - 1, GPU_ROWS - 1)
            if not seq.draft or room <= 0:
                continue
            chains = []
            if seq.mask_drafts:
                chains.append(("masks", seq.mask_drafts[:room], _chain(seq.mask_alpha, seq.mask_probs[:room])))
            guesses, ngram = seq.lookup.propose(room)
            if guesses:
                alpha = seq.lookup_alpha[ngram]
                chains.append(("lookup", guesses, [alpha ** (j + 1) for j in range(len(guesses))]))
            if chains:
                source, guesses, gains = max(chains, key=lambda c: c[2][0])
                offers += [(gains[j], id(seq), _Draft(guesses[: j + 1], source, gains[j], 0, ngram))
                           for j in range(len(guesses))]
        offers.sort(key=lambda o: -o[0])
        chosen: dict[int, _Draft] = {}
        for gain, key, draft in offers:  # a chain's j-th guess comes after its (j-1)-th: gains fall along it
            if width >= GPU_ROWS or gain <= DRAFT_MARGIN * expected * self._cost.marginal(width):
                break
            if len(draft.guesses) != len(chosen.get(key, _NO_DRAFT).guesses) + 1:
                continue
            chosen[key] = draft
            width += 1
            expected += gain
        if masks_ok:
            width = self._mask_offers(decoding, chosen, width, expected)
        return chosen

    def _mask_offers(self, decoding: list[_Seq], chosen: dict[int, _Draft], width: int, expected: float) -> int:
        """Add mask rows to ``chosen`` (:meth:`_drafts`); returns the step's width with them. A sequence's j-th
        mask row is worth the chance this step accepts all its guesses × the chance its draft is accepted next
        step (``mask_pos[j]``), over two rows (it and the guess row that verifies its draft): offered like the
        guesses, best first, a sequence's rows in order, while worth more than a row costs (by
        :data:`MASK_MARGIN`); a sequence without mask rows for :data:`EXPLORE_EVERY` steps per sequence in the
        batch gets one (the batch re-tries about once per EXPLORE_EVERY steps, as a solo generation does)."""
        block = next((s.block for s in decoding if s.draft and s.block is not None), None)
        if block is None:
            return width
        offers = []
        for seq in decoding:
            d = chosen.get(id(seq), _NO_DRAFT)
            left = seq.max_new_tokens - len(seq.out.tokens) - len(d.guesses) - 1  # tokens after this step's
            m = min(block.block_size - 1, seq.rows - seq.n - 1 - len(d.guesses), left)
            if seq.block is not block or m < 1:
                continue
            explore = seq.since_masks >= EXPLORE_EVERY * len(decoding)  # one re-try per EXPLORE_EVERY steps
            offers += [(math.inf if explore and j == 0 else d.p_all * seq.mask_pos[j] / 2, id(seq), j + 1)
                       for j in range(m)]
        offers.sort(key=lambda o: -o[0])
        for gain, key, rows in offers:
            if width >= GPU_ROWS or gain <= MASK_MARGIN * expected * self._cost.marginal(width):
                break
            d = chosen.get(key, _NO_DRAFT)
            if rows != d.mask_rows + 1:
                continue
            chosen[key] = dataclasses.replace(d, mask_rows=rows)
            width += 1
        return width

    def _commit(self, seq: _Seq, tokens: list[int], probs: list[float], origins: list[str] | None = None) -> None:
        taken = seq.out.add(tokens, probs, origins)
        self.tokens_out += len(taken)
        seq.chunks.append(taken)
        if seq.lookup is not None:
            seq.lookup.extend(taken)
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
