"""``policy="auto"``: lossless decoding that drafts only where drafting pays (the default).

Each iteration of the one-pass schedule (``bitmtp.decoding.onepass``) is planned to maximise

    expected committed tokens / cost(width, context)

over the options at hand: plain AR (width 1, one token), the lookup's guesses (k of them), the previous
step's adapter drafts (k of them), each with or without D' − 1 drafts appended for the next iteration's
guesses — mask rows with a mask-block adapter, heads drafts with a heads adapter (these take no rows:
they cost what :class:`~bitmtp.runtime.calibration.LiveCosts` observes a draft to cost). ``cost`` is
the step-cost table measured on this machine for this model, backend
and thread count (``bitmtp.runtime.calibration``, relative to a width-1 step at the same context).
Expected committed tokens are ``1 + Σ_i Π_(j≤i) α_j`` with α_j a running estimate of the probability
that guess j is accepted given guesses < j were — kept per source (lookup by the length of its n-gram
match; mask drafts by the draft's own probability bucket), per position, as decayed counts with a prior,
in a memory the engine keeps across its generations.

With a mask-block adapter and greedy decoding, a plan verifying mask drafts may also verify g_1's
runner-up in one more row (the ``top2`` schedule's row, ``bitmtp.decoding.onepass``): it adds
``(1 − α_1)·β`` expected tokens, β the running estimate that the runner-up holds when g_1 does not, for
the cost of that row; the planner takes it only where that pays.

Every committed token is verified (guess rows are AR-causal; a guess commits only when the AR argmax of
the row before it equals it), so the output equals AR greedy's token for token whatever is planned.
Where no draft is expected to pay, the plan is a width-1 step: AR itself. Options that are not chosen
are re-tried now and then (one guess, or the smallest mask block) so that their estimates can recover
when the text changes character.
"""

from __future__ import annotations

import math
from typing import ClassVar

from bitmtp.decoding.onepass import DecodeMemory, PassContext, PassPlan, Planner, fit
from bitmtp.decoding.policies import NoParams, Policy, register_policy

#: prior acceptance of a lookup guess by the length of the n-gram match it came from (pseudo-counts
#: below); measured on held-out SmolLM2 outputs: 3-gram matches are accepted ~0.6, 1-grams ~0.25
LOOKUP_PRIOR = {1: 0.25, 2: 0.45, 3: 0.6, 4: 0.65, 5: 0.7}
#: prior acceptance of a mask draft by its probability bucket (below 0.5, 0.5–0.9, 0.9 and above);
#: measured with SmolLM2's shipped mask-block adapter on held-out code: 0.17 / 0.46 / 0.91, on chat
#: 0.0 / 0.37 / 0.26 — priors sit below both so that mask rows are bought on evidence
MASK_PRIOR = (0.1, 0.35, 0.7)
PRIOR_WEIGHT = 2.0
#: prior probability that a mask draft's runner-up (the first mask row's second choice) is the token when
#: the draft itself is not: measured with SmolLM2's shipped mask-block adapter (top-2 minus top-1 over
#: 1 − top-1, first mask row, teacher-forced on the eval-acceptance sets): chat 0.27, code 0.41
RUNNER_UP_PRIOR = 0.25
#: the weight of older observations shrinks by this factor per observation of the same key: the
#: estimates follow a text that changes character within ~15 iterations (0.97 carried estimates learnt
#: on code into the next chat prompt for long enough to cost it 8 %)
DECAY = 0.93
#: mask rows are appended only when the mask chain's expected rate beats the plan without them by this
#: factor: their value is a forecast for the next iteration, and a forecast that merely ties costs rows
MASK_MARGIN = 1.1
#: guesses are verified only when their expected rate beats AR's by this factor: an estimate near
#: break-even is as likely to lose as to win, and each loss costs a wider step (on chat prompts, lookup
#: guesses chosen at ~1.0 cost a few % against AR; code and documents choose them at 1.3-2.0)
DRAFT_MARGIN = 1.05
#: iterations between re-tries of an option that is not chosen (a re-try costs ~0.3 of an AR step
#: here, so one per 48 iterations stays under 1 % of the decode time)
EXPLORE_EVERY = 48
#: longest guess run considered
MAX_GUESSES = 8
#: step times older than this (seconds) no longer price a width (``runtime.calibration.LiveCosts``, and the
#: batch's ``decoding.batch_plan.StepCost``): they describe another moment's load, and a width priced high by a
#: few disturbed steps would never be chosen, so never re-timed. A second is ~150 SmolLM2 steps on 2 CPU
#: cores: a width that really is dear is re-tried (a few steps) at most that often, and a server idle between
#: two requests plans the second with the table's costs.
STEP_TIMES_KEPT_S = 1.0


