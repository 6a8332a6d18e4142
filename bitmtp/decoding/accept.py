"""The acceptance rule of a verified draft, written once (DESIGN.md, "One iteration").

A verify step runs AR-causally over ``d_1..d_D`` and yields ``v_1..v_D`` (``v_i``: the AR argmax
after ``d_1..d_i``). The greedy rule accepts ``a = 1 + the longest i with d_(j+1) == v_j for every
j ≤ i``: ``d_1`` is the AR prediction itself, and ``d_(i+1)`` is accepted only while every earlier
draft token was and the verifier agrees with it.

:func:`accept_length` is that rule as tensor ops. The decode loop uses it in two places, both
through this one function:

* on the device, in ``bitmtp.runtime.verify_prep.resolve_verify`` (a hybrid verify resolved without
  the host reading anything);
* on the host, in :func:`speculative_accept`, which turns the lists of the iteration's one read into
  a tensor once and back into an int once.

The WGSL mirror (``wgsl_fallback/step.wgsl``, ``resolve``) implements the same greedy rule and is
tested against this function.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitmtp.errors import BitMTPError


def accept_length(draft: torch.Tensor, verify: torch.Tensor) -> torch.Tensor:
    """``a`` for each row of ``draft`` / ``verify`` (``[..., D]`` integer tensors): a long tensor of
    shape ``[...]`` (0-dim for 1-D inputs), on their device, with no device→host transfer.

    ``agree[i]`` says ``d_(i+2) == v_(i+1)``; the cumulative product keeps only the leading run of
    agreements, so its sum is the number of accepted tokens after ``d_1``.
    """
    agree = (draft[..., 1:] == verify[..., :-1]).long()
    return 1 + torch.cumprod(agree, -1).sum(-1)


def speculative_accept(draft: Sequence[int], verify: Sequence[int]) -> int:
    """:func:`accept_length` on the host: ``draft`` and ``verify`` as token lists (what the decode
    loop's one read returns) → ``a`` as an int.

    The two lists become one small CPU tensor and ``a`` one int: no device is involved."""
    if len(draft) < 1:
        raise BitMTPError("draft: needs at least one token")
    if len(verify) != len(draft):
        raise BitMTPError(f"verify: {len(verify)} verifier tokens for {len(draft)} draft tokens")
    pair = torch.tensor([[int(t) for t in draft], [int(t) for t in verify]], dtype=torch.long)
    return int(accept_length(pair[0], pair[1]))
