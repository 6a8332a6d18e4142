"""The kinds of one-pass step, as objects: how a planned step's rows are laid out, read, committed and handed on.

The one-pass loop (``runtime/decode.py``, ``_pass_step``) runs every iteration the same way — plan, ONE step,
ONE read, accept by the rule (``decoding.accept``), commit — and asks the step's layout for everything that
differs between kinds of step:

* :class:`PlainPass` — the pending row and guesses g_1..g_k (AR when k = 0), positions n, n + 1, …;
* :class:`MaskPass` — the same rows followed by D' − 1 mask rows (or heads output slots) that draft the next
  step's guesses; with the ``top2`` schedule, g_1's runner-up in one more row whose KV goes to a scratch slot
  (``decoding.onepass.top2_layout``) and moves to position n + 1 when it is the one committed;
* :class:`TreePass` — a block of mask rows after the pending row and after every guess
  (``decoding.onepass.tree_layout``): block a's drafts follow whatever was accepted.

:func:`pass_layout` picks the layout of a :class:`~bitmtp.decoding.onepass.PassPlan`.
"""

from __future__ import annotations

from typing import Any

import torch

from bitmtp.decoding import origins as origin
from bitmtp.decoding.onepass import PassPlan, runner_up_fits, runner_up_slot, top2_layout, tree_layout
from bitmtp.runtime.states import ReplayState

#: a layout's step outcome read by the host: the rows' choices, their probabilities (None when not read) and the
#: first mask row's second choice (None when not read)
Read = tuple[list[int], list[float] | None, list[int] | None]


class PlainPass:
    """The pending row and the guesses, AR-causal at positions n..n + k (no drafting rows)."""

    #: g_1's runner-up verified beside it (``top2``; only a :class:`MaskPass` has one)
    alt: int | None = None

    def __init__(self, plan: PassPlan, n: int):
        self.plan, self.n = plan, n
        self.guesses = plan.guesses
        self.k = len(plan.guesses)
        self.width = plan.width

    # -- the step's rows
    def runner(self, engine: Any, tok: int, sampled: bool) -> Any:
        """The replay runner of this step with its tokens and positions written."""
        runner = engine.pool.get(ReplayState(self.width, engine.kv.segment_for(self.n + self.width),
                                             "verify" if self.k else "ar"))
        if sampled and self.k:
            runner.fresh_from.fill_(1)  # row 0 is the committed pending token; the guesses are new
        self._tokens(runner, tok)
        torch.add(engine.arange[: self.width], self.n, out=runner.positions)
        return runner

    def _tokens(self, runner: Any, tok: int, extra: tuple[int, ...] = ()) -> None:
        if self.k:
            runner.tokens[: self.k + 1 + len(extra)].copy_(torch.tensor([tok, *self.guesses, *extra],
                                                                        dtype=torch.long))
        else:
            runner.tokens[:1].fill_(tok)

    def read(self, engine: Any, runner: Any, logprobs: bool, top2: bool) -> Read:
        """The iteration's one read: every row's choice (and probability when asked for)."""
        w = self.width
        if logprobs:
            v, p = engine.read(runner.out_token[:w], runner.out_prob[:w])
            return v, p, None
        (v,) = engine.read(runner.out_token[:w])
        return v, None, None

    def observe(self, costs: Any, seconds: float) -> None:
        """What the step took, for the live step costs."""
        costs.observe(self.width, seconds)

    # -- the outcome
    def runner_up(self, v: list[int], a: int) -> bool:
        """Whether the pending row chose g_1's runner-up (only a ``top2`` step has one)."""
        return False

    def committed(self, v: list[int], p: list[float] | None, a: int, runner_up: bool) -> tuple[list[int], Any,
                                                                                                list[str]]:
        """What commits — the accepted guesses are the choices of the rows before them, then the choice of the
        last accepted row — with their probabilities and origins."""
        return ([*self.guesses[:a], v[a]], p[: a + 1] if p is not None else None,
                [*[origin.of_source(self.plan.source)] * a, origin.AR])

    def advance(self, kv: Any, v: list[int], a: int, runner_up: bool) -> tuple[int, int]:
        """(KV rows that stay, the next pending token): the pending row and the accepted guesses' rows."""
        return a + 1, v[a]

    def hand_on(self, v: list[int], p: list[float] | None, a: int, runner_up: bool,
                second: list[int] | None) -> tuple[list[int], list[float], int | None]:
        """The next step's mask guesses, their probabilities and g_1's runner-up: none here."""
        return [], [], None

    def choice(self, fused: str) -> str:
        """The step's kind in ``DecodeStats.choices``."""
        return self.plan.source or "ar"


