"""Fused CPU decoder layers (``bitmtp/ops/fused_layers.py``) over the per-op path, same decoder.

For an AR step (width 1), a verify step (width 8) and a mask-block draft step (width 15, D = 8),
time(per-op step) / time(fused step), measured alternately in one run (median of per-round
ratios; ``BITMTP_FUSED`` switches the path per call). Two models: SmolLM2-135M shapes (dense
float32, random weights — the small-model case, where per-op dispatch was half the step) and
BitNet-2B shapes (random ternary; quick mode: 4 of 30 layers). Gated: every ``speedup_*``
(higher is better). Both paths give bit-identical results (tests/ops/test_fused_layers.py).
"""

from __future__ import annotations

import os

import pytest
import torch

from bench.conftest import HIGHER, by_mode, record
from bench.models import BITNET2B_LAYERS, SMOLLM2_LAYERS, shared_bitnet2b_decoder, smollm2_shaped_decoder, step_runners
from bench.ratios import alternating_ratio

BLOCK = 8


def _switched(fn, fused: bool):
    def run():
        os.environ["BITMTP_FUSED"] = "1" if fused else "0"
        try:
            fn()
        finally:
            os.environ.pop("BITMTP_FUSED", None)

    return run


@pytest.mark.parametrize("shapes", ["smollm2", "bitnet2b"])
def test_fused_over_per_op(benchmark, shapes):
    from bitmtp.ops.registry import availability

    if not availability("cpu", "cpu")[0]:
        pytest.skip("native CPU extension not built")
    if shapes == "smollm2":
        dec = smollm2_shaped_decoder(by_mode(8, SMOLLM2_LAYERS))
    else:
        dec = shared_bitnet2b_decoder(by_mode(4, BITNET2B_LAYERS))
    _eng, runners = step_runners(dec, BLOCK)
    benchmark.pedantic(_switched(runners["ar"].run, True), rounds=1, iterations=1, warmup_rounds=1)
    assert dec.fused_plan() is not None, dec.fused_reason
    if benchmark.disabled:
        for r in runners.values():
            _switched(r.run, True)()
            _switched(r.run, False)()
        return
    figures = {}
    for name, r in runners.items():
        ratio, t_per_op, t_fused = alternating_ratio(_switched(r.run, False), _switched(r.run, True), rounds=5,
                                                     inner=3)
        figures[f"speedup_{name}"] = ratio
        figures[f"{name}_fused_ms"] = t_fused * 1e3
        figures[f"{name}_per_op_ms"] = t_per_op * 1e3
    record(benchmark, shapes=f"{shapes}, {dec.args.num_layers} layers, cpu", threads=torch.get_num_threads(),
           gates={k: HIGHER for k in figures if k.startswith("speedup_")}, **figures)
