"""Weight-scale layouts and their validation.

Scales are ``float32[N_s, n_groups]``; a real weight is ``(c − 1) · scale``:

* per-tensor (BitNet absmean): ``[1, 1]``, one group spanning all of K;
* per-row: ``[N, 1]``;
* per-group (Ternary-Bonsai, G = 128): ``[N, ceil(K/G)]`` or ``[1, ceil(K/G)]``. Group g covers
  k ∈ [gG, min((g+1)G, K)); the last group may be partial. G must be a multiple of 16 so a T2
  word never straddles two groups.
"""

from __future__ import annotations

import numpy as np
import torch

from bitmtp.errors import DTypeError, FormatError, ShapeError
from bitmtp.formats.ternary import WEIGHTS_PER_WORD

GRANULARITIES = ("tensor", "row", "group")


def resolve_group_size(scales: torch.Tensor, n: int, k: int, group_size: int | None = None) -> int:
    """Check ``scales`` against a weight of shape ``[n, k]`` and return the group size G.

    With one scale column, G = K. With several, G is ``group_size`` when given, else K divided by
    the number of columns (which must then divide evenly).
    """
    if not isinstance(scales, torch.Tensor):
        raise DTypeError(f"scales: expected a torch.Tensor, got {type(scales).__name__}")
    if scales.dtype != torch.float32:
        raise DTypeError(f"scales: expected float32, got {scales.dtype}")
    if scales.dim() != 2:
        raise ShapeError(f"scales: expected a 2-D [N_s, n_groups] tensor, got shape {tuple(scales.shape)}")
    n_s, n_groups = scales.shape
    if n_s not in (1, n):
        raise ShapeError(f"scales: first dimension must be 1 (shared) or N={n}, got shape {tuple(scales.shape)}")
    if n_groups < 1:
        raise ShapeError(f"scales: needs at least one column, got shape {tuple(scales.shape)}")
    if n_groups == 1:
        if group_size is not None and group_size < k:
            raise ShapeError(
                f"group_size: {group_size} implies {-(-k // group_size)} scale columns for K={k}, "
                f"but scales has shape {tuple(scales.shape)}"
            )
        return int(k)
    if group_size is None:
        if k % n_groups:
            raise ShapeError(
                f"scales: {n_groups} groups do not divide K={k}; pass group_size= explicitly"
            )
        group_size = k // n_groups
    group_size = int(group_size)
    if group_size <= 0 or group_size % WEIGHTS_PER_WORD:
        raise ShapeError(f"group_size: must be a positive multiple of {WEIGHTS_PER_WORD}, got {group_size}")
    if -(-k // group_size) != n_groups:
        raise ShapeError(
            f"scales: group_size={group_size} and K={k} need {-(-k // group_size)} columns, "
            f"got shape {tuple(scales.shape)}"
        )
    return group_size


def expand_scales(scales: torch.Tensor, n: int, k: int, group_size: int) -> torch.Tensor:
    """Per-element scales ``float32[n, k]`` (for dequantization and references)."""
    n_groups = scales.shape[1]
    col = torch.arange(k, device=scales.device) // group_size if n_groups > 1 else torch.zeros(
        k, dtype=torch.long, device=scales.device
    )
    return scales.expand(n, n_groups)[:, col]


def check_finite(t: torch.Tensor, what: str) -> None:
    """FormatError naming ``what`` (the file and tensor) when a floating tensor holds Inf or NaN.

    One pass over the tensor as stored (no float32 copy of float16/bfloat16 data). float16/32/64 CPU
    tensors go through numpy, single-threaded: on a small machine shared with other work torch's threaded
    ``isfinite`` was many times slower (its worker threads spin). Integer tensors (packed codes) pass.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return
    t = t.detach()
    if t.device.type == "cpu" and t.dtype in (torch.float16, torch.float32, torch.float64):
        flat = t.reshape(-1).numpy()
        if np.isfinite(flat).all():
            return
        at = int(np.flatnonzero(~np.isfinite(flat))[0])
    else:
        flat = t.reshape(-1)
        finite = torch.isfinite(flat)
        if bool(finite.all()):
            return
        at = int((~finite).nonzero()[0, 0])
    raise FormatError(f"{what} holds a non-finite value ({float(flat[at])} at flat index {at} of shape "
                      f"{tuple(t.shape)}); the weights are corrupt or diverged — re-download, re-export or "
                      "retrain them")


__all__ = ["GRANULARITIES", "resolve_group_size", "expand_scales", "check_finite"]
