"""Random MTP adapters for the tiny test models."""

from __future__ import annotations

from bitmtp.formats.adapters import AdapterConfig, BaseShape
from bitmtp.model.adapters import init_adapter_tensors

INIT_RANGE = 0.3  # peakier than the default 0.02: draft probabilities straddle TAU, so both hybrid branches run
TAU = 0.3


def random_adapter(args, kind: str, block_size: int = 16, rank: int = 4, seed: int = 1, targets=None):
    """``(AdapterConfig, tensors)`` of a ``kind`` adapter for a model of ``args`` with random, non-zero LoRA B
    (a zero B would make every adapter a no-op and hide wiring bugs)."""
    extra = {"targets": targets} if targets else {}
    cfg = AdapterConfig(kind=kind, block_size=block_size, rank=rank, base=BaseShape.of(args), **extra)
    return cfg, init_adapter_tensors(cfg, seed=seed, zero_init_b=False, b_std=0.2)
