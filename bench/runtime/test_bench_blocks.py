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


def _alternate_per_width(benchmark, runners, switched, on: str, off: str) -> dict[str, float] | None:
    """Each runner's step with the switch on and off: once each in smoke mode (None), else
    ``speedup_<width>`` = time(off) / time(on), alternated, with both times in ms."""
    if benchmark.disabled:
        for r in runners.values():
            switched(r.run, True)()
            switched(r.run, False)()
        return None
    figures = {}
    for name, r in runners.items():
        ratio, t_off, t_on = alternating_ratio(switched(r.run, False), switched(r.run, True), rounds=5, inner=3)
        figures[f"speedup_{name}"] = ratio
        figures[f"{name}_{on}_ms"] = t_on * 1e3
        figures[f"{name}_{off}_ms"] = t_off * 1e3
    return figures


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
    figures = _alternate_per_width(benchmark, runners, switched, on="blocks", off="float32")
    if figures is None:
        return
    switched(lambda: None, True)()
    summary = dec.dense_summary()
    figures.update(float32_mb=summary["float_bytes"] / 1e6, blocks_mb=summary["step_bytes"] / 1e6)
    record(benchmark, shapes=f"smollm2, {dec.args.num_layers} layers, cpu", threads=torch.get_num_threads(),
           gates={k: HIGHER for k in figures if k.startswith("speedup_")}, **figures)


def test_bf16_head_over_float32_bitnet2b(benchmark):
    """BitNet b1.58-2B-4T's tied embedding / LM head is bfloat16 (128256 x 2560): ``bitmtp.load`` now keeps it as
    ``bf16`` rows (0.66 GB) where it held a float32 copy (1.31 GB). Same values both ways (the float32 weight is
    the exact widening), so the logits are the same bit for bit; per step width — AR (1), verify (8) —
    time(float32 head) / time(bf16 rows), alternated on one decoder (its LM head module switched). Gated:
    ``speedup_*``."""
    from bench.models import BITNET2B_LAYERS, bitnet2b_decoder
    from bitmtp.formats.ggml_blocks import dequantize
    from bitmtp.ops.registry import availability

    if not availability("cpu", "cpu")[0]:
        pytest.skip("native CPU extension not built")
    dec = bitnet2b_decoder(by_mode(4, BITNET2B_LAYERS), embed_rows="bf16")
    heads = {True: dec.lm_head, False: DenseLinear(dequantize(dec.lm_head.blocks))}  # bf16 rows / float32 copy
    _eng, runners = step_runners(dec, BLOCK)
    runners.pop(f"draft{2 * BLOCK - 1}")

    def switched(fn, half: bool):
        def run():
            if dec.lm_head is not heads[half]:
                dec.lm_head = heads[half]
                dec.invalidate_native()
            fn()
        return run

    benchmark.pedantic(switched(runners["ar"].run, True), rounds=1, iterations=1, warmup_rounds=1)
    assert heads[True].lazy and heads[True].blocks.fmt == "bf16" and heads[False].blocks is None
    figures = _alternate_per_width(benchmark, runners, switched, on="bf16", off="float32")
    if figures is None:
        return
    figures.update(head_float32_mb=heads[False].weight.numel() * 4 / 1e6, head_bf16_mb=heads[True].blocks.nbytes / 1e6)
    record(benchmark, shapes=f"bitnet-2b, {dec.args.num_layers} layers, cpu", threads=torch.get_num_threads(),
           gates={k: HIGHER for k in figures if k.startswith("speedup_")}, **figures)
