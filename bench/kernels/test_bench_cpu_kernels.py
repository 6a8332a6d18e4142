"""Native CPU W2A8 kernel (csrc/cpu) at BitNet-2B shapes.

Figures (all measured in one run, contenders alternating A B A B, medians of per-round ratios):

* ``bw_fraction`` — weight bytes / kernel time at M = 1, over this machine's streaming-read
  bandwidth (``stream_read`` probe, same threads). Goal ≥ 0.6.
* ``mM_over_m1`` — time(M)/time(M=1) on the same shape, M = 4, 8, 16 (full: 2, 4, 8, 16), with the
  weight GB/s at width M (``weights_GBps``: packed bytes / time; ``python -m bench.plots`` draws it
  against M). Goals ≤ 1.5 (M = 8) / ≤ 2.5 (M = 16).
* ``speedup_vs_f32`` — ``F.linear`` float32 time / kernel time at M = 1. Goal ≥ 8. Also reports both weight
  GB/s (``kernel_GBps``, ``f32_GBps``): F.linear's is the better read-bandwidth probe on hosts where one
  sequential stream per thread (``stream_read``) falls short of what memory delivers.

Gated (``bench.compare``): ``bw_fraction`` and ``speedup_vs_f32`` (higher is better), ``mM_over_m1``
(lower is better).

Both contenders' weights rotate through copies totalling twice this machine's last-level cache, at least
128 MiB (``bench.machine.streaming_bytes``: 128 MiB on the 32 MiB-L3 AMD hosts, 960 MiB on the 480 MiB-L3
Intel Xeon host), so every call streams its weights from memory as a decode step over a model larger than
the cache does. A single 70 MB float32 matrix is not enough: on the 480 MiB-L3 host it stayed in cache
and ``F.linear`` read it at ~56 GB/s against ~32 GB/s from memory, which put ``speedup_vs_f32`` at 6.7
where, both streaming, it measures ~10. The kernel is timed through the raw extension entry point (no
Python validation) because the figure is about the kernel.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from bench.conftest import HIGHER, LOWER, by_mode, record
from bench.machine import rotating_copies, streaming_bytes
from bench.ratios import alternating_ratio
from bitmtp.formats import pack_t2

cpu_backend = pytest.importorskip("bitmtp.ops.backends.cpu_backend")
try:
    EXT = cpu_backend._load_extension()
except ImportError:
    EXT = None
pytestmark = pytest.mark.skipif(EXT is None, reason="native CPU extension not built")

SHAPES = [(2560, 6912), (6912, 2560)]  # (N, K): BitNet-2B down_proj and a 6912-row projection
WIDTHS = by_mode((4, 8, 16), (2, 4, 8, 16))
GOALS = {8: 1.5, 16: 2.5}
ROTATE_BYTES = streaming_bytes()
READ_BYTES = streaming_bytes(minimum=512 * 2**20)


class KernelCall:
    """Calls the extension on rotating weight copies with pre-built arguments."""

    def __init__(self, n: int, k: int, m: int, g: torch.Generator):
        base = pack_t2(torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8))
        self.weight_bytes = base.numel() * 4
        self.copies = rotating_copies(base, ROTATE_BYTES, minimum=2)
        self.x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
        self.s = torch.rand(m, generator=g) + 0.5
        self.scales = torch.rand(1, 1, generator=g) + 0.1
        self.y = torch.empty(m, n)
        self.n, self.k, self.m, self.kw = n, k, m, base.shape[1]
        self.i = 0
        self.threads = torch.get_num_threads()

    def __call__(self) -> None:
        w = self.copies[self.i % len(self.copies)]
        self.i += 1
        EXT.run(self.x_q.data_ptr(), self.m, self.k, w.data_ptr(), self.n, self.kw, self.scales.data_ptr(), 1, 1,
                self.k, self.s.data_ptr(), 0, self.y.data_ptr(), 0, -1, self.threads)


@pytest.fixture(scope="module")
def read_probe():
    buf = torch.randint(0, 2**40, (READ_BYTES // 8,), dtype=torch.int64)
    threads = torch.get_num_threads()
    return lambda: EXT.stream_read(buf.data_ptr(), READ_BYTES, threads)


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_cpu_m1_bandwidth_fraction(benchmark, read_probe, n, k):
    call = KernelCall(n, k, 1, torch.Generator().manual_seed(n + k))
    benchmark.pedantic(call, rounds=20, iterations=1, warmup_rounds=2)
    if benchmark.disabled:
        return
    # ratio = t_kernel / t_read; fraction = (W / t_kernel) / (R / t_read) = (W / R) / ratio
    ratio, t_kernel, t_read = alternating_ratio(call, read_probe, rounds=7, inner=5)
    frac = (call.weight_bytes / READ_BYTES) / ratio
    record(benchmark, shape=f"{n}x{k}", M=1, isa=EXT.cpu_features()["best"], kernel_us=t_kernel * 1e6,
           kernel_GBps=call.weight_bytes / t_kernel / 1e9, weights_GBps=call.weight_bytes / t_kernel / 1e9,
           read_GBps=READ_BYTES / t_read / 1e9, bw_fraction=frac, goal="bw_fraction>=0.6", met=frac >= 0.6,
           gates={"bw_fraction": HIGHER})


@pytest.mark.parametrize("m", WIDTHS)
@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_cpu_width_scaling(benchmark, n, k, m):
    g = torch.Generator().manual_seed(n + k + m)
    wide = KernelCall(n, k, m, g)
    one = KernelCall(n, k, 1, g)
    benchmark.pedantic(wide, rounds=10, iterations=1, warmup_rounds=2)
    if benchmark.disabled:
        return
    ratio, t_wide, t_one = alternating_ratio(wide, one, rounds=7, inner=5)
    goal = GOALS.get(m)
    record(benchmark, shape=f"{n}x{k}", M=m, kernel_us=t_wide * 1e6, m1_us=t_one * 1e6,
           weights_GBps=wide.weight_bytes / t_wide / 1e9, **{f"m{m}_over_m1": ratio},
           goal=f"m{m}_over_m1<={goal}" if goal else "report", met=ratio <= goal if goal else "",
           gates={f"m{m}_over_m1": LOWER})


@pytest.mark.parametrize("n,k", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_cpu_vs_dense_f32(benchmark, n, k):
    g = torch.Generator().manual_seed(n * k)
    call = KernelCall(n, k, 1, g)
    benchmark.pedantic(call, rounds=10, iterations=1, warmup_rounds=2)
    if benchmark.disabled:
        return
    w = torch.randn(n, k, generator=g)  # 70 MB: stays in a large L3 (see the module docstring), so rotate it too
    dense_copies = rotating_copies(w, ROTATE_BYTES, minimum=2)
    x = torch.randn(1, k, generator=g)
    turn = itertools.cycle(dense_copies)

    def dense():
        return F.linear(x, next(turn))

    # One pass over every copy of both first: the clones above leave up to an L3 of dirty lines, whose
    # write-back slowed the first kernel rounds (a run measured 8.7 where the others gave 13-14).
    for _ in range(len(dense_copies)):
        dense()
    for _ in range(len(call.copies)):
        call()
    ratio, t_kernel, t_dense = alternating_ratio(call, dense, rounds=15, inner=3)  # ~0.2 s: more rounds are cheap
    speedup = 1.0 / ratio
    # Reported, not gated: the weight GB/s of both. F.linear's is a second read-bandwidth probe beside
    # stream_read (one sequential stream per thread), which reads less than F.linear on some hosts
    # (Intel Xeon 480 MiB L3: ~21 vs ~32 GB/s), so bw_fraction near 1 there is against a low probe.
    record(benchmark, shape=f"{n}x{k}", kernel_us=t_kernel * 1e6, f32_us=t_dense * 1e6,
           kernel_GBps=call.weight_bytes / t_kernel / 1e9, f32_GBps=w.numel() * 4 / t_dense / 1e9,
           speedup_vs_f32=speedup, goal="speedup_vs_f32>=8", met=speedup >= 8, gates={"speedup_vs_f32": HIGHER})
