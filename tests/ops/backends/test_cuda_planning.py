"""The host-side parts of the ``cuda`` backend, which need no GPU: the launch planner (which kernel,
how many rows per warp, the decode kernel's lane layout) and where the .cu sources are found.
Moved out of tests/ops/backends/test_cuda_kernels.py, whose module-wide ``cuda`` marker skipped them on every
machine without a GPU."""

from __future__ import annotations

import pytest

from bitmtp.errors import BackendUnavailableError
from bitmtp.ops.backends import cuda_backend


def test_planner_picks_decode_and_tiled():
    """Widths 1..16 use the width-specialized decode kernel (128-bit loads on aligned rows), 17+ the
    tiled one; a group size no lane segment covers exactly falls back to the tiled kernel."""
    for m in range(1, 17):
        p = cuda_backend.plan_w2a8(m, 6912, 2560, 2560, shared_scales=True, flags=0, rows_aligned16=True, sm_count=132)
        r = 4 if m <= 4 else 2
        assert p.name == f"w2a8_decode_kernel<{m},{r},4>" and p.grid == (-(-6912 // (4 * r)), 1, 1)
    # 2560 rows in 16-row blocks would leave most of 132 SMs with one block and some with two
    assert cuda_backend.rows_per_warp(1, 2560, 132) == 2 and cuda_backend.rows_per_warp(1, 2560, 40) == 4
    assert cuda_backend.plan_w2a8(17, 64, 256, 256, shared_scales=True, flags=0, rows_aligned16=True).name == (
        "w2a8_tiled_kernel"
    )
    assert cuda_backend.plan_w2a8(4, 64, 400, 48, shared_scales=False, flags=0, rows_aligned16=True).name == (
        "w2a8_tiled_kernel"
    )
    # group 128 on 16-byte rows: 2 lanes × 4 words per group, one shuffle level per step
    assert cuda_backend.decode_layout(160, 20, 128, True) == (4, 40, 2, 2, 1)
    assert cuda_backend.decode_layout(161, 21, 128, True)[0] == 1  # KW % 4 != 0: 32-bit loads


def test_sources_found_and_missing_reported(monkeypatch, tmp_path):
    """Sources come from the package or the checkout; a bad $BITMTP_CUDA_SRC is passed over, and
    when nothing holds them the error lists every path tried."""
    monkeypatch.setenv(cuda_backend.SRC_ENV, str(tmp_path / "nowhere"))
    found = cuda_backend.find_sources()
    assert (found / "w2a8_decode.cu").is_file()
    assert '#include "w2a8_common.cuh"' not in cuda_backend.load_source("w2a8_decode.cu")
    monkeypatch.setattr(cuda_backend, "source_dirs", lambda: [tmp_path / "a", tmp_path / "b"])
    with pytest.raises(BackendUnavailableError, match="tried .*a, .*b"):
        cuda_backend.find_sources()
