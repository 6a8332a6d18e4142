"""MTP decoding cost at BitNet b1.58-2B-4T shapes on the CPU backend (random ternary weights).

* Step ratios: time(draft step of width 2D − 1) / time(AR step) and time(verify step of width D) /
  time(AR step), D = 4 and 8, measured alternately in one run (median of per-round ratios).
  Goal: both ≤ 1.5 for D = 8. The mask-block draft step is the one the goal is about; the heads
  drafter's step (p rows + D − 1 sequential LM-head GEMVs) is reported beside it.
* End to end: tokens/s of ``speculative`` and ``hybrid`` over ``ar`` on the same engine with the
  oracle drafter (drafts the true AR continuation): the ceiling the machinery allows. With τ below
  every probability, hybrid commits each confident block without verifying — its ceiling; with
  τ = 1 it verifies every block (≈ speculative plus the hybrid bookkeeping).
"""

from __future__ import annotations

import statistics

import pytest
import torch

from bench.conftest import record
from bench.ratios import alternating_ratio
from bench.test_bench_ar_runtime import bitnet2b_decoder
from bitmtp.decoding.drafters import HeadsDrafter, MaskBlockDrafter, OracleDrafter
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
    decoder = bitnet2b_decoder()
    return Engine(decoder, capacity=512, m_max=31)


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
    draft_ratio, t_draft, t_ar = alternating_ratio(drafts["mask-block"].run, ar.run, rounds=5, inner=2)
    verify_ratio, t_verify, _ = alternating_ratio(verify.run, ar.run, rounds=5, inner=2)
    heads_ratio, _, _ = alternating_ratio(drafts["heads"].run, ar.run, rounds=3, inner=2)
    record(benchmark, shapes="BitNet-2B (random ternary), cpu", threads=torch.get_num_threads(), D=block,
           ar_step_ms=t_ar * 1e3, draft_width=2 * block - 1, draft_over_ar=draft_ratio, verify_over_ar=verify_ratio,
           heads_draft_over_ar=heads_ratio,
           goal="draft,verify<=1.5 (D=8)" if block == 8 else "report",
           met=(draft_ratio <= 1.5 and verify_ratio <= 1.5) if block == 8 else "")


@pytest.mark.parametrize("block", (4, 8))
def test_bitnet2b_end_to_end_oracle_cpu(benchmark, engine, block):
    eng = engine
    new = 48
    ar_res = Engine.run(eng.decode(PROMPT, max_new_tokens=new, eos=[], policy="ar"))
    oracle = OracleDrafter(eng.decoder, PROMPT + ar_res.tokens)

    def run(policy, tau=0.9):
        kw = dict(block_size=block, tau=tau, min_prefix=2, drafter=oracle) if policy != "ar" else {}
        res = Engine.run(eng.decode(PROMPT, max_new_tokens=new, eos=[], policy=policy, **kw))
        if res.tokens != ar_res.tokens and (policy == "speculative" or tau == 1.0):
            raise AssertionError(f"{policy} output differs from AR")  # lossless even while measuring
        return res

    benchmark.pedantic(lambda: run("speculative"), rounds=1, iterations=1)
    if benchmark.disabled:
        return
    rows = {"ar": [], "speculative": [], "hybrid": [], "hybrid_verify": []}
    for _ in range(3):  # alternate the contenders
        rows["ar"].append(run("ar").stats)
        rows["speculative"].append(run("speculative").stats)
        rows["hybrid"].append(run("hybrid", tau=1e-9).stats)
        rows["hybrid_verify"].append(run("hybrid", tau=1.0).stats)
    tps = {k: [s.tokens_per_second for s in v] for k, v in rows.items()}
    ratio = {k: statistics.median(a / b for a, b in zip(tps[k], tps["ar"], strict=True)) for k in tps if k != "ar"}
    record(benchmark, shapes="BitNet-2B (random ternary), cpu", D=block, drafter="oracle",
           ar_tok_s=statistics.median(tps["ar"]), spec_tok_s=statistics.median(tps["speculative"]),
           spec_over_ar=ratio["speculative"], spec_mean_committed=rows["speculative"][0].mean_committed,
           hybrid_over_ar=ratio["hybrid"], hybrid_mean_committed=rows["hybrid"][0].mean_committed,
           hybrid_tau1_over_ar=ratio["hybrid_verify"])
