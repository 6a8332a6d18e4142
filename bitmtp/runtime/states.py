"""Replay states: (width M, segment σ, role r) — the key of a captured or eager step."""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("prefill", "ar", "draft", "verify")


@dataclass(frozen=True)
class ReplayState:
    width: int
    segment: int
    role: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: expected one of {ROLES}, got {self.role!r}")
        if self.width < 1 or self.segment < 1:
            raise ValueError(f"width/segment must be positive, got {self.width}/{self.segment}")
