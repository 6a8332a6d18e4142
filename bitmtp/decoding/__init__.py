"""Decoding layer: policies (pure functions) that decide what an MTP iteration commits."""

from bitmtp.decoding.policies import (
    POLICIES,
    Commit,
    confidence_commit,
    confident_prefix,
    hybrid_uses_verifier,
    speculative_accept,
    speculative_commit,
)

__all__ = [
    "POLICIES",
    "Commit",
    "confident_prefix",
    "confidence_commit",
    "speculative_accept",
    "speculative_commit",
    "hybrid_uses_verifier",
]
