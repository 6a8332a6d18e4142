"""A batched step's forward pass and its one read (``runtime/batch.py``).

:class:`BatchPass` turns a step's rows (``runtime.batch_rows.StepRows``) into device inputs — tokens, positions,
KV slots (a sequence's base + position) and the mask that lets each row see its own sequence's KV rows only —
runs ONE forward pass over them (per op, or the fused GPU step where a solo step of those rows would take it),
lets sampled sequences choose from their rows' logits, and reads every chosen token and probability at once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from bitmtp.errors import BitMTPError
from bitmtp.model.decoder import GPU_STEP, StepInputs
from bitmtp.ops.choose import argmax_prob
from bitmtp.ops.step_inputs import StepInputsFill
from bitmtp.ops.threads import step_threads
from bitmtp.runtime.batch_rows import StepRows
from bitmtp.runtime.gpu_step import ROWS as GPU_ROWS
from bitmtp.runtime.gpu_step import Launcher
from bitmtp.runtime.kv import KVStore


class HostInputs:
    """A CPU step's inputs — tokens, positions, KV slots, the mask and the RoPE rows — written into buffers reused
    from step to step (the ints by numpy, the mask and RoPE rows by one native call: ``ops.step_inputs``), seen by
    torch through views made once per (rows, segment) shape. A step's host glue is mostly its torch calls, 10-90 µs
    each with the caches cold after the layers against 1-20 µs for a numpy call (``bench/glue.py``): the torch
    path's eight calls here cost ~140 µs a step at batch 1 on 2 CPU cores, numpy's five ~60-100.
    The views are valid until the next step writes the buffers (the engine runs one step at a time)."""

    #: (rows, segment) shapes whose views are kept (a step's shape recurs: its rows and its KV segment)
    KEEP = 64

    def __init__(self, kv_rows: int, head_dim: int):
        self.kv_rows = kv_rows
        self.head_dim = head_dim
        self._ints = np.zeros(0, dtype=np.int64)
        self._mask = np.zeros(0, dtype=np.bool_)
        self._rope = np.zeros(0, dtype=np.float32)
        self._views: dict[tuple[int, int], tuple] = {}
        self._outs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._logits = torch.empty(0, dtype=torch.float32)
        self._logit_views: dict[tuple[int, int], torch.Tensor] = {}

    def fill(self, rows: list[list[int]], seg: int, tables: tuple[np.ndarray, np.ndarray]) -> tuple:
        """``rows`` = [tokens, positions, slots, bases, ends] (one entry per row): the token, position and slot
        tensors, the mask (row i sees KV rows [bases[i], ends[i]] of the first ``seg``) and the rows' RoPE
        ``(cos, sin)`` from the decoder's ``tables`` (``Decoder.rope_host``)."""
        m = len(rows[0])
        views = self._views.get((m, seg))
        if views is None:
            views = self._make(m, seg)
        ints, fill, tensors = views
        ints[:] = rows
        fill(tables)  # the mask and the RoPE rows: one native call (ops.step_inputs)
        return tensors

    def outputs(self, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tok int64 [m], prob float32 [m])`` buffers for a step's choices (two ``torch.empty`` a step, cold,
        were ~40 µs); valid until the next step's."""
        out = self._outs.get(m)
        if out is None:
            if len(self._outs) >= self.KEEP:
                self._outs.clear()
            out = self._outs[m] = (torch.empty(m, dtype=torch.long), torch.empty(m, dtype=torch.float32))
        return out

    def logits(self, m: int, vocab: int) -> torch.Tensor:
        """A float32 ``[m, vocab]`` buffer for a step's logits, one allocation grown to the widest step (a new
        ``[16, 49152]`` tensor a step is 3 MB of fresh pages); valid until the next step's."""
        view = self._logit_views.get((m, vocab))
        if view is None:
            if self._logits.numel() < m * vocab:
                self._logits = torch.empty(m * vocab, dtype=torch.float32)
                self._logit_views.clear()
            view = self._logit_views[(m, vocab)] = self._logits[: m * vocab].view(m, vocab)
        return view

    def _make(self, m: int, seg: int) -> tuple:
        if not 0 < seg <= self.kv_rows:
            raise BitMTPError(f"segment: {seg} KV rows, but the store holds {self.kv_rows}")
        d = self.head_dim
        if self._ints.size < 5 * m or self._mask.size < m * seg or self._rope.size < 2 * m * d:
            # grow: the views of the old buffers go
            self._ints = np.zeros(max(self._ints.size, 5 * m), dtype=np.int64)
            self._mask = np.zeros(max(self._mask.size, m * seg), dtype=np.bool_)
            self._rope = np.zeros(max(self._rope.size, 2 * m * d), dtype=np.float32)
            self._views.clear()
        if len(self._views) >= self.KEEP:
            self._views.clear()
        ints, mask = self._ints[: 5 * m].reshape(5, m), self._mask[: m * seg].reshape(m, seg)
        cos, sin = self._rope[: m * d].reshape(m, d), self._rope[m * d : 2 * m * d].reshape(m, d)
        t = torch.from_numpy(ints)
        tensors = (t[0], t[1], t[2], torch.from_numpy(mask), (torch.from_numpy(cos), torch.from_numpy(sin)))
        views = self._views[(m, seg)] = (ints, StepInputsFill(ints[1], ints[3], ints[4], mask, cos, sin), tensors)
        return views


