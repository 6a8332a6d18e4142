"""The ``auto`` planner (``bitmtp.decoding.auto``): what it plans for given step costs and estimates.

Rules: with steps that cost as much as their rows it plans AR (no guesses) except for a rare re-try; it verifies
a mask draft's runner-up only when that row pays (cheap rows, a good estimate) and only with mask rows appended;
with flat costs and reliable guesses it verifies as many guesses as fit; its acceptance estimates move
toward what it observes and persist in the engine's memory; it never plans wider than the step allows.
"""

from __future__ import annotations

import pytest

from bitmtp.decoding.auto import EXPLORE_EVERY, LOOKUP_PRIOR, AutoPlanner, AutoPolicy
from bitmtp.decoding.lookup import LookupIndex
from bitmtp.decoding.onepass import DecodeMemory, PassContext, PassPlan


class _Lookup:
    kind = "lookup"


class _Masks:
    kind = "mask-block"
    max_block = 8


def ctx_for(costs, tokens=(1, 2, 3, 4, 1, 2, 3), masks=False, max_width=16, mask_guesses=()):
    return PassContext(LookupIndex(tokens), n=len(tokens), block=8, max_width=max_width, lookup=_Lookup(),
                       masks=_Masks() if masks else None, mask_guesses=list(mask_guesses),
                       mask_probs=[0.95] * len(mask_guesses), costs=costs)


def linear(per_row):
    return [0.0] + [1 + per_row * (w - 1) for w in range(1, 17)]


def test_expensive_rows_mean_ar_with_rare_retries():
    planner = AutoPlanner(DecodeMemory())
    ctx = ctx_for(linear(1.0), masks=True, mask_guesses=[5, 6, 7])
    plans = [planner.plan(ctx) for _ in range(3 * EXPLORE_EVERY)]
    tried = [p for p in plans if p.guesses or p.masks]
    assert plans[0] == PassPlan([], "", 0)
    assert 1 <= len(tried) <= 6 and all(len(p.guesses) <= 1 for p in tried)


def test_flat_costs_and_good_guesses_verify_all_that_fit():
    memory = DecodeMemory()
    planner = AutoPlanner(memory)
    ctx = ctx_for(linear(0.0), tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3], max_width=6)
    for _ in range(20):  # the lookup is always right here
        plan = planner.plan(ctx)
        planner.observe(plan, len(plan.guesses), ctx)
    plan = planner.plan(ctx)
    assert plan.source == "lookup" and plan.guesses == [4, 5, 6, 7, 8] and plan.width == 6


def test_estimates_follow_observations_and_persist():
    memory = DecodeMemory()
    planner = AutoPlanner(memory)
    ctx = ctx_for(linear(0.3))
    first = planner.plan(ctx)
    assert first.source == "lookup"  # a 3-gram match at the prior of 0.6 pays at 0.3 per row
    for _ in range(40):
        plan = planner.plan(ctx)
        if plan.guesses:
            planner.observe(plan, 0, ctx)  # always rejected
    # it stops trying once the estimate falls below break-even plus the margin (α < 0.365 at 0.3 per row)
    assert planner.alpha(("lookup", 3, 1), LOOKUP_PRIOR[3]) < 0.37
    again = AutoPlanner(memory)  # the next generation on the same engine starts from what was learnt
    assert again.plan(ctx).guesses == []


def test_choices_are_counted_and_policy_is_registered():
    from bitmtp.decoding import get_policy

    assert get_policy("auto") is AutoPolicy and AutoPolicy.lossless and AutoPolicy().decode_schedule == "one-pass"
    planner = AutoPlanner(DecodeMemory())
    for _ in range(5):
        planner.plan(ctx_for(linear(5.0)))
    assert planner.choices == {"ar": 5}


@pytest.mark.parametrize("max_width", (1, 2, 3))
def test_never_wider_than_allowed(max_width):
    planner = AutoPlanner(DecodeMemory())
    ctx = ctx_for(linear(0.0), masks=True, mask_guesses=[5, 6, 7], max_width=max_width)
    for _ in range(2 * EXPLORE_EVERY):
        assert planner.plan(ctx).width <= max_width


class _Heads:
    kind = "heads"
    max_block = 8


def _heads_ctx(costs, draft_cost, guesses=(5, 6, 7)):
    return PassContext(LookupIndex([1, 2, 3]), n=3, block=8, max_width=16, lookup=None, masks=_Heads(),
                       mask_guesses=list(guesses), mask_probs=[0.95] * len(guesses), costs=costs, fused="heads",
                       draft_cost=draft_cost)


