"""The one-pass schedule and ``policy="auto"`` end to end on a tiny random model.

Rules stated per test: every one-pass configuration (lookup, mask-block, heads, lookup+adapter, oracle; D = 2..8)
and ``auto`` commit exactly AR greedy's tokens; an iteration is one step and one device→host read; a
perfect (oracle) guesser commits D tokens per iteration; mask guesses are used only after a full accept;
heads guesses follow any accept length;
the KV rows [0, n) after generation equal a fresh prefill; stops (EOS inside accepted guesses, capacity,
max_new_tokens) cut exactly where AR's output would.
"""

from __future__ import annotations

import pytest
import torch

import bitmtp
from bitmtp.decoding.drafters import LookupDrafter, OracleDrafter
from bitmtp.errors import BitMTPError
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")

NEW = 48


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, quantize="ternary")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(99)
    out = [torch.randint(3, 95, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
           for _ in range(6)]
    out.append([5, 6, 7, 8] * 6)  # a repetitive prompt: lookup matches from the start
    return out


@pytest.fixture(scope="module")
def ar_outputs(model, prompts):
    return [bitmtp.generate(model, input_ids=p, max_new_tokens=NEW, policy="ar", eos_token_id=[]).token_ids
            for p in prompts]


def _gen(model, prompt, **kw):
    return bitmtp.generate(model, input_ids=prompt, max_new_tokens=NEW, eos_token_id=[], **kw)


def _record_plans(monkeypatch, model, prompt, **kw) -> list[tuple[list, list, list, list]]:
    """Generate with ``FixedPlanner`` recording, per iteration, (committed sequence before it, its
    guesses, the adapter guesses it was handed, their probabilities)."""
    from bitmtp.decoding import onepass

    records = []
    orig = onepass.FixedPlanner.plan

    def plan(self, ctx):
        p = orig(self, ctx)
        records.append((list(ctx.index.tokens), list(p.guesses), list(ctx.mask_guesses), list(ctx.mask_probs)))
        return p

    monkeypatch.setattr(onepass.FixedPlanner, "plan", plan)
    _gen(model, prompt, policy="speculative", **kw)
    monkeypatch.undo()
    return records


def _independent_draft(model, seq: list[int], rows: list[int], block: int):
    """A two-pass draft step of block ``block`` over pending ``rows``, on a fresh session engine after a
    prefill of ``seq[:-1]`` (the text before the pending token); returns its runner."""
    from bitmtp.runtime.states import ReplayState

    eng = model.session().engine
    eng.prefill(seq[:-1])
    eng.pool.set_drafter(model.drafter)
    p = len(rows)
    r = eng.pool.get(ReplayState(p + block - 1, eng.kv.segment_for(eng.n + p + block - 1), "draft", block))
    r.tokens[:p].copy_(torch.tensor(rows))
    torch.arange(eng.n, eng.n + p + block - 1, out=r.positions)
    r.run()
    return r


@pytest.mark.parametrize("block", (2, 3, 4, 8))
@pytest.mark.parametrize("drafter", ("lookup", "adapter", "lookup+adapter"))
def test_one_pass_equals_ar(model, prompts, ar_outputs, drafter, block):
    model.load_adapter(random_adapter(model.args, "mask-block", seed=block))
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        out = _gen(model, prompt, policy="speculative", schedule="one-pass", drafter=drafter, block_size=block)
        assert out.token_ids == ref, (drafter, block, prompt)
        s = out.stats
        assert s.schedule == "one-pass" and sum(s.committed) == NEW - 1
        assert s.syncs == 1 + s.iterations  # one read per iteration, one for the prefill
        assert all(w <= 2 * block - 1 for w in s.widths)
        assert s.accepted <= s.guesses
        if drafter != "lookup":
            assert s.draft_steps == s.iterations  # mask rows every step
        else:
            assert s.draft_steps == 0


@pytest.mark.parametrize("block", (2, 5, 8))
def test_oracle_one_pass_commits_block_per_iteration(model, prompts, ar_outputs, block):
    """Rows: pending + D − 1 oracle guesses; every guess is accepted, so D tokens commit per iteration."""
    for prompt, ref in zip(prompts[:3], ar_outputs[:3], strict=True):
        out = _gen(model, prompt, policy="speculative", schedule="one-pass", block_size=block,
                   drafter=OracleDrafter(model.decoder, prompt + ref))
        assert out.token_ids == ref
        assert out.stats.committed[:-1] == [block] * (len(out.stats.committed) - 1)
        assert set(out.stats.widths) == {block}


def test_noisy_oracle_exercises_every_accept_length(model, prompts, ar_outputs):
    """Guesses corrupted at random positions: every acceptance length 0..D−1 occurs, output stays AR's."""
    block = 5
    g = torch.Generator().manual_seed(7)
    seen = set()
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        seq = torch.tensor(prompt + ref)
        noise = torch.rand(seq.shape, generator=g) < 0.3
        seq[noise] = (seq[noise] + 1) % 90 + 3
        out = _gen(model, prompt, policy="speculative", schedule="one-pass", block_size=block,
                   drafter=OracleDrafter(model.decoder, seq.tolist()))
        assert out.token_ids == ref
        seen |= set(out.stats.committed[:-1])
    assert seen >= set(range(1, block + 1))


def test_mask_guesses_follow_a_full_accept_only(model, prompts, monkeypatch):
    """Mask drafts stand after the last guess: the planner sees them only when every guess was accepted."""
    from bitmtp.decoding import onepass

    model.load_adapter(random_adapter(model.args, "mask-block", seed=11))
    seen = []
    orig = onepass.FixedPlanner.plan

    def plan(self, ctx):
        seen.append(list(ctx.mask_guesses))
        p = orig(self, ctx)
        self.last = p
        return p

    outcomes = []

    def observe(self, plan, accepted, ctx):
        outcomes.append((len(plan.guesses), accepted))

    monkeypatch.setattr(onepass.FixedPlanner, "plan", plan)
    monkeypatch.setattr(onepass.FixedPlanner, "observe", observe)
    _gen(model, prompts[0], policy="speculative", schedule="one-pass", block_size=4)
    assert seen[0] == []  # the first step has no drafts yet
    for (k, a), nxt in zip(outcomes, seen[1:], strict=False):
        assert (len(nxt) == 3) == (a == k), (k, a, nxt)


def test_auto_equals_ar_and_says_what_it_chose(model, prompts, ar_outputs):
    model.load_adapter(random_adapter(model.args, "mask-block", seed=2))
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        out = _gen(model, prompt)  # auto is the default
        assert out.stats.policy == "auto" and out.token_ids == ref
        s = out.stats
        assert sum(s.choices.values()) == s.iterations and s.syncs == 1 + s.iterations
    model.load_adapter(None)
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        out = _gen(model, prompt)
        assert out.token_ids == ref
        assert any("lookup only" in n for n in out.stats.notes)
        assert not any("masks" in c for c in out.stats.choices)


@pytest.mark.parametrize("block", (2, 3, 4, 8))
@pytest.mark.parametrize("drafter", ("adapter", "lookup+adapter"))
def test_heads_one_pass_equals_ar(model, prompts, ar_outputs, drafter, block):
    """A heads adapter in one pass: no extra rows (its drafts take output slots), drafts every step,
    tokens equal AR's."""
    model.load_adapter(random_adapter(model.args, "heads", seed=block))
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        out = _gen(model, prompt, policy="speculative", schedule="one-pass", drafter=drafter, block_size=block)
        assert out.token_ids == ref, (drafter, block, prompt)
        s = out.stats
        assert s.syncs == 1 + s.iterations and s.draft_steps == s.iterations
        # k + 1 rows + D − 1 output slots: k = D − 1 adapter guesses (none on the first step); lookup may
        # propose fewer
        allowed = {block, 2 * block - 1} if drafter == "adapter" else set(range(block, 2 * block))
        assert set(s.widths) <= allowed
        assert not any("masks" in c for c in s.choices)


def test_auto_with_heads_adapter_equals_ar(model, prompts, ar_outputs):
    model.load_adapter(random_adapter(model.args, "heads", seed=4))
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        out = _gen(model, prompt)
        assert out.token_ids == ref
        assert not out.stats.notes  # heads draft in one pass: nothing to warn about
        assert sum(out.stats.choices.values()) == out.stats.iterations


def test_heads_drafts_follow_any_accept_length(model, prompts, monkeypatch):
    """Heads draft from the last accepted row: after the first step every iteration has D − 1 adapter
    guesses, whatever the previous step accepted; each equals d_2..d_D of a two-pass heads draft step whose
    pending rows are the previous step's t, g_1..g_a (the accepted ones), computed afresh on another
    engine — so the device-side accept count picks the right row."""
    block = 4
    model.load_adapter(random_adapter(model.args, "heads", seed=21))
    noisy = prompts[-1] + [9] * 4  # the lookup guesses sometimes hold, sometimes not
    records = _record_plans(monkeypatch, model, noisy, schedule="one-pass", block_size=block, drafter="lookup+adapter")
    accepts = set()
    for (seq, guesses, _, _), (nseq, _, nxt, nxt_p) in zip(records, records[1:], strict=False):
        assert len(nxt) == block - 1
        a = len(nseq) - len(seq) - 1
        accepts.add((len(guesses), a))
        r = _independent_draft(model, seq, [seq[-1], *guesses[:a]], block)
        assert r.out_token[-block] == nseq[-1]  # d_1: the committed v_a
        assert r.out_token[-(block - 1):].tolist() == nxt
        assert r.out_prob[-(block - 1):].tolist() == pytest.approx(nxt_p, abs=0)
    assert any(a < k for k, a in accepts) and any(a == k for k, a in accepts)


def test_kv_rows_equal_fresh_prefill_after_one_pass(model, prompts):
    model.load_adapter(random_adapter(model.args, "mask-block", seed=5))
    eng = model.engine
    for drafter, schedule in (("lookup", "one-pass"), ("lookup+adapter", "one-pass"), ("lookup+adapter", "tree"),
                              ("adapter", "tree")):
        out = _gen(model, prompts[-1], policy="speculative", schedule=schedule, drafter=drafter, block_size=4)
        n = eng.n
        text = (prompts[-1] + out.token_ids)[:n]
        ks = [k[:, :n].clone() for k in eng.kv.k]
        fresh = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256,
                            quantize="ternary").engine
        fresh.prefill(text)
        for a, b in zip(ks, fresh.kv.k, strict=True):
            assert torch.equal(a, b[:, :n])


