"""The W2A8 op as callers reach it — through the backend registry — against a memory copy.

:func:`op_vs_copy` times ``select("w2a8_linear_q", device, backend)(…)`` (the registry lookup is
made on every call, as ``bitmtp.ops.w2a8_linear`` makes it, so an override installed with
``bitmtp.ops.registry.override`` is what gets timed) alternately with a streaming read (or copy) of as many bytes as the
packed weights (:class:`RotatingStream`), and reports the op's weight bandwidth as a fraction of that stream's.
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


class RotatingStream:
    """The contender: streams one weight-sized slice of a ``rotate_bytes`` buffer per call, the next slice
    each time, so it moves as many bytes a call as the op, from memory the last calls did not touch.

    On the CPU with the native extension it *reads* the slice on the extension's own thread team
    (``stream_read``, the probe of ``test_bench_cpu_kernels.py``); elsewhere it copies it with torch. Two
    earlier contenders misled: copying the whole rotation buffer at once (~1 GB on the 480 MiB-L3 Intel host)
    flushed the op's weights and TLB entries before every op call, and any torch copy on the CPU leaves
    libgomp's workers spinning on the second core, which halved the next op call about half the time
    (op 200 -> 447 us at 2560x6912; fraction 0.23-0.56 run to run, 1.05 against a one-thread copy)."""

    def __init__(self, nbytes: int, rotate_bytes: int = 0, device: torch.device | str = "cpu"):
        self.nbytes = nbytes
        self.device = torch.device(device)
        self.src = torch.ones(max(nbytes, rotate_bytes), dtype=torch.uint8, device=self.device)
        self.slots = self.src.numel() // nbytes
        self.i = 0
        self.ext = _cpu_extension() if self.device.type == "cpu" else None
        # a small read on one thread: a second thread descheduled by outside load would stall a call of a few
        # microseconds by a whole time slice (tests/test_bench_gate.py's 8 KiB op failed so under load)
        self.threads = torch.get_num_threads() if nbytes >= 1 << 20 else 1
        self.dst = None if self.ext is not None else torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    @property
    def moved_bytes(self) -> int:
        """Bytes one call moves: read only (the probe) or read + write (a copy)."""
        return self.nbytes if self.ext is not None else 2 * self.nbytes

    def __call__(self) -> None:
        self.i = (self.i + 1) % self.slots
        if self.ext is not None:
            self.ext.stream_read(self.src.data_ptr() + self.i * self.nbytes, self.nbytes, self.threads)
        else:
            self.dst.copy_(self.src[self.i * self.nbytes:(self.i + 1) * self.nbytes])


def _cpu_extension():
    """The native CPU extension, or None without it (the copy contender is used then)."""
    try:
        from bitmtp.ops.backends.cpu_backend import _load_extension

        return _load_extension()
    except Exception:  # noqa: BLE001 - any failure to load means: no extension, use the copy
        return None


def op_vs_copy(backend: str, n: int, k: int, m: int = 1, *, rounds: int = 5, inner: int = 3,
               rotate_bytes: int = 0) -> dict[str, float]:
    """Figures of the op against :class:`RotatingStream` over the packed weights' size, measured
    alternately: ``op_us``, ``op_GBps`` (packed weight bytes / op time), ``stream_GBps`` (the contender's
    bytes moved / its time: a read on the CPU with the extension, read + write for a copy) and
    ``op_bw_fraction`` = op_GBps / stream_GBps."""
    call = OpCall(backend, n, k, m, rotate_bytes)
    stream = RotatingStream(call.weight_bytes, rotate_bytes, call.device)
    ratio, t_op, t_stream = alternating_ratio(call, stream, rounds=rounds, inner=inner)
    # fraction = (W / t_op) / (moved / t_stream) = (W / moved) / ratio
    return {"op_us": t_op * 1e6, "op_GBps": call.weight_bytes / t_op / 1e9,
            "stream_GBps": stream.moved_bytes / t_stream / 1e9,
            "op_bw_fraction": call.weight_bytes / stream.moved_bytes / ratio}
