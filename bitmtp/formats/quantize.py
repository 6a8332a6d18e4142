"""Absmean ternarization of float weights and per-token int8 quantization of activations."""

from __future__ import annotations

import torch

from bitmtp.errors import DTypeError, ShapeError
from bitmtp.formats.scales import GRANULARITIES
from bitmtp.formats.ternary import WEIGHTS_PER_WORD

#: Floor of the absmean / absmax denominators (BitNet's ``clamp(min=1e-5)``).
EPS = 1e-5


def absmean_ternarize(
    weight: torch.Tensor, granularity: str = "tensor", group_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ternarize a float weight by absmean (BitNet b1.58).

    For each scale region R (the whole tensor, a row, or a group of ``group_size`` columns of a
    row): ``a = max(mean|W_R|, 1e-5)``, ``q = clamp(round(W · (1/a)), -1, 1)`` and the scale is ``a``,
    so ``W ≈ q · a``. Multiplying by the reciprocal (rather than dividing) mirrors BitNet's
    ``WeightQuant`` so rounding ties land the same way.

    Returns:
        ``(q int8[N, K], scales float32[N_s, n_groups])`` in the layout of :mod:`bitmtp.formats.scales`.
    """
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise DTypeError(f"weight: expected a floating-point tensor, got {got}")
    if weight.dim() != 2 or 0 in weight.shape:
        raise ShapeError(f"weight: expected a non-empty 2-D [N, K] tensor, got shape {tuple(weight.shape)}")
    if granularity not in GRANULARITIES:
        raise ShapeError(f"granularity: expected one of {GRANULARITIES}, got {granularity!r}")
    w = weight.detach().float()
    n, k = w.shape
    if granularity == "tensor":
        a = w.abs().mean().clamp(min=EPS).reshape(1, 1)
        q = (w * (1.0 / a)).round().clamp(-1, 1)
        return q.to(torch.int8), a.contiguous()
    if granularity == "row":
        a = w.abs().mean(dim=1, keepdim=True).clamp(min=EPS)
        q = (w * (1.0 / a)).round().clamp(-1, 1)
        return q.to(torch.int8), a.contiguous()
    if group_size is None or group_size <= 0 or group_size % WEIGHTS_PER_WORD:
        raise ShapeError(f"group_size: per-group ternarization needs a positive multiple of 16, got {group_size}")
    n_groups = -(-k // group_size)
    sums = torch.zeros(n, n_groups, dtype=torch.float32, device=w.device)
    col = torch.arange(k, device=w.device) // group_size
    sums.index_add_(1, col, w.abs())
    counts = torch.bincount(col, minlength=n_groups).to(torch.float32)
    a = (sums / counts).clamp(min=EPS)
    q = (w * (1.0 / a)[:, col]).round().clamp(-1, 1)
    return q.to(torch.int8), a.contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 quantization (the A8 of W2A8).

    ``s = 127 / max(|x|, 1e-5)`` per row and ``x_q = clamp(round_half_even(x · s), -128, 127)``, all in
    float32 (a bf16/fp16 input is widened first), so every backend reproduces the same integers.

    Args:
        x: float tensor ``[..., K]``.

    Returns:
        ``(x_q int8[..., K], s float32[...])``.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise DTypeError(f"x: expected a floating-point tensor, got {got}")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ShapeError(f"x: expected shape [..., K] with K > 0, got {tuple(x.shape)}")
    xf = x.float()
    s = 127.0 / xf.abs().amax(dim=-1).clamp(min=EPS)
    # torch.round rounds half to even.
    x_q = (xf * s.unsqueeze(-1)).round().clamp(-128, 127).to(torch.int8)
    return x_q, s


def dequantize_ternary(
    q: torch.Tensor, scales: torch.Tensor, group_size: int | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``q · scale`` as a dense ``[N, K]`` tensor (``q`` ternary int, ``scales`` as in formats.scales)."""
    from bitmtp.formats.scales import expand_scales, resolve_group_size

    n, k = q.shape
    g = resolve_group_size(scales, n, k, group_size)
    return (q.to(torch.float64) * expand_scales(scales, n, k, g).to(torch.float64)).to(dtype)


__all__ = ["EPS", "absmean_ternarize", "quantize_activations", "dequantize_ternary"]
