"""The decode loop: AR, confidence, speculative and hybrid iterations over one engine.

One iteration (DESIGN.md, "One iteration"), block size D, pending suffix P (p tokens whose KV is
not materialized yet; it always ends with the last committed token):

1. **draft** (width p + D − 1): P's KV rows are written exactly (n += p); d_1..d_D with probabilities.
2. **hoisted verify prep**: the verify step's inputs (d_1..d_D and their positions) are written on
   the device right after the draft step, before the host reads anything.
3. **one read**: the host reads d, their probabilities and — when the previous iteration verified —
   that verify step's outputs, all in one device→host transfer (``Engine.read``).
4. **decide** with the policy object (``bitmtp.decoding.policies``): its ``plan`` (asked before each draft
   step) says the block size, the drafter and when to verify (``Verify``); its ``commit`` says what
   commits. The built-in policies:
   * confidence: commit d_1..d_max(1,h); they become P (their KV came from mask rows, so it is recomputed);
   * speculative: run the verify step; its outputs are part of this iteration's read; commit
     d_1..d_a and v_a, rows of d_1..d_a stay (n += a), P = [v_a];
   * hybrid: confidence when max(1, h) ≥ m, else verify. A hybrid verify is *resolved on the device*
     (``verify_prep.resolve_verify``): the next draft step starts from [v_a] without the host
     having read v, and the host learns a from the next iteration's read. So every iteration costs
     exactly one device→host read; only a verify that cannot be followed by another draft (the end
     of the KV store) is read at once ("flush", at most one per generation).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from bitmtp.decoding import origins as origin
from bitmtp.decoding.accept import speculative_accept
from bitmtp.decoding.drafters import CombinedDrafter, DraftSource
from bitmtp.decoding.lookup import LookupIndex
from bitmtp.decoding.onepass import (
    HEADS_DRAFT_COST,
    PassContext,
    PassPlan,
    runner_up_fits,
    runner_up_slot,
    top2_layout,
    tree_layout,
)
from bitmtp.decoding.policies import ONE_PASS_SCHEDULES, Commit, Plan, Policy, Verify, resolve_policy
from bitmtp.decoding.sampling import Sampler, SamplingParams
from bitmtp.errors import BitMTPError
from bitmtp.runtime.states import ReplayState
from bitmtp.runtime.verify_prep import prepare_verify, resolve_verify

#: generations asking for fewer new tokens than this plan ``auto`` with the prior step costs instead of
#: calibrating first (``runtime.calibration``): the ~5 s measurement pays off over longer generations
CALIBRATE_MIN_NEW_TOKENS = 64


@dataclass
class DecodeStats:
    """What a generation did.

    ``committed``: tokens committed by each iteration (the prefill's first token is not an
    iteration). ``verifier_calls``: iterations that ran a verify step. ``widths``: how many steps ran
    at each width. ``syncs``: device→host reads, prefill included. ``draft_steps``: draft steps run
    (an iteration whose draft was overtaken by a stop found in the previous verify commits nothing
    and is not counted in ``committed``). ``flushes``: verify results read outside an iteration's read.
    """

    policy: str
    block_size: int
    committed: list[int] = field(default_factory=list)
    verified: list[bool] = field(default_factory=list)  # per iteration: did a verify step decide it
    verifier_calls: int = 0
    widths: Counter = field(default_factory=Counter)
    syncs: int = 0
    draft_steps: int = 0
    flushes: int = 0
    seconds: float = 0.0
    tokens: int = 0
    #: the schedule that ran ("two-pass" or "one-pass"; "" for AR)
    schedule: str = ""
    #: one-pass iterations by what they ran: "ar" (no guesses), "lookup", "masks", "oracle", with
    #: "+masks" when mask rows drafted the next guesses
    choices: Counter = field(default_factory=Counter)
    #: guesses verified and accepted (one pass)
    guesses: int = 0
    accepted: int = 0
    #: one pass, guesses drafted by the adapter's mask rows: per guess position j (g_(j+1)), how many steps
    #: checked it (every guess before it accepted) and how many accepted it — the ``top2`` schedule counts
    #: position 0 accepted when g_1 or its runner-up is
    position_checked: list[int] = field(default_factory=list)
    position_accepted: list[int] = field(default_factory=list)
    #: the ``top2`` schedule: runner-up rows verified, and how many of them committed
    runner_ups: int = 0
    runner_ups_accepted: int = 0
    #: what the caller should know about how it decoded (e.g. "auto: no adapter, lookup drafts only")
    notes: list[str] = field(default_factory=list)

    @property
    def iterations(self) -> int:
        return len(self.committed)

    @property
    def mean_committed(self) -> float:
        """Mean committed tokens per iteration."""
        return sum(self.committed) / len(self.committed) if self.committed else float("nan")

    @property
    def histogram(self) -> dict[int, int]:
        """Committed tokens per iteration → how many iterations committed that many."""
        return dict(sorted(Counter(self.committed).items()))

    @property
    def verifier_rate(self) -> float:
        """Fraction of iterations that ran the verifier."""
        return self.verifier_calls / len(self.committed) if self.committed else float("nan")

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: tokens committed by iterations over the decode time."""
        return sum(self.committed) / self.seconds if self.seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        return {"policy": self.policy, "block_size": self.block_size, "iterations": self.iterations,
                "mean_committed": self.mean_committed, "histogram": self.histogram,
                "verifier_calls": self.verifier_calls, "verifier_rate": self.verifier_rate,
                "widths": dict(sorted(self.widths.items())), "syncs": self.syncs, "draft_steps": self.draft_steps,
                "flushes": self.flushes, "tokens_per_second": self.tokens_per_second, "schedule": self.schedule,
                "choices": dict(sorted(self.choices.items())), "guesses": self.guesses, "accepted": self.accepted,
                "position_checked": list(self.position_checked), "position_accepted": list(self.position_accepted),
                "runner_ups": self.runner_ups, "runner_ups_accepted": self.runner_ups_accepted,
                "notes": list(self.notes)}


