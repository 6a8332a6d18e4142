"""The fused GPU step (bitmtp/runtime/gpu_step.py), run on the CPU through Triton's interpreter.

Rules: a decode or verify step launches at most 10 kernels a layer plus 6 a step — every op the step
dispatches is counted, torch's included (views excepted: they launch nothing); its tokens equal the per-op
path's greedy tokens; a row's probability has the same bits at every width (AR rows == verify rows); it is
off unless asked for, and a model or step it does not cover runs per op with the reason recorded.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import bitmtp
from bitmtp.decoding.drafters import OracleDrafter
from bitmtp.decoding.onepass import tree_layout
from bitmtp.runtime import gpu_step
from bitmtp.runtime.states import ReplayState
from tests.support.hf_models import tiny_model

pytest.importorskip("transformers")
pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: the CPU checks (tiny models on CPU tensors): they need the interpreter, which tests/conftest.py sets without a GPU
interpreted = pytest.mark.skipif(not INTERPRETED, reason="CPU tensors through the Triton interpreter "
                                 "(TRITON_INTERPRET=1, set by tests/conftest.py where no GPU is visible)")

PROMPT = [5, 9, 12, 40, 3, 7, 8]
NEW = 5


def _switch(monkeypatch, env: str | None) -> None:
    """The fused step off (None) or on (``gpu_step.ENABLED``) for what follows."""
    if env is None:
        monkeypatch.delenv(gpu_step.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(gpu_step.ENV_VAR, env)


@pytest.fixture
def fused(monkeypatch):
    monkeypatch.setenv(gpu_step.ENV_VAR, gpu_step.ENABLED)


@pytest.fixture(scope="module")
def bitnet():
    return bitmtp.load(tiny_model("bitnet", seed=3), capacity=300, quantize="ternary")


class _Ops(TorchDispatchMode):
    """Counts the torch ops a block dispatches outside the launcher (views launch nothing)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused and not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _counted_step(model, width: int) -> tuple[Counter, Counter]:
    """One step of ``width`` rows through the graph pool's runner: (kernels launched by name, torch ops)."""
    engine = model.engine
    engine.reset()
    engine._prefill(PROMPT)
    role = "ar" if width == 1 else "verify"
    runner = engine.pool.get(ReplayState(width, engine.kv.segment_for(len(PROMPT) + width), role))
    runner.tokens.copy_(torch.arange(3, 3 + width))
    runner.positions.copy_(torch.arange(len(PROMPT), len(PROMPT) + width))
    mode = _Ops()
    original = runner.launcher.__class__.__call__

    def launch(self, *args, **kwargs):
        mode.paused += 1
        try:
            original(self, *args, **kwargs)
        finally:
            mode.paused -= 1

    runner.launcher.reset()
    before = model.decoder.path_counts["gpu-step"]
    with mode, pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_step.Launcher, "__call__", launch)
        runner.run()
    assert model.decoder.path_counts["gpu-step"] == before + 1, model.decoder.gpu_step_reason
    return runner.launcher.counts, mode.ops


@interpreted
@pytest.mark.parametrize("width", [1, 16])
def test_a_step_stays_within_the_launch_budget(bitnet, fused, width):
    kernels, ops = _counted_step(bitnet, width)
    layers = len(bitnet.decoder.layers)
    # everything but the attention mask (one comparison, the runner's mask function) is a counted kernel
    assert sum(ops.values()) <= 1, ops
    total = sum(kernels.values()) + sum(ops.values())
    assert total <= gpu_step.LAYER_BUDGET * layers + gpu_step.STEP_BUDGET, (kernels, ops)
    per_layer = {k: v for k, v in kernels.items() if k not in ("embed", "head_partial", "head_combine")}
    assert sum(per_layer.values()) == 9 * layers + 1  # 9 a layer, plus the final norm's norm_quant


