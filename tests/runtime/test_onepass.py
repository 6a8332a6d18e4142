"""The one-pass schedule and ``policy="auto"`` end to end on a tiny random model.

Rules stated per test: every one-pass configuration (lookup, mask-block, heads, lookup+adapter, oracle; D = 2..8)
and ``auto`` commit exactly AR greedy's tokens; an iteration is one step and one device→host read; a
perfect (oracle) guesser commits D tokens per iteration; mask guesses are used only after a full accept;
heads guesses follow any accept length; the top2 schedule's runner-up row sees only the committed rows and
itself, commits exactly AR's tokens when it holds (its KV row moved into place), and is the first mask row's
second choice;
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

# the solo engine's loop: generate's default would decode ar / auto as a batch of one (bitmtp.api.batches_alone)
pytestmark = pytest.mark.usefixtures("solo_engine")

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


def _force_runner_ups(monkeypatch, model, prompt, ref, every: int = 2):
    """Speculative top2 over ``prompt`` with FixedPlanner's plans rewritten so that, every ``every``-th plan
    with mask guesses, g_1 is a wrong token and the runner-up is AR's token there (known from ``ref``): the
    runner-up path — commit, KV move, the next step's lack of mask guesses — runs many times."""
    from bitmtp.decoding import onepass

    orig = onepass.FixedPlanner.plan
    count = [0]

    def plan(self, ctx):
        p = orig(self, ctx)
        if p.alt is not None:
            count[0] += 1
            if count[0] % every == 0:
                at = len(ctx.index.tokens) - len(prompt)  # ref index of the token g_1 guesses
                if at < len(ref):
                    right = ref[at]
                    p.guesses[0] = (right + 1) % model.args.vocab_size
                    p.alt = right
        return p

    monkeypatch.setattr(onepass.FixedPlanner, "plan", plan)
    try:
        return _gen(model, prompt, policy="speculative", schedule="top2", block_size=4)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("p,d", [(2, 2), (2, 8), (3, 4), (4, 3), (8, 8), (9, 16)])
def test_top2_layout(p, d):
    """The runner-up (row p) sits at g_1's position and writes the first slot 1 + 16·j past every other row's
    (the CPU attention's lane of position 1); the AR rows and the mask rows keep a plain fused step's
    positions and write them in place."""
    from bitmtp.decoding.onepass import runner_up_fits, runner_up_slot, top2_layout
    from bitmtp.ops.linear import ATTENTION_CHUNK, ATTENTION_LANES

    pos, slot = top2_layout(p, d)
    w = p + d
    others = slot[:p] + slot[p + 1 :]
    assert len(pos) == len(slot) == w and sorted(others) == list(range(w - 1))
    assert pos[:p] == slot[:p] == list(range(p))
    assert pos[p] == 1 and slot[p] == runner_up_slot(p, d) >= w - 1
    assert slot[p] % ATTENTION_LANES == 1 and slot[p] - ATTENTION_LANES < w - 1
    assert pos[p + 1 :] == slot[p + 1 :] == list(range(p, p + d - 1))
    # the slot must share n + 1's softmax chunk and fit the store
    fits = [n for n in range(4 * ATTENTION_CHUNK) if runner_up_fits(n, p, d, 10_000)]
    assert all((n + slot[p]) // ATTENTION_CHUNK == (n + 1) // ATTENTION_CHUNK for n in fits)
    assert len(fits) == 4 * (ATTENTION_CHUNK - slot[p] + 1)
    assert not runner_up_fits(100, p, d, 100 + slot[p])
    with pytest.raises(ValueError, match="needs a guess"):
        top2_layout(1, 4)


@pytest.mark.parametrize("block", (2, 3, 4, 8))
@pytest.mark.parametrize("drafter", ("adapter", "lookup+adapter"))
def test_top2_equals_ar(model, prompts, ar_outputs, drafter, block):
    model.load_adapter(random_adapter(model.args, "mask-block", seed=block))
    copied0 = model.engine.kv.rows_copied
    tried = held = 0
    for prompt, ref in zip(prompts, ar_outputs, strict=True):
        out = _gen(model, prompt, policy="speculative", schedule="top2", drafter=drafter, block_size=block)
        assert out.token_ids == ref, (drafter, block, prompt)
        s = out.stats
        assert s.schedule == "top2" and sum(s.committed) == NEW - 1
        assert s.syncs == 1 + s.iterations and s.draft_steps == s.iterations
        assert all(w <= 2 * block for w in s.widths)
        # a runner-up rides with mask guesses only, and every accepted one moved one KV row
        alt = sum(v for c, v in s.choices.items() if "+alt" in c)
        assert s.runner_ups == alt and all(c.startswith("masks") for c in s.choices if "+alt" in c)
        assert s.runner_ups_accepted <= s.runner_ups and len(s.position_checked) <= block - 1
        assert s.position_accepted[:1] <= s.position_checked[:1]
        tried, held = tried + s.runner_ups, held + s.runner_ups_accepted
    assert tried > 0
    assert model.engine.kv.rows_copied - copied0 == held
    if drafter == "adapter":
        assert held > 0  # tiny vocabulary: the random adapter's second choice is right now and then


@pytest.mark.parametrize("every", (1, 2, 3))
def test_top2_forced_runner_ups_equal_ar_and_keep_kv_exact(model, prompts, ar_outputs, monkeypatch, every):
    """Runner-ups that are AR's token in every (every=1), every other or every third step with mask guesses:
    each commits two tokens, its KV row moves into place, and the text and the KV rows [0, n) stay AR's."""
    model.load_adapter(random_adapter(model.args, "mask-block", seed=21))
    eng = model.engine
    for prompt, ref in list(zip(prompts, ar_outputs, strict=True))[:4]:
        copied0 = eng.kv.rows_copied
        out = _force_runner_ups(monkeypatch, model, prompt, ref, every)
        assert out.token_ids == ref, (every, prompt)
        s = out.stats
        assert s.runner_ups_accepted >= 2 and eng.kv.rows_copied - copied0 == s.runner_ups_accepted
        assert s.position_accepted[0] >= s.runner_ups_accepted
        n = eng.n
        text = (prompt + out.token_ids)[:n]
        ks = [k[:, :n].clone() for k in eng.kv.k]
        vs = [v[:, :n].clone() for v in eng.kv.v]
        fresh = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256,
                            quantize="ternary").engine
        fresh.prefill(text)
        for a, b in zip(ks + vs, fresh.kv.k + fresh.kv.v, strict=True):
            assert torch.equal(a, b[:, :n])


