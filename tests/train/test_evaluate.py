"""Acceptance evaluation (``bitmtp.train.evaluate``): per-position acceptance of the drafts."""

from __future__ import annotations

import math

import pytest

import bitmtp
from bitmtp.errors import BitMTPError
from bitmtp.train.evaluate import (
    evaluate_acceptance,
    format_table,
    onepass_position_acceptance,
    position_acceptance,
)
from tests.support.adapters import INIT_RANGE, random_adapter
from tests.support.hf_models import tiny_model


def test_position_acceptance_counts_checked_and_accepted_drafts():
    # D=4: committed = 2 + accepted mask drafts; the last iteration (cut by max_new_tokens) is left out
    run = ([2, 3, 4, 2, 5, 1], [True] * 6)
    rates, checked = position_acceptance([run], 4)
    assert checked == [5, 3, 2]  # position 1 always checked; k only after k-1 accepted
    assert rates == pytest.approx([3 / 5, 2 / 3, 1 / 2])
    # unverified iterations are not counted; runs add up
    rates2, checked2 = position_acceptance([run, ([5, 2, 9], [False, True, False])], 4)
    assert checked2 == [6, 3, 2] and rates2 == pytest.approx([3 / 6, 2 / 3, 1 / 2])
    # a position never reached is NaN, not 0
    rates3, checked3 = position_acceptance([([2, 2, 2], [True] * 3)], 3)
    assert checked3 == [2, 0] and rates3[0] == 0.0 and math.isnan(rates3[1])
    with pytest.raises(BitMTPError, match="two-pass speculative"):
        position_acceptance([([6, 2], [True, True])], 4)  # D=4 cannot commit 6
    with pytest.raises(BitMTPError, match="block_size"):
        position_acceptance([], 1)


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("transformers")
    m = bitmtp.load(tiny_model("llama", seed=3, initializer_range=INIT_RANGE), capacity=256, adapter=None)
    m.load_adapter(random_adapter(m.args, "mask-block", 4))
    return m


def test_evaluate_reports_first_position_acceptance(model):
    import torch

    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 14)]
    rows = evaluate_acceptance(model, prompts, policies=("speculative", "hybrid"), block_sizes=(2, 4),
                               max_new_tokens=24, tau=0.3, progress=False)
    by = {(r.policy, r.block_size): r for r in rows}
    assert by[("hybrid", 4)].position_acceptance is None and by[("hybrid", 4)].position_checked is None
    for d in (2, 4):
        row = by[("speculative", d)]
        runs = []
        for ids in prompts:
            st = bitmtp.generate(model, input_ids=ids, max_new_tokens=24, policy="speculative", block_size=d,
                                 eos_token_id=[]).stats
            runs.append(st.committed)
        assert len(row.position_acceptance) == len(row.position_checked) == d - 1
        # every non-final speculative iteration is verified and checks the first mask draft
        assert row.position_checked[0] == sum(len(c) - 1 for c in runs)
        accepted_first = sum(c >= 3 for r in runs for c in r[:-1])
        assert row.position_acceptance[0] == pytest.approx(accepted_first / row.position_checked[0])
    # D=2 has one drafted position: its acceptance is the histogram's share of 3-token iterations
    assert 0.0 <= by[("speculative", 2)].position_acceptance[0] <= 1.0
    table = format_table(rows)
    assert "accepted d_2..d_D" in table
    line = next(ln for ln in table.splitlines() if "| speculative | 2 |" in ln)
    assert line.rstrip(" |").endswith(f"{by[('speculative', 2)].position_acceptance[0]:.2f}")


def test_evaluate_passes_each_generations_history(monkeypatch):
    """Per-generation histories reach position_acceptance (each run's last iteration dropped on its own)."""
    from types import SimpleNamespace

    histories = {(1,): [3, 3, 2, 1], (2,): [2, 3, 3]}  # per prompt; AR runs get [1] * n

    def fake_generate(model, *, input_ids, policy, **kw):
        c = [1] * 4 if policy == "ar" else histories[tuple(input_ids)]
        st = SimpleNamespace(committed=c, verified=[policy != "ar"] * len(c), verifier_calls=len(c),
                             iterations=len(c), tokens_per_second=10.0)
        return SimpleNamespace(token_ids=[5] * sum(c), stats=st)

    monkeypatch.setattr(bitmtp, "generate", fake_generate)
    (row,) = evaluate_acceptance(None, [[1], [2]], policies=("speculative",), block_sizes=(2,), progress=False)
    # kept: [3, 3, 2] and [2, 3] -> 3 of 5 first drafts accepted
    assert row.position_checked == [5] and row.position_acceptance == pytest.approx([3 / 5])


