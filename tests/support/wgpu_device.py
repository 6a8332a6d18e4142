"""The Vulkan device for ``wgpu``-marked tests and benchmarks: skipped without an adapter, unless
``BITMTP_REQUIRE_WGPU=1`` (CI sets it, so a missing lavapipe fails instead of skipping)."""

from __future__ import annotations

import os

import pytest


def device_runner_or_skip():
    """The process-wide ``bitmtp.wgsl_fallback.runner`` device of the Vulkan runtime (see the module docstring)."""
    from bitmtp.errors import BackendUnavailableError
    from bitmtp.wgsl_fallback.runner import default_runner

    try:
        return default_runner()
    except BackendUnavailableError as exc:
        if os.environ.get("BITMTP_REQUIRE_WGPU") == "1":
            raise
        pytest.skip(str(exc))