def test_a_dense_model_without_sub_norms_takes_8_launches_a_layer(fused):
    dense = bitmtp.load(tiny_model("llama", seed=1), capacity=64)  # float projections (SmolLM2's kind)
    kernels, ops = _counted_step(dense, 4)
    layers = len(dense.decoder.layers)
    assert sum(ops.values()) <= 1 and sum(kernels.values()) == 8 * layers + 4, kernels
    assert kernels["dense_qkv"] == kernels["dense_glu"] == layers and kernels["dense_residual"] == 2 * layers


@interpreted
@pytest.mark.parametrize("family,quantize", [("bitnet", "ternary"), ("llama", "ternary"), ("llama", None),
                                             ("qwen3", "ternary"), ("qwen3", None)])
def test_tokens_equal_the_per_op_path(family, quantize, monkeypatch):
    """Ternary projections (W2A8 kernels) and dense ones (float kernels, SmolLM2's kind); Qwen3's q / k norms
    inside the qkv epilogue."""
    model = bitmtp.load(tiny_model(family, seed=3), capacity=300, quantize=quantize)
    ref = bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=NEW, policy="ar", eos_token_id=[])
    monkeypatch.setenv(gpu_step.ENV_VAR, gpu_step.ENABLED)
    before = model.decoder.path_counts["gpu-step"]
    out = bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=NEW, policy="ar", eos_token_id=[])
    assert out.token_ids == ref.token_ids
    assert model.decoder.path_counts["gpu-step"] - before == NEW  # the 7-row prefill and every decode step


@interpreted
def test_rows_have_the_same_bits_at_every_width(bitnet, fused):
    """AR (width 1) and one-pass verify rows (width 6) commit the same tokens with bit-identical probabilities:
    speculative == AR by construction."""
    ar = bitmtp.generate(bitnet, input_ids=PROMPT, max_new_tokens=NEW, policy="ar", eos_token_id=[], logprobs=True)
    spec = bitmtp.generate(bitnet, input_ids=PROMPT, max_new_tokens=NEW, policy="speculative", schedule="one-pass",
                           block_size=6, eos_token_id=[], logprobs=True,
                           drafter=OracleDrafter(bitnet.decoder, PROMPT + ar.token_ids))
    assert spec.token_ids == ar.token_ids and spec.logprobs == ar.logprobs
    assert max(spec.stats.committed) > 1  # several rows per step were verified


@interpreted
def test_off_unless_asked_for(bitnet, monkeypatch):
    monkeypatch.delenv(gpu_step.ENV_VAR, raising=False)
    before = bitnet.decoder.path_counts["gpu-step"]
    bitmtp.generate(bitnet, input_ids=PROMPT, max_new_tokens=3, policy="ar", eos_token_id=[])
    assert bitnet.decoder.path_counts["gpu-step"] == before
    assert gpu_step.ENV_VAR in bitnet.decoder.gpu_step_reason


@interpreted
def test_uncovered_models_and_steps_run_per_op_with_a_reason(fused):
    odd = bitmtp.load(tiny_model("qwen3", seed=1, head_dim=24), capacity=64, quantize="ternary")
    bitmtp.generate(odd, input_ids=PROMPT, max_new_tokens=2, policy="ar", eos_token_id=[])
    assert odd.decoder.path_counts["gpu-step"] == 0 and "head_dim 24" in odd.decoder.gpu_step_reason
    bitnet = bitmtp.load(tiny_model("bitnet", seed=2), capacity=64, quantize="ternary")
    eng = bitnet.engine
    eng.reset()
    eng._prefill(PROMPT)
    before = bitnet.decoder.path_counts["gpu-step"]
    eng.pool.get(ReplayState(17, eng.kv.segment_for(len(PROMPT) + 17), "verify")).run()
    assert bitnet.decoder.path_counts["gpu-step"] == before and "17-row" in bitnet.decoder.gpu_step_reason


