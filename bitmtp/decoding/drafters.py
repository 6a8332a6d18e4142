"""Drafters: what a draft step computes (DESIGN.md, "One iteration").

A draft step of block size D runs over the pending suffix P (p rows at positions n..n+p−1, ending
with the last committed token) and yields ``d_1..d_D`` with their probabilities:

* ``d_1`` is always the argmax of the last pending row — exactly the AR prediction, because the
  pending rows run AR-causally on the base model's exact path;
* ``d_2..d_D`` come from the drafter.

Every drafter writes P's KV rows exactly (they are the next committed rows), and writes its
results into ``runner.out_token[-D:]`` / ``runner.out_prob[-D:]`` of the step's static buffers, so
a draft step replays as one CUDA graph. The runner's static inputs have ``p + D − 1`` rows (the
replay state's width); drafters without mask rows use the first p.

* :class:`MaskBlockDrafter` — mask-conditioned block-causal drafting: D − 1 mask rows (the adapter's
  mask embedding, gated LoRA) attend to history + P and bidirectionally within the block.
* :class:`HeadsDrafter` — the Divine recurrent residual draft heads over the last pending row's
  hidden state, logits through the shared LM head (in one pass: over the last *accepted* row's).
* :class:`OracleDrafter` — drafts a known continuation (computed beforehand). A test and benchmark
  device: with ``speculative`` it shows what the machinery delivers when every draft is accepted.
* :class:`LookupDrafter` — prompt lookup (``bitmtp.decoding.lookup``): the continuation of the
  sequence's latest suffix match in prompt + output, found on the host at no model cost.

**One-pass schedule** (``runtime/decode.py``, "one pass"): an iteration is one step whose rows are the
pending token, the guesses ``g_1..g_k`` for the next positions and, for a mask-block drafter, D − 1
mask rows after the last guess (role ``fused``). Drafters with ``host_guesses`` (lookup, oracle) give
the guesses through :meth:`Drafter.propose` from the committed sequence; a mask-block or heads drafter's
guesses are the previous fused step's drafts (``fused_drafts``):

* ``"masks"`` (mask-block): D − 1 mask rows after the last guess; their drafts continue the sequence only
  when every guess was accepted.
* ``"heads"``: no extra rows. On the device, the step finds how many guesses match the AR argmax of the
  row before them (a), and runs the heads from row a's hidden state and its argmax v_a, which are the
  next iteration's pending token; so the drafts are valid at any accept length. The step's last D − 1
  output slots hold them (the state's width counts them, the decoder runs the k + 1 AR rows only).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from bitmtp.decoding.lookup import LookupIndex
from bitmtp.decoding.onepass import tree_layout
from bitmtp.errors import BitMTPError
from bitmtp.model.adapters import DraftHeads, MaskBlock
from bitmtp.model.decoder import Decoder, StepInputs
from bitmtp.ops.choose import argmax_prob


def _argmax_prob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return argmax_prob(logits.float())


def _choose(runner, logits: torch.Tensor, positions: torch.Tensor, ar_rows: int = 0) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
    """Tokens and probabilities of ``logits`` rows at ``positions``: the argmax, or the runner's sampler
    (``bitmtp.decoding.sampling``: row r samples the token at ``positions[r] + 1`` with that position's
    uniform, so a draft guessing a position is coupled to the target sampled there). Rows ``[0, ar_rows)``
    are the step's AR rows over ``runner.tokens`` (row 0 committed, the rest guesses)."""
    sampler = getattr(runner, "sampler", None)
    if sampler is None:
        return _argmax_prob(logits)
    return sampler.select(logits, positions, runner.tokens if ar_rows else None, ar_rows, 1)


@runtime_checkable
class DraftSource(Protocol):
    """What the decode loops read of a drafter — :class:`Drafter` and :class:`CombinedDrafter` both — as
    plain attributes (no ``getattr`` probing): ``kind`` (its name in messages and token origins),
    ``host_guesses`` (guesses come from the host: lookup, oracle, the lookup half of a pair),
    ``fused_drafts`` (``"masks"`` / ``"heads"``: drafts inside a one-pass step; ``""``: it does not),
    ``max_block`` and :meth:`check_block`."""

    kind: str
    host_guesses: bool
    fused_drafts: str
    max_block: int

    def check_block(self, block_size: int) -> None:
        """BitMTPError when this drafter cannot draft ``block_size`` tokens."""