@pytest.mark.parametrize("stop_at_eos,expected", [(False, []), (True, None)])
def test_evaluate_runs_past_eos_unless_asked_to_stop(monkeypatch, stop_at_eos, expected):
    """Past the end (the default, the recorded figures' setting) every run gets ``eos_token_id=[]``; with
    ``stop_at_eos`` AR and every policy get None — the model's own end ids — alike."""
    from types import SimpleNamespace

    seen = []

    def fake_generate(model, *, input_ids, policy, eos_token_id, **kw):
        seen.append((policy, eos_token_id))
        st = SimpleNamespace(committed=[2, 3], verified=[True, True], verifier_calls=2, iterations=2,
                             tokens_per_second=10.0)
        return SimpleNamespace(token_ids=[5] * 5, stats=st)

    monkeypatch.setattr(bitmtp, "generate", fake_generate)
    evaluate_acceptance(None, [[1], [2]], policies=("speculative",), block_sizes=(2, 4), stop_at_eos=stop_at_eos,
                        progress=False)
    assert [p for p, _ in seen] == ["ar"] * 2 + ["speculative"] * 4
    assert all(e == expected for _, e in seen)


def test_stop_at_eos_ends_generations_at_the_models_end_id(model):
    """On a model: with ``stop_at_eos`` a generation whose AR output reaches an end id stops there, so fewer
    first drafts are checked than when running past it."""
    import torch

    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist() for n in (6, 10)]
    ar = bitmtp.generate(model, input_ids=prompts[0], max_new_tokens=24, policy="ar", eos_token_id=[]).token_ids
    saved = model.args.eos_token_id
    model.args.eos_token_id = [ar[5]]  # the sixth AR token ends the first prompt's answer
    try:
        kw = dict(policies=("speculative",), block_sizes=(2,), max_new_tokens=24, progress=False)
        (past,) = evaluate_acceptance(model, prompts, **kw)
        (stopped,) = evaluate_acceptance(model, prompts, stop_at_eos=True, **kw)
    finally:
        model.args.eos_token_id = saved
    assert stopped.position_checked[0] < past.position_checked[0]


def test_onepass_position_acceptance_sums_the_stats():
    from bitmtp.runtime.decode import DecodeStats

    a, b = DecodeStats("speculative", 4), DecodeStats("speculative", 4)
    a.position_checked, a.position_accepted = [10, 6, 3], [6, 3, 1]
    b.position_checked, b.position_accepted = [4], [2]
    rates, checked = onepass_position_acceptance([a, b], 4)
    assert checked == [14, 6, 3] and rates == pytest.approx([8 / 14, 3 / 6, 1 / 3])
    rates, checked = onepass_position_acceptance([DecodeStats("speculative", 3)], 3)
    assert checked == [0, 0] and all(math.isnan(r) for r in rates)
    with pytest.raises(BitMTPError, match="at most D - 1"):
        onepass_position_acceptance([a], 3)
    with pytest.raises(BitMTPError, match="block_size"):
        onepass_position_acceptance([], 1)


@pytest.mark.parametrize("schedule", ("one-pass", "top2"))
def test_evaluate_one_pass_schedules_report_guess_positions(model, schedule):
    """With a one-pass schedule the rows come from the decode stats: position 1 counts the steps that verified
    mask guesses; top2 counts a runner-up that committed as an accepted first position."""
    import torch

    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, model.args.vocab_size, (n,), generator=g).tolist() for n in (4, 11)]
    rows = evaluate_acceptance(model, prompts, policies=("speculative",), block_sizes=(4,), max_new_tokens=32,
                               progress=False, schedule=schedule)
    (row,) = rows
    stats = [bitmtp.generate(model, input_ids=ids, max_new_tokens=32, policy="speculative", block_size=4,
                             schedule=schedule, eos_token_id=[]).stats for ids in prompts]
    assert row.position_checked[0] == sum(s.position_checked[0] for s in stats) > 0
    first = sum(s.position_accepted[0] for s in stats)
    assert row.position_acceptance[0] == pytest.approx(first / row.position_checked[0])
    if schedule == "top2":
        assert first >= sum(s.runner_ups_accepted for s in stats)
    with pytest.raises(BitMTPError, match="applies to the speculative policy only"):
        evaluate_acceptance(model, prompts, policies=("speculative", "hybrid"), progress=False, schedule=schedule)
    with pytest.raises(BitMTPError, match="schedule: expected one of"):
        evaluate_acceptance(model, prompts, policies=("speculative",), progress=False, schedule="top3")
