"""Front door of RMSNorm: ``y = w * (x * rsqrt(mean(x²) + eps))`` per row.

The torch reference (``bitmtp.ops.reference.rms_norm_reference``) is the one definition: its mean of squares is
summed in float64 and rounded to float32, so the statistic does not depend on the summation order. The ``cpu``
backend runs the fused layers' own norm (csrc/cpu/layers.cpp), bit-exact with it, in one call: the decoder's
final norm runs once a step, where the reference's nine small torch ops cost 20-120 µs (cold caches after the
layers) and the native call ~1 µs. Tensors that need gradients, other dtypes and other devices take the
reference.
"""

from __future__ import annotations

import torch

from bitmtp.errors import ShapeError
from bitmtp.ops import registry


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, backend: str | None = None) -> torch.Tensor:
    """RMSNorm of the rows of ``x [..., n]`` with ``weight [n]`` (the reference's bits on every backend)."""
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        raise ShapeError(f"rms_norm: expected x [..., n] and weight [n], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    return registry.select("rms_norm", x.device, backend)(x, weight, float(eps))


__all__ = ["rms_norm"]
