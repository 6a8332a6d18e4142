"""Ops on a backend *variant*: a backend name, or ``cpu:<isa>`` for the native CPU backend forced onto one ISA
path (each path is its own compiled loop, so tests run each)."""

from __future__ import annotations

import torch

from bitmtp.ops import attention


def attention_on(variant: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """``bitmtp.ops.attention`` on ``variant``."""
    if variant.startswith("cpu:"):
        from bitmtp.ops.backends import cpu_backend

        with cpu_backend.forced_isa(variant.split(":")[1]):
            return attention(q, k, v, mask, scale, backend="cpu")
    return attention(q, k, v, mask, scale, backend=variant)
