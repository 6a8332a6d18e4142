"""Hoisted verifier preparation (M3) and on-device verify resolution.

Both functions only enqueue device work — no value travels to the host — so the engine can
prepare the verify step before the host reads h, and can start the next draft step after a
verify step before the host has seen the verify result. That is what keeps the decode loop at
one device→host read per iteration.
"""

from __future__ import annotations

import torch

from bitmtp.runtime.protocols import runs_verify_on_device


def _on_device(runner) -> bool:
    """Runners with the on-device verify capability (``runtime.protocols.DeviceVerifyRunner``, the Vulkan
    runtime's) do the decode loop's bookkeeping themselves."""
    return runs_verify_on_device(runner)


def prepare_verify(draft, verify, arange: torch.Tensor) -> None:
    """Write the verify step's static inputs from the draft step's outputs, on the device.

    ``draft``: the draft runner (p pending rows, block D); ``verify``: the width-D verify runner.
    The verify step runs AR-causally over d_1..d_D at the positions right after P:
    tokens = d_1..d_D, positions = (last pending position) + 1 + [0, D).
    """
    if _on_device(verify):
        verify.prepare_from_draft(draft)
        return
    d = verify.tokens.shape[0]
    p = draft.state.pending
    verify.tokens.copy_(draft.out_token[-d:])
    torch.add(arange[:d], draft.positions[p - 1] + 1, out=verify.positions)


def resolve_verify(verify, next_draft, arange: torch.Tensor) -> None:
    """After a verify step, set up the next draft step (p = 1) on the device, unseen by the host.

    ``a = 1 + the longest i with d_(i+1) == v_i`` (the acceptance rule of
    ``decoding.policies.speculative_accept``, as tensor ops); the next pending suffix is ``[v_a]``
    at position (position of d_1) + a. The host learns ``a`` with the next iteration's one read.
    """
    if _on_device(verify):
        verify.resolve_into(next_draft)
        return
    agree = (verify.tokens[1:] == verify.out_token[:-1]).long()
    a = 1 + torch.cumprod(agree, 0).sum()
    next_draft.tokens[:1].copy_(verify.out_token.gather(0, (a - 1).view(1)))
    w = next_draft.positions.shape[0]
    torch.add(arange[:w], verify.positions[0] + a, out=next_draft.positions)