@dataclass
class GenerationResult:
    """Generated token ids (prompt excluded), why generation stopped, timing and stats."""

    tokens: list[int]
    stop_reason: str  # "eos" | "max_new_tokens" | "capacity"
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    stats: DecodeStats
    #: per token, the log-probability of the chosen token under the distribution it was chosen from
    #: (asked for with ``logprobs=True``; see :func:`decode`): always finite, ≥ :data:`LOGPROB_FLOOR`
    logprobs: list[float] | None = None
    #: the sampling seed used (None when decoding greedily)
    seed: int | None = None
    #: per token, where it came from (``bitmtp.decoding.origins``: "ar", "lookup", "mask", ...)
    origins: list[str] = field(default_factory=list)
    #: per token, the iteration that committed it (0: the prefill's token; equal steps: one iteration)
    steps: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput: generated tokens after the first, over decode time."""
        return max(len(self.tokens) - 1, 0) / self.decode_seconds if self.decode_seconds > 0 else float("nan")


#: the logprob of a probability that underflowed float32 to 0: log(2^-149), the smallest positive float32
#: (an upper bound of the true value). The sampler's chosen tokens always have a probability > 0 (the top
#: score of a finite row gives ≥ 1/V; an inverse-CDF pick lands in a nonempty bin): this is a guard, so that
#: a logprob is always a finite float (JSON has no -Infinity: the server returns these as they are)
LOGPROB_FLOOR = math.log(2.0 ** -149)


def _logprob(p: float) -> float:
    """``log(p)`` of a chosen token's probability, finite: :data:`LOGPROB_FLOOR` for 0 (or a NaN)."""
    return math.log(p) if p > 0 else LOGPROB_FLOOR


