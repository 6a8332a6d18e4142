"""MTP runtime-step cost at BitNet b1.58-2B-4T shapes on the CPU backend (random ternary weights).

Step ratios: time(draft step of width 2D − 1) / time(AR step) and time(verify step of width D) /
time(AR step), D = 4 and 8, measured alternately in one run (median of per-round ratios).
Goal: both ≤ 1.5 for D = 8. The mask-block draft step is the one the goal is about; the heads
drafter's step (p rows + D − 1 sequential LM-head GEMVs) is reported beside it. All three ratios
are gated (lower is better). Quick mode: 4 of the 30 layers (the dense LM head, which every step
reads once whatever its width, is then a larger share of the step). End-to-end speedups of the
policies over AR are in ``bench/e2e/test_bench_policies.py``.
"""

from __future__ import annotations

import pytest
import torch

from bench.conftest import LOWER, by_mode, record
from bench.models import BITNET2B_LAYERS, shared_bitnet2b_decoder
from bench.ratios import alternating_ratio
from bitmtp.decoding.drafters import HeadsDrafter, MaskBlockDrafter
from bitmtp.formats.adapters import AdapterConfig, BaseShape
from bitmtp.model.adapters import DraftHeads, MaskBlock, init_adapter_tensors
from bitmtp.runtime import Engine, ReplayState

PROMPT = list(range(100, 164))  # 64 tokens


def _cpu_ext_or_skip():
    from bitmtp.ops.registry import availability

    if not availability("cpu", "cpu")[0]:
        pytest.skip("native CPU extension not built")


@pytest.fixture(scope="module")
def engine():
    _cpu_ext_or_skip()
    return Engine(shared_bitnet2b_decoder(by_mode(4, BITNET2B_LAYERS)), capacity=512, m_max=31)


def _drafter(decoder, kind: str, block: int):
    cfg = AdapterConfig(kind=kind, block_size=block, rank=16, base=BaseShape.of(decoder.args))
    tensors = init_adapter_tensors(cfg, seed=0, zero_init_b=False)
    if kind == "mask-block":
        return MaskBlockDrafter(decoder, MaskBlock(cfg, tensors))
    return HeadsDrafter(decoder, DraftHeads(cfg, tensors, eps=decoder.args.rms_norm_eps))


@pytest.mark.parametrize("block", (4, 8))
def test_bitnet2b_step_ratios_cpu(benchmark, engine, block):
    eng = engine
    eng.reset()
    eng.prefill(PROMPT)
    n = eng.n
    seg = eng.kv.segment_for(n + 2 * block)
    ar = eng.pool.get(ReplayState(1, seg, "ar"))
    verify = eng.pool.get(ReplayState(block, seg, "verify"))
    for r in (ar, verify):
        r.tokens.copy_(torch.randint(100, 1000, r.tokens.shape))
        torch.arange(n, n + r.tokens.numel(), out=r.positions)
    drafts = {}
    for kind in ("mask-block", "heads"):
        eng.pool.set_drafter(_drafter(eng.decoder, kind, block))
        d = eng.pool.get(ReplayState(2 * block - 1, seg, "draft", block))  # p = D pending rows: the widest
        d.tokens.copy_(torch.randint(100, 1000, d.tokens.shape))
        torch.arange(n, n + 2 * block - 1, out=d.positions)
        drafts[kind] = d

    benchmark.pedantic(ar.run, rounds=1, iterations=1, warmup_rounds=1)
    if benchmark.disabled:
        drafts["mask-block"].run()
        drafts["heads"].run()
        verify.run()
        return
    draft_ratio, t_draft, t_ar = alternating_ratio(drafts["mask-block"].run, ar.run, rounds=5, inner=3)
    verify_ratio, t_verify, _ = alternating_ratio(verify.run, ar.run, rounds=5, inner=3)
    heads_ratio, _, _ = alternating_ratio(drafts["heads"].run, ar.run, rounds=3, inner=3)
    record(benchmark, shapes=f"BitNet-2B, {eng.decoder.args.num_layers} layers (random ternary), cpu",
           threads=torch.get_num_threads(), D=block,
           ar_step_ms=t_ar * 1e3, draft_width=2 * block - 1, draft_over_ar=draft_ratio, verify_over_ar=verify_ratio,
           heads_draft_over_ar=heads_ratio,
           goal="draft,verify<=1.5 (D=8)" if block == 8 else "report",
           met=(draft_ratio <= 1.5 and verify_ratio <= 1.5) if block == 8 else "",
           gates={"draft_over_ar": LOWER, "verify_over_ar": LOWER, "heads_draft_over_ar": LOWER})
