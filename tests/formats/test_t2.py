"""T2 packing: exact bit layout of DESIGN.md, round trip, padding, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitmtp.errors import BitMTPError, DTypeError, FormatError, ShapeError
from bitmtp.formats import pack_t2, padded_k, unpack_codes, unpack_t2, words_per_row
from tests.support.random_inputs import random_ternary


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 9), k=st.integers(1, 70), seed=st.integers(0, 2**31 - 1))
def test_round_trip_any_shape(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = random_ternary(n, k, g)
    packed = pack_t2(w)
    assert packed.dtype == torch.int32 and packed.shape == (n, words_per_row(k))
    assert torch.equal(unpack_t2(packed, k), w)


@pytest.mark.parametrize("k", [1, 15, 16, 17, 48, 176, 400])
def test_bit_positions_follow_design(k, rng):
    """Weight k = 16j + 4s + b sits at bits 8b + 2s of word j (checked against a scalar loop)."""
    n = 3
    w = random_ternary(n, k, rng)
    packed = pack_t2(w)
    for row in range(n):
        for j in range(words_per_row(k)):
            word = int(packed[row, j]) & 0xFFFFFFFF
            for s in range(4):
                four = (word >> (2 * s)) & 0x03030303
                for b in range(4):
                    kk = 16 * j + 4 * s + b
                    expected = int(w[row, kk]) + 1 if kk < k else 1  # padding is code 1 (weight 0)
                    assert (four >> (8 * b)) & 0xFF == expected


def test_uint32_view_is_the_same_bits(rng):
    w = random_ternary(5, 40, rng)
    u = pack_t2(w, as_uint32=True)
    assert u.dtype == torch.uint32
    assert torch.equal(u.view(torch.int32), pack_t2(w))
    assert torch.equal(unpack_t2(u, 40), w)


def test_float_ternary_input_accepted(rng):
    w = random_ternary(4, 20, rng)
    assert torch.equal(pack_t2(w.float()), pack_t2(w))


def test_padded_k():
    assert [padded_k(k) for k in (1, 16, 17, 32, 2560)] == [16, 16, 32, 32, 2560]


@pytest.mark.parametrize(
    "bad, exc, needle",
    [
        (torch.tensor([[0, 2, 1]]), FormatError, "ternary"),
        (torch.tensor([[0.0, 0.5]]), FormatError, "ternary"),
        (torch.tensor([[float("nan"), 0.0]]), FormatError, "NaN"),
        (torch.zeros(3, dtype=torch.int8), ShapeError, "2-D"),
        (torch.zeros(0, 4, dtype=torch.int8), ShapeError, "non-empty"),
        (torch.zeros(2, 2, dtype=torch.bool), DTypeError, "dtype"),
    ],
)
def test_pack_rejects_bad_input(bad, exc, needle):
    with pytest.raises(exc, match=needle) as info:
        pack_t2(bad)
    assert isinstance(info.value, BitMTPError)
    assert "weight" in str(info.value)


def test_unpack_rejects_bad_input(rng):
    packed = pack_t2(random_ternary(2, 40, rng))
    with pytest.raises(ShapeError, match="k"):
        unpack_t2(packed, 60)  # 60 needs 4 words, packed has 3
    with pytest.raises(ShapeError, match="k"):
        unpack_t2(packed, 32)  # 32 needs 2 words
    with pytest.raises(DTypeError, match="packed"):
        unpack_t2(packed.to(torch.int64), 40)
    bad = packed.clone()
    bad[0, 0] = 3  # code 3 at k = 0
    with pytest.raises(FormatError, match="code 3"):
        unpack_codes(bad, 40)