def test_top2_forced_runner_ups_up_to_capacity(model, monkeypatch):
    """Runner-ups accepted up to the end of the KV store (240 of 256 rows taken by the prompt): the scratch slot
    never leaves the store (near the end a runner-up is left out), the stop is "capacity" exactly where AR's is."""
    model.load_adapter(random_adapter(model.args, "mask-block", seed=22))
    long_prompt = [5, 6, 7, 8] * 60
    ar = bitmtp.generate(model, input_ids=long_prompt, max_new_tokens=NEW, policy="ar", eos_token_id=[])
    assert ar.stop_reason == "capacity"
    out = _force_runner_ups(monkeypatch, model, long_prompt, ar.token_ids, every=1)
    assert out.stop_reason == "capacity" and out.token_ids == ar.token_ids
    assert out.stats.runner_ups_accepted >= 1


def test_top2_runner_up_is_the_first_mask_rows_second_choice(model, prompts, monkeypatch):
    """The runner-up a fused step hands on is the second-largest logit of its first mask row: the same step
    replayed with logits kept (an independent runner on a fresh session) ranks it second, after g_1."""
    from bitmtp.runtime.states import ReplayState

    block = 4
    model.load_adapter(random_adapter(model.args, "mask-block", seed=23))
    from bitmtp.decoding import onepass

    seen = []
    orig = onepass.FixedPlanner.plan

    def plan(self, ctx):
        p = orig(self, ctx)
        seen.append((list(ctx.index.tokens), list(p.guesses), ctx.mask_alt, list(ctx.mask_guesses)))
        return p

    monkeypatch.setattr(onepass.FixedPlanner, "plan", plan)
    _gen(model, prompts[2], policy="speculative", schedule="top2", block_size=block)
    monkeypatch.undo()
    checked = 0
    for (seq, guesses, _, _), (_, _, alt, nxt) in zip(seen, seen[1:], strict=False):
        if alt is None:
            continue
        # replay the step that drafted them: rows [t, g_1..g_k, D − 1 masks] after the text before t
        eng = model.session().engine
        eng.prefill(seq[:-1])
        eng.pool.set_drafter(model.drafter)
        rows = [seq[-1], *guesses]
        w = len(rows) + block - 1
        r = eng.pool.get(ReplayState(w, eng.kv.segment_for(eng.n + w), "fused", block))
        r.tokens[: len(rows)].copy_(torch.tensor(rows))
        torch.arange(eng.n, eng.n + w, out=r.positions)
        r.run()
        assert r.out_token[len(rows):].tolist() == nxt and r.out_second.tolist() == [alt]
        # and from the logits themselves (the decoder run directly, no drafter code): second-largest
        from bitmtp.model.decoder import StepInputs

        p = len(rows)
        reach = torch.where(torch.arange(w) < p, r.positions, r.positions[-1])
        mask = r.kv_index[None, :] <= reach[:, None]
        step = StepInputs(r.tokens, r.positions, mask, mask_rows=block - 1, mask_block=model.drafter.block)
        logits = model.decoder.logits(model.decoder.hidden_states(step, eng.kv)[p : p + 1])[0]
        order = logits.argsort(descending=True)[:2].tolist()
        assert order == [nxt[0], alt]
        checked += 1
    assert checked >= 3


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
    with pytest.raises(BitMTPError, match="top2 schedule .* needs a mask-block adapter"):
        _gen(model, prompts[0], policy="speculative", schedule="top2", drafter="lookup")
    with pytest.raises(BitMTPError, match="'top2' .* greedy decoding only"):
        _gen(model, prompts[0], policy="speculative", schedule="top2", temperature=0.8, seed=1)
    model.load_adapter(random_adapter(model.args, "heads"))
    with pytest.raises(BitMTPError, match="heads draft at any accept length already"):
        _gen(model, prompts[0], policy="speculative", schedule="tree")
    with pytest.raises(BitMTPError, match="top2 schedule .* the heads drafter has no mask rows"):
        _gen(model, prompts[0], policy="speculative", schedule="top2")
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