def test_stops_inside_accepted_guesses(model, prompts, ar_outputs):
    """EOS among accepted guesses ends the output right after it; capacity and max_new_tokens cut as AR's."""
    ref = ar_outputs[-1]
    eos = ref[9]
    first = ref.index(eos)
    for kw in (dict(policy="speculative", schedule="one-pass", drafter="lookup", block_size=8),
               dict(policy="speculative", schedule="one-pass", block_size=8,
                    drafter=OracleDrafter(model.decoder, prompts[-1] + ref)), dict(policy="auto")):
        out = bitmtp.generate(model, input_ids=prompts[-1], max_new_tokens=NEW, eos_token_id=eos, **kw)
        assert out.stop_reason == "eos" and out.token_ids == ref[: first + 1]
        for k in (1, 2, 7):
            short = bitmtp.generate(model, input_ids=prompts[-1], max_new_tokens=k, eos_token_id=[], **kw)
            assert short.token_ids == ref[:k]
    long_prompt = [5, 6, 7, 8] * 60  # 240 of 256 rows
    ar = bitmtp.generate(model, input_ids=long_prompt, max_new_tokens=100, policy="ar", eos_token_id=[])
    for kw in (dict(policy="speculative", schedule="one-pass", drafter="lookup", block_size=8), dict(policy="auto")):
        out = bitmtp.generate(model, input_ids=long_prompt, max_new_tokens=100, eos_token_id=[], **kw)
        assert out.stop_reason == "capacity" and out.token_ids == ar.token_ids
        assert len(long_prompt) + len(out.token_ids) == 256 + 1