def _rate(expect: float, cost: float) -> float:
    """Expected tokens per unit of cost; 0.0 (never chosen) for a cost that is not finite and positive.
    ``LiveCosts`` gives finite positive costs for every table it accepts; a caller's own ``ctx.costs`` with a
    0, an inf or a NaN makes that option unaffordable instead of a ZeroDivisionError or an inf/NaN rate
    that compares false with everything."""
    return expect / cost if 0.0 < cost < math.inf else 0.0


def mask_bucket(p: float) -> int:
    """The bucket of a mask draft's probability that its acceptance is kept by: 0 below 0.5, 1 to 0.9, 2 above."""
    return 2 if p >= 0.9 else (1 if p >= 0.5 else 0)


class AutoPlanner(Planner):
    """The ``auto`` planner of one generation (module docstring). ``memory``: the engine's
    :class:`~bitmtp.decoding.onepass.DecodeMemory`, which keeps the acceptance estimates across generations."""

    def __init__(self, memory: DecodeMemory):
        self.est: dict[tuple, list[float]] = memory.acceptance
        self.since_lookup = 0
        self.since_masks = 0
        self.choices: dict[str, int] = {}
        # what the current plan's guesses were estimated from (observe() updates those keys)
        self._lookup_n = 0
        self._mask_probs: list[float] = []
        self._chain: tuple[int, float] = (0, 0.0)
        self._chain_left = 0
        self._chain_costs = None
        self._alt_bucket = 0  # the probability bucket of the g_1 whose runner-up the plan verifies

    # -- estimates ----------------------------------------------------------------------------------

    def alpha(self, key: tuple, prior: float) -> float:
        hit, tried = self.est.get(key, (0.0, 0.0))
        return (hit + prior * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def _update(self, key: tuple, hit: bool) -> None:
        h, t = self.est.get(key, (0.0, 0.0))
        self.est[key] = [h * DECAY + (1.0 if hit else 0.0), t * DECAY + 1.0]

    def _lookup_alphas(self, n: int, k: int) -> list[float]:
        prior = LOOKUP_PRIOR.get(n, LOOKUP_PRIOR[5])
        return [self.alpha(("lookup", n, min(i, MAX_GUESSES)), prior) for i in range(1, k + 1)]

    def _mask_alphas(self, source: str, probs: list[float]) -> list[float]:
        out = []
        for i, p in enumerate(probs, 1):
            b = mask_bucket(p)
            out.append(self.alpha((source, b, min(i, MAX_GUESSES)), MASK_PRIOR[b]))
        return out

    def _chain_alphas(self, source: str, d: int, bucket: int = 1) -> list[float]:
        """Expected acceptance of the adapter's drafts in steady state, for drafts of probability bucket
        ``bucket`` (mask drafts: the middle one, the typical mix)."""
        return [self.alpha((source, bucket, min(i, MAX_GUESSES)), MASK_PRIOR[bucket]) for i in range(1, d)]

    # -- planning -------------------------------------------------------------------------------------

    @staticmethod
    def _best_k(alphas: list[float], costs, extra: int, max_width: int,
                draft_cost: float | None = None, runner_up: float | None = None) -> tuple[float, int]:
        """(rate, k) maximising (1 + Σ_(i≤k) Π α) / cost over k ≥ 0, with ``extra`` drafts appended for the
        next iteration: mask rows (``draft_cost`` None: cost(1 + k + extra)) or heads drafts, which take
        output slots, not rows (cost(1 + k) + extra · draft_cost). ``runner_up``: β, the plans with k ≥ 1
        also verify g_1's runner-up — one more row, (1 − α_1)·β more expected tokens."""
        alt = runner_up is not None

        def cost(k: int) -> float:
            rows = 1 + k + (alt and k > 0)
            return costs[rows + extra] if draft_cost is None else costs[rows] + extra * draft_cost

        best_rate, best_k = (_rate(1.0, cost(0)) if 1 + extra < len(costs) else 0.0), 0
        if alt:
            best_rate = 0.0  # k = 0 is the plan without the runner-up: the caller weighs it
        expect, run = 1.0, 1.0
        if alt and alphas:
            expect += (1.0 - alphas[0]) * runner_up
        for k, a in enumerate(alphas, 1):
            w = 1 + k + extra + alt
            if w > max_width or w >= len(costs):
                break
            run *= a
            expect += run
            rate = _rate(expect, cost(k))
            if rate > best_rate:
                best_rate, best_k = rate, k
        return best_rate, best_k

    def _chain_rate(self, ctx: PassContext, costs) -> tuple[int, float]:
        """(D', rate) of the best steady-state chain of the adapter's drafts: every step verifies the
        previous step's drafts and appends D' − 1 new ones; (0, 0.0) without a fused-step drafter."""
        masks, chain_rate = 0, 0.0
        if ctx.masks is not None:
            dc = ctx.draft_cost if ctx.fused == "heads" else None
            # heads drafts continue the chain at any accept length, so the drafts at hand say what the
            # chain is worth; mask drafts only after a full accept: the typical (middle) bucket, as tuned
            bucket = mask_bucket(ctx.mask_probs[0]) if ctx.fused == "heads" and ctx.mask_probs else 1
            for d in range(2, min(ctx.block, ctx.masks.max_block) + 1):
                w = 1 + 2 * (d - 1)
                if w > ctx.max_width or w >= len(costs):
                    break
                alphas = self._chain_alphas(ctx.fused, d, bucket)
                rate, _ = self._best_k(alphas, costs, d - 1, ctx.max_width, dc)
                if rate > chain_rate:
                    masks, chain_rate = d, rate
        return masks, chain_rate

    def plan(self, ctx: PassContext) -> PassPlan:
        costs = ctx.costs
        kmax = min(MAX_GUESSES, ctx.max_width - 1)
        # candidate guesses: the lookup's, else the previous step's mask drafts
        options: list[tuple[str, list[int], list[float]]] = []
        if ctx.lookup is not None and kmax > 0:
            props, self._lookup_n = ctx.index.propose(kmax)
            if props:
                options.append(("lookup", props, self._lookup_alphas(self._lookup_n, len(props))))
        if ctx.mask_guesses and kmax > 0:
            g = ctx.mask_guesses[:kmax]
            self._mask_probs = list(ctx.mask_probs[: len(g)])
            options.append((ctx.fused, g, self._mask_alphas(ctx.fused, self._mask_probs)))
        # mask rows for the next iteration: worth their rows when a chain of mask drafts beats AR. The
        # chain's rate moves only with the estimates and the costs: recomputed every 8 plans (it was
        # two thirds of a plan's ~150 us, 1.5 % of a SmolLM2 step)
        if self._chain_left <= 0 or self._chain_costs is not costs:
            self._chain = self._chain_rate(ctx, costs)
            self._chain_left, self._chain_costs = 8, costs
        self._chain_left -= 1
        masks, chain_rate = self._chain
        best = PassPlan([], "", 0)
        best_rate = DRAFT_MARGIN  # AR: one token per width-1 step, and the margin a draft must clear
        dc = ctx.draft_cost if ctx.fused == "heads" else None
        beta = None
        if ctx.top2 and ctx.mask_alt is not None and self._mask_probs:
            self._alt_bucket = mask_bucket(self._mask_probs[0])
            beta = self.alpha(("runner-up", self._alt_bucket), RUNNER_UP_PRIOR)
        for source, guesses, alphas in options:
            for extra in ((0, masks - 1) if masks else (0,)):
                # a runner-up row runs in fused steps (mask rows appended) only
                for alt in ((None, beta) if source == "masks" and beta is not None and extra else (None,)):
                    rate, k = self._best_k(alphas, costs, extra, ctx.max_width, dc, alt)
                    if rate > best_rate and k > 0:
                        best, best_rate = PassPlan(guesses[:k], source, extra + 1 if extra else 0,
                                                   alt=None if alt is None else ctx.mask_alt), rate
        # drafts appended now pay in the next iteration. Mask rows must beat this iteration's plan (as
        # tuned on held-out prompts); a heads chain, which feeds itself at any accept length, must beat
        # AR's rate — or the lookup's, when the lookup is what this iteration verifies
        bar = DRAFT_MARGIN if ctx.fused == "heads" and best.source in ("", "heads") else best_rate
        if masks and chain_rate > bar * MASK_MARGIN and not best.masks:
            best = PassPlan(best.guesses, best.source, masks, alt=best.alt)
        # re-tries of options not chosen lately
        self.since_lookup += 1
        self.since_masks += 1
        if best.source == "lookup":
            self.since_lookup = 0
        if best.masks or (ctx.fused and best.source == ctx.fused):
            self.since_masks = 0
        if not best.guesses and options and self.since_lookup >= EXPLORE_EVERY:
            source, guesses, _ = options[0]
            best = PassPlan(guesses[:1], source, best.masks)
            self.since_lookup = 0
        elif ctx.masks is not None and not best.masks and self.since_masks >= EXPLORE_EVERY:
            best = PassPlan(best.guesses, best.source, 2, alt=best.alt)
            self.since_masks = 0
        best = fit(best, ctx.max_width)
        label = (best.source or "ar") + ("+alt" if best.alt is not None else "") + (f"+{ctx.fused}" if best.masks
                                                                                    else "")
        self.choices[label] = self.choices.get(label, 0) + 1
        return best

    def observe(self, plan: PassPlan, accepted: int, ctx: PassContext) -> None:
        if not plan.guesses:
            return
        if plan.alt is not None and accepted == 0:  # g_1 failed: was the runner-up the token?
            self._update(("runner-up", self._alt_bucket), ctx.runner_up)
        tried = min(accepted + 1, len(plan.guesses))  # guess i is judged only when guesses < i were accepted
        for i in range(1, tried + 1):
            if plan.source == "lookup":
                key = ("lookup", self._lookup_n, min(i, MAX_GUESSES))
            elif plan.source in ("masks", "heads"):
                key = (plan.source, mask_bucket(self._mask_probs[i - 1]), min(i, MAX_GUESSES))
            else:
                return
            self._update(key, i <= accepted)


@register_policy
class AutoPolicy(Policy):
    """``auto``: one pass per iteration; each iteration AR or drafting (lookup, the adapter's mask
    drafts), whichever the measured step costs and running acceptance estimates say commits most tokens
    per second. Lossless: exactly AR greedy's output. Without an adapter it drafts by lookup only."""

    name = "auto"
    needs_verify = True
    lossless = True
    Params = NoParams
    default_drafter: ClassVar[str] = "lookup+adapter"
    #: plans with the measured step costs (the decode loop loads them: bitmtp.runtime.calibration)
    uses_costs: ClassVar[bool] = True
    #: may verify a mask draft's runner-up beside it (greedy, mask-block adapters; the decode loop reads the
    #: runner-ups for it)
    plans_runner_ups: ClassVar[bool] = True

    @property
    def decode_schedule(self) -> str:
        return "one-pass"

    def planner(self, memory: DecodeMemory) -> Planner:
        return AutoPlanner(memory)

    def commit(self, draft, probs, verify):  # the one-pass loop commits itself; kept for the base API
        if verify is None:
            from bitmtp.errors import BitMTPError

            raise BitMTPError("verify: the auto policy commits verified tokens only")
        return self._verified_commit(draft, verify)
