"""The mask-block adapter's first-draft refiner (``MaskBlock.refine``) at inference.

Rules: with a refiner, every schedule's ``speculative`` output equals AR greedy's token for token; a fresh
refiner (W_up = 0) leaves every draft token as the adapter without it drafts (the refiner is then a positive
rescale of the mask row's state, so the LM head's argmax is unchanged); a refined first draft is exactly the
argmax of the LM head over ``refine(hidden of the first mask row, E(d_1))`` among the mask row's own
``refine_candidates`` most likely tokens (float64 reference of the refiner and head, atol 1e-4 on the
probabilities) while the later mask rows' drafts are untouched; one-pass guesses
still equal those of an independent two-pass draft step.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import bitmtp
from bitmtp.model.decoder import StepInputs
from bitmtp.runtime.states import ReplayState
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")

NEW = 40


@pytest.fixture(scope="module")
def model():
    return bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, quantize="ternary")


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 95, (n,), generator=g).tolist() for n in (1, 5, 17)] + [[5, 6, 7, 8] * 5]


def _gen(model, prompt, **kw):
    return bitmtp.generate(model, input_ids=prompt, max_new_tokens=NEW, eos_token_id=[], **kw)


@pytest.mark.parametrize("block", (2, 3, 5))
@pytest.mark.parametrize("schedule,drafter", [("two-pass", "adapter"), ("one-pass", "adapter"),
                                              ("one-pass", "lookup+adapter"), ("tree", "adapter")])
def test_refined_speculative_equals_ar(model, prompts, block, schedule, drafter):
    model.load_adapter(random_adapter(model.args, "mask-block", block_size=8, seed=block, refine_rank=3))
    assert model.drafter.block.refiner is not None
    for prompt in prompts:
        ar = _gen(model, prompt, policy="ar").token_ids
        out = _gen(model, prompt, policy="speculative", schedule=schedule, drafter=drafter, block_size=block)
        assert out.token_ids == ar, (schedule, drafter, block, prompt)


def test_fresh_refiner_keeps_every_draft_token(model, prompts):
    """``confidence`` with a tiny tau commits every draft unverified: its output is a function of the drafts."""
    cfg, tensors = random_adapter(model.args, "mask-block", block_size=4, seed=11, refine_rank=5)
    tensors["refine.up"].zero_()
    plain = dict(tensors)
    for name in ("refine.down", "refine.up", "refine.norm"):
        del plain[name]
    outs = []
    for adapter in ((cfg, tensors), (dataclasses.replace(cfg, refine_rank=0), plain)):
        model.load_adapter(adapter)
        outs.append([_gen(model, p, policy="confidence", tau=1e-9, block_size=4).token_ids for p in prompts])
    assert outs[0] == outs[1]
    model.load_adapter(random_adapter(model.args, "mask-block", block_size=4, seed=11, refine_rank=5))
    trained = [_gen(model, p, policy="confidence", tau=1e-9, block_size=4).token_ids for p in prompts]
    assert trained != outs[0]  # a non-zero refiner does change drafts (the rule above is not vacuous)


@pytest.mark.parametrize("candidates", (5, 1000))
@pytest.mark.parametrize("pending", (1, 3))
def test_refined_first_draft_is_the_refiner_over_d1(model, prompts, pending, candidates):
    d = 4
    model.load_adapter(random_adapter(model.args, "mask-block", block_size=d, seed=21, refine_rank=3))
    block = model.drafter.block
    block.refine_candidates = candidates  # a few of the 97 tokens, or all of them
    seq = prompts[2]
    eng = model.session().engine
    eng.prefill(seq[: len(seq) - pending])
    eng.pool.set_drafter(model.drafter)
    width = pending + d - 1
    r = eng.pool.get(ReplayState(width, eng.kv.segment_for(eng.n + width), "draft", d))
    r.out_token.fill_(-7)  # poison: every drafted slot must be written
    r.tokens[:pending].copy_(torch.tensor(seq[len(seq) - pending :]))
    torch.arange(eng.n, eng.n + width, out=r.positions)
    r.run()
    # reference: the same rows through the decoder (hidden states), then the refiner and LM head in float64
    pos = r.positions
    reach = torch.where(torch.arange(width) < pending, pos, pos[-1])
    mask = r.kv_index[None, :] <= reach[:, None]
    with torch.no_grad():
        hidden = model.decoder.hidden_states(StepInputs(r.tokens, pos, mask, mask_rows=d - 1, mask_block=block),
                                             eng.kv)
    head = model.decoder.lm_head.weight.double()
    plain = hidden.double() @ head.T
    d1 = int(plain[pending - 1].argmax())
    down, up, norm = (t.double() for t in block.refiner)
    s = hidden[pending].double()
    gate, lin = (torch.cat([s, model.decoder.embed[d1].double()]) @ down.T).chunk(2)
    z = (torch.nn.functional.silu(gate) * lin) @ up.T + s
    z = z * torch.rsqrt(z.pow(2).mean() + block.eps) * norm
    # scored against the LM-head rows of the mask row's own most likely tokens only
    cand = plain[pending].topk(block.refine_candidates).indices
    refined = torch.full_like(plain[pending], float("-inf")).scatter_(0, cand, z @ head[cand].T).softmax(-1)
    assert r.out_token[-d:].tolist() == [d1, int(refined.argmax()), *plain[pending + 1 :].argmax(-1).tolist()]
    assert float(r.out_prob[-d + 1]) == pytest.approx(float(refined.max()), abs=1e-4)
    assert int(refined.argmax()) != int(plain[pending].argmax()) or float(r.out_prob[-d + 1]) != pytest.approx(
        float(plain[pending].softmax(-1).max()), abs=1e-6)  # the refiner did act on this row


def test_one_pass_guesses_equal_a_refined_two_pass_draft(model, prompts, monkeypatch):
    """The guesses a fused step hands on are the refined drafts of an independent two-pass draft step
    over the same AR rows (``tests/runtime/test_onepass.py``'s rule, with a refiner)."""
    from tests.runtime.test_onepass import _independent_draft, _record_plans

    block = 4
    model.load_adapter(random_adapter(model.args, "mask-block", block_size=block, seed=13, refine_rank=4))
    records = _record_plans(monkeypatch, model, prompts[1], schedule="one-pass", block_size=block)
    checked = 0
    for (seq, guesses, _, _), (_, _, nxt, _) in zip(records, records[1:], strict=False):
        if nxt:
            r = _independent_draft(model, seq, [seq[-1], *guesses], block)
            assert r.out_token[-(block - 1):].tolist() == nxt
            checked += 1
    assert checked >= 3