class _Output:
    """Committed tokens with the stop rules applied (EOS inclusive, max_new_tokens, capacity)."""

    def __init__(self, max_new_tokens: int, eos: set[int], limit: int, sampler: Sampler | None = None,
                 logprobs: bool = False):
        self.tokens: list[int] = []
        self.max_new, self.eos, self.limit = max_new_tokens, eos, limit
        self.reason: str | None = None
        self.sampler = sampler  # counts the committed tokens for its penalties
        self.logprobs: list[float] | None = [] if logprobs else None
        #: per token, where it came from (``bitmtp.decoding.origins``) and the iteration that committed it
        self.origins: list[str] = []
        self.steps: list[int] = []
        self._step = 0

    def add(self, tokens: Sequence[int], probs: Sequence[float] | None = None,
            origins: Sequence[str] | None = None) -> list[int]:
        """Commit ``tokens`` (one iteration's) up to the first stop; ``origins``: one per token (None: all
        the model's own, ``ar``). Returns the tokens taken."""
        taken = []
        for i, t in enumerate(tokens):
            if self.reason is not None:
                break
            self.tokens.append(int(t))
            taken.append(int(t))
            self.origins.append(origins[i] if origins is not None else origin.AR)
            self.steps.append(self._step)
            if self.logprobs is not None and probs is not None:
                self.logprobs.append(_logprob(probs[i]))
            if int(t) in self.eos:
                self.reason = "eos"
            elif len(self.tokens) >= self.max_new:
                self.reason = "max_new_tokens"
            elif len(self.tokens) >= self.limit:
                self.reason = "capacity"
        if taken:  # an iteration overtaken by a stop commits nothing and is no step (as in DecodeStats)
            self._step += 1
        if self.sampler is not None:
            self.sampler.commit(taken)
        return taken


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
        _check_block(engine, d, drafter, pol)
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
    engine.reset()
    ids = list(input_ids)
    if sampler is not None:
        sampler.start(params.seed, ids)
    t0 = time.perf_counter()
    if logprobs:
        first, first_p = engine._prefill(ids, with_prob=True)
    else:
        first, first_p = engine._prefill(ids), None
    t1 = time.perf_counter()
    # committed tokens may reach capacity + 1: the last one needs no KV row
    out = _Output(max_new_tokens, set(int(e) for e in eos), engine.capacity + 1 - len(ids), sampler, logprobs)
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
        yield from _mtp_loop(engine, out, stats, ids, first, pol, d, drafter)
    t2 = time.perf_counter()
    stats.syncs = engine.syncs - syncs0
    stats.seconds = t2 - t1
    stats.tokens = len(out.tokens)
    return GenerationResult(out.tokens, out.reason or "max_new_tokens", len(ids), t1 - t0, t2 - t1, stats,
                            out.logprobs, params.seed if params is not None else None, out.origins, out.steps)


def _count_positions(stats: DecodeStats, k: int, accepted: int, runner_up: bool) -> None:
    """Per guess position (``DecodeStats.position_checked`` / ``position_accepted``): a step with ``k`` mask
    guesses of which the first ``accepted`` held checked positions 0..min(accepted, k − 1) — after an
    accepted runner-up the chain's later guesses were drafted after g_1 and are not checked."""
    top = 1 if runner_up else min(accepted + 1, k)
    for lst in (stats.position_checked, stats.position_accepted):
        if len(lst) < k:
            lst.extend([0] * (k - len(lst)))
    for j in range(top):
        stats.position_checked[j] += 1
        stats.position_accepted[j] += j < accepted


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


def _check_block(engine, d: int, drafter, policy: Policy) -> None:
    """A draft step of block size ``d`` with ``drafter`` fits the engine (m_max) and the drafter."""
    if isinstance(d, bool) or not isinstance(d, int) or not 2 <= d <= 16:
        raise BitMTPError(f"plan: policy {policy.name!r} planned a block size of {d!r}; a draft step's block "
                          "size must be an integer in 2..16")
    if 2 * d - 1 > engine.kv.m_max:
        raise BitMTPError(f"block_size: D={d} needs steps of width 2D-1={2 * d - 1}, but the engine's "
                          f"m_max is {engine.kv.m_max}; load the model with m_max >= {2 * d - 1}")
    if drafter is None:
        raise BitMTPError(f"policy: {policy.name!r} needs a drafter (an MTP adapter); none is loaded")
    drafter.check_block(d)