def test_two_pass_lookup_equals_ar(model, prompts, ar_outputs):
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        out = _gen(model, prompt, policy="speculative", drafter="lookup", block_size=4)
        assert out.token_ids == ref and out.stats.schedule == "two-pass"


def test_lookup_guesses_are_used_on_repetitive_text(model, prompts, ar_outputs):
    out = _gen(model, prompts[-1], policy="speculative", schedule="one-pass", drafter="lookup", block_size=4)
    assert out.stats.choices.get("lookup", 0) > 0 and out.stats.accepted > 0


@pytest.mark.parametrize("p,d", [(1, 2), (1, 8), (2, 2), (3, 4), (4, 3), (2, 8)])
def test_tree_layout(p, d):
    """Every row writes its own slot inside the step's width; mask rows never write over an AR row; block
    b's rows sit at positions b + 1.. and see the AR rows up to b and their own block's slots."""
    from bitmtp.decoding.onepass import tree_layout

    pos, slot, anchor, lo, hi = tree_layout(p, d)
    w = p * d
    assert len(pos) == len(slot) == w and sorted(slot) == list(range(w))
    assert pos[:p] == slot[:p] == anchor[:p] == list(range(p)) and all(lo[i] > hi[i] for i in range(p))
    for b in range(p):
        rows = range(p + b * (d - 1), p + (b + 1) * (d - 1))
        assert [pos[r] for r in rows] == list(range(b + 1, b + d))
        assert all(anchor[r] == b and slot[r] >= p for r in rows)
        assert sorted(slot[r] for r in rows) == list(range(lo[rows[0]], hi[rows[0]] + 1))
    assert [slot[r] for r in range(w - (d - 1), w)] == [pos[r] for r in range(w - (d - 1), w)]  # block k: in place


