"""The transformers BitNet packed layout and its conversion to T2.

transformers stores a BitNet ternary weight ``W[N, K]`` as ``uint8[ceil(N/4), K]``: byte ``[r, k]``
holds the codes ``c = w + 1`` of rows ``r``, ``r + R``, ``r + 2R``, ``r + 3R`` (R = ceil(N/4)) at bits
0, 2, 4, 6 — four rows N/4 apart, not four neighbouring columns.

**Scale convention (pinned by tests/formats/test_bitnet.py).** Real BitNet checkpoints
(microsoft/bitnet-b1.58-2B-4T, ``quantization_config.linear_class == "bitlinear"``) are run by
transformers' ``BitLinear``, which computes ``y = (x_q @ Wᵀ) / (s_x · weight_scale)``: the stored
``weight_scale`` is the *inverse* absmean, ``1 / mean|W|``, and the real weight is
``w / weight_scale``. ``AutoBitLinear`` (``linear_class == "autobitlinear"``) multiplies instead:
``y = F.linear(...) · weight_scale``, so its ``weight_scale`` is the absmean itself. bitmtp's scales
are multiplicative (``W = (c − 1) · scale``), so a ``bitlinear`` checkpoint converts with
``scale = 1 / weight_scale`` and an ``autobitlinear`` one with ``scale = weight_scale``.
"""

from __future__ import annotations

import torch

from bitmtp.errors import DTypeError, FormatError, ShapeError
from bitmtp.formats.ternary import pack_t2

ROWS_PER_BYTE = 4
LINEAR_CLASSES = ("bitlinear", "autobitlinear")


def unpack_bitnet(packed: torch.Tensor, out_features: int | None = None) -> torch.Tensor:
    """Ternary ``int8[N, K]`` from the transformers packed layout ``uint8[ceil(N/4), K]``."""
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8:
        got = packed.dtype if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise DTypeError(f"packed: expected a uint8 tensor in the BitNet layout, got {got}")
    if packed.dim() != 2 or 0 in packed.shape:
        raise ShapeError(f"packed: expected a non-empty 2-D [N/4, K] tensor, got shape {tuple(packed.shape)}")
    rows = packed.shape[0]
    n = rows * ROWS_PER_BYTE if out_features is None else int(out_features)
    if not (rows * ROWS_PER_BYTE - ROWS_PER_BYTE < n <= rows * ROWS_PER_BYTE):
        raise ShapeError(f"out_features: {n} does not fit packed weights with {rows} byte rows")
    planes = [(packed >> (2 * i)) & 0x3 for i in range(ROWS_PER_BYTE)]
    codes = torch.cat(planes, dim=0)[:n]
    if bool((codes == 3).any()):
        raise FormatError("packed: holds the invalid 2-bit code 3 (BitNet codes are 0, 1, 2)")
    return codes.to(torch.int8) - 1


def pack_bitnet(weight: torch.Tensor) -> torch.Tensor:
    """Pack ternary ``W[N, K]`` into the transformers BitNet layout ``uint8[ceil(N/4), K]``."""
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or 0 in weight.shape:
        raise ShapeError("weight: expected a non-empty 2-D [N, K] tensor")
    if bool(((weight != -1) & (weight != 0) & (weight != 1)).any()):
        raise FormatError("weight: BitNet packing takes only ternary values -1, 0, 1")
    n, k = weight.shape
    rows = -(-n // ROWS_PER_BYTE)
    codes = torch.ones(rows * ROWS_PER_BYTE, k, dtype=torch.uint8, device=weight.device)
    codes[:n] = (weight.to(torch.int16) + 1).to(torch.uint8)
    out = torch.zeros(rows, k, dtype=torch.uint8, device=weight.device)
    for i in range(ROWS_PER_BYTE):
        out |= codes[i * rows : (i + 1) * rows] << (2 * i)
    return out


def bitnet_scale_to_multiplier(weight_scale: torch.Tensor, linear_class: str = "bitlinear") -> torch.Tensor:
    """bitmtp's multiplicative per-tensor scale ``float32[1, 1]`` from a BitNet ``weight_scale``."""
    if linear_class not in LINEAR_CLASSES:
        raise FormatError(f"linear_class: expected one of {LINEAR_CLASSES}, got {linear_class!r}")
    if not isinstance(weight_scale, torch.Tensor) or weight_scale.numel() != 1:
        raise ShapeError("weight_scale: expected a one-element tensor (BitNet scales are per tensor)")
    ws = weight_scale.detach().to(torch.float32).reshape(1, 1)
    if not bool(torch.isfinite(ws).all()) or float(ws) <= 0:
        raise FormatError(f"weight_scale: must be finite and positive, got {float(ws)}")
    return (1.0 / ws if linear_class == "bitlinear" else ws).contiguous()


def bitnet_to_t2(
    packed: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    out_features: int | None = None,
    linear_class: str = "bitlinear",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Convert a transformers BitNet weight to ``(T2 words int32[N, ceil(K/16)], scales float32[1, 1])``."""
    return pack_t2(unpack_bitnet(packed, out_features)), bitnet_scale_to_multiplier(weight_scale, linear_class)


__all__ = ["unpack_bitnet", "pack_bitnet", "bitnet_scale_to_multiplier", "bitnet_to_t2", "LINEAR_CLASSES"]
