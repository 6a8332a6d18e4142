"""CUDA W2A8 decode kernels (``backend="cuda"``) against the Triton ones, at BitNet-2B shapes.

Figures (recorded into the end-of-run ratio table by ``bench.conftest.record``):

* ``*_bw_frac`` — M = 1 weight bandwidth (packed weight bytes / kernel time) as a fraction of the
  device-to-device copy bandwidth measured in the same run (``dst.copy_(src)`` of a 512 MiB buffer,
  read + write bytes counted);
* ``*_t8_over_t1`` / ``*_t16_over_t1`` — time at M = 8 and M = 16 over time at M = 1 (1.0 would be
  perfect width specialization: the weights are read once whatever M is), and ``*_m<M>_GBps``, the
  packed weight bytes over the time at width M (``python -m bench.plots`` draws it against M).

* ``triton_splitk_*`` / ``triton_splitk_speedup_m<M>`` — Triton through the fused GPU step's split-K tensor-core
  kernel at every width (not gated: what sets ``bitmtp.triton_kernels.w2a8.SPLITK_UP_TO``);
* ``triton_tiled_*`` / ``triton_tiled_over_decode_m<M>`` — Triton with widths 2..16 on its ``tl.dot`` tiled
  kernel, and its time over the decode buckets' at width M (below 1: the tiled kernel is faster; not gated —
  what a GPU session reads to set ``bitmtp.triton_kernels.w2a8.TILED_FROM``).

Gated (``bench.compare``): ``*_bw_frac`` (higher is better) and ``*_t<M>_over_t1`` (lower).

Timing: CUDA events around replays of a CUDA graph holding one launch per weight copy, cycling
through enough copies (≥ 256 MiB in all) that no launch finds its weights in L2 — a kernel that
reads 4 MiB would otherwise be timed against the cache, and Python launch overhead (tens of µs)
would swamp a kernel of a few µs. Graph replay is also how the runtime calls these kernels.
Contenders run alternately (A B A B …) and the median of the per-round ratios is reported, as in
bench/ratios.py. The pytest-benchmark timing itself is the CUDA kernel's M = 1 graph replay.
"""

from __future__ import annotations

import contextlib
import statistics
from unittest import mock

import pytest
import torch

from bench.conftest import HIGHER, LOWER, by_mode, record
from bench.ratios import cuda_event_time
from bitmtp.formats import pack_t2
from bitmtp.ops.registry import availability, select

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

# (N, K): down 2560×6912, the o/qkv side 6912×2560 (as N×K), fused gate/up 13824×2560.
SHAPES = [(2560, 6912), (6912, 2560), (13824, 2560)]
WIDTHS = by_mode((1, 8, 16), (1, 2, 4, 8, 16))
ROUNDS = by_mode(5, 7)
REPLAYS = 5
COPY_BYTES = 512 << 20
ROTATION_BYTES = 256 << 20  # > 2× the L2 of any current GPU (H100/H200: 50 MiB)




class _Rotation:
    """One captured graph launching a backend's W2A8 linear once per weight copy."""

    def __init__(self, impl, x_q, s, packs, scales, k, out):
        self.launches = len(packs)

        def body():
            for packed in packs:
                impl(x_q, s, packed, scales, k, k, None, torch.bfloat16, out=out)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile / autotune / load modules outside the capture
            body()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            body()
        self.graph.replay()
        torch.cuda.synchronize()

    def seconds_per_launch(self) -> float:
        return cuda_event_time(self.graph.replay, REPLAYS) / self.launches


@pytest.fixture(scope="module")
def copy_buffers():
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    dst.copy_(src)
    torch.cuda.synchronize()
    return src, dst


def _backends() -> list[str]:
    dev = torch.device("cuda")
    names = [name for name in ("cuda", "triton") if availability(name, dev)[0]]
    if "cuda" not in names:
        pytest.fail(f"cuda backend unavailable on a GPU machine: {availability('cuda', dev)[1]}")
    return names


