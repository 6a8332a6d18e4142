"""The Vulkan runtime (``runtime="vulkan"``: WGSL through wgpu): register tiling, readbacks per iteration,
the 4 GB plan.

Figures (lavapipe — Vulkan on this CPU — is only indicative of a GPU; nothing here is gated):

* ``tiled_speedup`` — 16 dispatches of the W2A8 shader at M = 1 over one dispatch at M = 16 (same
  weights, same 16 token rows), each recorded in one command buffer and synced, alternating A B A B,
  median of the per-round ratios. Goal ≥ 4 (the 16-token tile decodes each packed word once). Run
  for both W2A8 shaders (``kernel``): ``rows`` (``w2a8_rows.py``, the default on CPU adapters) and
  ``tiled`` (``w2a8.wgsl``, the default on GPUs); ``rows_over_tiled_m16`` is how much faster the rows
  shader runs the M = 16 dispatch than the tiled one on this adapter (alternated the same way).
* ``dense_rows_over_tiled`` — the rows dense shader (``dense_rows.py``, CPU adapters' default) over
  ``dense.wgsl`` on an LM-head-like float32 matrix (8192 × 576 quick, SmolLM2's 49152 × 576 full) at
  M = 1 and M = 16, alternated; ``dense_tiled_speedup``: 16 dispatches at M = 1 over one at M = 16 of
  the rows dense shader.
* ``captured_over_eager`` — AR tokens/s of the Vulkan runtime when steps replay their recorded commands
  (the default) over the same model with ``BITMTP_EAGER=1`` (every step runs the Python that records
  it), alternated, best round over best round. On lavapipe the device time of a step dominates; on a
  GPU the Python recording would, so there the figure is larger. ``record_us_per_dispatch`` /
  ``replay_us_per_dispatch``: host time per dispatch of a step (no device wait).
* ``readbacks_per_iteration`` — device→host reads of a whole speculative / hybrid generation on the
  Vulkan runtime, over its engine reads (prefill + one per iteration): goal 1.
* the offload plan of BitNet b1.58-2B-4T and of an 8B ternary model under 3.9 GB (``plan_*``), loaded
  in bfloat16 (dense weights 16-bit on the device, KV float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.conftest import by_mode, record
from bench.ratios import alternating_ratio, best_over_best
from bitmtp.formats import pack_t2
from tests.support.wgpu_device import device_runner_or_skip


@pytest.fixture(scope="module")
def runner():
    return device_runner_or_skip()


SHAPE = by_mode((2560, 2560), (2560, 6912))  # (N, K)


@pytest.mark.parametrize("kernel", ["rows", "tiled"])
def test_wgsl_tiled_vs_per_token(benchmark, runner, kernel, monkeypatch):
    from bitmtp.wgsl_fallback.ops import Ops, TernaryWeight

    monkeypatch.setenv("BITMTP_WGPU_W2A8", kernel)
    n, k = SHAPE
    g = torch.Generator().manual_seed(0)
    ops = Ops(runner)
    w = TernaryWeight.upload(runner, pack_t2(torch.randint(-1, 2, (n, k), generator=g)).numpy(),
                             np.full((1, 1), 0.02, np.float32), k)
    x = torch.randn(16, k, generator=g)
    tiled_in = ops.act_quant(runner.upload(x.numpy()), k)
    rows_in = [ops.act_quant(runner.upload(x[i:i + 1].numpy()), k) for i in range(16)]
    runner.sync()

    def tiled():
        ops.w2a8(*tiled_in, w)
        runner.sync()

    def per_token():
        for xq, s, xs in rows_in:
            ops.w2a8(xq, s, xs, w)
        runner.sync()

    benchmark.pedantic(tiled, rounds=by_mode(3, 8), iterations=1, warmup_rounds=1)
    if benchmark.disabled:
        return
    ratio, t_per_token, t_tiled = alternating_ratio(per_token, tiled, rounds=by_mode(3, 5), inner=2)
    extra = {}
    if kernel == "rows":
        other = "tiled"

        def tiled_other():
            monkeypatch.setenv("BITMTP_WGPU_W2A8", other)
            try:
                tiled()
            finally:
                monkeypatch.setenv("BITMTP_WGPU_W2A8", kernel)

        extra["rows_over_tiled_m16"] = alternating_ratio(tiled_other, tiled, rounds=by_mode(2, 3), inner=2)[0]
    record(benchmark, kernel=kernel, shape=f"{n}x{k}", device=runner.info.get("device", "?"),
           subgroups=runner.subgroups, tiled_ms=t_tiled * 1e3, per_token_ms=t_per_token * 1e3,
           tiled_speedup=ratio, goal=4.0, **extra)


def test_wgsl_dense_rows_vs_tiled(benchmark, runner, monkeypatch):
    from bitmtp.wgsl_fallback.ops import DenseWeight, Ops

    n, k = by_mode((8192, 576), (49152, 576))
    g = torch.Generator().manual_seed(0)
    ops = Ops(runner)
    w = DenseWeight.upload(runner, torch.randn(n, k, generator=g))
    x16 = runner.upload(torch.randn(16, k, generator=g).numpy())
    x1 = [runner.upload(torch.randn(1, k, generator=g).numpy()) for _ in range(16)]

    def shader(kind, fn):
        def run():
            monkeypatch.setenv("BITMTP_WGPU_DENSE", kind)
            fn()
            runner.sync()
        return run

    def m16():
        ops.dense(x16, w)

    def m1():
        ops.dense(x1[0], w)

    def per_token():
        for x in x1:
            ops.dense(x, w)

    benchmark.pedantic(shader("rows", m16), rounds=by_mode(3, 5), iterations=1, warmup_rounds=1)
    if benchmark.disabled:
        return
    over16, t_tiled16, t_rows16 = alternating_ratio(shader("tiled", m16), shader("rows", m16), rounds=3, inner=1)
    over1, t_tiled1, t_rows1 = alternating_ratio(shader("tiled", m1), shader("rows", m1), rounds=3, inner=2)
    speedup = alternating_ratio(shader("rows", per_token), shader("rows", m16), rounds=3, inner=2)[0]
    record(benchmark, shape=f"{n}x{k}", rows_m16_ms=t_rows16 * 1e3, tiled_m16_ms=t_tiled16 * 1e3,
           rows_m1_ms=t_rows1 * 1e3, tiled_m1_ms=t_tiled1 * 1e3, dense_rows_over_tiled_m16=over16,
           dense_rows_over_tiled_m1=over1, dense_tiled_speedup=speedup)


def test_wgpu_captured_vs_eager_steps(benchmark, runner, monkeypatch):
    import time

    import bitmtp
    from tests.support.hf_models import tiny_model

    hf = tiny_model("bitnet", seed=3, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    prompt = [1, 5, 7, 9, 11, 3, 4, 60]
    tokens = by_mode(32, 64)
    models = {}
    for mode in ("eager", "captured"):
        monkeypatch.setenv("BITMTP_EAGER", "1" if mode == "eager" else "0")
        models[mode] = bitmtp.load(hf, quantize="ternary", adapter=None, runtime="vulkan")
        bitmtp.generate(models[mode], input_ids=prompt, max_new_tokens=8, policy="ar")  # runners made, warm

    def run(mode):
        return bitmtp.generate(models[mode], input_ids=prompt, max_new_tokens=tokens, policy="ar")

    out = benchmark.pedantic(lambda: run("captured"), rounds=by_mode(2, 4), iterations=1)
    if benchmark.disabled:
        return
    tps = {"eager": [], "captured": []}
    for _ in range(by_mode(3, 5)):
        for mode in tps:
            tps[mode].append(run(mode).stats.tokens_per_second)
    host = {}
    for mode, model in models.items():  # host time of one AR step's encoding, without the device's
        step = model.engine.pool.get(next(s for s in model.engine.pool.runners if s.role == "ar"))
        best = float("inf")
        for _ in range(4):  # the captured runner records twice first (the other model used its arena)
            runner.sync()
            d0, t0 = runner.dispatches, time.perf_counter()
            step.run()
            best = min(best, (time.perf_counter() - t0) / (runner.dispatches - d0))
            model.engine.pool.flush()
        host[mode] = best
    runners = models["captured"].engine.pool.runners.values()
    record(benchmark, tokens=len(out.token_ids), eager_tok_s=max(tps["eager"]), captured_tok_s=max(tps["captured"]),
           captured_over_eager=best_over_best(tps["captured"], tps["eager"]),
           record_us_per_dispatch=host["eager"] * 1e6, replay_us_per_dispatch=host["captured"] * 1e6,
           replayed_steps=sum(r.replayed for r in runners))


@pytest.mark.parametrize("policy", ["speculative", "hybrid"])
def test_wgpu_readbacks_per_iteration(benchmark, runner, policy):
    import bitmtp
    from bitmtp.formats.adapters import AdapterConfig, BaseShape
    from bitmtp.model.adapters import init_adapter_tensors
    from tests.support.hf_models import tiny_model

    hf = tiny_model("bitnet", seed=3, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    cfg = None
    models = {}
    for runtime in ("vulkan", "torch"):
        m = bitmtp.load(hf, quantize="ternary", adapter=None, runtime=runtime)
        cfg = cfg or AdapterConfig(kind="mask-block", block_size=4, rank=8, base=BaseShape.of(m.args))
        m.load_adapter((cfg, init_adapter_tensors(cfg, seed=2, zero_init_b=False, b_std=0.2)))
        models[runtime] = m
    prompt = [1, 5, 7, 9, 11, 3, 4, 60]

    def run(model, pol):
        return bitmtp.generate(model, input_ids=prompt, max_new_tokens=32, policy=pol, block_size=4, tau=0.5)

    dev = models["vulkan"]
    out = benchmark.pedantic(lambda: run(dev, policy), rounds=1, iterations=1)
    if benchmark.disabled:
        return
    before = runner.reads
    out = run(dev, policy)
    reads = runner.reads - before
    ar = run(dev, "ar")
    record(benchmark, policy=policy, iterations=out.stats.iterations, device_reads=reads,
           readbacks_per_iteration=(reads - 1) / out.stats.iterations,
           committed_per_iteration=out.stats.mean_committed,
           same_as_torch=out.token_ids == run(models["torch"], policy).token_ids,
           speedup_vs_ar_wgpu=out.tokens_per_second / ar.tokens_per_second)


@pytest.mark.parametrize("preset", ["bitnet-b1.58-2b-4t", "llama3-8b-1.58"])
def test_offload_plan_4gb(benchmark, preset):
    from bitmtp.cli_presets import PRESETS
    from bitmtp.runtime.vulkan.planner import DEFAULT_VRAM_BUDGET, LAVAPIPE_MAX_BINDING_BYTES, plan_offload

    def plan():
        return plan_offload(PRESETS[preset], DEFAULT_VRAM_BUDGET, dense_dtype_bytes=2, kv_dtype_bytes=4,
                            max_binding_bytes=LAVAPIPE_MAX_BINDING_BYTES, name=preset)

    p = benchmark.pedantic(plan, rounds=3, iterations=1)
    if benchmark.disabled:
        return
    print("\n" + p.table())
    record(benchmark, preset=preset, plan_gpu_layers=len(p.gpu_layers), plan_cpu_layers=len(p.cpu_layers),
           plan_gpu_mib=p.gpu_bytes / 2**20, plan_budget_mib=p.budget / 2**20, lm_head_on_gpu=p.lm_head_on_gpu)
