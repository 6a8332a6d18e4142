"""End to end: MTP policies over AR on the same runtime, per block size D (BitNet-2B shapes, random
ternary weights, oracle drafter).

The oracle drafter drafts the true AR continuation, so the figures are the ceiling the runtime
allows — what the machinery costs, not what an adapter accepts:

* ``speculative_over_ar`` — tokens/s of ``speculative`` over ``ar`` (every block verified; the
  output is checked equal to AR while measuring);
* ``hybrid_over_ar`` — ``hybrid`` with τ below every probability: each block with ≥ m confident
  drafts is committed without a verify step (its ceiling);
* ``hybrid_verify_over_ar`` — ``hybrid`` with τ = 1: every block verified (≈ speculative plus the
  hybrid bookkeeping; output checked equal to AR);
* ``*_committed`` — committed tokens per iteration, and ``*_committed_full`` — tokens one full
  iteration commits (D + 1 with the verifier's bonus token, D for confidence commits). Exact for the
  oracle: a change here is a runtime bug, not noise; ``bench.compare`` recomputes each from D and
  ``new_tokens`` (``bench.goals.oracle_committed``) and gates it by equality.

Contenders alternate (ar, speculative, hybrid, hybrid τ=1, ar, …) and each speedup is the ratio of
the best tokens/s over the rounds (``bench.ratios.best_over_best``: the least disturbed round of
each). All speedups are gated (higher is better; machine-independent floor 1.0), the
committed-per-iteration figures exactly.
On a GPU the engine replays CUDA graphs (bench/gpu_check.sh runs this file there) and both modes use
all 30 layers and D ∈ {2, 4, 8, 16}. On the CPU, quick mode: 4 layers, D ∈ {2, 4, 8}, 24 new tokens;
full: 30 layers, D ∈ {2, 4, 8, 16}, 48 new tokens; 4 rounds either way. ``python -m bench.plots``
draws speedup vs D per policy from these.
"""

from __future__ import annotations

import pytest
import torch

from bench.conftest import EXACT, HIGHER, by_mode, record
from bench.models import BITNET2B_LAYERS, bitnet2b_decoder, shared_bitnet2b_decoder
from bench.ratios import best_over_best
from bitmtp.decoding import get_policy
from bitmtp.decoding.drafters import OracleDrafter
from bitmtp.runtime import Engine

PROMPT = list(range(100, 164))  # 64 tokens
GPU = torch.cuda.is_available()  # a GPU affords the real depth and D = 16 even in quick mode
BLOCKS = (2, 4, 8, 16) if GPU else by_mode((2, 4, 8), (2, 4, 8, 16))
LAYERS = BITNET2B_LAYERS if GPU else by_mode(4, BITNET2B_LAYERS)
NEW = by_mode(24, 48)
ROUNDS = 4
#: label -> (policy, tau)
POLICIES = {"speculative": ("speculative", 0.9), "hybrid": ("hybrid", 1e-9), "hybrid_verify": ("hybrid", 1.0)}


@pytest.fixture(scope="module")
def engine():
    if GPU:
        return Engine(bitnet2b_decoder(LAYERS, device="cuda"), capacity=512, m_max=31)
    from bitmtp.ops.registry import availability

    if not availability("cpu", "cpu")[0]:
        pytest.skip("native CPU extension not built (the torch reference would take minutes per token)")
    return Engine(shared_bitnet2b_decoder(LAYERS), capacity=512, m_max=31)


@pytest.mark.parametrize("block", BLOCKS, ids=[f"D{d}" for d in BLOCKS])
def test_policies_over_ar(benchmark, engine, block):
    eng = engine
    ar_res = Engine.run(eng.decode(PROMPT, max_new_tokens=NEW, eos=[], policy="ar"))
    oracle = OracleDrafter(eng.decoder, PROMPT + ar_res.tokens)

    def run(label: str):
        if label == "ar":
            return Engine.run(eng.decode(PROMPT, max_new_tokens=NEW, eos=[], policy="ar"))
        policy, tau = POLICIES[label]
        res = Engine.run(eng.decode(PROMPT, max_new_tokens=NEW, eos=[], policy=policy, block_size=block, tau=tau,
                                    min_prefix=2, drafter=oracle))
        # lossless policies, and hybrid at τ = 1 here (its unverified commits are the oracle's, i.e. AR's, tokens)
        if res.tokens != ar_res.tokens and (get_policy(policy).lossless or tau == 1.0):
            raise AssertionError(f"{label} output differs from AR")  # lossless even while measuring
        return res

    benchmark.pedantic(lambda: run("speculative"), rounds=1, iterations=1)
    if benchmark.disabled:
        for label in POLICIES:
            run(label)
        return
    labels = ["ar", *POLICIES]
    stats: dict[str, list] = {label: [] for label in labels}
    for _ in range(ROUNDS):  # alternate the contenders
        for label in labels:
            stats[label].append(run(label).stats)
    tps = {k: [s.tokens_per_second for s in v] for k, v in stats.items()}
    figures: dict[str, object] = {
        "shapes": f"BitNet-2B, {eng.decoder.args.num_layers} layers (random ternary), {eng.decoder.device.type}",
        "D": block, "drafter": "oracle", "new_tokens": NEW, "ar_tok_s": max(tps["ar"]),
        "graphs": bool(eng.pool.capture),
    }
    gates = {}
    for label in POLICIES:
        figures[f"{label}_tok_s"] = max(tps[label])
        figures[f"{label}_over_ar"] = best_over_best(tps[label], tps["ar"])
        figures[f"{label}_committed"] = float(stats[label][0].mean_committed)
        # tokens a full iteration commits: the mean alone cannot see a lost bonus token where
        # ceil(n / (D + 1)) == ceil(n / D) (D = 8 with 24 new tokens: 9+9+5 and 8+8+7 both average 23/3)
        figures[f"{label}_committed_full"] = float(max(stats[label][0].committed))
        gates[f"{label}_over_ar"] = HIGHER
        gates[f"{label}_committed"] = EXACT
        gates[f"{label}_committed_full"] = EXACT
    record(benchmark, gates=gates, **figures)