class Drafter(abc.ABC):
    """Base of the drafters: a name, the largest block size it supports, and the draft body."""

    kind = "drafter"
    #: guesses come from the host (:meth:`propose`), not from the model: lookup, oracle
    host_guesses = False
    #: how the drafter drafts in a one-pass ``fused`` step: ``"masks"`` (mask rows after the last guess,
    #: valid after a full accept), ``"heads"`` (from the last accepted row, valid at any accept length),
    #: ``""`` (it does not: host guesses, or two passes only)
    fused_drafts = ""

    def __init__(self, decoder: Decoder, max_block: int):
        self.decoder = decoder
        self.max_block = int(max_block)

    def check_block(self, block_size: int) -> None:
        if block_size > self.max_block:
            raise BitMTPError(f"block_size: the {self.kind} drafter supports D <= {self.max_block}, got {block_size}")

    def _pending_hidden(self, runner) -> tuple[torch.Tensor, int, int]:
        """Run the p pending rows AR-causally (writing their exact KV); return the final hidden states
        of all pending rows, p and D."""
        st = runner.state
        p, d = st.pending, st.block
        pos = runner.positions[:p]
        mask = runner.kv_index[None, :] <= pos[:, None]
        hidden = self.decoder.hidden_states(StepInputs(runner.tokens[:p], pos, mask), runner.kv)
        return hidden, p, d

    def _write_first(self, runner, last_hidden: torch.Tensor, d: int) -> torch.Tensor:
        """d_1 from the last pending row's hidden state; returns d_1 as a 1-element device tensor."""
        p = runner.state.pending
        tok, prob = _choose(runner, self.decoder.logits(last_hidden), runner.positions[p - 1 : p])
        runner.out_token[-d : -d + 1].copy_(tok)
        runner.out_prob[-d : -d + 1].copy_(prob)
        return tok

    @abc.abstractmethod
    def draft(self, runner) -> None:
        """Write d_1..d_D and their probabilities into the runner's outputs (see the module docstring)."""

    def prepare(self, runner, history: Sequence[int]) -> None:
        """Host work before a two-pass draft step of ``runner`` whose committed sequence is ``history``
        (prompt + output; its last token is the last pending row). Nothing by default."""
        return None

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Host guesses for the ``k`` positions after ``history`` (``host_guesses`` drafters)."""
        raise BitMTPError(f"drafter: the {self.kind} drafter drafts on the device, not from the host")


class MaskBlockDrafter(Drafter):
    """Mask-conditioned block-causal drafting with a ``mask-block`` adapter."""

    kind = "mask-block"
    fused_drafts = "masks"

    def __init__(self, decoder: Decoder, block: MaskBlock):
        super().__init__(decoder, block.block_size)
        self.block = block
        self._trees: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _tree_reach(self, p: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(anchor, lo, hi) offsets of a tree step's rows as ``[W, 1]`` tensors (``onepass.tree_layout``)."""
        got = self._trees.get((p, d))
        if got is None:
            _, _, anchor, lo, hi = tree_layout(p, d)
            got = self._trees[(p, d)] = tuple(torch.tensor(x, dtype=torch.long, device=device)[:, None]
                                              for x in (anchor, lo, hi))
        return got

    def layout(self, runner) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The step's ``(attention mask [W, L], KV slots or None (= positions), mask rows)``: what both this
        drafter's per-op body and the fused GPU step (``runtime.gpu_step``) run the step's rows with.

        * draft / fused: pending rows causal, the D − 1 mask rows (the last rows) see everything up to the last
          position (:meth:`block_mask`); with ``alt`` (the top2 schedule) row p — g_1's runner-up at g_1's
          position, its KV in the scratch slot the loop wrote to ``runner.slots`` — sees the committed rows up
          to t's (≤ n) and itself only;
        * tree: p AR rows, then a block of D − 1 mask rows after each of them (``onepass.tree_layout``; the
          loop wrote the rows' positions and KV slots): AR rows attend causally, a block's rows the history up
          to the row they follow plus their own block."""
        st = runner.state
        p, d = st.pending, st.block
        if st.role == "tree":
            anchor, lo, hi = self._tree_reach(p, d, runner.positions.device)
            n = runner.positions[:1]
            kv = runner.kv_index[None, :]
            return (kv <= n + anchor) | ((kv >= n + lo) & (kv <= n + hi)), runner.slots, p * (d - 1)
        mask = self.block_mask(runner)
        if not st.alt:
            return mask, None, d - 1
        n = runner.positions[:1]
        alt = (runner.kv_index <= n) | (runner.kv_index == runner.slots[p : p + 1])
        return torch.cat([mask[:p], alt[None, :], mask[p + 1 :]]), runner.slots, d - 1

    @staticmethod
    def first_output_row(runner) -> int:
        """The first row whose choice a step reads: every row in a one-pass (fused, tree) step, which verifies
        its pending rows too; the last pending row and the mask rows in a two-pass draft step."""
        st = runner.state
        return st.pending - 1 if st.role == "draft" else 0

    @staticmethod
    def block_mask(runner) -> torch.Tensor:
        """A draft or fused step's attention mask: pending rows attend causally (row i sees KV rows ≤ its
        position); the D − 1 mask rows see the history, P and the whole block (bidirectional inside it): every
        row ≤ the last position."""
        pos = runner.positions
        reach = torch.where(torch.arange(pos.shape[0], device=pos.device) < runner.state.pending, pos, pos[-1])
        return runner.kv_index[None, :] <= reach[:, None]

    def take(self, runner, logits: torch.Tensor) -> None:
        """Choose the step's output rows from ``logits`` (rows from :meth:`first_output_row` on) into the runner's
        outputs; a fused step also records its first mask row's runner-up (the top2 schedule verifies it beside
        the next step's g_1; one row's top-2 over the vocabulary, ~0.3 % of a SmolLM2 step on the CPU)."""
        st = runner.state
        lo = self.first_output_row(runner)
        tok, prob = _choose(runner, logits, runner.positions[lo:], st.pending if lo == 0 else 0)
        runner.out_token[lo:].copy_(tok)
        runner.out_prob[lo:].copy_(prob)
        if st.role == "fused":
            runner.out_second.copy_(logits[st.pending + st.alt - lo].topk(2).indices[1:])

    def draft(self, runner) -> None:
        mask, slots, mask_rows = self.layout(runner)
        dec = self.decoder
        step = StepInputs(runner.tokens, runner.positions, mask, mask_rows=mask_rows, mask_block=self.block,
                          slots=slots)
        hidden = dec.hidden_states(step, runner.kv)
        # LM head only over the rows whose choice is read (the other pending rows' logits never are in a
        # two-pass draft step, and the LM head is the largest matrix of the step)
        self.take(runner, dec.logits(hidden[self.first_output_row(runner):]))


class HeadsDrafter(Drafter):
    """Recurrent residual draft heads: ``s_0`` is the last pending row's final hidden state,
    ``s_k = head_k(s_(k−1), E(d_k))`` and ``d_(k+1) = argmax LMHead(s_k)``."""

    kind = "heads"
    fused_drafts = "heads"

    def __init__(self, decoder: Decoder, heads: DraftHeads):
        super().__init__(decoder, heads.block_size)
        self.heads = heads

    def _run_heads(self, runner, state: torch.Tensor, tok: torch.Tensor, d: int, position: torch.Tensor) -> None:
        """d_2..d_D from ``state`` (the hidden state, at ``position``, whose chosen token is ``tok`` = d_1)
        into the last D − 1 output slots (head k's draft sits where a row at ``position + 1 + k`` would
        choose it)."""
        for k in range(d - 1):
            state = self.heads.step(k, state, self.decoder.embed[tok])
            tok, prob = _choose(runner, self.decoder.logits(state), position + 1 + k)
            at = runner.out_token.shape[0] - d + 1 + k
            runner.out_token[at : at + 1].copy_(tok)
            runner.out_prob[at : at + 1].copy_(prob)

    def draft(self, runner) -> None:
        hidden, p, d = self._pending_hidden(runner)
        if runner.state.role == "fused":
            # one pass: rows [t, g_1..g_k] verify (every row's argmax is an output); the heads draft
            # from the last row whose guess chain holds — found here, on the device, so the step stays
            # one captured graph and one host read: a = the leading guesses equal to the row before's argmax
            tok, prob = _choose(runner, self.decoder.logits(hidden), runner.positions[:p], p)
            runner.out_token[:p].copy_(tok)
            runner.out_prob[:p].copy_(prob)
            match = (runner.tokens[1:p] == tok[: p - 1]).to(torch.long)
            a = torch.cumprod(match, 0).sum().reshape(1) if p > 1 else torch.zeros(1, dtype=torch.long,
                                                                                   device=tok.device)
            self._run_heads(runner, hidden.index_select(0, a), tok.index_select(0, a), d,
                            runner.positions.index_select(0, a))
            return
        state = hidden[p - 1 : p]
        tok = self._write_first(runner, state, d)
        self._run_heads(runner, state, tok, d, runner.positions[p - 1 : p])


class OracleDrafter(Drafter):
    """Drafts ``sequence[position]`` for d_2..d_D with probability 1 (d_1 is still the model's own
    AR prediction). ``sequence`` is the whole token sequence by position — prompt then the AR
    continuation, computed beforehand; positions past its end draft token 0."""

    kind = "oracle"
    host_guesses = True

    def __init__(self, decoder: Decoder, sequence: Sequence[int], max_block: int = 16):
        super().__init__(decoder, max_block)
        self.host_sequence = [int(t) for t in sequence]
        seq = torch.as_tensor(self.host_sequence, dtype=torch.long)
        if seq.numel() == 0:
            raise BitMTPError("sequence: the oracle needs at least one token")
        self.sequence = torch.cat([seq, torch.zeros(max_block + 1, dtype=torch.long)]).to(decoder.device)
        self.offsets = torch.arange(2, max_block + 1, device=decoder.device)

    def draft(self, runner) -> None:
        hidden, p, d = self._pending_hidden(runner)
        self._write_first(runner, hidden[p - 1 : p], d)
        # d_k sits at position (last pending position) + k
        idx = (runner.positions[p - 1] + self.offsets[: d - 1]).clamp_(max=self.sequence.numel() - 1)
        runner.out_token[-(d - 1) :].copy_(self.sequence[idx])
        runner.out_prob[-(d - 1) :].fill_(1.0)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """The known continuation after ``history`` (token 0 past its end, as on the device)."""
        at = len(history)
        out = self.host_sequence[at : at + k]
        return out + [0] * (k - len(out))


class LookupDrafter(Drafter):
    """Prompt lookup (``bitmtp.decoding.lookup``): guesses are the continuation of the sequence's latest
    suffix match in prompt + output. No model work, no adapter.

    One pass: :meth:`propose` gives the guesses (the decode loop keeps one :class:`LookupIndex` per
    generation and passes it as ``history``; a plain sequence works too). Two passes: :meth:`prepare`
    writes the continuation into the draft step's spare token slots and :meth:`draft` runs the pending
    rows (``d_1``, exact) and copies ``d_2..d_D`` from there with probability 0 (a lookup draft is a
    guess, never a confident prediction: policies that commit unverified drafts must not trust it).
    """

    kind = "lookup"
    host_guesses = True

    def __init__(self, decoder: Decoder, max_block: int = 16, *, ngram_max: int = 5, ngram_min: int = 1):
        super().__init__(decoder, max_block)
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        LookupIndex((), ngram_max=ngram_max, ngram_min=ngram_min)  # validates the n-gram bounds

    def index(self, history: Sequence[int] = ()) -> LookupIndex:
        """A fresh index over ``history`` with this drafter's n-gram bounds."""
        return LookupIndex(history, ngram_max=self.ngram_max, ngram_min=self.ngram_min)

    def propose(self, history: Sequence[int] | LookupIndex, k: int) -> list[int]:
        idx = history if isinstance(history, LookupIndex) else self.index(history)
        return idx.propose(k)[0]

    def prepare(self, runner, history: Sequence[int] | LookupIndex) -> None:
        st = runner.state
        p, d = st.pending, st.block
        # the guesses continue the committed sequence: c_1 guesses d_1 (the AR prediction), so c_2..c_D
        # stand for d_2..d_D; without a match they repeat the last token (a cheap, usually wrong guess)
        cont = self.propose(history, d)[1:]
        last = history.tokens[-1] if isinstance(history, LookupIndex) else history[-1]
        cont = cont + [last] * (d - 1 - len(cont))
        runner.tokens[p:].copy_(torch.tensor(cont, dtype=torch.long))

    def draft(self, runner) -> None:
        hidden, p, d = self._pending_hidden(runner)
        self._write_first(runner, hidden[p - 1 : p], d)
        runner.out_token[-(d - 1) :].copy_(runner.tokens[p:])
        runner.out_prob[-(d - 1) :].fill_(0.0)


