"""The decode loop over one engine: ``decode`` prefills, then runs one of three iterations.

* **AR** (``policy="ar"``): one token a step (``Engine._ar_step``), inline below.
* **One pass** (``auto``, ``speculative`` with ``schedule="one-pass" / "tree" / "top2"``): each iteration is
  ONE step over [pending token, guesses, mask rows] and ONE read (``decoding/onepass.py`` plans it). The
  iteration is :func:`_pass_step`, the same for every kind of step: plan, lay the rows out, run, read, accept by
  the rule written once (``decoding.accept``), commit, hand the next drafts on. What differs between kinds of
  step — plain, mask rows / heads slots, a runner-up row (top2), a tree of mask blocks — lives in the step's
  layout object (``runtime/pass_layouts.py``); what a generation learns lives in ``Engine.memory``.
* **Two pass** (``speculative``'s default schedule, the lossy ``confidence`` / ``hybrid``): a draft step, then a
  verify step when the policy says — in ``runtime/two_pass.py``.

Many sequences in one step: ``runtime/batch.py`` (``BatchEngine``: the same acceptance rule and one forward
pass over every sequence's rows).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from bitmtp.decoding.accept import speculative_accept
from bitmtp.decoding.drafters import CombinedDrafter, DraftSource
from bitmtp.decoding.lookup import LookupIndex
from bitmtp.decoding.onepass import HEADS_DRAFT_COST, PassContext
from bitmtp.decoding.policies import ONE_PASS_SCHEDULES, Policy, resolve_policy
from bitmtp.decoding.sampling import SamplingParams
from bitmtp.errors import BitMTPError
from bitmtp.runtime.output import DecodeStats, GenerationResult, Output
from bitmtp.runtime.pass_layouts import pass_layout
from bitmtp.runtime.two_pass import check_block, two_pass_loop

#: generations asking for fewer new tokens than this plan ``auto`` with the prior step costs instead of
#: calibrating first (``runtime.calibration``): the ~5 s measurement pays off over longer generations
CALIBRATE_MIN_NEW_TOKENS = 64


def decode(engine, input_ids: Sequence[int], *, max_new_tokens: int, eos: Sequence[int] = (),
           policy: str | Policy = "ar", block_size: int = 8, tau: float | None = None, min_prefix: int | None = None,
           drafter=None, report: dict[str, DecodeStats] | None = None, schedule: str | None = None,
           notes: Sequence[str] = (), sampling: SamplingParams | None = None,
           logprobs: bool = False) -> Iterator[list[int]]:
    """Generate; yields each iteration's committed tokens, returns a :class:`GenerationResult`.

    ``sampling``: how tokens are chosen (``bitmtp.decoding.sampling``; None or temperature 0 without
    penalties: greedy). Every verifying policy commits exactly the tokens AR decoding with the same
    parameters and seed commits. ``logprobs``: also return each committed token's log-probability under
    the distribution it was chosen from (the model's for AR and verified tokens; the drafter's for the
    tokens ``confidence`` / ``hybrid`` commit unverified after ``d_1``).

    ``policy``: a registered name (with the loose ``tau`` / ``min_prefix``; None: τ = 0.9, m =
    max(2, D // 2)) or a :class:`~bitmtp.decoding.Policy` (``bitmtp.decoding.resolve_policy``); it
    is bound to ``block_size`` here. Arguments are validated by the caller (``bitmtp.api.generate``),
    except what only the engine knows. Run it through ``Engine.decode``, whose ``Generation`` owns the
    engine's KV store meanwhile (this generator writes the store's rows and ``engine.n`` and assumes no
    one else does). ``report`` receives ``{"stats": DecodeStats}`` as soon as decoding starts.
    """
    if max_new_tokens < 1:
        raise BitMTPError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
    d = int(block_size)
    pol = resolve_policy(policy, tau=tau, min_prefix=min_prefix, schedule=schedule).bind(d)
    one_pass = pol.drafts and pol.decode_schedule in ONE_PASS_SCHEDULES
    if pol.drafts:
        check_block(engine, d, drafter, pol)
        _check_drafter(engine, drafter, pol)
    stats = DecodeStats(pol.name, d if pol.drafts else 1, schedule=pol.decode_schedule if pol.drafts else "")
    stats.notes.extend(notes)
    engine.last_stats = stats  # readable even when the caller stops the generator early
    if report is not None:
        report["stats"] = stats  # the caller's own view (engine.last_stats is the latest generation's)
    syncs0 = engine.syncs
    costs = None
    if one_pass and pol.uses_costs:
        from bitmtp.runtime.calibration import LiveCosts, load_cost_table, prior_cost_table

        # measured once per machine/model/threads (cached; it overwrites KV rows), then corrected by the
        # step times this generation observes. A short generation does not pay the ~5 s measurement (a
        # one-token CLI call would spend most of its time there): it plans with the prior table,
        # which the observed steps correct
        table = load_cost_table(engine, measure=max_new_tokens >= CALIBRATE_MIN_NEW_TOKENS)
        if table is None:
            table = engine.memory.prior_costs
            if table is None:
                table = engine.memory.prior_costs = prior_cost_table(engine)
        costs = engine.memory.live_costs
        if costs is None or costs.table is not table:  # observations carry over to the engine's next generation
            costs = engine.memory.live_costs = LiveCosts(table, engine.kv.m_max)
    if one_pass and pol.decode_schedule == "top2" and sampling is not None and not sampling.greedy:
        raise BitMTPError("schedule: 'top2' verifies a runner-up guess beside the first one, which greedy decoding "
                          "only can accept exactly; decode greedily (temperature 0, no penalties) or use "
                          "schedule='one-pass'")
    params = sampling.with_seed() if sampling is not None and not sampling.greedy else None
    sampler = engine.pool.set_sampling(params)
    ids = list(input_ids)
    # the prompt's longest prefix whose KV rows the store still holds exactly (the prompt-prefix cache)
    stats.prompt_cached = engine.resume(ids)
    if sampler is not None:
        sampler.start(params.seed, ids)
    t0 = time.perf_counter()
    if logprobs:
        first, first_p = engine._prefill(ids[stats.prompt_cached :], with_prob=True)
    else:
        first, first_p = engine._prefill(ids[stats.prompt_cached :]), None
    t1 = time.perf_counter()
    engine.keep(ids, len(ids))
    # committed tokens may reach capacity + 1: the last one needs no KV row
    out = Output(max_new_tokens, set(int(e) for e in eos), engine.capacity + 1 - len(ids), sampler, logprobs)
    if report is not None:  # what a caller that stops early (a stop string) still needs
        report.update(output=out, seed=params.seed if params is not None else None, prefill_seconds=t1 - t0,
                      prompt_tokens=len(ids))
    yield out.add([first], [first_p])

    if not pol.drafts:
        tok, pr = first, None
        while out.reason is None:
            if logprobs:
                tok, pr = engine._ar_step(tok, with_prob=True)
            else:
                tok = engine._ar_step(tok)
            stats.committed.append(1)
            stats.verified.append(False)
            stats.widths[1] += 1
            yield out.add(pol.commit((tok,), (), None).tokens, [pr])
    elif out.reason is None and one_pass:
        yield from _onepass_loop(engine, out, stats, ids, first, pol, d, drafter, costs)
    elif out.reason is None:
        yield from two_pass_loop(engine, out, stats, ids, first, pol, d, drafter)
    t2 = time.perf_counter()
    if not pol.drafts or pol.lossless:  # rows [0, n) hold the prompt and the tokens committed after it
        engine.keep((ids + out.tokens)[: engine.n], len(ids))
    stats.syncs = engine.syncs - syncs0
    stats.seconds = t2 - t1
    stats.tokens = len(out.tokens)
    return GenerationResult(out.tokens, out.reason or "max_new_tokens", len(ids), t1 - t0, t2 - t1, stats,
                            out.logprobs, params.seed if params is not None else None, out.origins, out.steps)


def _check_drafter(engine, drafter: DraftSource, policy: Policy) -> None:
    """The drafter suits the policy's schedule (module docstring; ``bitmtp.decoding.drafters``)."""
    kind = drafter.kind
    if policy.decode_schedule == "two-pass":
        if isinstance(drafter, CombinedDrafter):
            raise BitMTPError("drafter: 'lookup+adapter' drafts in the one-pass schedule only; use policy='auto' or "
                              "schedule='one-pass', or one drafter ('lookup' or 'adapter')")
        if kind == "lookup" and not policy.lossless:
            raise BitMTPError(f"drafter: lookup drafts are unverified guesses, and policy {policy.name!r} commits "
                              "drafts without verifying them; use policy='speculative' or 'auto' with lookup")
        return
    one = drafter.adapter if isinstance(drafter, CombinedDrafter) else drafter
    fused = one.fused_drafts
    if not (one.host_guesses or fused):
        raise BitMTPError(f"schedule: the {kind} drafter does not run in the one-pass schedule (mask-block, heads, "
                          "lookup and oracle drafters do); use schedule='two-pass'")
    if fused and not engine.pool.fused_steps:
        raise BitMTPError(f"schedule: the one-pass schedule's {fused} drafts do not run on runtime={engine.runtime!r}; "
                          "use schedule='two-pass' or drafter='lookup'")
    if policy.decode_schedule == "tree" and fused != "masks":
        what = "heads draft at any accept length already" if fused == "heads" else "it has no mask rows"
        raise BitMTPError(f"schedule: the tree schedule grows mask rows after every row and needs a mask-block "
                          f"adapter; the {kind} drafter does not fit ({what}); use schedule='one-pass'")
    if policy.decode_schedule == "top2" and fused != "masks":
        raise BitMTPError(f"schedule: the top2 schedule verifies the runner-up of a mask row's draft and needs a "
                          f"mask-block adapter; the {kind} drafter has no mask rows; use schedule='one-pass'")


def _onepass_loop(engine, out: Output, stats: DecodeStats, ids: list[int], first: int, policy: Policy, d: int,
                  drafter, costs) -> Iterator[list[int]]:
    """The one-pass schedule (``bitmtp.decoding.onepass``): each iteration is ONE step over
    [pending token, guesses g_1..g_k, (D − 1 mask rows)] and ONE read; the guesses commit while they
    equal the AR argmax of the row before them, then that row's argmax commits too. A heads drafter
    appends no rows: its D − 1 drafts, from the last accepted row, fill the step's last output slots.

    The pending and guess rows are AR-causal (each sees KV rows ≤ its position; the mask rows come
    after them), so every committed token is exactly AR greedy's, and the KV rows of the pending token
    and the accepted guesses are exact and stay (n += a + 1). Rows of rejected guesses and mask rows are
    not counted: the next step overwrites them in place. The iteration is :func:`_pass_step`; what differs
    between kinds of step (tree, top2, heads) is the step's layout (``runtime.pass_layouts``).
    """
    loop = _PassLoop.start(engine, out, stats, ids, first, policy, d, drafter, costs)
    while loop.n < engine.capacity:
        taken = _pass_step(engine, loop)
        yield taken
        if out.reason is not None:
            break
    else:
        out.reason = out.reason or "capacity"
    engine.n = loop.n


@dataclass(eq=False)
class _PassLoop:
    """The one-pass loop's state between iterations."""

    out: Output
    stats: DecodeStats
    ctx: PassContext  # what the planner is told (updated in place)
    planner: Any
    index: LookupIndex  # the committed sequence
    costs: Any  # live step costs (``runtime.calibration.LiveCosts``), or None when the policy does not plan by them
    fused: str  # how the drafter's mask rows draft: "masks", "heads" or "" (none)
    n: int  # materialized KV rows: the pending token's position
    tok: int  # the pending token: committed, its KV row not written yet
    next_costs: int = 0  # the iteration at which the relative costs are looked up again
    #: tree and top2 steps' position / slot offsets from n, by (kind, k + 1, D) (``runtime.pass_layouts``)
    offsets: dict = field(default_factory=dict)

    @classmethod
    def start(cls, engine, out: Output, stats: DecodeStats, ids: list[int], first: int, policy: Policy, d: int,
              drafter, costs) -> _PassLoop:
        lookup = masks = host = None
        for one in (drafter.lookup, drafter.adapter) if isinstance(drafter, CombinedDrafter) else (drafter,):
            if one.kind == "lookup":
                lookup = one
            elif one.fused_drafts:
                masks = one
            elif one.host_guesses:
                host = one
        fused = masks.fused_drafts if masks is not None else ""
        if masks is not None:
            engine.pool.set_drafter(masks)
        index = lookup.index(ids + [first]) if lookup is not None else LookupIndex(ids + [first], ngram_max=1)
        ctx = PassContext(index, engine.n, d, engine.kv.m_max, lookup=lookup, host=host, masks=masks, fused=fused,
                          tree=policy.decode_schedule == "tree",
                          top2=policy.decode_schedule == "top2"
                          or (policy.plans_runner_ups and fused == "masks" and out.sampler is None))
        if fused == "heads":
            ctx.draft_cost = costs.draft_cost(HEADS_DRAFT_COST) if costs is not None else HEADS_DRAFT_COST
        # sampled guesses are accepted less often than greedy ones (a guess must match a sample, not the argmax):
        # sampled generations keep their own acceptance estimates, so neither kind plans with the other's
        planner = policy.planner(engine.memory.for_sampling(out.sampler is not None))
        return cls(out, stats, ctx, planner, index, costs, fused, engine.n, first)


def _pass_step(engine, loop: _PassLoop) -> list[int]:
    """One one-pass iteration: plan, ONE step over the planned rows, ONE read, accept by the rule, commit;
    returns the tokens committed. The step's layout (``runtime.pass_layouts``) places, reads and hands on its
    rows as its kind of step needs."""
    ctx, stats, costs, n = loop.ctx, loop.stats, loop.costs, loop.n
    ctx.n, ctx.max_width = n, engine.kv.m_max
    if costs is not None and stats.iterations >= loop.next_costs:
        # the relative cost of a width changes with the context (attention) and with what the steps are
        # observed to cost: refreshed every 8 iterations (~60 us each, against ~10 ms steps)
        ctx.costs = costs.relative(n)
        if loop.fused == "heads":
            ctx.draft_cost = costs.draft_cost(HEADS_DRAFT_COST)
        loop.next_costs = stats.iterations + 8
    layout = pass_layout(loop.planner.plan(ctx), n, engine.kv.rows, loop.fused, loop.offsets)
    logprobs = loop.out.logprobs is not None
    runner = layout.runner(engine, loop.tok, loop.out.sampler is not None)
    t0 = time.perf_counter()
    runner.run()
    v, p, second = layout.read(engine, runner, logprobs, ctx.top2)
    if costs is not None:
        layout.observe(costs, time.perf_counter() - t0)
    # guesses accepted: the rule written once (decoding.accept), over [the pending row's choice, guesses]
    a = speculative_accept([v[0], *layout.guesses], v[: layout.k + 1]) - 1
    runner_up = layout.runner_up(v, a)
    taken = loop.out.add(*layout.committed(v, p, a, runner_up))
    stats.record_pass(layout, a, runner_up, len(taken), loop.fused)
    ctx.runner_up = runner_up
    loop.planner.observe(layout.plan, a, ctx)
    rows, loop.tok = layout.advance(engine.kv, v, a, runner_up)
    loop.n = engine.n = n + rows
    loop.index.extend(taken)
    ctx.mask_guesses, ctx.mask_probs, ctx.mask_alt = layout.hand_on(v, p, a, runner_up, second)
    return taken