@interpreted
def test_sampled_steps_and_kept_logits_run_the_fused_layers(bitnet, monkeypatch):
    """Sampled rows take the fused layers and the head's logits, then the sampler: the same text for a seed as
    the per-op path (temperature, top-p, a repetition penalty)."""
    kw = dict(input_ids=PROMPT, max_new_tokens=NEW, temperature=0.9, top_p=0.95, repetition_penalty=1.2, seed=5,
              eos_token_id=[])
    monkeypatch.delenv(gpu_step.ENV_VAR, raising=False)
    ref = bitmtp.generate(bitnet, **kw)
    monkeypatch.setenv(gpu_step.ENV_VAR, gpu_step.ENABLED)
    before = bitnet.decoder.path_counts["gpu-step"]
    out = bitmtp.generate(bitnet, **kw)
    assert out.token_ids == ref.token_ids
    assert bitnet.decoder.path_counts["gpu-step"] - before == NEW


@interpreted
@pytest.mark.parametrize("family,quantize", [("bitnet", "ternary"), ("qwen3", "ternary"), ("llama", None)])
def test_kept_logits_equal_the_per_op_logits(family, quantize, monkeypatch):
    """A verify step that keeps its logits: the fused step's float32 logits equal the per-op path's within 1e-4
    of their range (every norm, Qwen3's q / k norms included, in place) and each row's token is their argmax."""
    from bitmtp.runtime.graphs import GraphPool

    model = bitmtp.load(tiny_model(family, seed=3), capacity=64, quantize=quantize)
    got = {}
    for env in (None, gpu_step.ENABLED):
        _switch(monkeypatch, env)
        eng = model.engine
        eng.reset()
        eng._prefill(PROMPT)
        pool = GraphPool(model.decoder, eng.kv, keep_logits=True)
        r = pool.get(ReplayState(3, eng.kv.segment_for(len(PROMPT) + 3), "verify"))
        r.tokens.copy_(torch.tensor([4, 17, 30]))
        r.positions.copy_(torch.arange(len(PROMPT), len(PROMPT) + 3))
        r.logits.fill_(float("nan"))
        r.out_token.fill_(-1)
        before = model.decoder.path_counts["gpu-step"]
        r.run()
        assert model.decoder.path_counts["gpu-step"] == before + (env is not None)
        got[env] = (r.logits.clone(), r.out_token.clone())
    (l0, t0), (l1, t1) = got[None], got[gpu_step.ENABLED]
    assert not l1.isnan().any() and (l0 - l1).abs().max() <= 1e-4 * l0.abs().max()
    assert torch.equal(t1, l1.argmax(-1)) and torch.equal(t0, t1)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["bitnet", "llama"])
def test_on_a_gpu_graphs_replay_the_fused_step_exactly(family, monkeypatch):
    """On a GPU (bench/gpu_check.sh runs the ``cuda`` marker): CUDA graphs of the fused step give the eager fused
    step's tokens, and one-pass speculative decoding gives AR's."""
    hf = tiny_model(family, seed=4)
    monkeypatch.setenv(gpu_step.ENV_VAR, gpu_step.ENABLED)
    monkeypatch.setenv("BITMTP_EAGER", "1")
    eager = bitmtp.load(hf, capacity=256, device="cuda", quantize="ternary")
    ref = bitmtp.generate(eager, input_ids=PROMPT, max_new_tokens=24, policy="ar", eos_token_id=[])
    monkeypatch.delenv("BITMTP_EAGER")
    graphed = bitmtp.load(hf, capacity=256, device="cuda", quantize="ternary")
    out = bitmtp.generate(graphed, input_ids=PROMPT, max_new_tokens=24, policy="ar", eos_token_id=[], logprobs=True)
    assert out.token_ids == ref.token_ids and graphed.decoder.path_counts["gpu-step"] > 0
    spec = bitmtp.generate(graphed, input_ids=PROMPT, max_new_tokens=24, policy="speculative", schedule="one-pass",
                           block_size=8, eos_token_id=[], logprobs=True,
                           drafter=OracleDrafter(graphed.decoder, PROMPT + out.token_ids))
    assert spec.token_ids == out.token_ids and spec.logprobs == out.logprobs