@dataclass
class _Deferred:
    """A verify step resolved on the device whose outcome the host reads with the next iteration."""

    draft: list[int]
    probs: list[float]
    verify: object  # the verify runner
    n: int  # materialized rows after its draft step
    block: int
    origin: str  # of its draft tokens (bitmtp.decoding.origins)


def _commit_probs(commit: Commit, probs: Sequence[float], ver_probs: Sequence[float] | None) -> list[float]:
    """The probabilities of a commit's tokens: d_1's from its draft row (AR-exact); a verified commit's
    later tokens equal the verifier's outputs v_1.., whose rows chose them; unverified drafts carry the
    drafter's probabilities."""
    if commit.verified and ver_probs is not None:
        return [probs[0], *ver_probs[: len(commit.tokens) - 1]]
    return list(probs[: len(commit.tokens)])

def _mtp_loop(engine, out: _Output, stats: DecodeStats, ids: list[int], first: int, policy: Policy, d: int,
              drafter) -> Iterator[list[int]]:
    """The MTP iterations: ``policy`` plans each one and decides what it commits (module docstring)."""
    pool, kv = engine.pool, engine.kv
    sampler, logprobs = out.sampler, out.logprobs is not None
    # penalties make a row's distribution depend on the committed text, which the host must then know
    # before the next draft samples d_1: no verify resolved unseen on the device
    defer_ok = sampler is None or not sampler.needs_history
    # a drafter that reads the committed text (lookup) gets it as an index kept up to date here
    index = drafter.index(ids + [first]) if drafter.kind == "lookup" else None
    pool.set_drafter(drafter)
    current = drafter  # the pool's drafter
    arange = engine.arange
    cap = engine.capacity
    n = engine.n  # materialized rows (exact when nothing is pending)
    pending_tokens = [first]  # P, when the host knows it
    deferred: _Deferred | None = None  # a verify resolved on the device, not yet seen by the host
    next_draft = None  # the draft runner that resolve_verify prepared
    plan = None

    def planned() -> Plan:
        """The policy's next plan, checked, with the pool switched to its drafter."""
        nonlocal current
        nxt = policy.plan(d, stats)
        use = drafter if nxt.drafter is None else nxt.drafter
        if nxt.block != d or use is not drafter:
            _check_block(engine, nxt.block, use, policy)
        if not isinstance(nxt.verify, Verify):
            raise BitMTPError(f"plan: policy {policy.name!r} planned verify={nxt.verify!r}; expected a "
                              "bitmtp.decoding.Verify member")
        if use is not current:
            pool.set_drafter(use)
            current = use
        return nxt

    while True:
        # -- draft step ----------------------------------------------------------------------
        if deferred is None:
            plan = planned()
            b = plan.block
            p = len(pending_tokens)
            if n + p > cap:
                out.reason = out.reason or "capacity"
                break
            runner = pool.get(ReplayState(p + b - 1, kv.segment_for(n + p + b - 1), "draft", b))
            runner.tokens[:p].copy_(torch.as_tensor(pending_tokens))
            if index is not None:
                current.prepare(runner, index)
            torch.add(arange[: p + b - 1], n, out=runner.positions)
            n_hi = n + p  # materialized after the draft
        else:
            # planned when the verify was resolved
            b, p, runner = plan.block, 1, next_draft
            n_hi = deferred.n + deferred.block + 1  # a ≤ D accepted rows, then v_a's row
        runner.run()
        draft_origin = origin.of_drafter(current)  # of this draft's tokens (current: the drafter that ran)
        stats.draft_steps += 1
        stats.widths[runner.state.width] += 1
        # -- hoisted verify prep: on the device, before the host reads anything -------------------
        verify = None
        if plan.verify is not Verify.NEVER:
            verify = pool.get(ReplayState(b, kv.segment_for(n_hi + b), "verify"))
            if sampler is not None:
                verify.fresh_from.fill_(0)  # d_1..d_D: none committed yet (their penalties count them)
            prepare_verify(runner, verify, arange)
        # -- the iteration's one read ------------------------------------------------------------
        ver_p = None
        if plan.verify is Verify.ALWAYS:
            verify.run()
            if logprobs:
                draft, probs, ver, ver_p = engine.read(runner.out_token[-b:], runner.out_prob[-b:], verify.out_token,
                                                       verify.out_prob[:b])
            else:
                draft, probs, ver = engine.read(runner.out_token[-b:], runner.out_prob[-b:], verify.out_token)
        else:
            extra = (deferred.verify.out_token,) if deferred is not None else ()
            if deferred is not None and logprobs:
                extra += (deferred.verify.out_prob[: deferred.block],)
            draft, probs, *rest = engine.read(runner.out_token[-b:], runner.out_prob[-b:], *extra)
        if deferred is not None:
            # the previous iteration's verify, resolved on the device, is now seen by the host
            commit = policy.commit(deferred.draft, deferred.probs, rest[0])
            n = deferred.n + commit.exact_rows
            taken = out.add(commit.tokens, _commit_probs(commit, deferred.probs, rest[1] if logprobs else None),
                            origin.of_commit(len(commit.tokens), commit.verified, deferred.origin))
            stats.committed.append(len(taken))
            stats.verified.append(commit.verified)
            if index is not None:
                index.extend(taken)
            yield taken
            deferred = None
            if out.reason is not None:
                break  # this iteration's draft (from [v_a]) is not needed
            n_hi = n + 1
        n = n_hi  # P's rows are materialized
        engine.n = n
        # -- decide -------------------------------------------------------------------------------
        if plan.verify is Verify.ALWAYS:
            commit = policy.commit(draft, probs, ver)
            stats.verifier_calls += 1
            stats.widths[b] += 1
        elif plan.verify is Verify.NEVER or not policy.wants_verify(draft, probs):
            commit = policy.commit(draft, probs, None)
        else:
            verify.run()
            stats.verifier_calls += 1
            stats.widths[b] += 1
            if n + b + 1 <= cap and defer_ok:
                # resolve on the device; the host reads the outcome with the next draft
                plan = planned()
                nb = plan.block
                next_draft = pool.get(ReplayState(nb, kv.segment_for(n + b + nb), "draft", nb))
                resolve_verify(verify, next_draft, arange, policy.device_accept)
                deferred = _Deferred(draft, probs, verify, n, b, draft_origin)
                continue
            # the end of the store (or penalties): read at once
            if logprobs:
                ver, ver_p = engine.read(verify.out_token, verify.out_prob[:b])
            else:
                (ver,) = engine.read(verify.out_token)
            stats.flushes += 1
            commit = policy.commit(draft, probs, ver)
        taken = out.add(commit.tokens, _commit_probs(commit, probs, ver_p),
                        origin.of_commit(len(commit.tokens), commit.verified, draft_origin))
        stats.committed.append(len(taken))
        stats.verified.append(commit.verified)
        if index is not None:
            index.extend(taken)
        yield taken
        n += commit.exact_rows
        engine.n = n
        pending_tokens = list(commit.tokens[commit.exact_rows :])
        if out.reason is not None:
            break
    engine.n = n


