"""Argument checks shared by the op front doors. Each failure names the argument at fault."""

from __future__ import annotations

import torch

from bitmtp.errors import DeviceError, DTypeError, LayoutError, ShapeError
from bitmtp.formats.scales import resolve_group_size
from bitmtp.formats.ternary import WEIGHTS_PER_WORD, padded_k

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise DTypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def packed_weight(weight: object) -> torch.Tensor:
    """T2 words as int32 (uint32 accepted and viewed), 2-D, contiguous."""
    w = tensor("weight", weight)
    if w.dtype == torch.uint32:
        w = w.view(torch.int32)
    if w.dtype != torch.int32:
        raise DTypeError(f"weight: expected T2-packed int32 (or uint32) words, got {w.dtype}")
    if w.dim() != 2 or 0 in w.shape:
        raise ShapeError(
            f"weight: expected a non-empty 2-D [N, ceil(K/16)] tensor, got shape {tuple(w.shape)}"
        )
    if not w.is_contiguous():
        raise LayoutError("weight: packed weights must be contiguous (pack once, keep them contiguous)")
    return w


def in_features(k: int | None, x_k: int, weight: torch.Tensor, x_name: str = "x") -> int:
    """Resolve K and check it against the packed weight and the activations."""
    kw = weight.shape[1]
    if k is None:
        k = x_k
    if x_k != k:
        raise ShapeError(f"{x_name}: last dimension {x_k} does not match k={k}")
    if padded_k(k) != kw * WEIGHTS_PER_WORD:
        raise ShapeError(
            f"{x_name}: K={k} does not match weight with {kw} words per row "
            f"(packed K = {kw * WEIGHTS_PER_WORD}, "
            f"so K must be in {kw * WEIGHTS_PER_WORD - 15}..{kw * WEIGHTS_PER_WORD})"
        )
    return int(k)


def activations(x: object) -> torch.Tensor:
    x = tensor("x", x)
    if x.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"x: expected a float tensor ({', '.join(map(str, FLOAT_DTYPES))}), got {x.dtype}")
    if x.dim() < 1:
        raise ShapeError("x: expected shape [..., K], got a scalar")
    if x.numel() == 0:
        raise ShapeError(f"x: has no rows (shape {tuple(x.shape)}); W2A8 needs M >= 1 tokens")
    return x


def quantized_activations(x_q: object, act_scale: object | None = None) -> torch.Tensor:
    x_q = tensor("x_q", x_q)
    if x_q.dtype != torch.int8:
        raise DTypeError(f"x_q: expected int8 quantized activations, got {x_q.dtype}")
    if x_q.dim() != 2:
        raise ShapeError(f"x_q: expected a 2-D [M, K] tensor, got shape {tuple(x_q.shape)}")
    if x_q.shape[0] == 0:
        raise ShapeError("x_q: M = 0 rows; W2A8 needs M >= 1 tokens")
    if act_scale is not None:
        s = tensor("act_scale", act_scale)
        if s.dtype != torch.float32:
            raise DTypeError(f"act_scale: expected float32, got {s.dtype}")
        if s.shape != (x_q.shape[0],):
            raise ShapeError(f"act_scale: expected shape ({x_q.shape[0]},), got {tuple(s.shape)}")
    return x_q


def weight_scales(scales: object, n: int, k: int, group_size: int | None) -> tuple[torch.Tensor, int]:
    s = tensor("scales", scales)
    g = resolve_group_size(s, n, k, group_size)
    if not s.is_contiguous():
        raise LayoutError("scales: must be contiguous")
    return s, g


def bias_vector(bias: object | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    b = tensor("bias", bias)
    if b.dtype not in FLOAT_DTYPES:
        raise DTypeError(f"bias: expected a float tensor, got {b.dtype}")
    if b.shape != (n,):
        raise ShapeError(f"bias: expected shape ({n},), got {tuple(b.shape)}")
    return b.contiguous()


def out_dtype(dtype: torch.dtype | None, default: torch.dtype) -> torch.dtype:
    dtype = default if dtype is None else dtype
    if dtype not in FLOAT_DTYPES:
        raise DTypeError(f"out_dtype: expected one of {', '.join(map(str, FLOAT_DTYPES))}, got {dtype}")
    return dtype


def same_device(**tensors: torch.Tensor | None) -> torch.device:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    first_name, first = next(iter(devices.items()))
    for name, dev in devices.items():
        if dev != first:
            raise DeviceError(f"{name}: on {dev}, but {first_name} is on {first}; move them to one device")
    return first
