"""``w2a8_linear`` on the reference (``torch``) backend against ``F.linear`` float32 at BitNet-2B
shapes. The pytest-benchmark timing is the W2A8 call; ``extra_info`` holds the ratio to F.linear
measured alternately in the same run (ratio > 1: slower than dense float32).

The reference unpacks T2 and accumulates in int64 on every call, so it is expected to be far slower
than a BLAS float32 GEMM: it defines exact results, it is not a fast path (csrc/cpu is).
Quick mode: the 2560×2560 shape at M = 1 and 16 (``ref_over_f32`` gated, lower is better); full:
every shape at M = 1, 8, 16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.conftest import LOWER, by_mode, record
from bench.ratios import alternating_ratio
from bitmtp.formats import pack_t2
from bitmtp.ops import w2a8_linear

# BitNet b1.58-2B-4T: fused qkv 3840×2560, o 2560×2560, fused gate/up 13824×2560, down 2560×6912.
SHAPES = [(3840, 2560), (2560, 2560), (13824, 2560), (2560, 6912)]


CASES = by_mode(SHAPES[1:2], SHAPES)


@pytest.mark.parametrize("m", by_mode([1, 16], [1, 8, 16]))
@pytest.mark.parametrize("n,k", CASES, ids=[f"{n}x{k}" for n, k in CASES])
def test_reference_w2a8_vs_dense_f32(benchmark, n, k, m):
    torch.set_num_threads(max(1, torch.get_num_threads()))
    g = torch.Generator().manual_seed(n * 7 + k + m)
    packed = pack_t2(torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8))
    scales = torch.rand(1, 1, generator=g) + 0.1
    x = torch.randn(m, k, generator=g)
    w_dense = torch.randn(n, k, generator=g)

    def w2a8():
        return w2a8_linear(x, packed, scales, backend="torch")

    def dense():
        return F.linear(x, w_dense)

    benchmark.pedantic(w2a8, rounds=3, iterations=1, warmup_rounds=1)
    if benchmark.disabled:
        return
    ratio, t_w2a8, t_dense = alternating_ratio(w2a8, dense, rounds=3, inner=2)
    record(benchmark, shape=f"{n}x{k}", M=m, ref_ms=t_w2a8 * 1e3, f32_ms=t_dense * 1e3, ref_over_f32=ratio,
           gates={"ref_over_f32": LOWER})