class MaskPass(PlainPass):
    """Guess rows, then mask rows (or heads output slots) drafting the next guesses; ``top2``: g_1's runner-up
    verified in one more row, its KV in a scratch slot."""

    def __init__(self, plan: PassPlan, n: int, fused: str, offsets: dict):
        super().__init__(plan, n)
        self.fused, self.alt = fused, plan.alt
        self.r0 = self.k + 1 + (self.alt is not None)  # the first mask row
        # the runner-up's scratch KV row may lie past the step's width: the segment must cover it
        self.alt_slot = n + runner_up_slot(self.k + 1, plan.masks) if self.alt is not None else None
        self._offsets = offsets

    def runner(self, engine: Any, tok: int, sampled: bool) -> Any:
        w, n, alt = self.width, self.n, self.alt
        end = n + w if self.alt_slot is None else max(n + w, self.alt_slot + 1)
        runner = engine.pool.get(ReplayState(w, engine.kv.segment_for(end), "fused", self.plan.masks,
                                             alt=int(alt is not None)))
        self._tokens(runner, tok, (alt,) if alt is not None else ())
        if alt is None:
            torch.add(engine.arange[:w], n, out=runner.positions)
        else:
            _place(runner, n, self._offsets, ("top2", self.k + 1, self.plan.masks), engine.arange.device)
        return runner

    def read(self, engine: Any, runner: Any, logprobs: bool, top2: bool) -> Read:
        w = self.width
        if top2:
            v, p, (second,) = engine.read(runner.out_token[:w], runner.out_prob[:w], runner.out_second)
            return v, p, second
        v, p = engine.read(runner.out_token[:w], runner.out_prob[:w])
        return v, p, None

    def observe(self, costs: Any, seconds: float) -> None:
        if self.fused == "heads":
            # the heads' drafts take output slots, not rows: their time is what the step took beyond a step of
            # its k + 1 rows
            costs.observe_drafts(self.k + 1, self.plan.masks - 1, seconds, self.n)
        else:
            costs.observe(self.width, seconds)

    def runner_up(self, v: list[int], a: int) -> bool:
        return self.alt is not None and a == 0 and v[0] == self.alt

    def committed(self, v: list[int], p: list[float] | None, a: int, runner_up: bool) -> tuple[list[int], Any,
                                                                                                list[str]]:
        if not runner_up:
            return super().committed(v, p, a, runner_up)
        # the pending row chose g_1's runner-up: it commits with its own row's argmax (row k + 1)
        k = self.k
        return [self.alt, v[k + 1]], [p[0], p[k + 1]] if p is not None else None, [origin.RUNNER_UP, origin.AR]

    def advance(self, kv: Any, v: list[int], a: int, runner_up: bool) -> tuple[int, int]:
        if not runner_up:
            return super().advance(kv, v, a, runner_up)
        # its KV row, written to its scratch slot (the same bits as at n + 1: onepass.runner_up_slot), becomes
        # position n + 1's
        kv.move_row(self.alt_slot, self.n + 1)
        return 2, v[self.k + 1]

    def hand_on(self, v: list[int], p: list[float] | None, a: int, runner_up: bool,
                second: list[int] | None) -> tuple[list[int], list[float], int | None]:
        # the mask rows drafted the positions after the last guess: valid only if every guess was accepted; the
        # heads drafted after the last accepted row: valid whatever was accepted
        if runner_up or not (a == self.k or self.fused == "heads"):
            return [], [], None
        return v[self.r0 : self.width], p[self.r0 : self.width], second

    def choice(self, fused: str) -> str:
        return (self.plan.source or "ar") + ("+alt" if self.alt is not None else "") + f"+{fused}"


class TreePass(PlainPass):
    """A block of D' − 1 mask rows after the pending row and after every guess: block a's drafts follow v_a."""

    def __init__(self, plan: PassPlan, n: int, offsets: dict):
        super().__init__(plan, n)
        self._offsets = offsets

    def runner(self, engine: Any, tok: int, sampled: bool) -> Any:
        runner = engine.pool.get(ReplayState(self.width, engine.kv.segment_for(self.n + self.width), "tree",
                                             self.plan.masks, alt=0))
        self._tokens(runner, tok)
        _place(runner, self.n, self._offsets, ("tree", self.k + 1, self.plan.masks), engine.arange.device)
        return runner

    def read(self, engine: Any, runner: Any, logprobs: bool, top2: bool) -> Read:
        v, p = engine.read(runner.out_token[: self.width], runner.out_prob[: self.width])
        return v, p, None

    def hand_on(self, v: list[int], p: list[float] | None, a: int, runner_up: bool,
                second: list[int] | None) -> tuple[list[int], list[float], int | None]:
        b, r0 = self.plan.masks - 1, self.k + 1
        return v[r0 + a * b : r0 + (a + 1) * b], p[r0 + a * b : r0 + (a + 1) * b], None

    def choice(self, fused: str) -> str:
        return (self.plan.source or "ar") + "+tree"


def _place(runner: Any, n: int, offsets: dict, key: tuple[str, int, int], device: torch.device) -> None:
    """A tree / top2 step's positions and KV slots: n + the layout's offsets (cached by kind, k + 1 and D')."""
    offs = offsets.get(key)
    if offs is None:
        kind, p, d = key
        pos_off, slot_off = tree_layout(p, d)[:2] if kind == "tree" else top2_layout(p, d)
        offs = offsets[key] = (torch.tensor(pos_off, device=device), torch.tensor(slot_off, device=device))
    torch.add(offs[0], n, out=runner.positions)
    torch.add(offs[1], n, out=runner.slots)


def pass_layout(plan: PassPlan, n: int, rows: int, fused: str, offsets: dict) -> PlainPass:
    """The layout of a planned step at ``n`` in a store of ``rows`` rows (``fused``: how the drafter's mask rows
    draft, ``"masks"`` or ``"heads"``; ``offsets``: the loop's cache of tree / top2 offsets). A runner-up rides
    in fused mask steps only, and only where its scratch slot gives AR's bits: elsewhere it is dropped."""
    if plan.alt is not None and not (plan.masks and plan.guesses and not plan.tree
                                     and runner_up_fits(n, len(plan.guesses) + 1, plan.masks, rows)):
        plan = PassPlan(plan.guesses, plan.source, plan.masks, plan.tree)
    if not plan.masks:
        return PlainPass(plan, n)
    if plan.tree:
        return TreePass(plan, n, offsets)
    return MaskPass(plan, n, fused, offsets)


__all__ = ["MaskPass", "PlainPass", "TreePass", "pass_layout"]
