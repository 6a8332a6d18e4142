"""CUDA-graph replay of runtime steps (invariant 4: graphs replay bit-identical to eager).
Marked ``cuda``: skipped without a GPU; bench/gpu_check.sh runs it on one."""

from __future__ import annotations

import pytest
import torch

import bitmtp
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")


@pytest.mark.cuda
@pytest.mark.parametrize("family,quantize", [("llama", None), ("bitnet", "ternary"), ("qwen3", "ternary")])
def test_graph_replay_equals_eager(family, quantize, monkeypatch):
    hf = tiny_model(family, seed=4)
    ids = list(range(3, 40))
    monkeypatch.setenv("BITMTP_EAGER", "1")
    eager = bitmtp.load(hf, capacity=256, device="cuda", quantize=quantize)
    assert not eager.engine.pool.capture
    ref = eager.generate_ar(ids, max_new_tokens=32, eos_token_id=[])
    monkeypatch.delenv("BITMTP_EAGER")
    graphed = bitmtp.load(hf, capacity=256, device="cuda", quantize=quantize)
    assert graphed.engine.pool.capture
    out = graphed.generate_ar(ids, max_new_tokens=32, eos_token_id=[])
    assert out.tokens == ref.tokens
    runners = [r for r in graphed.engine.pool.runners.values() if r.state.role == "ar"]
    assert runners and all(r.graph is not None for r in runners)
    assert sum(r.replays for r in runners) == 31
    # KV rows equal between the two runs, bit for bit
    n = graphed.engine.n
    for a, b in zip(graphed.engine.kv.k + graphed.engine.kv.v, eager.engine.kv.k + eager.engine.kv.v, strict=True):
        assert torch.equal(a[:, :n], b[:, :n])


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["mask-block", "heads"])
def test_mtp_graph_replay_equals_eager_and_ar(kind, monkeypatch):
    """Draft, verify and the on-device verify resolution under CUDA graphs: speculative equals AR
    greedy, and hybrid (both branches) commits exactly what it commits eagerly."""
    from tests.support.adapters import INIT_RANGE, TAU, random_adapter

    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    ids = list(range(3, 40))
    outs = {}
    for mode in ("eager", "graphs"):
        if mode == "eager":
            monkeypatch.setenv("BITMTP_EAGER", "1")
        else:
            monkeypatch.delenv("BITMTP_EAGER", raising=False)
        model = bitmtp.load(hf, capacity=256, device="cuda", quantize="ternary")
        model.load_adapter(random_adapter(model.args, kind))
        ar = bitmtp.generate(model, input_ids=ids, max_new_tokens=64, policy="ar", eos_token_id=[])
        spec = bitmtp.generate(model, input_ids=ids, max_new_tokens=64, policy="speculative", block_size=4,
                               eos_token_id=[])
        hyb = bitmtp.generate(model, input_ids=ids, max_new_tokens=64, policy="hybrid", block_size=4, tau=TAU,
                              eos_token_id=[])
        assert spec.token_ids == ar.token_ids
        assert spec.stats.syncs == 1 + spec.stats.draft_steps
        outs[mode] = (hyb.token_ids, hyb.stats.committed)
        if mode == "graphs":
            drafts = [r for r in model.engine.pool.runners.values() if r.state.role == "draft"]
            assert drafts and all(r.graph is not None for r in drafts)
    assert outs["graphs"] == outs["eager"]


@pytest.mark.cuda
@pytest.mark.parametrize("kind,schedule", [("mask-block", "one-pass"), ("mask-block", "tree"), ("mask-block", "top2"),
                                           ("heads", "one-pass")])
def test_one_pass_graph_replay_equals_ar(kind, schedule, monkeypatch):
    """The one-pass schedule under CUDA graphs: fused steps (mask rows; heads with the accept count found
    on the device), tree steps (scratch KV slots) and auto all replay as captured graphs, one read per
    iteration, tokens equal to AR greedy's and to the eager run's stats (top2: runner-up rows in captured fused
    steps, their KV rows moved between replays)."""
    from tests.support.adapters import INIT_RANGE, random_adapter

    monkeypatch.setenv("BITMTP_CACHE_DIR", str(__import__("tempfile").mkdtemp()))
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    ids = [5, 6, 7, 8] * 6 + list(range(3, 20))
    committed = {}
    for mode in ("eager", "graphs"):
        if mode == "eager":
            monkeypatch.setenv("BITMTP_EAGER", "1")
        else:
            monkeypatch.delenv("BITMTP_EAGER", raising=False)
        model = bitmtp.load(hf, capacity=256, device="cuda", quantize="ternary")
        model.load_adapter(random_adapter(model.args, kind, seed=6))
        ar = bitmtp.generate(model, input_ids=ids, max_new_tokens=64, policy="ar", eos_token_id=[])
        for drafter in ("adapter", "lookup+adapter"):
            out = bitmtp.generate(model, input_ids=ids, max_new_tokens=64, policy="speculative", schedule=schedule,
                                  block_size=4, drafter=drafter, eos_token_id=[])
            assert out.token_ids == ar.token_ids, (mode, drafter)
            assert out.stats.syncs == 1 + out.stats.iterations
            committed[(mode, drafter)] = out.stats.committed
        auto = bitmtp.generate(model, input_ids=ids, max_new_tokens=64, eos_token_id=[])
        assert auto.token_ids == ar.token_ids
        if mode == "graphs":
            roles = {r.state.role for r in model.engine.pool.runners.values() if r.graph is not None}
            assert ("tree" if schedule == "tree" else "fused") in roles
    for drafter in ("adapter", "lookup+adapter"):
        assert committed[("graphs", drafter)] == committed[("eager", drafter)]


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", ["two-pass", "one-pass", "tree"])
def test_sampling_under_graphs_equals_ar_sampling(schedule, monkeypatch):
    """Sampling inside captured graphs (the seed and the penalty counts are device tensors read at replay):
    speculative sampling equals AR sampling for each seed, and a new seed changes the text without a
    recapture."""
    from tests.support.adapters import INIT_RANGE, random_adapter

    monkeypatch.delenv("BITMTP_EAGER", raising=False)
    hf = tiny_model("llama", seed=3, initializer_range=INIT_RANGE)
    model = bitmtp.load(hf, capacity=256, device="cuda", quantize="ternary")
    model.load_adapter(random_adapter(model.args, "mask-block", seed=6))
    ids = [5, 6, 7, 8] * 6 + list(range(3, 20))
    kw = dict(max_new_tokens=48, eos_token_id=[], temperature=0.8, top_p=0.9, repetition_penalty=1.2)
    texts = set()
    for seed in (1, 2, 3):
        ar = bitmtp.generate(model, input_ids=ids, policy="ar", seed=seed, **kw)
        out = bitmtp.generate(model, input_ids=ids, policy="speculative", schedule=schedule, block_size=4,
                              seed=seed, **kw)
        assert out.token_ids == ar.token_ids, seed
        texts.add(tuple(ar.token_ids))
    assert len(texts) == 3
    assert any(r.graph is not None and r.replays > 0 for r in model.engine.pool.runners.values())
