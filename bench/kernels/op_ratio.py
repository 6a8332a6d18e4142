"""The W2A8 op as callers reach it — through the backend registry — against a memory copy.

:func:`op_vs_copy` times ``select("w2a8_linear_q", device, backend)(…)`` (the registry lookup is
made on every call, as ``bitmtp.ops.w2a8_linear`` makes it, so an override installed with
``bitmtp.ops.registry.override`` is what gets timed) alternately with ``dst.copy_(src)`` over as many
bytes as the packed weights, and reports the op's weight bandwidth as a fraction of the copy's.
``bench/kernels/test_bench_ops.py`` gates that fraction; ``tests/test_bench_gate.py`` slows the op
through the registry and checks the gate catches it.
"""

from __future__ import annotations

import torch

from bench.machine import rotating_copies
from bench.ratios import alternating_ratio
from bitmtp.formats import pack_t2
from bitmtp.ops.registry import select

OP = "w2a8_linear_q"


def benchmark_name(backend: str, n: int, k: int, m: int) -> str:
    """The pytest-benchmark fullname of ``test_op_bw_fraction`` for these parameters."""
    return f"bench/kernels/test_bench_ops.py::test_op_bw_fraction[{backend}-{n}x{k}-M{m}]"


class OpCall:
    """One registry-dispatched W2A8 linear call on rotating weight copies (pre-built arguments)."""

    def __init__(self, backend: str, n: int, k: int, m: int, rotate_bytes: int = 0, seed: int = 0,
                 device: str = "cpu"):
        g = torch.Generator().manual_seed(seed)
        self.backend, self.device = backend, torch.device(device)
        base = pack_t2(torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)).to(self.device)
        self.weight_bytes = base.numel() * base.element_size()
        self.copies = rotating_copies(base, rotate_bytes)
        self.x_q = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8).to(self.device)
        self.s = (torch.rand(m, generator=g) + 0.5).to(self.device)
        self.scales = (torch.rand(1, 1, generator=g) + 0.1).to(self.device)
        self.out = torch.empty(m, n, dtype=torch.float32, device=self.device)
        self.k = k
        self.i = 0

    def __call__(self) -> None:
        w = self.copies[self.i % len(self.copies)]
        self.i += 1
        select(OP, self.device, self.backend)(self.x_q, self.s, w, self.scales, self.k, self.k, None, torch.float32,
                                              out=self.out)


def op_vs_copy(backend: str, n: int, k: int, m: int = 1, *, rounds: int = 5, inner: int = 3,
               rotate_bytes: int = 0) -> dict[str, float]:
    """Figures of the op against a copy of the packed weights' size, measured alternately:
    ``op_us``, ``op_GBps`` (packed weight bytes / op time), ``copy_GBps`` (read + write bytes / copy
    time) and ``op_bw_fraction`` = op_GBps / copy_GBps."""
    call = OpCall(backend, n, k, m, rotate_bytes)
    nbytes = max(call.weight_bytes, rotate_bytes)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ratio, t_op, t_copy = alternating_ratio(call, lambda: dst.copy_(src), rounds=rounds, inner=inner)
    # fraction = (W / t_op) / (2 B / t_copy) = (W / 2B) / ratio
    return {"op_us": t_op * 1e6, "op_GBps": call.weight_bytes / t_op / 1e9, "copy_GBps": 2 * nbytes / t_copy / 1e9,
            "op_bw_fraction": call.weight_bytes / (2 * nbytes) / ratio}
