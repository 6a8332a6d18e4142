"""Random kernel inputs over their full ranges (never all zero, so a kernel that ignores its input fails)."""

from __future__ import annotations

import torch

POISON_INT = -0x5EEDBAD  # written into outputs first, so an unwritten element shows


def random_ternary(n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """A ``[n, k]`` int8 matrix of values in {-1, 0, 1}."""
    return torch.randint(-1, 2, (n, k), generator=g, dtype=torch.int8)


def random_int8(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Activations over the full int8 range (-128 included), never all zero."""
    x = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int16)
    x[:, 0] = torch.where(x[:, 0] == 0, torch.full_like(x[:, 0], -128), x[:, 0])
    return x.to(torch.int8)
