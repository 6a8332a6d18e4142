"""A CPU step's mask and RoPE rows, written into a runner's fixed numpy buffers.

Row ``i`` of a step may attend to KV rows ``[lo[i], hi[i]]`` of the segment's first ``L`` (``lo`` absent: from 0, the
causal mask of a solo step), and its RoPE ``cos`` / ``sin`` rows are rows ``positions[i]`` of the decoder's tables
(``Decoder.rope_host``). The CPU runners (``runtime.batch_pass.HostInputs``, ``runtime.graphs.HostCausal``) refill
them every step: with the native extension one call (``step_inputs`` in csrc/cpu/w2a8_module.cpp), else four numpy
calls — :func:`fill_numpy`, the reference. Why native: each numpy call costs 10-30 µs with the caches cold after the
layers' call, four of them ~60-100 µs of a SmolLM2 step's host glue (``bench/glue.py``), the one call ~10.
"""

from __future__ import annotations

import numpy as np

from bitmtp.errors import BitMTPError
from bitmtp.ops import registry


def _ext():
    """The ``cpu`` backend's extension when it loads and has ``step_inputs`` (else None: the numpy reference runs;
    the registry says once what a missing extension costs)."""
    ext = getattr(registry.backend("cpu"), "_ext", None)
    return ext if hasattr(ext, "step_inputs") else None


def fill_numpy(positions: np.ndarray, lo: np.ndarray | None, hi: np.ndarray, mask: np.ndarray,
               tables: tuple[np.ndarray, np.ndarray], cos: np.ndarray, sin: np.ndarray) -> None:
    """The reference: ``mask[i, j] = lo[i] <= j <= hi[i]`` (``lo`` None: 0), ``cos[i] = tables[0][positions[i]]``,
    ``sin[i] = tables[1][positions[i]]``, by numpy."""
    index = np.arange(mask.shape[1], dtype=np.int64)
    np.less_equal(index[None, :], hi[:, None], out=mask)
    if lo is not None:
        mask &= index[None, :] >= lo[:, None]
    np.take(tables[0], positions, axis=0, out=cos)
    np.take(tables[1], positions, axis=0, out=sin)


class StepInputsFill:
    """Refills one runner's buffers (module docstring): ``positions``, ``lo`` (or None) and ``hi`` int64 ``[M]``,
    ``mask`` bool ``[M, L]``, ``cos`` / ``sin`` float32 ``[M, head_dim]`` — all C-contiguous numpy arrays the runner
    keeps, read or written in place by every :meth:`__call__` (their pointers are taken once, here)."""

    def __init__(self, positions: np.ndarray, lo: np.ndarray | None, hi: np.ndarray, mask: np.ndarray,
                 cos: np.ndarray, sin: np.ndarray):
        m, d = cos.shape
        for name, a, dtype, shape in (("positions", positions, np.int64, (m,)), ("lo", lo, np.int64, (m,)),
                                      ("hi", hi, np.int64, (m,)), ("mask", mask, np.bool_, (m, mask.shape[-1])),
                                      ("cos", cos, np.float32, (m, d)), ("sin", sin, np.float32, (m, d))):
            if a is not None and (a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous):
                raise BitMTPError(f"{name}: expected a C-contiguous {np.dtype(dtype).name} array of shape {shape}, "
                                  f"got {a.dtype} {a.shape}")
        self.positions, self.lo, self.hi, self.mask, self.cos, self.sin = positions, lo, hi, mask, cos, sin
        self.ext = _ext()
        self._args = (positions.ctypes.data, 0 if lo is None else lo.ctypes.data, hi.ctypes.data, m, mask.shape[1],
                      mask.ctypes.data)
        self._out = (d, cos.ctypes.data, sin.ctypes.data)
        self._tables: tuple | None = None  # (the tables, their native arguments)

    def __call__(self, tables: tuple[np.ndarray, np.ndarray]) -> None:
        """Fill the mask and the RoPE rows from the current positions / lo / hi and the RoPE ``tables``."""
        held = self._tables
        if held is None or held[0] is not tables:
            cos_t, sin_t = tables
            d = self.cos.shape[1]
            if cos_t.dtype != np.float32 or sin_t.dtype != np.float32 or cos_t.shape != sin_t.shape \
                    or cos_t.ndim != 2 or cos_t.shape[1] != d or not (cos_t.flags.c_contiguous
                                                                      and sin_t.flags.c_contiguous):
                raise BitMTPError(f"tables: expected two C-contiguous float32 [rows, {d}] arrays, got {cos_t.dtype} "
                                  f"{cos_t.shape} / {sin_t.dtype} {sin_t.shape}")
            held = self._tables = (tables, (cos_t.ctypes.data, sin_t.ctypes.data, cos_t.shape[0]))
        if self.ext is None:
            if len(self.positions) and not 0 <= int(self.positions.min()) <= int(self.positions.max()) \
                    < held[1][2]:
                raise BitMTPError(f"positions: outside the RoPE tables' {held[1][2]} rows")
            fill_numpy(self.positions, self.lo, self.hi, self.mask, tables, self.cos, self.sin)
            return
        try:
            self.ext.step_inputs(*self._args, *held[1], *self._out)
        except ValueError as exc:  # a position outside the tables
            raise BitMTPError(str(exc)) from exc


__all__ = ["StepInputsFill", "fill_numpy"]