class BatchPass:
    """Forward passes over the rows of a batch's steps, on ``decoder`` and the batch's KV store ``kv``.

    ``forwards`` counts the passes run (tests: one a step whatever the batch), ``syncs`` the reads,
    ``launcher`` the fused GPU step's launches (``runtime.gpu_step``)."""

    def __init__(self, decoder: Any, kv: KVStore):
        self.decoder, self.kv = decoder, kv
        #: the store's device: the steps' (a decoder's ``device`` is a property, looked up through its embedding)
        self.device = kv.k[0].device
        self.kv_index = torch.arange(kv.rows, device=decoder.device)
        #: on the CPU, a step's inputs are written into reused host buffers by numpy (:class:`HostInputs`)
        cpu = torch.device(decoder.device).type == "cpu" and decoder.rope_host() is not None
        self.host = HostInputs(kv.rows, decoder.args.head_dim) if cpu else None
        self.launcher = Launcher()
        self.forwards = 0
        self.syncs = 0

    def run(self, rows: StepRows, prompts: int, fused: Any = None) -> tuple[list[int], list[float]]:
        """ONE pass over ``rows`` (``prompts``: how many sequences' prompt rows it holds) and its one read: the
        chosen token and its probability for each row whose choice is read (``rows.heads``), in order.
        ``fused``: the fused GPU step's plan when it is on."""
        # the whole step — the pass and the sampled rows' vocabulary-wide torch ops (softmax, sort, cumsum) — with
        # torch's own ops inline on this thread, as a solo step's are: an OpenMP region here would leave libgomp
        # workers spinning on the extension's cores (ops/threads.py)
        with torch.no_grad(), step_threads(self.device):
            toks, probs, logits = self._pass(rows, prompts, fused)
            self._choose_sampled(rows, toks, probs, logits)
        self.syncs += 1
        return toks.tolist(), probs.tolist()

    def _pass(self, rows: StepRows, prompts: int, fused: Any) -> tuple[torch.Tensor, ...]:
        """The step's forward pass: the chosen tokens and probabilities of the rows read, and their logits."""
        # the fused step takes a pass of decode rows only or one solo prefill chunk, of ≤ 16 rows (as solo)
        if fused is not None and len(rows.tokens) <= GPU_ROWS and not (prompts and (rows.decode_rows or prompts > 1)):
            sampled = any(g.seq.sampler is not None for g in rows.groups)
            return self.fused(fused, rows.tokens, rows.positions, rows.bases, rows.heads, sampled=sampled)
        # with the fused step on, a solo prefill chunk's logits over all its rows (a solo step's head)
        solo_like = bool(prompts) and fused is not None
        if self.host is not None and not solo_like:
            # the CPU: the layers, the final norm, the head and the choice of the rows read in one native call
            # (Decoder.choose_step), into reused buffers
            return self._choose(rows)
        logits = self.forward(rows.tokens, rows.positions, rows.bases, None if solo_like else rows.heads, rows.reach,
                              rows.mask_rows, rows.block)
        logits = logits[rows.heads] if solo_like else logits
        # every row: row-independent, each row's bits alone; on the CPU into buffers reused from step to step
        out = self.host.outputs(logits.shape[0]) if self.host is not None and logits.device.type == "cpu" else None
        toks, probs = argmax_prob(logits, out=out)
        return toks, probs, logits

    @staticmethod
    def _choose_sampled(rows: StepRows, toks: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor) -> None:
        """Sampled sequences choose from their rows' logits (the solo runner's call), over the argmax."""
        for g in rows.groups:
            if g.seq.sampler is not None:
                at, r, dev = g.head, g.read_rows, logits.device
                t, p = g.seq.sampler.select(logits[at : at + r], torch.tensor(g.positions[:r], device=dev),
                                            torch.tensor(g.tokens[:r], device=dev), g.ar_rows, 1)
                toks[at : at + r], probs[at : at + r] = t, p

    def inputs(self, tokens: list[int], positions: list[int], bases: list[int],
               reach: list[int] | None = None) -> tuple:
        """A step's device inputs: tokens, positions, KV slots (base + position), the mask — each row sees
        its own sequence's rows [base, base + reach] of the store's smallest covering segment (``reach``: its
        position, except a mask row's, which sees its whole block: the block's last position) — and the rows'
        RoPE ``(cos, sin)`` on the CPU (None: the decoder looks them up)."""
        slots = [b + p for b, p in zip(bases, positions, strict=True)]
        last = slots if reach is None else [b + r for b, r in zip(bases, reach, strict=True)]
        seg = self.kv.segment_for(max(slots) + 1)
        dec = self.decoder
        tables = dec.rope_host() if self.host is not None else None
        if tables is not None:
            return self.host.fill([tokens, positions, slots, bases, last], seg, tables)
        # one host tensor for every per-row list, one copy to the device: each torch op costs tens of µs with the
        # caches cold after a step's layers (bench/glue.py)
        rows = torch.tensor([tokens, positions, slots, bases, last], dtype=torch.long).to(dec.device)
        tok, pos, slot, base, end = rows
        kv = self.kv_index[None, :seg]
        mask = (kv >= base[:, None]) & (kv <= end[:, None])
        return tok, pos, slot, mask, None

    def _choose(self, rows: StepRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A CPU pass over ``rows`` and the choice of the rows read: ``(tok, prob, logits)`` of ``rows.heads``, in
        buffers reused from step to step (``Decoder.choose_step``: one native call where the layers run fused).
        Inside :meth:`run`'s ``no_grad`` / ``step_threads`` block."""
        step = self._step(rows.tokens, rows.positions, rows.bases, rows.reach, rows.mask_rows, rows.block)
        r = len(rows.heads)
        return self.decoder.choose_step(step, self.kv, rows.heads, out=self.host.outputs(r),
                                        logits_out=self.host.logits(r, self.decoder.args.vocab_size))

    def _step(self, tokens: list[int], positions: list[int], bases: list[int], reach: list[int] | None,
              mask_rows: int, block: Any) -> StepInputs:
        """One pass's :class:`StepInputs` (:meth:`inputs`), counted in :attr:`forwards`."""
        tok, pos, slots, mask, rope = self.inputs(tokens, positions, bases, reach)
        self.forwards += 1
        return StepInputs(tok, pos, mask, slots=slots, mask_rows=mask_rows, mask_block=block, rope=rope)

    def forward(self, tokens: list[int], positions: list[int], bases: list[int], heads: list[int] | None = None,
                reach: list[int] | None = None, mask_rows: int = 0, block: Any = None) -> torch.Tensor:
        """One forward pass over rows (token, position, its sequence's first KV row): each row writes its KV at
        base + position and attends to its own sequence's rows [base, base + position] (``reach``: see
        :meth:`inputs`); the last ``mask_rows`` rows are ``block``'s mask rows (its mask embedding and gated
        LoRA); returns the logits of rows ``heads`` (default all: the LM head runs only over the rows whose
        choice is read)."""
        dev = self.decoder.device
        step = self._step(tokens, positions, bases, reach, mask_rows, block)
        with torch.no_grad(), step_threads(dev):
            hidden = self.decoder.hidden_states(step, self.kv)
            if heads is not None and heads != list(range(len(tokens))):  # (every row in order: no gather)
                if not heads:  # prompt rows only, none a prompt's last: nothing to choose
                    return hidden.new_zeros((0, self.decoder.args.vocab_size), dtype=torch.float32)
                hidden = hidden[torch.tensor(heads, dtype=torch.long, device=dev)]
            return self.decoder.logits(hidden)

    def fused(self, plan: Any, tokens: list[int], positions: list[int], bases: list[int], heads: list[int],
              sampled: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A step through the fused GPU kernels: the argmax tokens, probabilities and (only when some row
        samples) logits of rows ``heads``. The rows attend to their own KV ranges (the mask); the split-KV
        attention splits at absolute multiples of 256 rows, which ``batch_schedule.ALIGN`` keeps, so a row has
        its solo bits."""
        dev = self.decoder.device
        m = len(tokens)
        tok, pos, slots, mask, _ = self.inputs(tokens, positions, bases)
        out_tok = torch.empty(GPU_ROWS, dtype=torch.long, device=dev)
        out_prob = torch.empty(GPU_ROWS, dtype=torch.float32, device=dev)
        logits = plan.logits_rows(m) if sampled else None
        self.forwards += 1
        with torch.no_grad():
            plan.step(self.launcher, tok, pos, slots, mask, out_tok, out_prob, m=m, logits=logits)
        self.decoder._took(GPU_STEP, "")
        at = torch.tensor(heads, dtype=torch.long, device=dev)
        return out_tok[at], out_prob[at], logits[at] if logits is not None else out_prob[:0]


__all__ = ["BatchPass", "HostInputs"]
