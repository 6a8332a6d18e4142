"""The two-pass schedule: a draft step, then (when the policy says) a verify step — ``speculative``'s default
schedule and the lossy ``confidence`` / ``hybrid`` policies (DESIGN.md, "One iteration").

One iteration, block size D, pending suffix P (p tokens whose KV is not materialized yet; it always ends with
the last committed token):

1. **draft** (width p + D − 1): P's KV rows are written exactly (n += p); d_1..d_D with probabilities.
2. **hoisted verify prep**: the verify step's inputs (d_1..d_D and their positions) are written on the device
   right after the draft step, before the host reads anything.
3. **one read**: the host reads d, their probabilities and — when the previous iteration verified — that verify
   step's outputs, all in one device→host transfer (``Engine.read``).
4. **decide** with the policy object (``bitmtp.decoding.policies``): its ``plan`` (asked before each draft step)
   says the block size, the drafter and when to verify (``Verify``); its ``commit`` says what commits:
   * confidence: commit d_1..d_max(1,h); they become P (their KV came from mask rows, so it is recomputed);
   * speculative: run the verify step; its outputs are part of this iteration's read; commit d_1..d_a and v_a,
     rows of d_1..d_a stay (n += a), P = [v_a];
   * hybrid: confidence when max(1, h) ≥ m, else verify. A hybrid verify is *resolved on the device*
     (``verify_prep.resolve_verify``): the next draft step starts from [v_a] without the host having read v,
     and the host learns a from the next iteration's read. So every iteration costs exactly one device→host
     read; only a verify that cannot be followed by another draft (the end of the KV store) is read at once
     ("flush", at most one per generation).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from bitmtp.decoding import origins as origin
from bitmtp.decoding.policies import Commit, Plan, Policy, Verify
from bitmtp.errors import BitMTPError
from bitmtp.runtime.output import DecodeStats, Output
from bitmtp.runtime.states import ReplayState
from bitmtp.runtime.verify_prep import prepare_verify, resolve_verify


def check_block(engine, d: int, drafter, policy: Policy) -> None:
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

def two_pass_loop(engine, out: Output, stats: DecodeStats, ids: list[int], first: int, policy: Policy, d: int,
              drafter) -> Iterator[list[int]]:
    """The two-pass MTP iterations: ``policy`` plans each one and decides what it commits (module docstring)."""
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
            check_block(engine, nxt.block, use, policy)
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


__all__ = ["check_block", "two_pass_loop"]
