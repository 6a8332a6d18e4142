"""The W2A8 op through the backend registry (what ``bitmtp.ops.w2a8_linear`` dispatches to, Python
dispatch included) as a fraction of this machine's read bandwidth, at BitNet-2B shapes, M = 1.

``op_bw_fraction`` = (packed weight bytes / op time) / (the extension's streaming-read bandwidth over
as many bytes), op and read alternating (``bench.kernels.op_ratio``: a torch copy as the contender left
libgomp spinning against the op and halved it run to run). Weights rotate through copies totalling
twice this machine's last-level cache, at least 128 MiB (``bench.machine.streaming_bytes``), so every call
streams from memory. Gated: ``op_bw_fraction`` (higher
is better) — the figure ``tests/test_bench_gate.py`` shows the gate failing on when a delay is
injected into the op through ``bitmtp.ops.registry.override``. Compare the raw-kernel figure
``bw_fraction`` of ``test_bench_cpu_kernels.py``: the difference is the dispatch overhead.

``linear_over_kernel`` (``test_ternary_linear_overhead``): a ``TernaryLinear`` call at M = 1 on float
activations (validation, activation quantization, the kernel, the epilogue) over the raw kernel call on
pre-quantized activations, alternating, same rotating weights. Goal ≤ 1.3 (issue "GPU decode at the memory
roofline", item 3: every backend quantizes inside its kernel call); torch-op quantization made it 3.3-7x.
The quantization's x_q and scales are checked bit-equal to the reference first.
"""

from __future__ import annotations

import pytest
import torch

from bench.conftest import HIGHER, LOWER, by_mode, record
from bench.kernels.op_ratio import OpCall, op_vs_copy
from bench.machine import rotating_copies, streaming_bytes
from bench.ratios import alternating_ratio
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


#: goal of linear_over_kernel (module docstring)
LINEAR_OVERHEAD_GOAL = 1.3


@pytest.mark.skipif(not BACKENDS, reason="native CPU extension not built")
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_ternary_linear_overhead(benchmark, n, k):
    from bitmtp.formats import pack_t2
    from bitmtp.formats.quantize import quantize_activations
    from bitmtp.ops import TernaryLinear, registry

    g = torch.Generator().manual_seed(n + 7 * k)
    base = pack_t2(torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8))
    scales = torch.rand(1, 1, generator=g) + 0.1
    layers = [TernaryLinear(k, n, w, scales, backend="cpu") for w in rotating_copies(base, ROTATE_BYTES)]
    x = torch.randn(1, k, generator=g)
    cpu = registry.backend("cpu")
    x_q, s = cpu.act_quant(x)
    ref_q, ref_s = quantize_activations(x)
    assert torch.equal(x_q, ref_q) and torch.equal(s, ref_s), "act_quant differs from the reference"
    y = torch.empty(1, n)
    turn = {"layer": 0, "kernel": 0}

    def layer():
        i = turn["layer"] = turn["layer"] + 1
        layers[i % len(layers)](x)

    def kernel():
        i = turn["kernel"] = turn["kernel"] + 1
        cpu._run(x_q, layers[i % len(layers)].weight, k, k, scales=scales, act_scale=s, y=y)

    benchmark.pedantic(layer, rounds=by_mode(10, 20), iterations=1, warmup_rounds=2)
    if benchmark.disabled:
        return
    for _ in range(len(layers)):  # one pass over every copy first (their clones leave dirty lines)
        layer()
        kernel()
    ratio, t_layer, t_kernel = alternating_ratio(layer, kernel, rounds=by_mode(7, 11), inner=5)
    record(benchmark, backend="cpu", shape=f"{n}x{k}", M=1, layer_us=t_layer * 1e6, kernel_us=t_kernel * 1e6,
           linear_over_kernel=ratio, goal=f"linear_over_kernel<={LINEAR_OVERHEAD_GOAL}",
           met=ratio <= LINEAR_OVERHEAD_GOAL, gates={"linear_over_kernel": LOWER})