def _onepass_loop(engine, out: _Output, stats: DecodeStats, ids: list[int], first: int, policy: Policy, d: int,
                  drafter, costs) -> Iterator[list[int]]:
    """The one-pass schedule (``bitmtp.decoding.onepass``): each iteration is ONE step over
    [pending token, guesses g_1..g_k, (D − 1 mask rows)] and ONE read; the guesses commit while they
    equal the AR argmax of the row before them, then that row's argmax commits too. A heads drafter
    appends no rows: its D − 1 drafts, from the last accepted row, fill the step's last output slots.

    The pending and guess rows are AR-causal (each sees KV rows ≤ its position; the mask rows come
    after them), so every committed token is exactly AR greedy's, and the KV rows of the pending token
    and the accepted guesses are exact and stay (n += a + 1). Rows of rejected guesses and mask rows are
    not counted: the next step overwrites them in place.
    """
    pool, kv = engine.pool, engine.kv
    cap, m_max = engine.capacity, kv.m_max
    sampler, logprobs = out.sampler, out.logprobs is not None
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
        pool.set_drafter(masks)
    index = lookup.index(ids + [first]) if lookup is not None else LookupIndex(ids + [first], ngram_max=1)
    ctx = PassContext(index, engine.n, d, m_max, lookup=lookup, host=host, masks=masks, fused=fused,
                      tree=policy.decode_schedule == "tree",
                      top2=policy.decode_schedule == "top2"
                      or (policy.plans_runner_ups and fused == "masks" and sampler is None))
    # tree and top2 steps: position / slot offsets from n, by (kind, k + 1, D)
    layouts: dict[tuple[str, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    if fused == "heads":
        ctx.draft_cost = costs.draft_cost(HEADS_DRAFT_COST) if costs is not None else HEADS_DRAFT_COST
    # sampled guesses are accepted less often than greedy ones (a guess must match a sample, not the argmax):
    # sampled generations keep their own acceptance estimates, so neither kind plans with the other's
    planner = policy.planner(engine.memory.for_sampling(sampler is not None))
    arange = engine.arange
    n = engine.n
    tok = first  # the pending token: committed, its KV row not written yet
    next_costs = 0  # the iteration at which the relative costs are looked up again
    while True:
        if n >= cap:
            out.reason = out.reason or "capacity"
            break
        ctx.n = n
        ctx.max_width = m_max
        if costs is not None and stats.iterations >= next_costs:
            # the relative cost of a width changes with the context (attention) and with what the steps
            # are observed to cost: refreshed every 8 iterations (~60 us each, against ~10 ms steps)
            ctx.costs = costs.relative(n)
            if fused == "heads":
                ctx.draft_cost = costs.draft_cost(HEADS_DRAFT_COST)
            next_costs = stats.iterations + 8
        plan: PassPlan = planner.plan(ctx)
        if plan.alt is not None and not (plan.masks and plan.guesses and not plan.tree
                                         and runner_up_fits(n, len(plan.guesses) + 1, plan.masks, kv.rows)):
            # a runner-up rides in fused steps only, and only where its scratch slot gives AR's bits
            plan = PassPlan(plan.guesses, plan.source, plan.masks, plan.tree)
        guesses = plan.guesses
        k = len(guesses)
        w = plan.width
        tree = plan.tree and plan.masks
        alt = plan.alt  # the runner-up of g_1 (top2)
        r0 = k + 1 + (alt is not None)  # the first mask row
        # the runner-up's scratch KV row may lie past the step's width: the segment must cover it
        alt_slot = n + runner_up_slot(k + 1, plan.masks) if alt is not None else None
        if plan.masks:
            seg = kv.segment_for(n + w if alt_slot is None else max(n + w, alt_slot + 1))
            runner = pool.get(ReplayState(w, seg, "tree" if tree else "fused", plan.masks, alt=int(alt is not None)))
        else:
            runner = pool.get(ReplayState(w, kv.segment_for(n + w), "verify" if k else "ar"))
            if sampler is not None and k:
                runner.fresh_from.fill_(1)  # row 0 is the committed pending token; the guesses are new
        if k:
            runner.tokens[:r0].copy_(torch.tensor([tok, *guesses] + ([alt] if alt is not None else []),
                                                  dtype=torch.long))
        else:
            runner.tokens[:1].fill_(tok)
        if tree or alt is not None:
            key = ("tree" if tree else "top2", k + 1, plan.masks)
            offs = layouts.get(key)
            if offs is None:
                pos_off, slot_off = (tree_layout(k + 1, plan.masks)[:2] if tree
                                     else top2_layout(k + 1, plan.masks))
                offs = layouts[key] = (torch.tensor(pos_off, device=arange.device),
                                       torch.tensor(slot_off, device=arange.device))
            torch.add(offs[0], n, out=runner.positions)
            torch.add(offs[1], n, out=runner.slots)
        else:
            torch.add(arange[:w], n, out=runner.positions)
        t0 = time.perf_counter()
        runner.run()
        row_p = second = None
        if plan.masks or logprobs:
            if ctx.top2 and plan.masks and not tree:
                v, row_p, (second,) = engine.read(runner.out_token[:w], runner.out_prob[:w], runner.out_second)
            else:
                v, row_p = engine.read(runner.out_token[:w], runner.out_prob[:w])
            drafts_p = row_p[r0:w]
        else:
            (v,) = engine.read(runner.out_token[:w])
        if costs is not None:
            if fused == "heads" and plan.masks:
                # the heads' drafts take output slots, not rows: their time is what the step took beyond
                # a step of its k + 1 rows
                costs.observe_drafts(k + 1, plan.masks - 1, time.perf_counter() - t0, n)
            else:
                costs.observe(w, time.perf_counter() - t0)
        # guesses accepted: the rule written once (decoding.accept), over [the pending row's choice, guesses]
        a = speculative_accept([v[0], *guesses], v[: k + 1]) - 1
        runner_up = alt is not None and a == 0 and v[0] == alt
        if runner_up:
            # the pending row chose g_1's runner-up: it commits with its own row's argmax (row k + 1), and
            # its KV row, written to its scratch slot (the same bits as at n + 1: onepass.runner_up_slot),
            # becomes position n + 1's
            taken = out.add([alt, v[k + 1]], [row_p[0], row_p[k + 1]] if logprobs else None,
                            (origin.RUNNER_UP, origin.AR))
        else:
            # the accepted guesses are the outputs of the rows before them: rows 0..a chose what commits
            taken = out.add([*guesses[:a], v[a]], row_p[: a + 1] if logprobs else None,
                            [*[origin.of_source(plan.source)] * a, origin.AR])
        stats.committed.append(len(taken))
        stats.verified.append(k > 0)
        stats.widths[w] += 1
        stats.choices[(plan.source or "ar") + ("+alt" if alt is not None else "")
                      + (("+tree" if tree else f"+{fused}") if plan.masks else "")] += 1
        if k:
            stats.verifier_calls += 1
            stats.guesses += k
            stats.accepted += 1 if runner_up else a
            if plan.source == "masks":
                _count_positions(stats, k, 1 if runner_up else a, runner_up)
        if alt is not None:
            stats.runner_ups += 1
            stats.runner_ups_accepted += runner_up
        if plan.masks:
            stats.draft_steps += 1
        ctx.runner_up = runner_up
        planner.observe(plan, a, ctx)
        if runner_up:
            kv.move_row(alt_slot, n + 1)
            n += 2
            tok = v[k + 1]
        else:
            n += a + 1
            tok = v[a]
        engine.n = n
        index.extend(taken)
        # the mask rows drafted the positions after the last guess: valid only if every guess was
        # accepted; the heads drafted after the last accepted row: valid whatever was accepted; a tree
        # has a block of mask rows after every row: block a's drafts follow v_a
        ctx.mask_alt = None
        if tree:
            b = plan.masks - 1
            ctx.mask_guesses, ctx.mask_probs = v[k + 1 + a * b : k + 1 + (a + 1) * b], drafts_p[a * b : (a + 1) * b]
        elif plan.masks and not runner_up and (a == k or fused == "heads"):
            ctx.mask_guesses, ctx.mask_probs = v[r0:w], drafts_p
            ctx.mask_alt = second
        else:
            ctx.mask_guesses, ctx.mask_probs = [], []
        yield taken
        if out.reason is not None:
            break
    engine.n = n
