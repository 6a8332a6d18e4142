"""Where each committed token came from: the decode loop records one origin per token.

Every token a verifying policy commits is the model's own choice (AR-exact); its origin says which
draft *proposed* it before the model confirmed it, i.e. what made decoding take fewer forward passes:

=============  ==============================================================================
``ar``         the model's own next token: the prefill's, an AR step's, a verify row's argmax
               after the last accepted guess (every iteration commits at least one of these)
``lookup``     a prompt-lookup guess (the continuation of an n-gram already in the text)
``mask``       a mask-block MTP draft (the adapter's mask rows); the lossy ``confidence`` /
               ``hybrid`` policies also commit such drafts unverified
``heads``      an MTP-heads draft
``runner_up``  the runner-up of a mask draft, verified beside it (schedule ``top2``)
``oracle``     the test drafter that replays known text
=============  ==============================================================================

``bitmtp.generate`` returns them as ``GenerateOutput.origins`` (with ``steps``: the iteration that
committed each token; 0 is the prefill's), a stream as ``TextStream.spans``, and ``bitmtp serve`` as
``bitmtp.origins`` on request.
"""

from __future__ import annotations

AR = "ar"
LOOKUP = "lookup"
MASK = "mask"
HEADS = "heads"
RUNNER_UP = "runner_up"
ORACLE = "oracle"

#: every origin the decode loop records
ORIGINS = (AR, LOOKUP, MASK, HEADS, RUNNER_UP, ORACLE)

#: a one-pass plan's guess source (``PassPlan.source``) → the origin of its accepted guesses
_OF_SOURCE = {"lookup": LOOKUP, "masks": MASK, "heads": HEADS, "oracle": ORACLE}
#: a drafter's ``kind`` → the origin of the draft tokens it proposes
_OF_DRAFTER = {"mask-block": MASK, "heads": HEADS, "lookup": LOOKUP, "oracle": ORACLE}


def of_source(source: str) -> str:
    """The origin of the guesses of a one-pass plan whose ``source`` is given (mask rows for unknown
    sources: every other guess source is an MTP draft)."""
    return _OF_SOURCE.get(source, MASK)


def of_drafter(drafter: object) -> str:
    """The origin of the draft tokens ``drafter`` proposes (by its ``kind``)."""
    return _OF_DRAFTER.get(getattr(drafter, "kind", ""), MASK)


def of_commit(n_tokens: int, verified: bool, draft_origin: str) -> list[str]:
    """The origins of a two-pass iteration's commit of ``n_tokens``: ``d_1`` is the AR prediction (its
    draft row is AR-causal); then the drafts ``d_2..d_a``; a verified commit ends with the verifier's own
    token ``v_a``."""
    if n_tokens <= 0:
        return []
    if verified and n_tokens >= 2:
        return [AR, *[draft_origin] * (n_tokens - 2), AR]
    return [AR, *[draft_origin] * (n_tokens - 1)]


__all__ = ["AR", "HEADS", "LOOKUP", "MASK", "ORACLE", "ORIGINS", "RUNNER_UP", "of_commit", "of_drafter",
           "of_source"]
