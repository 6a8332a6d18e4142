"""The acceptance rule of a verified draft, written once (DESIGN.md, "One iteration").

A verify step runs AR-causally over ``d_1..d_D`` and yields ``v_1..v_D`` (``v_i``: the AR argmax
after ``d_1..d_i``). The greedy rule accepts ``a = 1 + the longest i with d_(j+1) == v_j for every
j ≤ i``: ``d_1`` is the AR prediction itself, and ``d_(i+1)`` is accepted only while every earlier
draft token was and the verifier agrees with it.

:func:`accept_length` is that rule as tensor ops, used on the device in
``bitmtp.runtime.verify_prep.resolve_verify`` (a hybrid verify resolved without the host reading anything).
Its two mirrors are tested against it: :func:`speculative_accept`, the same rule on the token lists of an
iteration's one read (every decode loop's host commit), and the WGSL one (``wgsl_fallback/step.wgsl``,
``resolve``).
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

    The same rule on Python ints (tested against :func:`accept_length`, as the WGSL mirror is): every decode
    step runs it, and a tensor round trip there cost ~20 µs of host time a step."""
    if len(draft) < 1:
        raise BitMTPError("draft: needs at least one token")
    if len(verify) != len(draft):
        raise BitMTPError(f"verify: {len(verify)} verifier tokens for {len(draft)} draft tokens")
    a = 1
    while a < len(draft) and int(draft[a]) == int(verify[a - 1]):
        a += 1
    return a