def test_a_gpu_without_int8_tensor_cores_runs_per_op(monkeypatch):
    monkeypatch.setenv(gpu_step.ENV_VAR, gpu_step.ENABLED)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    ok, why = gpu_step.enabled(torch.device("cuda"))
    assert not ok and "sm_75" in why and "Ampere" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert gpu_step.enabled(torch.device("cuda")) == (True, "")
    monkeypatch.setenv(gpu_step.ENV_VAR, "yes")
    ok, why = gpu_step.enabled(torch.device("cuda"))
    assert not ok and f"{gpu_step.ENV_VAR}={gpu_step.ENABLED}" in why


@pytest.mark.parametrize("m", [1, 8, 16])
def test_planned_bytes_stay_near_the_roofline_at_bitnet_2b_shapes(m):
    """What the fused kernels move beyond the weights, the head and the KV rows (activations, partials) stays
    within 5 % of what a step must read, at BitNet-2B shapes with a bf16 head and 512 KV rows."""
    from bitmtp.model.args import ModelArgs

    a = ModelArgs(family="bitnet", vocab_size=128256, hidden_size=2560, num_layers=30, num_heads=20, num_kv_heads=5,
                  head_dim=128, intermediate_size=6912)
    got = gpu_step.planned_bytes(a, m=m, length=512, head_bytes=128256 * 2560 * 2, kv_bytes=2, sms=132)
    assert got["hbm"] <= 1.05 * got["roofline"], got
    assert got["scratch"] < 50 * 2**20  # stays in an H100's L2
    assert 1.20e9 < got["roofline"] < 1.23e9  # 0.52 GB of ternary weights + 0.66 GB of head + 39 MB of KV rows


@interpreted
@pytest.mark.parametrize("family,quantize", [("bitnet", "ternary"), ("llama", None)])
def test_mask_block_draft_and_one_pass_steps(family, quantize, monkeypatch):
    """A mask-block adapter's draft step and one-pass (fused) step in the fused kernels — mask embedding and
    gated LoRA on the mask rows inside them — give the per-op path's drafts, probabilities (float32 epilogues:
    within 1e-5) and runner-up; speculative decoding with them commits AR's tokens."""
    from tests.support.adapters import INIT_RANGE, random_adapter

    model = bitmtp.load(tiny_model(family, seed=3, initializer_range=INIT_RANGE), capacity=300, quantize=quantize)
    model.load_adapter(random_adapter(model.args, "mask-block", seed=4))
    eng = model.engine
    got = {}
    for env in (None, gpu_step.ENABLED):
        _switch(monkeypatch, env)
        eng.reset()
        eng._prefill(PROMPT)
        eng.pool.runners = {}
        eng.pool.set_drafter(model.drafter)
        n = len(PROMPT)
        for role, pending, block in (("draft", 1, 4), ("fused", 3, 4), ("tree", 2, 3)):
            width = pending * block if role == "tree" else pending + block - 1
            r = eng.pool.get(ReplayState(width, eng.kv.segment_for(n + width), role, block))
            r.tokens.copy_(torch.randint(3, 90, (width,), generator=torch.Generator().manual_seed(1)))
            if role == "tree":  # AR rows, then a block after each (mask rows at shared positions: scratch slots)
                pos, slot, *_ = tree_layout(pending, block)
                r.positions.copy_(n + torch.tensor(pos))
                r.slots.copy_(n + torch.tensor(slot))
            else:
                r.positions.copy_(torch.arange(n, n + width))
            r.out_token.fill_(-1)
            before = model.decoder.path_counts["gpu-step"]
            r.run()
            assert model.decoder.path_counts["gpu-step"] == before + (env is not None)
            got[(env, role)] = (r.out_token.clone(), r.out_prob.clone(), r.out_second.clone())
    for role in ("draft", "fused", "tree"):
        (t0, p0, s0), (t1, p1, s1) = got[(None, role)], got[(gpu_step.ENABLED, role)]
        assert torch.equal(t0, t1) and (p0 - p1).abs().max() <= 1e-5 and (t1 >= 0).all()
        if role == "fused":
            assert torch.equal(s0, s1)
    if family != "bitnet":  # the generation checks once (the interpreter takes ~1 s a step)
        return
    ar = bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=NEW, policy="ar", eos_token_id=[])
    for schedule in ("one-pass", "tree"):
        out = bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=NEW, policy="speculative", schedule=schedule,
                              block_size=4 if schedule == "one-pass" else 3, eos_token_id=[])
        assert out.token_ids == ar.token_ids, schedule


