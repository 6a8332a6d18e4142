"""Replay states: (width M, segment σ, role r[, block D]) — the key of a captured or eager step.

A draft step of block size D over p pending rows has width ``p + D − 1`` (``block`` = D, so the
runner knows which rows are pending and which are mask rows); so has a ``fused`` step, the one-pass
schedule's verify-and-draft (its p AR rows are the pending token and the guesses, and every row's argmax
is an output). A ``tree`` step (the one-pass schedule's tree variant) has k + 1 AR rows and a block of
D − 1 mask rows after *each* of them: width (k + 1)·D, so p = width / D. Every other role has
``block`` = 0.

``alt`` = 1 marks a ``fused`` step of the ``top2`` schedule: after its p AR rows (t, g_1..g_k) one more
row carries the runner-up of g_1 (the previous step's first mask row's second choice) at g_1's position,
written to a scratch slot (``onepass.runner_up_slot``, possibly past the width: the segment covers it);
then the D − 1 mask rows. Its width is p + 1 + D − 1.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "ar", "draft", "verify", "fused", "tree")
#: roles whose steps run a drafter body (p pending rows, then drafting rows)
DRAFT_ROLES = ("draft", "fused", "tree")


@dataclass(frozen=True)
class ReplayState:
    width: int
    segment: int
    role: str
    block: int = 0
    alt: int = 0

    @property
    def pending(self) -> int:
        """p: the pending rows of a draft step (width − (D − 1); a tree step: width / D)."""
        if self.role == "tree":
            return self.width // self.block
        return self.width - (self.block - 1) - self.alt if self.role in DRAFT_ROLES else self.width

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {self.role!r}")
        if self.width < 1 or self.segment < 1:
            raise ValueError(f"width/segment must be positive, got {self.width}/{self.segment}")
        if self.role in DRAFT_ROLES and not (2 <= self.block <= 16 and self.width >= self.block):
            raise ValueError(f"draft state: block must be in 2..16 and width >= block, got {self.width}/{self.block}")
        if self.alt and not (self.alt == 1 and self.role == "fused" and self.width >= self.block + 2):
            raise ValueError(f"alt: one runner-up row, in a fused step with a guess (width >= block + 2); got "
                             f"alt={self.alt} in a {self.role} step of width {self.width}, block {self.block}")
        if self.role == "tree" and self.width % self.block:
            raise ValueError(f"tree state: width must be a multiple of the block, got {self.width}/{self.block}")
