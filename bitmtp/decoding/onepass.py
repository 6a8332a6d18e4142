"""Planners of the one-pass schedule (verify-and-draft in one step; DESIGN.md, "One pass").

An iteration of the one-pass schedule is ONE step over the rows

    [pending token t, guesses g_1..g_k, (D − 1 mask rows)]

at positions n, n+1, …: the pending row and each guess row are AR-causal, so their argmaxes
``v_0..v_k`` are exact AR predictions; the guesses are accepted while ``g_i == v_(i−1)``, and the
iteration commits ``g_1..g_a, v_a`` (their rows t, g_1..g_a stay: n += a + 1; the rejected rows are
simply not counted and are overwritten later). Mask rows, when a mask-block drafter is in use, draft
the guesses of the next iteration; they stand after the last guess, so their drafts are valid only when
every guess was accepted — otherwise the next iteration has no mask guesses. A heads drafter drafts the
next guesses instead from the last accepted row (found on the device), valid at any accept length; its
drafts take output slots, not rows (``bitmtp.decoding.drafters``, ``fused_drafts``).

A planner decides each iteration's rows (:class:`PassPlan`) from what the loop tells it
(:class:`PassContext`) and learns from the outcome (:meth:`Planner.observe`):

* :class:`FixedPlanner` — ``speculative`` with ``schedule="one-pass"``: always D − 1 guesses from the
  drafter (lookup / oracle: proposed on the host; mask-block: the previous step's mask drafts) and, for a
  mask-block drafter, D − 1 mask rows every step. With ``schedule="top2"`` a mask-drafted g_1 comes with
  its runner-up (the first mask row's second choice) in one more row at g_1's position, KV to a scratch
  slot: when the pending row's argmax is the runner-up, it commits with that row's own argmax, and its KV
  row moves to its position (``KVStore.move_row``).
* ``auto`` (``bitmtp.decoding.auto``): per iteration, AR or drafting with the number of guesses and
  mask rows that maximise expected committed tokens per unit of measured step cost.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bitmtp.decoding.lookup import LookupIndex
from bitmtp.ops.linear import ATTENTION_CHUNK, ATTENTION_LANES

#: what one heads draft costs relative to a width-1 step before any is observed: a head is a rank-r
#: residual block plus an LM-head row, and the LM head is the largest matrix of a small model's step
#: (SmolLM2-135M: 28 M of 135 M weights, read as Q8_0 — about a quarter of the step's bytes)
HEADS_DRAFT_COST = 0.3


def tree_layout(p: int, d: int) -> tuple[list[int], list[int], list[int], list[int], list[int]]:
    """Rows of a tree step with ``p`` AR rows (t, g_1..g_k) and a block of ``d − 1`` mask rows after each
    of them (``ReplayState(p·d, σ, "tree", d)``): per row, offsets from n (the pending token's position)
    of its position, its KV slot, and what it attends: KV rows ≤ n + ``anchor`` and the slots
    [n + ``lo``, n + ``hi``] (its own block; empty for AR rows).

    Rows are the p AR rows, then block 0 (after t), block 1 (after g_1), …, block k. Mask row j of block b
    sits at position n + b + j and drafts the token after it; block k's rows write their own positions
    (past every AR row, like a fused step's mask rows); blocks b < k share positions with guess rows, so
    they write scratch slots after block k, in order — the last is n + p·d − 1, inside the step's width,
    and every slot a mask row writes lies past the AR rows (none is ever counted)."""
    k = p - 1
    pos, slot, anchor, lo, hi = list(range(p)), list(range(p)), list(range(p)), [1] * p, [0] * p
    for b in range(p):
        first = k + 1 if b == k else k + d + b * (d - 1)
        for j in range(1, d):
            pos.append(b + j)
            slot.append(first + j - 1)
            anchor.append(b)
            lo.append(first)
            hi.append(first + d - 2)
    return pos, slot, anchor, lo, hi


def runner_up_slot(p: int, d: int) -> int:
    """The KV slot (offset from n) of a ``top2`` step's runner-up row: the first n + 1 + 16·j past the step's
    other rows (their slots end at n + p + d − 2). Its attention then sums every KV row in the lane it
    would have at its own position n + 1 (``bitmtp.ops.linear.ATTENTION_LANES``), so its outputs and
    its KV row are AR's bits — provided n + 1 and the slot share a softmax chunk (:func:`runner_up_fits`)."""
    return 1 + ATTENTION_LANES * -(-(p + d - 2) // ATTENTION_LANES)


def runner_up_fits(n: int, p: int, d: int, rows: int) -> bool:
    """Whether a ``top2`` step at pending position ``n`` can verify a runner-up: its scratch slot
    (:func:`runner_up_slot`) lies in n + 1's softmax chunk (``bitmtp.ops.linear.ATTENTION_CHUNK``) and inside
    a KV store of ``rows`` rows. About 7 pending positions in 8 qualify at D ≤ 8."""
    at = n + runner_up_slot(p, d)
    return at < rows and at // ATTENTION_CHUNK == (n + 1) // ATTENTION_CHUNK


def top2_layout(p: int, d: int) -> tuple[list[int], list[int]]:
    """Rows of a ``top2`` step with ``p`` AR rows (t, g_1..g_k, k ≥ 1), g_1's runner-up, then ``d − 1`` mask
    rows (``ReplayState(p + d, σ, "fused", d, alt=1)``): per row, offsets from n of its position and its KV
    slot. The runner-up sits at g_1's position (n + 1) and writes the scratch slot :func:`runner_up_slot`,
    past the other rows' slots, so no row of the step reads it but itself; the mask rows keep the positions
    they have in a plain fused step (after the last guess)."""
    if p < 2 or d < 2:
        raise ValueError(f"top2 layout: needs a guess (p >= 2) and a block (d >= 2), got p={p}, d={d}")
    masks = list(range(p, p + d - 1))
    return [*range(p), 1, *masks], [*range(p), runner_up_slot(p, d), *masks]


@dataclass
class PassPlan:
    """One iteration's rows: ``guesses`` (g_1..g_k, host-known) from ``source`` (``"lookup"``,
    ``"masks"``, ``"heads"``, ``"oracle"`` or ``""`` for none), and ``masks``: the block size D' of the
    drafts appended for the next iteration (D' − 1 mask rows, or D' − 1 heads drafts; 0 for none).
    ``width`` is the step's state width: the rows, plus the heads' output slots."""

    guesses: list[int]
    source: str
    masks: int = 0
    #: the mask rows form a tree: a block after the pending row and after every guess (width (k + 1)·D')
    tree: bool = False
    #: the ``top2`` schedule: g_1's runner-up, verified in one more row beside g_1 (None: no such row)
    alt: int | None = None

    @property
    def width(self) -> int:
        if self.tree and self.masks:
            return (1 + len(self.guesses)) * self.masks
        return 1 + len(self.guesses) + (self.alt is not None) + (self.masks - 1 if self.masks else 0)


@dataclass
class PassContext:
    """What the loop tells a planner before each iteration (updated in place).

    ``index``: the committed sequence (prompt + output) as a lookup index (``index.tokens``);
    ``n``: materialized KV rows (the pending token sits at position n); ``mask_guesses`` /
    ``mask_probs``: the previous step's mask drafts when they are valid (every guess of that step was
    accepted), else empty; ``max_width``: the widest step that fits (m_max and the store's capacity);
    ``block``: the generation's D; ``lookup`` / ``host`` / ``masks``: the drafters available (a lookup
    drafter, another host drafter such as the oracle, a drafter of fused steps: mask-block or heads),
    None where absent; ``fused``: how ``masks`` drafts (``"masks"`` or ``"heads"``, its ``fused_drafts``:
    also the source name of its guesses); ``draft_cost``: what one heads draft costs relative to a
    width-1 step (heads only; their drafts take no rows); ``tree``: the schedule is ``tree``; ``top2``: the
    plans may verify runner-ups (the ``top2`` schedule, or ``auto`` decoding greedily with a mask-block
    adapter), and ``mask_alt`` the previous step's runner-up of its first mask draft (None when the mask
    drafts are not valid);
    ``costs``: relative step cost by width at the current context (``costs[w]``, ``costs[1] == 1``;
    None when the planner does not need them).
    """

    index: LookupIndex
    n: int
    block: int
    max_width: int
    lookup: Any = None
    host: Any = None
    masks: Any = None
    mask_guesses: list[int] = field(default_factory=list)
    mask_probs: list[float] = field(default_factory=list)
    costs: Sequence[float] | None = None
    fused: str = ""
    draft_cost: float = 0.0
    tree: bool = False
    top2: bool = False
    mask_alt: int | None = None
    #: after a step whose plan had a runner-up: whether the runner-up committed (:meth:`Planner.observe`
    #: then gets ``accepted`` = 0, g_1 having been rejected)
    runner_up: bool = False


@dataclass
class DecodeMemory:
    """What an engine's generations learn and keep across generations (``Engine.memory``); only the generation
    that owns the engine's store touches it.

    ``acceptance``: ``auto``'s running acceptance estimates, by (source, bucket, position) → [hits, tries]
    (``decoding.auto.AutoPlanner``); ``prior_costs`` / ``live_costs``: the step-cost table planned with before
    one was measured and the live corrections of the table in use (``runtime.calibration``; None until the first
    generation that plans with costs); ``sampled``: the memory of sampled generations (their acceptance differs
    from greedy decoding's), made on first use."""

    acceptance: dict[tuple, list[float]] = field(default_factory=dict)
    prior_costs: Any = None
    live_costs: Any = None
    sampled: DecodeMemory | None = None

    def for_sampling(self, sampled: bool) -> DecodeMemory:
        """This memory, or with ``sampled`` the sampled generations' own."""
        if not sampled:
            return self
        if self.sampled is None:
            self.sampled = DecodeMemory()
        return self.sampled


class Planner:
    """Base of the one-pass planners: :meth:`plan` before each step, :meth:`observe` after its read."""

    def plan(self, ctx: PassContext) -> PassPlan:
        raise NotImplementedError

    def observe(self, plan: PassPlan, accepted: int, ctx: PassContext) -> None:
        """``accepted``: how many of ``plan.guesses`` were accepted (a ≤ k; 0 when g_1's runner-up
        committed instead, ``ctx.runner_up`` then True)."""


def fit(plan: PassPlan, max_width: int) -> PassPlan:
    """``plan`` trimmed to ``max_width`` rows: guesses first kept, mask rows dropped when they do not fit
    (a tree keeps its block size and verifies fewer guesses)."""
    if plan.width <= max_width:
        return plan
    if plan.alt is not None:  # the runner-up row goes first: it is the least likely to commit anything
        return fit(PassPlan(plan.guesses, plan.source, plan.masks, plan.tree), max_width)
    if plan.tree and plan.masks:
        if plan.masks <= max_width:
            return PassPlan(plan.guesses[: max_width // plan.masks - 1], plan.source, plan.masks, True)
        plan = PassPlan(plan.guesses, plan.source, 0)
    if plan.masks and 1 + len(plan.guesses) + plan.masks - 1 > max_width:
        plan = PassPlan(plan.guesses, plan.source, 0)
    if plan.width > max_width:
        plan = PassPlan(plan.guesses[: max(0, max_width - 1)], plan.source, plan.masks)
    return plan


class FixedPlanner(Planner):
    """``speculative`` in one pass: D − 1 guesses each iteration from the drafter, and D − 1 drafts
    (mask rows or heads) every step when the drafter drafts in fused steps (``lookup+adapter``: lookup
    guesses when the context matches, the adapter's drafts otherwise)."""

    def plan(self, ctx: PassContext) -> PassPlan:
        d = ctx.block
        if ctx.host is not None:
            plan = PassPlan(ctx.host.propose(ctx.index.tokens, d - 1), "oracle")
        else:
            plan = PassPlan([], "")
            if ctx.lookup is not None:
                props, _ = ctx.index.propose(d - 1)
                if props:
                    plan = PassPlan(props, "lookup")
            if not plan.guesses and ctx.mask_guesses:
                plan = PassPlan(ctx.mask_guesses[: d - 1], ctx.fused, alt=ctx.mask_alt if ctx.top2 else None)
            if ctx.masks is not None:
                plan.masks = d
                plan.tree = ctx.tree
        return fit(plan, ctx.max_width)
