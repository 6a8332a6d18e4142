"""The W2A8 backends this machine runs and the float-epilogue check shared by the W2A8 kernel tests."""

from __future__ import annotations

import pytest
import torch

from bitmtp.ops import reference
from bitmtp.ops.registry import availability


def _backends():
    names = []
    for name in ("torch", "triton", "cpu"):
        ok, _ = availability(name, "cpu")
        if ok:
            names.append(pytest.param(name, marks=[pytest.mark.triton] if name == "triton" else []))
    return names


#: the host backends available here, as pytest params (Triton ones marked ``triton``)
BACKENDS = _backends()


def check_float(y: torch.Tensor, x_q, s, packed, scales, k, group, bias=None, rtol=1e-5):
    """Assert the float W2A8 output ``y`` is finite and within ``rtol``·|ref| + 1e-6·Σ_g|acc_g·scale_g/s| of the
    float64 reference (the second term bounds float32 rounding of the per-group sum, which can cancel)."""
    ref = reference.w2a8_linear_q_reference(x_q, s, packed, scales, k, group, bias)
    acc = reference.w2a8_accumulate_reference(x_q, packed, k, group).double()
    mag = (acc * scales.double().expand(packed.shape[0], scales.shape[1])).abs().sum(-1) / s.double()[:, None]
    err = (y.double() - ref).abs()
    bound = rtol * ref.abs() + 1e-6 * mag + 1e-30
    assert torch.isfinite(y).all()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"float epilogue off by {worst:.3g}x the tolerance"
