"""Token windows for the training tests."""

from __future__ import annotations

import torch


def periodic_windows(n: int = 40, length: int = 48, seed: int = 0, period: int = 7) -> list[list[int]]:
    """``n`` windows of ``length`` tokens from a periodic corpus: every token determines the ones after it
    (so the tokens 2..D ahead are learnable from the context)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(3, 90, (period,), generator=g).tolist()
    seq = base * (2 + (n + length) // period)
    return [seq[i : i + length] for i in range(n)]
