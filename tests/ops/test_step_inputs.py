"""A CPU step's mask and RoPE rows (``bitmtp.ops.step_inputs``). Rule: the native call writes exactly what the numpy
reference (``fill_numpy``) writes — every element of buffers poisoned first, rows with and without a lower bound, on
awkward shapes and over buffers a previous fill wrote — and the numpy path runs where the extension is missing;
bad arrays and positions outside the tables get a BitMTPError naming them."""

from __future__ import annotations

import numpy as np
import pytest

from bitmtp.errors import BitMTPError
from bitmtp.ops import step_inputs
from bitmtp.ops.step_inputs import StepInputsFill, fill_numpy

HEAD_DIM = 20


def _buffers(m: int, seg: int, lower: bool):
    ints = np.full((3, m), -7, dtype=np.int64)
    mask = np.ones((m, seg), dtype=np.bool_)  # poisoned: every element is written
    rope = np.full((2, m, HEAD_DIM), np.nan, dtype=np.float32)
    return ints, mask, rope, StepInputsFill(ints[0], ints[1] if lower else None, ints[2], mask, rope[0], rope[1])


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("lower", [True, False])
@pytest.mark.parametrize("m,seg", [(1, 256), (3, 300), (8, 17), (15, 641), (16, 512)])
def test_fill_equals_the_numpy_reference(native, lower, m, seg, rng, monkeypatch):
    if native and step_inputs._ext() is None:
        pytest.skip("native CPU extension not built")
    if not native:
        monkeypatch.setattr(step_inputs, "_ext", lambda: None)
    g = np.random.default_rng(int(rng.initial_seed()))
    tables = tuple(g.standard_normal((700, HEAD_DIM), dtype=np.float32) for _ in range(2))
    ints, mask, rope, fill = _buffers(m, seg, lower)
    assert (fill.ext is None) == (not native)
    for _ in range(3):  # refilled: nothing of the previous fill may stay
        ints[0] = g.integers(0, 700, m)
        ints[1] = g.integers(0, seg, m)
        ints[2] = ints[1] + g.integers(-2, seg, m)  # an upper bound below the lower one: an empty row
        fill(tables)
        want_mask = np.zeros_like(mask)
        want_rope = np.zeros_like(rope)
        fill_numpy(ints[0], ints[1] if lower else None, ints[2], want_mask, tables, want_rope[0], want_rope[1])
        assert np.array_equal(mask, want_mask) and np.array_equal(rope, want_rope)
        j = np.arange(seg)[None, :]
        expect = (j <= ints[2][:, None]) & ((j >= ints[1][:, None]) if lower else True)
        assert np.array_equal(mask, expect) and np.array_equal(rope[0], tables[0][ints[0]])


@pytest.mark.parametrize("native", [True, False])
def test_bad_input_is_named(native, monkeypatch):
    if native and step_inputs._ext() is None:
        pytest.skip("native CPU extension not built")
    if not native:
        monkeypatch.setattr(step_inputs, "_ext", lambda: None)
    tables = (np.zeros((50, HEAD_DIM), dtype=np.float32), np.zeros((50, HEAD_DIM), dtype=np.float32))
    ints, mask, rope, fill = _buffers(2, 64, True)
    ints[:] = [[3, 50], [0, 0], [5, 5]]
    with pytest.raises(BitMTPError, match="outside the RoPE tables' 50 rows"):
        fill(tables)
    ints[0] = [3, -1]
    with pytest.raises(BitMTPError, match="outside the RoPE tables"):
        fill(tables)
    with pytest.raises(BitMTPError, match="tables: expected two C-contiguous float32"):
        fill((tables[0].astype(np.float64), tables[1]))
    with pytest.raises(BitMTPError, match="mask: expected a C-contiguous bool"):
        StepInputsFill(ints[0], None, ints[2], mask.astype(np.uint8), rope[0], rope[1])
    with pytest.raises(BitMTPError, match="hi: expected"):
        StepInputsFill(ints[0], None, ints[2][:1], mask, rope[0], rope[1])
