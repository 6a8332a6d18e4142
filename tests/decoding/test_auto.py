"""The ``auto`` planner (``bitmtp.decoding.auto``): what it plans for given step costs and estimates.

Rules: with steps that cost as much as their rows it plans AR (no guesses) except for a rare re-try;
with flat costs and reliable guesses it verifies as many guesses as fit; its acceptance estimates move
toward what it observes and persist in the engine's memory; it never plans wider than the step allows.
"""

from __future__ import annotations

import pytest

from bitmtp.decoding.auto import EXPLORE_EVERY, LOOKUP_PRIOR, AutoPlanner, AutoPolicy
from bitmtp.decoding.lookup import LookupIndex
from bitmtp.decoding.onepass import PassContext, PassPlan


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
    planner = AutoPlanner({})
    ctx = ctx_for(linear(1.0), masks=True, mask_guesses=[5, 6, 7])
    plans = [planner.plan(ctx) for _ in range(3 * EXPLORE_EVERY)]
    tried = [p for p in plans if p.guesses or p.masks]
    assert plans[0] == PassPlan([], "", 0)
    assert 1 <= len(tried) <= 6 and all(len(p.guesses) <= 1 for p in tried)


def test_flat_costs_and_good_guesses_verify_all_that_fit():
    memory = {}
    planner = AutoPlanner(memory)
    ctx = ctx_for(linear(0.0), tokens=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3], max_width=6)
    for _ in range(20):  # the lookup is always right here
        plan = planner.plan(ctx)
        planner.observe(plan, len(plan.guesses), ctx)
    plan = planner.plan(ctx)
    assert plan.source == "lookup" and plan.guesses == [4, 5, 6, 7, 8] and plan.width == 6


def test_estimates_follow_observations_and_persist():
    memory = {}
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
    planner = AutoPlanner({})
    for _ in range(5):
        planner.plan(ctx_for(linear(5.0)))
    assert planner.choices == {"ar": 5}


@pytest.mark.parametrize("max_width", (1, 2, 3))
def test_never_wider_than_allowed(max_width):
    planner = AutoPlanner({})
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
    memory = {}
    planner = AutoPlanner(memory)
    ctx = _heads_ctx(linear(0.05), 0.01)
    for _ in range(30):  # the heads are always right here
        plan = planner.plan(ctx)
        planner.observe(plan, len(plan.guesses), ctx)
    plan = planner.plan(ctx)
    assert plan.source == "heads" and plan.guesses == [5, 6, 7] and plan.masks >= 2
    assert planner.choices.get("heads+heads", 0) > 0
    assert any(key[0] == "heads" for key in memory["auto_acceptance"])
    dear = AutoPlanner(memory).plan(_heads_ctx(linear(0.05), 1.5))
    assert dear.source == "heads" and dear.masks == 0  # verifying is still worth it, drafting more is not
