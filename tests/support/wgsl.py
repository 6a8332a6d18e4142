"""Helpers shared by the WGSL shader tests (tests/wgsl_fallback/, one test file per shader).

Rules of those tests: integer results (x_q, the W2A8 accumulators, argmax ids, KV writes, gathers) equal
the reference exactly; float ops are compared with a float64 reference within 1e-5 relative (fp32
shaders) by :func:`close`. Outputs are poisoned with NaN first where an op writes into a given buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from bitmtp.formats import pack_t2

#: step widths the shaders are tested at (1, odd, a tile, one short of a tile, a full tile)
MS = [1, 3, 8, 15, 16]


def close(got, want, rel: float = 1e-5) -> None:
    """Assert ``got`` equals ``want`` within ``rel`` of the largest magnitude of ``want``."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), 1e-30)
    err = np.abs(got - want).max() / scale
    assert err <= rel, f"max error {err:.3g} of max |ref| (allowed {rel})"


def ternary(rng: torch.Generator, n: int, k: int, layout: str, group: int | None):
    """A random ternary weight ``[n, k]``, its T2 words, scales of ``layout`` (tensor / row / group) and an
    ``upload(runner, **kw)`` that puts it on a device as a ``TernaryWeight``."""
    from bitmtp.wgsl_fallback.ops import TernaryWeight

    w = torch.randint(-1, 2, (n, k), generator=rng, dtype=torch.int8)
    cols = 1 if layout != "group" else k // group
    scales = torch.rand(1 if layout == "tensor" else n, cols, generator=rng) + 0.05
    return w, pack_t2(w), scales, (lambda r, **kw: TernaryWeight.upload(r, pack_t2(w).numpy(), scales.numpy(), k,
                                                                         group, **kw))


def dispatched(r, shader: str) -> bool:
    """Whether runner ``r`` built a pipeline of ``shader`` (so a test knows which kernel ran)."""
    return any(key[0] == shader for key in r._pipelines)