#: the drafter names ``generate(drafter=...)`` and ``--drafter`` accept (besides a Drafter object):
#: ``adapter`` (the loaded MTP adapter's), ``lookup`` (prompt lookup, no adapter needed) and
#: ``lookup+adapter`` (one pass: lookup guesses when the context matches, the adapter's otherwise)
DRAFTER_NAMES = ("adapter", "lookup", "lookup+adapter")


class CombinedDrafter:
    """``lookup+adapter``: one-pass drafting from both — the lookup's guesses when the context matches,
    the adapter's mask-row drafts otherwise. Only the one-pass schedule runs it."""

    kind = "lookup+adapter"
    #: the capability attributes of :class:`Drafter`, as the pair has them: guesses from the host and
    #: drafts in one pass both, taken apart by the one-pass loop (``runtime/decode.py``)
    host_guesses = True
    fused_drafts = ""

    def __init__(self, lookup: LookupDrafter, adapter: Drafter):
        self.lookup, self.adapter = lookup, adapter
        self.max_block = adapter.max_block
        self.fused_drafts = adapter.fused_drafts

    def check_block(self, block_size: int) -> None:
        self.adapter.check_block(block_size)


def drafter_for(decoder: Decoder, module: MaskBlock | DraftHeads) -> Drafter:
    """The drafter of an adapter module (see ``bitmtp.model.adapters.build_adapter``)."""
    if isinstance(module, MaskBlock):
        return MaskBlockDrafter(decoder, module)
    if isinstance(module, DraftHeads):
        return HeadsDrafter(decoder, module)
    raise BitMTPError(f"adapter: no drafter for {type(module).__name__}")
