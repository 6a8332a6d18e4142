"""The packed training layout of the joint NTP + MTP objective (DESIGN.md, "Training").

A training sequence ``x_0 .. x_(T−1)`` is followed by one block of D − 1 mask rows per sampled
anchor t (0 ≤ t ≤ T − D − 1), exactly as a draft step sees them at inference:

* sequence rows ``i < T``: position i, AR-causal among the sequence rows (the base model's path);
  row i predicts ``x_(i+1)`` (NTP);
* block a with anchor t: rows ``T + a(D−1) + j`` (j = 0..D−2), position ``t + 1 + j``; they see the
  sequence rows ≤ t (history and the anchor, the last pending row) and every row of their own
  block (bidirectional inside it); blocks never see each other and sequence rows never see blocks.
  The anchor row predicts d_1 = ``x_(t+1)``; block row j predicts ``d_(j+2) = x_(t+j+2)``, at block
  position k = j + 1 with loss weight γ^k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bitmtp.errors import BitMTPError


@dataclass
class PackedLayout:
    """Positions ``[L]``, attention mask ``[L, L]`` (True = may attend), and for the block rows their
    target index into the sequence ``[A·(D−1)]`` and block position k ``[A·(D−1)]`` (1..D−1)."""

    seq_len: int
    block_size: int
    anchors: list[int]
    positions: torch.Tensor
    mask: torch.Tensor
    block_targets: torch.Tensor
    block_k: torch.Tensor

    @property
    def length(self) -> int:
        return self.positions.numel()


def sample_anchors(seq_len: int, block_size: int, count: int, generator: torch.Generator) -> list[int]:
    """``count`` distinct anchors in [0, T − D − 1] (every block target exists), sorted."""
    hi = seq_len - block_size  # exclusive: t + D ≤ T − 1
    if hi < 1:
        raise BitMTPError(f"seq_len: sequences of {seq_len} tokens are too short for block size {block_size}")
    count = min(count, hi)
    return sorted(torch.randperm(hi, generator=generator)[:count].tolist())


def packed_layout(seq_len: int, anchors: Sequence[int], block_size: int,
                  device: torch.device | str = "cpu") -> PackedLayout:
    """Build the layout with tensor ops (see the module docstring for the rules)."""
    t_len, d = int(seq_len), int(block_size)
    if not 2 <= d <= 16:
        raise BitMTPError(f"block_size: D must be in 2..16, got {d}")
    anchors = [int(a) for a in anchors]
    bad = [a for a in anchors if not 0 <= a <= t_len - d - 1]
    if bad:
        raise BitMTPError(f"anchors: {bad[:3]} outside [0, {t_len - d - 1}] for T={t_len}, D={d}")
    a_n, w = len(anchors), d - 1
    anc = torch.tensor(anchors, dtype=torch.long, device=device)
    j = torch.arange(w, device=device)
    block_pos = (anc[:, None] + 1 + j[None, :]).reshape(-1)  # [A·w]
    positions = torch.cat([torch.arange(t_len, device=device), block_pos])
    length = t_len + a_n * w
    mask = torch.zeros(length, length, dtype=torch.bool, device=device)
    seq = torch.arange(t_len, device=device)
    mask[:t_len, :t_len] = seq[None, :] <= seq[:, None]  # causal prefix
    if a_n:
        owner = torch.arange(a_n, device=device).repeat_interleave(w)  # block of each block row
        rows = t_len + torch.arange(a_n * w, device=device)
        # block rows see the sequence up to their anchor ...
        mask[t_len:, :t_len] = seq[None, :] <= anc[owner][:, None]
        # ... and their own block, bidirectionally
        mask[rows[:, None], rows[None, :]] = owner[:, None] == owner[None, :]
    return PackedLayout(t_len, d, anchors, positions, mask, block_pos + 1,
                        (j[None, :] + 1).expand(a_n, w).reshape(-1).clone())


def packed_layout_reference(seq_len: int, anchors: Sequence[int], block_size: int) -> torch.Tensor:
    """The attention mask by brute force, one (row, column) at a time (tests compare against it)."""
    w = block_size - 1
    rows = [("seq", i, None) for i in range(seq_len)]
    for a, t in enumerate(anchors):
        rows += [("block", t + 1 + j, a) for j in range(w)]
    length = len(rows)
    mask = torch.zeros(length, length, dtype=torch.bool)
    for r, (kind_r, pos_r, blk_r) in enumerate(rows):
        for c, (kind_c, pos_c, blk_c) in enumerate(rows):
            if kind_r == "seq":
                ok = kind_c == "seq" and pos_c <= pos_r
            elif kind_c == "seq":
                ok = pos_c <= anchors[blk_r]
            else:
                ok = blk_c == blk_r
            mask[r, c] = ok
    return mask
