"""Hoisted verifier preparation (M3) and on-device verify resolution.

Both functions only enqueue device work — no value travels to the host — so the engine can
prepare the verify step before the host reads h, and can start the next draft step after a
verify step before the host has seen the verify result. That is what keeps the decode loop at
one device→host read per iteration.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bitmtp.decoding.accept import accept_length
from bitmtp.errors import BitMTPError
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


def resolve_verify(verify, next_draft, arange: torch.Tensor,
                   accept: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> None:
    """After a verify step, set up the next draft step (p = 1) on the device, unseen by the host.

    ``a`` is the acceptance rule ``decoding.accept.accept_length`` (or ``accept``, a policy's own rule,
    ``Policy.device_accept``) over the verify step's inputs d_1..d_D and outputs v_1..v_D; the next
    pending suffix is ``[v_a]`` at position (position of d_1) + a. The host learns ``a`` with the next
    iteration's one read.
    """
    if _on_device(verify):
        if accept is not None:
            raise BitMTPError("policy: this policy's own acceptance rule cannot run in the Vulkan runtime, whose "
                              "resolve step (step.wgsl) implements the greedy rule only; load the model "
                              "without runtime='vulkan' to decode with it")
        verify.resolve_into(next_draft)
        return
    a = (accept or accept_length)(verify.tokens, verify.out_token)
    next_draft.tokens[:1].copy_(verify.out_token.gather(0, (a - 1).view(1)))
    w = next_draft.positions.shape[0]
    torch.add(arange[:w], verify.positions[0] + a, out=next_draft.positions)