def test_heads_drafts_cost_what_they_are_observed_to_cost():
    """Heads drafts take output slots, not rows: with cheap rows and cheap drafts auto verifies the heads'
    guesses and appends drafts (labelled "heads"); when a draft costs as much as a step, it appends none."""
    memory = DecodeMemory()
    planner = AutoPlanner(memory)
    ctx = _heads_ctx(linear(0.05), 0.01)
    for _ in range(30):  # the heads are always right here
        plan = planner.plan(ctx)
        planner.observe(plan, len(plan.guesses), ctx)
    plan = planner.plan(ctx)
    assert plan.source == "heads" and plan.guesses == [5, 6, 7] and plan.masks >= 2
    assert planner.choices.get("heads+heads", 0) > 0
    assert any(key[0] == "heads" for key in memory.acceptance)
    dear = AutoPlanner(memory).plan(_heads_ctx(linear(0.05), 1.5))
    assert dear.source == "heads" and dear.masks == 0  # verifying is still worth it, drafting more is not


def _top2_ctx(costs, alt=9):
    ctx = ctx_for(costs, tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9), masks=True, mask_guesses=[5, 6, 7])
    ctx.fused, ctx.top2, ctx.mask_alt = "masks", True, alt
    ctx.mask_probs = [0.6, 0.6, 0.6]  # the middle bucket: g_1 is often wrong
    return ctx


def test_runner_up_planned_where_rows_are_cheap_and_with_mask_rows_only():
    from bitmtp.decoding.auto import RUNNER_UP_PRIOR

    planner = AutoPlanner(DecodeMemory())
    flat = _top2_ctx(linear(0.0))
    for _ in range(3):  # warm: the mask chain's estimates (prior 0.35) pay on flat costs
        plan = planner.plan(flat)
    assert plan.source == "masks" and plan.alt == 9 and plan.masks
    assert plan.width == 1 + len(plan.guesses) + 1 + plan.masks - 1
    # steep rows: the runner-up's expected (1 - α₁)·β ≈ 0.16 tokens never pays its row
    steep = _top2_ctx(linear(0.9))
    assert all(AutoPlanner(DecodeMemory()).plan(steep).alt is None for _ in range(5))
    # no runner-up at hand, or top2 off: never planned
    assert planner.plan(_top2_ctx(linear(0.0), alt=None)).alt is None
    off = _top2_ctx(linear(0.0))
    off.top2 = False
    assert planner.plan(off).alt is None
    assert 0 < RUNNER_UP_PRIOR < 0.5


def test_runner_up_estimate_follows_observations():
    from bitmtp.decoding.auto import RUNNER_UP_PRIOR

    memory = DecodeMemory()
    planner = AutoPlanner(memory)
    ctx = _top2_ctx(linear(0.0))
    for hit in (True,) * 20:
        plan = planner.plan(ctx)
        assert plan.alt is not None
        ctx.runner_up = hit
        planner.observe(plan, 0, ctx)  # g_1 rejected, its runner-up committed
    assert planner.alpha(("runner-up", 1), RUNNER_UP_PRIOR) > 0.8
    for _ in range(40):
        plan = planner.plan(ctx)
        ctx.runner_up = False
        planner.observe(plan, 0, ctx)
    assert planner.alpha(("runner-up", 1), RUNNER_UP_PRIOR) < 0.1
    # an accepted g_1 says nothing about its runner-up
    before = dict(memory.acceptance)
    plan = planner.plan(ctx)
    planner.observe(plan, 1, ctx)
    assert memory.acceptance[("runner-up", 1)] == before[("runner-up", 1)]


def test_decode_memory_keeps_sampled_generations_estimates_apart():
    """``Engine.memory`` is typed (``DecodeMemory``): greedy generations learn into it, sampled ones into their own
    (made once, kept): a sampled generation's acceptance does not move greedy decoding's estimates."""
    memory = DecodeMemory()
    assert memory.for_sampling(False) is memory
    sampled = memory.for_sampling(True)
    assert sampled is memory.for_sampling(True) and sampled is not memory
    AutoPlanner(sampled).est[("lookup", 1, 1)] = [1.0, 1.0]
    assert memory.acceptance == {} and sampled.acceptance == {("lookup", 1, 1): [1.0, 1.0]}
