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

A block may be shorter than D − 1 rows (``widths``): a block of w rows is exactly what a step of block
size w + 1 drafts at inference (the one-pass schedule appends D' − 1 mask rows for the D' it plans, and
``auto`` plans D' = 2 most often), so short blocks train the first drafted positions under the
attention pattern they are used with, at one row per anchor instead of D − 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bitmtp.errors import BitMTPError


@dataclass
class PackedLayout:
    """Positions ``[L]``, attention mask ``[L, L]`` (True = may attend), and for the block rows their
    target index into the sequence ``[R]`` and block position k ``[R]`` (1..D−1); ``R = Σ widths``
    (``A·(D−1)`` when every block is full)."""

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
    """``count`` distinct anchors in [0, T − D − 1] (every block target exists), sorted. For blocks of
    w < D − 1 rows pass ``block_size = w + 1``."""
    hi = seq_len - block_size  # exclusive: t + D ≤ T − 1
    if hi < 1:
        raise BitMTPError(f"seq_len: sequences of {seq_len} tokens are too short for block size {block_size}")
    count = min(count, hi)
    return sorted(torch.randperm(hi, generator=generator)[:count].tolist())


def _check_widths(anchors: list[int], widths: Sequence[int] | None, d: int) -> list[int]:
    if widths is None:
        return [d - 1] * len(anchors)
    widths = [int(w) for w in widths]
    if len(widths) != len(anchors):
        raise BitMTPError(f"widths: one block width per anchor, got {len(widths)} widths for {len(anchors)} "
                          f"anchors")
    bad = [w for w in widths if not 1 <= w <= d - 1]
    if bad:
        raise BitMTPError(f"widths: a block has 1..{d - 1} mask rows at D={d}, got {bad[:3]}")
    return widths


def packed_layout(seq_len: int, anchors: Sequence[int], block_size: int,
                  device: torch.device | str = "cpu", widths: Sequence[int] | None = None) -> PackedLayout:
    """Build the layout with tensor ops (see the module docstring for the rules). ``widths``: mask rows
    of each anchor's block (default D − 1 each); anchor t with width w needs t ≤ T − w − 2."""
    t_len, d = int(seq_len), int(block_size)
    if not 2 <= d <= 16:
        raise BitMTPError(f"block_size: D must be in 2..16, got {d}")
    anchors = [int(a) for a in anchors]
    widths = _check_widths(anchors, widths, d)
    bad = [a for a, w in zip(anchors, widths, strict=True) if not 0 <= a <= t_len - w - 2]
    if bad:
        raise BitMTPError(f"anchors: {bad[:3]} outside [0, T - w - 2] for T={t_len}, D={d} (w: the block's rows)")
    a_n = len(anchors)
    anc = torch.tensor(anchors, dtype=torch.long, device=device)
    wid = torch.tensor(widths, dtype=torch.long, device=device)
    owner = torch.arange(a_n, device=device).repeat_interleave(wid)  # block of each block row
    starts = torch.cumsum(wid, 0) - wid  # first row of each block (relative to T)
    n_rows = int(wid.sum()) if a_n else 0
    j = torch.arange(n_rows, device=device) - starts[owner]  # row index inside its block
    block_pos = anc[owner] + 1 + j  # [R]
    positions = torch.cat([torch.arange(t_len, device=device), block_pos])
    length = t_len + n_rows
    mask = torch.zeros(length, length, dtype=torch.bool, device=device)
    seq = torch.arange(t_len, device=device)
    mask[:t_len, :t_len] = seq[None, :] <= seq[:, None]  # causal prefix
    if a_n:
        rows = t_len + torch.arange(n_rows, device=device)
        # block rows see the sequence up to their anchor ...
        mask[t_len:, :t_len] = seq[None, :] <= anc[owner][:, None]
        # ... and their own block, bidirectionally
        mask[rows[:, None], rows[None, :]] = owner[:, None] == owner[None, :]
    return PackedLayout(t_len, d, anchors, positions, mask, block_pos + 1, j + 1)


def packed_layout_reference(seq_len: int, anchors: Sequence[int], block_size: int,
                            widths: Sequence[int] | None = None) -> torch.Tensor:
    """The attention mask by brute force, one (row, column) at a time (tests compare against it)."""
    widths = [block_size - 1] * len(anchors) if widths is None else list(widths)
    rows = [("seq", i, None) for i in range(seq_len)]
    for a, (t, w) in enumerate(zip(anchors, widths, strict=True)):
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
