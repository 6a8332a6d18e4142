"""The Triton tiled kernel at decode widths (``SMALL_TILED``, BLOCK_M = 16; ``tiled_from`` / ``TILED_FROM``):
exact integer accumulators and the float epilogue against the reference, as the decode buckets must — so a GPU
session can make it the default for M ≥ 2..16 from the width-scaling benchmark without a correctness question.

Rules as tests/ops/test_w2a8_linear.py: accumulators equal the int64 reference bit for bit; float outputs within
the float64 reference's stated tolerance (tests/support/w2a8.check_float); outputs poisoned first.
Runs through Triton's interpreter on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from bitmtp.formats import pack_t2
from bitmtp.ops import reference
from bitmtp.ops.registry import availability
from tests.support.random_inputs import POISON_INT, random_int8, random_ternary
from tests.support.w2a8 import check_float

pytestmark = [pytest.mark.triton,
              pytest.mark.skipif(not availability("triton", "cpu")[0], reason="Triton not available here")]


def test_config_for_width_routes_decode_widths_to_the_small_tile():
    from bitmtp.triton_kernels import SMALL_TILED, config_for_width, w2a8

    assert w2a8.TILED_FROM == 17 and config_for_width(16).kind == "decode"  # the default is unchanged
    assert config_for_width(1, tiled_from=2).kind == "decode"
    assert [config_for_width(m, tiled_from=5) for m in (5, 8, 16)] == [SMALL_TILED] * 3
    assert config_for_width(4, tiled_from=5).kind == "decode" and config_for_width(17, tiled_from=5).block_m == 32
    with pytest.raises(ValueError, match="tiled_from"):
        config_for_width(3, tiled_from=1)


@pytest.mark.parametrize("m", [2, 3, 8, 15, 16])
@pytest.mark.parametrize("n,k,group", [(24, 48, 48), (200, 176, 16), (7, 33, 33), (72, 400, 32)])
def test_small_tile_exact_at_decode_widths(m, n, k, group, rng):
    from bitmtp.triton_kernels import w2a8_matmul

    w = random_ternary(n, k, rng)
    packed = pack_t2(w)
    ng = -(-k // group)
    scales = torch.rand(n, ng, generator=rng) + 0.1
    x_q = random_int8(m, k, rng)
    acc = torch.full((m, n, ng), POISON_INT, dtype=torch.int32)
    w2a8_matmul(x_q, torch.ones(m), packed, torch.ones(1, ng), k, group, acc_out=acc, tiled_from=2)
    assert torch.equal(acc.to(torch.int64), reference.w2a8_accumulate_reference(x_q, packed, k, group))
    s = torch.rand(m, generator=rng) * 50 + 0.5
    bias = torch.randn(n, generator=rng)
    out = torch.full((m, n), float("nan"))
    w2a8_matmul(x_q, s, packed, scales, k, group, bias=bias, out=out, tiled_from=2)
    check_float(out, x_q, s, packed, scales, k, group, bias)