@pytest.mark.parametrize("block", (2, 3, 4, 8))
@pytest.mark.parametrize("drafter", ("adapter", "lookup+adapter"))
def test_tree_equals_ar(model, prompts, ar_outputs, drafter, block):
    model.load_adapter(random_adapter(model.args, "mask-block", seed=30 + block))
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        out = _gen(model, prompt, policy="speculative", schedule="tree", drafter=drafter, block_size=block)
        assert out.token_ids == ref, (drafter, block, prompt)
        s = out.stats
        assert s.schedule == "tree" and s.syncs == 1 + s.iterations and s.draft_steps == s.iterations
        m_max = model.engine.kv.m_max
        assert all(w % block == 0 and w <= m_max for w in s.widths)
        assert all(c.endswith("+tree") for c in s.choices)
        if drafter == "adapter":  # the tree always hands the next step D − 1 mask guesses (as many as fit)
            assert s.guesses == (s.iterations - 1) * min(block - 1, m_max // block - 1)


def test_tree_drafts_follow_any_accept_length(model, prompts, monkeypatch):
    """Block a of a tree step (after the last accepted row) gives the next guesses; they equal the mask
    drafts of a two-pass draft step whose pending rows are t, g_1..g_a, computed afresh on another engine:
    the block attends exactly what that draft step does, whatever else shares its positions."""
    block = 3
    model.load_adapter(random_adapter(model.args, "mask-block", seed=17))
    records = _record_plans(monkeypatch, model, prompts[-1] + [9, 9], schedule="tree", block_size=block,
                            drafter="lookup+adapter")
    accepts = set()
    for (seq, guesses, _, _), (nseq, _, nxt, nxt_p) in zip(records, records[1:], strict=False):
        a = len(nseq) - len(seq) - 1
        accepts.add((len(guesses), a))
        r = _independent_draft(model, seq, [seq[-1], *guesses[:a]], block)
        assert r.out_token[-block] == nseq[-1]  # d_1 = v_a
        assert r.out_token[-(block - 1):].tolist() == nxt
        # the tree's block rows read their own keys from scratch slots, the independent step from the rows
        # right after the history: the CPU attention merges its softmax per fixed 128-slot chunk, so the same
        # keys in other slots group differently (float rounding, ~1e-7); the tokens are exact
        assert r.out_prob[-(block - 1):].tolist() == pytest.approx(nxt_p, rel=1e-5, abs=0)
    assert any(a < k for k, a in accepts) and any(a == k > 0 for k, a in accepts)


class _TwoPassOnly(OracleDrafter):
    """A device drafter with neither host guesses nor fused-step drafts."""

    kind = "two-pass-only"
    host_guesses = False


def test_bad_input(model, prompts):
    with pytest.raises(BitMTPError, match="does not run in the one-pass schedule"):
        _gen(model, prompts[0], policy="speculative", schedule="one-pass",
             drafter=_TwoPassOnly(model.decoder, prompts[0]))
    with pytest.raises(BitMTPError, match="drafter: expected one of"):
        _gen(model, prompts[0], policy="speculative", drafter="lookahead")
    with pytest.raises(BitMTPError, match="unverified guesses"):
        _gen(model, prompts[0], policy="hybrid", drafter="lookup")
    with pytest.raises(BitMTPError, match="one-pass schedule only"):
        model.load_adapter(random_adapter(model.args, "mask-block"))
        _gen(model, prompts[0], policy="speculative", drafter="lookup+adapter")
    with pytest.raises(BitMTPError, match="tree schedule .* needs a mask-block adapter"):
        _gen(model, prompts[0], policy="speculative", schedule="tree", drafter="lookup")
    model.load_adapter(random_adapter(model.args, "heads"))
    with pytest.raises(BitMTPError, match="heads draft at any accept length already"):
        _gen(model, prompts[0], policy="speculative", schedule="tree")
    model.load_adapter(random_adapter(model.args, "mask-block"))
    with pytest.raises(BitMTPError, match="schedule: expected one of"):
        _gen(model, prompts[0], policy="speculative", schedule="three-pass")
    with pytest.raises(BitMTPError, match="schedule: policy 'hybrid' has one schedule"):
        _gen(model, prompts[0], policy="hybrid", schedule="one-pass")
    with pytest.raises(BitMTPError, match="ngram_max"):
        LookupDrafter(model.decoder, ngram_max=0)
    model.load_adapter(None)
    with pytest.raises(BitMTPError, match="drafter='lookup'"):
        _gen(model, prompts[0], policy="speculative")


def test_mask_guesses_equal_an_independent_draft_step(model, prompts, monkeypatch):
    """The guesses a fused step hands to the next iteration are the drafts d_2..d_D of a two-pass draft
    step whose pending rows are that fused step's AR rows [t, g_1..g_k], computed afresh on another
    engine after a prefill of the text before t."""
    block = 4
    model.load_adapter(random_adapter(model.args, "mask-block", seed=13))
    records = _record_plans(monkeypatch, model, prompts[1], schedule="one-pass", block_size=block)
    checked = 0
    for (seq, guesses, _, _), (_, _, nxt, nxt_p) in zip(records, records[1:], strict=False):
        if not nxt:
            continue
        # the fused step's AR rows: pending token t, then the guesses
        r = _independent_draft(model, seq, [seq[-1], *guesses], block)
        assert r.out_token[-(block - 1):].tolist() == nxt
        assert r.out_prob[-(block - 1):].tolist() == pytest.approx(nxt_p, abs=0)
        checked += 1
    assert checked >= 3
