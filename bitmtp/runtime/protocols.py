"""What the decode loop and the engine need of a runtime: a step pool and its step runners.

Two runtimes implement these protocols: the torch runtime (``runtime/graphs.py``: :class:`GraphPool`,
eager on the CPU, captured CUDA graphs on NVIDIA GPUs) and the Vulkan runtime
(``runtime/vulkan/device.py``: :class:`VulkanStepPool`, whole layers through WGSL shaders). The
engine (``runtime/engine.py``), the decode loop (``runtime/decode.py``) and the verify preparation
(``runtime/verify_prep.py``) talk to either through these names only — no attribute probing.

A step is one fixed-shape transition of the decode loop (a :class:`~bitmtp.runtime.states.ReplayState`):
the caller fills the runner's static host inputs (``tokens``, ``positions``), calls ``run()``, and
reads the outputs (``out_token``, ``out_prob``) through ``Engine.read``, which calls the pool's
``flush()`` first. A pool whose runners keep their outputs on another device brings them to the
host in that ``flush`` (one transfer for every pending runner); the torch pool's outputs are
already where ``Engine.read`` reads them, so its ``flush`` does nothing.

On-device verify bookkeeping is an explicit capability: a runner that satisfies
:class:`DeviceVerifyRunner` *and* says ``device_verify`` prepares the verify step from a draft
step's outputs and resolves the next draft step from a verify step's outputs on its own device
(``step.wgsl`` on Vulkan); every other runner gets the torch ops of ``verify_prep``.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from bitmtp.runtime.states import ReplayState

__all__ = ["StepRunner", "StepPool", "DeviceVerifyRunner", "runs_verify_on_device"]


@runtime_checkable
class StepRunner(Protocol):
    """One replay state's step: static host-visible inputs and outputs around ``run()``.

    ``tokens`` / ``positions``: the step's M token ids and absolute positions (long ``[M]``), filled in
    place by the caller. ``out_token`` / ``out_prob``: each row's argmax id and its softmax probability
    (``[M]``), valid after ``run()`` and the pool's ``flush()``.
    """

    state: ReplayState
    tokens: torch.Tensor
    positions: torch.Tensor
    out_token: torch.Tensor
    out_prob: torch.Tensor

    def feed(self, tokens: torch.Tensor | int, start: int) -> None:
        """Fill ``tokens`` (all M, or an int for every row) and positions ``start .. start + M - 1`` in place."""

    def run(self) -> None:
        """Run the step on its current inputs (enqueue it; outputs are valid after the pool's ``flush``)."""


@runtime_checkable
class DeviceVerifyRunner(StepRunner, Protocol):
    """A runner that can do the decode loop's verify bookkeeping on its own device (the capability
    ``verify_prep`` dispatches on). ``device_verify`` is False when its pool needs the host in every
    step anyway (the Vulkan runtime with CPU-offloaded layers): the torch ops then run instead."""

    device_verify: bool

    def prepare_from_draft(self, draft: Any) -> None:
        """Fill this verify runner's inputs from ``draft``'s outputs, on the device."""

    def resolve_into(self, next_draft: Any) -> None:
        """Fill ``next_draft``'s inputs from this verify runner's outputs (greedy acceptance), on the device."""


def runs_verify_on_device(runner: Any) -> bool:
    """Whether ``runner`` does the verify preparation / resolution itself (see :class:`DeviceVerifyRunner`).

    The capability flag is read first: a structural ``isinstance`` against the protocol costs ~15 µs, paid
    twice per decode iteration, and torch runners (no ``device_verify``) never need it."""
    if getattr(runner, "device_verify", False) is not True:
        return False
    return isinstance(runner, DeviceVerifyRunner)


@runtime_checkable
class StepPool(Protocol):
    """Maps a replay state to its runner (made on first use) and owns the draft body.

    ``drafter``: the drafter of draft states (None before one is set). ``capture``: its steps are
    captured CUDA graphs (the engine then serializes steps of sessions sharing the GPU).
    ``fused_steps``: it runs the one-pass schedule's ``fused`` steps (AR rows followed by a mask-block
    drafter's mask rows or a heads drafter's output slots, every row's argmax out) and ``tree`` steps
    (mask blocks after every AR row, written to the runner's ``slots``).
    """

    drafter: Any
    capture: bool
    fused_steps: bool

    def get(self, state: ReplayState) -> StepRunner:
        """The runner of ``state`` (BitMTPError for a draft state before a drafter is set)."""

    def set_drafter(self, drafter: Any) -> None:
        """Use ``drafter`` for draft states from now on (runners of another drafter are dropped);
        BitMTPError when this runtime cannot run that drafter."""

    def set_sampling(self, params: Any) -> Any:
        """Choose tokens by ``params`` (a ``bitmtp.decoding.sampling.SamplingParams``; None: argmax) from now
        on; returns the sampler whose ``start`` / ``commit`` the decode loop calls (None when greedy).
        BitMTPError when this runtime cannot sample so."""

    def check_sampling(self, params: Any) -> None:
        """BitMTPError when this runtime cannot sample by ``params`` (changes nothing: callers check before a
        generation owns the pool)."""

    def flush(self) -> None:
        """Make every run runner's outputs readable on the host (a no-op where they already are)."""
