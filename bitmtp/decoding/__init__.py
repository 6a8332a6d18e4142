"""Decoding layer: policies (pure functions) that decide what an MTP iteration commits, and the
drafters (``bitmtp.decoding.drafters``) that produce the drafts."""

from bitmtp.decoding.policies import (
    POLICIES,
    Commit,
    ar_commit,
    confidence_commit,
    confident_prefix,
    hybrid_commit,
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
    "hybrid_commit",
    "ar_commit",
]
