"""The ``wg`` fixture of the WGSL shader tests: the process-wide Vulkan runner and its ``Ops``."""

from __future__ import annotations

import pytest

from tests.support.wgpu_device import device_runner_or_skip


@pytest.fixture(scope="module")
def wg():
    """``(runner, ops)``: skipped without a Vulkan adapter unless BITMTP_REQUIRE_WGPU=1."""
    from bitmtp.wgsl_fallback.ops import Ops

    runner = device_runner_or_skip()
    return runner, Ops(runner)
