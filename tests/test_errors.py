"""Bad input to the ops raises a BitMTPError that names the argument at fault."""

from __future__ import annotations

import pytest
import torch

from bitmtp.errors import BackendUnavailableError, BitMTPError, DeviceError, DTypeError, LayoutError, ShapeError
from bitmtp.formats import pack_t2
from bitmtp.ops import act_quant, dense_linear, w2a8_accumulate, w2a8_linear
from tests.support.random_inputs import random_ternary


@pytest.fixture
def layer(rng):
    n, k = 24, 40
    return pack_t2(random_ternary(n, k, rng)), torch.ones(1, 1), torch.randn(3, k, generator=rng)


def _raises(exc, needle, fn, *a, **kw):
    with pytest.raises(exc) as info:
        fn(*a, **kw)
    assert isinstance(info.value, BitMTPError)
    assert needle in str(info.value), str(info.value)


def test_wrong_dtypes(layer):
    w, s, x = layer
    _raises(DTypeError, "x:", w2a8_linear, x.to(torch.int32), w, s)
    _raises(DTypeError, "weight:", w2a8_linear, x, w.to(torch.int64), s)
    _raises(DTypeError, "weight:", w2a8_linear, x, w.float(), s)
    _raises(DTypeError, "scales:", w2a8_linear, x, w, s.double())
    _raises(DTypeError, "bias:", w2a8_linear, x, w, s, bias=torch.zeros(24, dtype=torch.int32))
    _raises(DTypeError, "out_dtype:", w2a8_linear, x, w, s, out_dtype=torch.int8)
    _raises(DTypeError, "x_q:", w2a8_accumulate, x, w)
    _raises(DTypeError, "x:", w2a8_linear, [[1.0]], w, s)


def test_wrong_shapes(layer):
    w, s, x = layer
    _raises(ShapeError, "x:", w2a8_linear, torch.randn(3, 64), w, s)  # K mismatch
    _raises(ShapeError, "x:", w2a8_linear, torch.randn(0, 40), w, s)  # M = 0
    _raises(ShapeError, "k=", w2a8_linear, x, w, s, k=41)
    _raises(ShapeError, "scales:", w2a8_linear, x, w, torch.ones(5, 1))
    _raises(ShapeError, "scales:", w2a8_linear, x, w, torch.ones(1, 3))  # 3 groups do not divide 40
    _raises(ShapeError, "group_size:", w2a8_linear, x, w, torch.ones(1, 3), group_size=20)
    _raises(ShapeError, "scales:", w2a8_linear, x, w, torch.ones(1, 2), group_size=16)  # needs 3 columns
    _raises(ShapeError, "bias:", w2a8_linear, x, w, s, bias=torch.zeros(23))
    _raises(ShapeError, "weight:", w2a8_linear, x, w[0], s)
    _raises(ShapeError, "x_q:", w2a8_accumulate, torch.zeros(0, 40, dtype=torch.int8), w)
    _raises(ShapeError, "out:", w2a8_accumulate, torch.ones(3, 40, dtype=torch.int8), w, out=torch.zeros(3, 24))
    _raises(ShapeError, "x:", act_quant, torch.zeros(2, 0))
    _raises(ShapeError, "x:", dense_linear, x, torch.randn(5, 41))


def test_layout_and_device(layer):
    w, s, x = layer
    wide = torch.zeros(24, 6, dtype=torch.int32)[:, ::2]
    _raises(LayoutError, "weight:", w2a8_linear, x, wide, s)
    _raises(DeviceError, "weight:", w2a8_linear, x, w.to("meta"), s)
    _raises(DeviceError, "scales:", w2a8_linear, x, w, s.to("meta"))


def test_backend_requests(layer, monkeypatch):
    w, s, x = layer
    _raises(BitMTPError, "unknown backend", w2a8_linear, x, w, s, backend="fpga")
    monkeypatch.setenv("BITMTP_BACKEND", "fpga")
    _raises(BitMTPError, "BITMTP_BACKEND", w2a8_linear, x, w, s)
    monkeypatch.setenv("BITMTP_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _raises(BackendUnavailableError, "TRITON_INTERPRET", w2a8_linear, x, w, s)