def _setup(n: int, k: int, widths, backends):
    """Weight copies plus one :class:`_Rotation` per (backend, width). ``triton_tiled``: the Triton backend with
    every width 2..16 on its ``tl.dot`` tiled kernel (``SMALL_TILED``), chosen while the graph is captured."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(n * 31 + k)
    packed = pack_t2(torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)).to(dev)
    weight_bytes = packed.numel() * packed.element_size()
    copies = max(2, -(-ROTATION_BYTES // weight_bytes))
    packs = [packed.clone() for _ in range(copies)]
    scales = torch.rand(1, 1, generator=g, device="cpu").add_(0.1).to(dev)  # BitNet: one scale per tensor
    rotations = {}
    for name in backends:
        impl = select("w2a8_linear_q", dev, name.removesuffix("_tiled").removesuffix("_splitk"))
        for m in widths:
            x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8).to(dev)
            s = (torch.rand(m, generator=g) + 0.5).to(dev)
            out = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            tiled = (mock.patch("bitmtp.triton_kernels.w2a8.TILED_FROM", 2) if name == "triton_tiled"
                     else mock.patch("bitmtp.triton_kernels.w2a8.SPLITK_UP_TO", 16) if name == "triton_splitk"
                     else contextlib.nullcontext())  # the kernel is chosen at capture: the graph keeps it
            with tiled:
                rotations[name, m] = _Rotation(impl, x_q, s, packs, scales, k, out)
    return weight_bytes, rotations


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_m1_weight_bandwidth(benchmark, copy_buffers, n, k):
    """M = 1 weight bandwidth of the CUDA and Triton kernels as a fraction of copy bandwidth."""
    backends = _backends()
    if "triton" in backends:
        backends.append("triton_splitk")  # the fused step's split-K tensor-core kernel (w2a8.SPLITK_UP_TO)
    weight_bytes, rot = _setup(n, k, (1,), backends)
    benchmark.pedantic(lambda: (rot["cuda", 1].graph.replay(), torch.cuda.synchronize()), rounds=5, iterations=1,
                       warmup_rounds=1)
    if benchmark.disabled:
        return
    src, dst = copy_buffers
    fracs: dict[str, list[float]] = {name: [] for name in backends}
    times: dict[str, list[float]] = {name: [] for name in backends}
    copy_bw = []
    for _ in range(ROUNDS):  # alternate: copy, cuda, triton, copy, cuda, triton, …
        bw = 2 * COPY_BYTES / cuda_event_time(lambda: dst.copy_(src), 3)
        copy_bw.append(bw)
        for name in backends:
            t = rot[name, 1].seconds_per_launch()
            times[name].append(t)
            fracs[name].append(weight_bytes / t / bw)
    figures = dict(shape=f"{n}x{k}", copy_GBps=statistics.median(copy_bw) / 1e9)
    for name in backends:
        figures[f"{name}_m1_us"] = statistics.median(times[name]) * 1e6
        figures[f"{name}_m1_GBps"] = weight_bytes / statistics.median(times[name]) / 1e9
        figures[f"{name}_bw_frac"] = statistics.median(fracs[name])
    record(benchmark, gates={f"{name}_bw_frac": HIGHER for name in backends if name != "triton_splitk"}, **figures)


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_width_scaling(benchmark, n, k):
    """time(M = 8) / time(M = 1) and time(M = 16) / time(M = 1) for the CUDA and Triton kernels, and for Triton
    with widths 2..16 on its tiled ``tl.dot`` kernel (``triton_tiled``, not gated: the figures a GPU session
    uses to choose ``bitmtp.triton_kernels.w2a8.TILED_FROM``)."""
    backends = _backends()
    if "triton" in backends:
        backends += ["triton_tiled", "triton_splitk"]
    weight_bytes, rot = _setup(n, k, WIDTHS, backends)
    benchmark.pedantic(lambda: (rot["cuda", 16].graph.replay(), torch.cuda.synchronize()), rounds=5,
                       iterations=1, warmup_rounds=1)
    if benchmark.disabled:
        return
    figures: dict[str, object] = dict(shape=f"{n}x{k}")
    gates = {}
    for name in backends:
        times: dict[int, list[float]] = {m: [] for m in WIDTHS}
        ratios: dict[int, list[float]] = {m: [] for m in WIDTHS if m != 1}
        for _ in range(ROUNDS):  # alternate every width within each round
            for m in WIDTHS:
                times[m].append(rot[name, m].seconds_per_launch())
            for m in ratios:
                ratios[m].append(times[m][-1] / times[1][-1])
        for m in WIDTHS:
            figures[f"{name}_m{m}_GBps"] = weight_bytes / statistics.median(times[m]) / 1e9
        for m, r in ratios.items():
            figures[f"{name}_t{m}_over_t1"] = statistics.median(r)
            if name not in ("triton_tiled", "triton_splitk"):
                gates[f"{name}_t{m}_over_t1"] = LOWER
    if "triton_tiled" in backends:  # the candidates against today's decode buckets, same widths, same run
        for m in WIDTHS[1:]:
            figures[f"triton_tiled_over_decode_m{m}"] = (figures[f"triton_m{m}_GBps"]
                                                         / figures[f"triton_tiled_m{m}_GBps"])
        for m in WIDTHS:  # > 1: split-K faster than the decode buckets (sets w2a8.SPLITK_UP_TO)
            figures[f"triton_splitk_speedup_m{m}"] = (figures[f"triton_splitk_m{m}_GBps"]
                                                      / figures[f"triton_m{m}_GBps"])
    record(benchmark, gates=gates, **figures)
