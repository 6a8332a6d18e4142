"""Dense weights kept in GGML blocks (``DenseLinear.blocks``) over the same weights in float32.

SmolLM2-135M's GGUF stores Q4_1 projections and a Q8_0 embedding (the tied LM head). Packed, a
step reads 96 MB instead of 538 MB, with bit-identical results (tests/formats/test_ggml_blocks.py). Per
step width — AR (1), verify (8), mask-block draft (15, D = 8) — time(float32 step) / time(block
step), alternating rounds on one decoder (``drop_dense_blocks`` / ``pack_dense_blocks`` switch it),
fused CPU layers on. Gated: every ``speedup_*`` (higher is better).
"""

from __future__ import annotations

import pytest
import torch

from bench.conftest import HIGHER, by_mode, record
from bench.models import SMOLLM2_LAYERS, smollm2_shaped_decoder, step_runners
from bench.ratios import alternating_ratio
from bitmtp.model.layers import DenseLinear

BLOCK = 8


def test_blocks_over_float32(benchmark):
    from bitmtp.ops.registry import availability

    if not availability("cpu", "cpu")[0]:
        pytest.skip("native CPU extension not built")
    dec = smollm2_shaped_decoder(by_mode(8, SMOLLM2_LAYERS), blocks=True)
    _eng, runners = step_runners(dec, BLOCK)

    kept = {m: m._blocks for m in dec.modules() if isinstance(m, DenseLinear)}  # packed once, switched cheaply

    def switched(fn, packed: bool):
        def run():
            if (dec.lm_head.blocks is not None) != packed:
                for m, b in kept.items():
                    m._blocks = b if packed else None
                dec.invalidate_native()
            fn()
        return run

    benchmark.pedantic(switched(runners["ar"].run, True), rounds=1, iterations=1, warmup_rounds=1)
    assert dec.fused_plan() is not None, dec.fused_reason
    if benchmark.disabled:
        for r in runners.values():
            switched(r.run, True)()
            switched(r.run, False)()
        return
    switched(lambda: None, True)()
    summary = dec.dense_summary()
    figures = {"float32_mb": summary["float_bytes"] / 1e6, "blocks_mb": summary["step_bytes"] / 1e6}
    for name, r in runners.items():
        ratio, t_f32, t_blk = alternating_ratio(switched(r.run, False), switched(r.run, True), rounds=5, inner=3)
        figures[f"speedup_{name}"] = ratio
        figures[f"{name}_blocks_ms"] = t_blk * 1e3
        figures[f"{name}_float32_ms"] = t_f32 * 1e3
    record(benchmark, shapes=f"smollm2, {dec.args.num_layers} layers, cpu", threads=torch.get_num_threads(),
           gates={k: HIGHER for k in figures if k.startswith("speedup_")}, **figures)
