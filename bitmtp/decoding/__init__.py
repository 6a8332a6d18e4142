"""Decoding layer: policies (objects in a registry, ``bitmtp.decoding.policies``) that decide what an
MTP iteration runs and commits, the acceptance rule (``bitmtp.decoding.accept``), and the drafters
(``bitmtp.decoding.drafters``) that produce the drafts."""

from bitmtp.decoding.accept import accept_length, speculative_accept
from bitmtp.decoding.auto import AutoPolicy
from bitmtp.decoding.lookup import LookupIndex
from bitmtp.decoding.policies import (
    ARPolicy,
    Commit,
    ConfidenceParams,
    ConfidencePolicy,
    History,
    HybridParams,
    HybridPolicy,
    NoParams,
    Plan,
    Policy,
    SpeculativeParams,
    SpeculativePolicy,
    Verify,
    confidence_commit,
    confident_prefix,
    get_policy,
    hybrid_uses_verifier,
    policy_names,
    register_policy,
    resolve_policy,
    speculative_commit,
    unregister_policy,
)

__all__ = [
    "Policy",
    "Plan",
    "Verify",
    "History",
    "Commit",
    "NoParams",
    "ConfidenceParams",
    "HybridParams",
    "ARPolicy",
    "ConfidencePolicy",
    "SpeculativePolicy",
    "HybridPolicy",
    "AutoPolicy",
    "SpeculativeParams",
    "LookupIndex",
    "register_policy",
    "unregister_policy",
    "get_policy",
    "policy_names",
    "resolve_policy",
    "accept_length",
    "speculative_accept",
    "confident_prefix",
    "confidence_commit",
    "speculative_commit",
    "hybrid_uses_verifier",
]