@interpreted
def test_the_top2_runner_up_row_runs_per_op(monkeypatch):
    """The top2 schedule's runner-up row keeps its KV in a scratch slot that only the per-op attention sums in
    its own position's order: that step runs per op (with the reason) and the output still equals AR's."""
    from tests.support.adapters import INIT_RANGE, random_adapter

    model = bitmtp.load(tiny_model("bitnet", seed=3, initializer_range=INIT_RANGE), capacity=300, quantize="ternary")
    model.load_adapter(random_adapter(model.args, "mask-block", seed=4))
    ar = bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=NEW, policy="ar", eos_token_id=[])
    monkeypatch.setenv(gpu_step.ENV_VAR, gpu_step.ENABLED)
    eng = model.engine
    eng.reset()
    eng._prefill(PROMPT)
    eng.pool.set_drafter(model.drafter)
    r = eng.pool.get(ReplayState(6, eng.kv.segment_for(len(PROMPT) + 32), "fused", 4, alt=1))
    before = model.decoder.path_counts["gpu-step"]
    r.run()
    assert model.decoder.path_counts["gpu-step"] == before and "top2" in model.decoder.gpu_step_reason
    out = bitmtp.generate(model, input_ids=PROMPT, max_new_tokens=NEW, policy="speculative", schedule="top2",
                          block_size=4, eos_token_id=[])
    assert out.token_ids == ar.token_ids


@interpreted
def test_a_batch_in_the_fused_step_equals_its_solo_outputs(bitnet, monkeypatch):
    """With the fused step on, a batch's decode steps run it (up to 16 rows of 16-row kernels: rows have their
    solo bits, KV ranges on the 256-row split grid) and prompts prefill in the solo engine's chunks: every
    sequence — greedy or sampled — gets exactly its solo output, logprobs included."""
    from bitmtp.runtime.batch import BatchEngine

    monkeypatch.setenv(gpu_step.ENV_VAR, gpu_step.ENABLED)
    prompts = [PROMPT * 10, PROMPT]  # 70 tokens: a 64-row chunk (per op) and a 6-row one (fused)
    kws = [dict(temperature=0.9, seed=4), dict()]
    solo = [bitmtp.generate(bitnet, input_ids=p, max_new_tokens=3, policy="ar", eos_token_id=[], logprobs=True,
                            **kw) for p, kw in zip(prompts, kws, strict=True)]
    eng = BatchEngine(bitnet.decoder, capacity=300, max_batch=4)
    from bitmtp.decoding.sampling import SamplingParams

    gens = [eng.submit(p, max_new_tokens=3, logprobs=True, sampling=SamplingParams(**kw) if kw else None)
            for p, kw in zip(prompts, kws, strict=True)]
    before = bitnet.decoder.path_counts["gpu-step"]
    results = []
    for g in gens:
        while True:
            try:
                next(g)
            except StopIteration as stop:
                results.append(stop.value)
                break
    for res, s in zip(results, solo, strict=True):
        assert res.tokens == s.token_ids and res.logprobs == s.logprobs
    assert bitnet.decoder.path_counts["gpu-step"] > before and eng.launcher.total > 0
    assert eng.rows_in_use == 0
