"""The W2A8 op through the backend registry (what ``bitmtp.ops.w2a8_linear`` dispatches to, Python
dispatch included) as a fraction of this machine's copy bandwidth, at BitNet-2B shapes, M = 1.

``op_bw_fraction`` = (packed weight bytes / op time) / (copy bandwidth, read + write bytes counted),
op and copy alternating (``bench.kernels.op_ratio``). Weights rotate through copies totalling
twice this machine's last-level cache, at least 128 MiB (``bench.machine.streaming_bytes``), so every call
streams from memory. Gated: ``op_bw_fraction`` (higher
is better) — the figure ``tests/test_bench_gate.py`` shows the gate failing on when a delay is
injected into the op through ``bitmtp.ops.registry.override``. Compare the raw-kernel figure
``bw_fraction`` of ``test_bench_cpu_kernels.py``: the difference is the dispatch overhead.
"""

from __future__ import annotations

import pytest

from bench.conftest import HIGHER, by_mode, record
from bench.kernels.op_ratio import OpCall, op_vs_copy
from bench.machine import streaming_bytes
from bitmtp.ops.registry import availability

SHAPES = [(2560, 6912), (6912, 2560)]
ROTATE_BYTES = streaming_bytes()
BACKENDS = [b for b in ("cpu",) if availability(b, "cpu")[0]]


CASES = [(b, n, k) for b in BACKENDS or ["cpu"] for n, k in SHAPES]


@pytest.mark.skipif(not BACKENDS, reason="native CPU extension not built")
@pytest.mark.parametrize("backend,n,k", CASES, ids=[f"{b}-{n}x{k}-M1" for b, n, k in CASES])
def test_op_bw_fraction(benchmark, backend, n, k):
    # ids follow bench.kernels.op_ratio.benchmark_name (tests/test_bench_gate.py names its runs so)
    call = OpCall(backend, n, k, 1, ROTATE_BYTES)
    benchmark.pedantic(call, rounds=by_mode(10, 20), iterations=1, warmup_rounds=2)
    if benchmark.disabled:
        return
    figures = op_vs_copy(backend, n, k, 1, rounds=by_mode(5, 9), inner=5, rotate_bytes=ROTATE_BYTES)
    record(benchmark, backend=backend, shape=f"{n}x{k}", M=1, **figures, gates={"op_bw_fraction": HIGHER})
