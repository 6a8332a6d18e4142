"""The canonical packed ternary layout "T2".

W ∈ {-1, 0, +1}^(N×K) is stored as codes c = w + 1 ∈ {0, 1, 2}, two bits each, sixteen to a
32-bit word. K is padded to a multiple of 16 with code 1 (weight 0). In word j of row n, weight
k = 16j + 4s + b sits at bits 8b + 2s (s, b ∈ 0..3), so ``(word >> 2s) & 0x03030303`` yields four
bytes holding the codes of k = 16j+4s .. 16j+4s+3 — lined up with one little-endian int32 of four
consecutive int8 activations (dp4a, dot4I8Packed, VNNI/maddubs all consume that directly).

Storage dtype: the words are the bit patterns of uint32, held in a ``torch.int32`` tensor of shape
``[N, ceil(K/16)]``. torch's ``uint32`` has no shift operators on CPU, and every kernel (Triton,
CUDA, C++, WGSL) reinterprets the same 32 bits anyway; ``pack_t2(..., as_uint32=True)`` gives the
uint32 view for interchange.
"""

from __future__ import annotations

import torch

from bitmtp.errors import DTypeError, FormatError, ShapeError

WEIGHTS_PER_WORD = 16
#: Shift of weight ``i = 4s + b`` inside its word: ``8b + 2s``.
T2_SHIFTS = tuple(8 * (i % 4) + 2 * (i // 4) for i in range(WEIGHTS_PER_WORD))
ZERO_CODE = 1


def padded_k(k: int) -> int:
    """K rounded up to the T2 word size (16)."""
    return -(-int(k) // WEIGHTS_PER_WORD) * WEIGHTS_PER_WORD


def words_per_row(k: int) -> int:
    """Number of 32-bit words per packed row for ``k`` input features."""
    return padded_k(k) // WEIGHTS_PER_WORD


def _shift_tensor(device: torch.device) -> torch.Tensor:
    return torch.tensor(T2_SHIFTS, dtype=torch.int64, device=device)


def pack_t2(weight: torch.Tensor, *, as_uint32: bool = False) -> torch.Tensor:
    """Pack a ternary matrix ``weight[N, K]`` (values in {-1, 0, 1}) into T2 words.

    Args:
        weight: integer or float tensor of shape ``[N, K]`` whose values are exactly -1, 0 or 1.
        as_uint32: return a ``torch.uint32`` view instead of the default ``torch.int32`` storage.

    Returns:
        ``int32[N, ceil(K/16)]`` (or ``uint32``) holding the T2 bit pattern.

    Raises:
        ShapeError: ``weight`` is not 2-D or has a zero dimension.
        FormatError: ``weight`` holds a value outside {-1, 0, 1}.
    """
    if not isinstance(weight, torch.Tensor):
        raise DTypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] == 0:
        raise ShapeError(f"weight: expected a non-empty 2-D [N, K] tensor, got shape {tuple(weight.shape)}")
    if weight.dtype == torch.bool or weight.is_complex():
        raise DTypeError(f"weight: expected integer or float values in {{-1, 0, 1}}, got dtype {weight.dtype}")
    if weight.is_floating_point() and not torch.isfinite(weight).all():
        raise FormatError("weight: holds NaN or infinite values; T2 packs only -1, 0 and 1")
    bad = (weight != -1) & (weight != 0) & (weight != 1)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise FormatError(
            f"weight: T2 packs only ternary values -1, 0, 1; found {weight[idx].item()!r} at index {idx}"
        )
    n, k = weight.shape
    kp = padded_k(k)
    codes = torch.full((n, kp), ZERO_CODE, dtype=torch.int64, device=weight.device)
    codes[:, :k] = weight.to(torch.int64) + 1
    codes = codes.view(n, kp // WEIGHTS_PER_WORD, WEIGHTS_PER_WORD)
    words = (codes << _shift_tensor(weight.device)).sum(dim=-1)  # bit fields are disjoint
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.view(torch.uint32) if as_uint32 else words


def _as_int32_words(packed: torch.Tensor, name: str = "packed") -> torch.Tensor:
    if not isinstance(packed, torch.Tensor):
        raise DTypeError(f"{name}: expected a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype == torch.uint32:
        packed = packed.view(torch.int32)
    if packed.dtype != torch.int32:
        raise DTypeError(f"{name}: expected T2 words as int32 or uint32, got dtype {packed.dtype}")
    if packed.dim() != 2:
        raise ShapeError(f"{name}: expected a 2-D [N, ceil(K/16)] tensor, got shape {tuple(packed.shape)}")
    return packed


def unpack_codes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """Codes c ∈ {0, 1, 2} of a T2 matrix as ``uint8[N, k]``."""
    packed = _as_int32_words(packed)
    n, kw = packed.shape
    if not (0 < k <= kw * WEIGHTS_PER_WORD and padded_k(k) == kw * WEIGHTS_PER_WORD):
        raise ShapeError(
            f"k: {k} does not match packed weights with {kw} words per row "
            f"(expected {kw * WEIGHTS_PER_WORD - WEIGHTS_PER_WORD + 1}..{kw * WEIGHTS_PER_WORD})"
        )
    words = packed.to(torch.int64) & 0xFFFFFFFF
    codes = (words.unsqueeze(-1) >> _shift_tensor(packed.device)) & 0x3
    codes = codes.reshape(n, kw * WEIGHTS_PER_WORD)[:, :k]
    if bool((codes == 3).any()):
        raise FormatError("packed: holds the invalid 2-bit code 3 (T2 codes are 0, 1, 2)")
    return codes.to(torch.uint8)


def unpack_t2(packed: torch.Tensor, k: int, dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """Inverse of :func:`pack_t2`: ternary values ``[N, k]`` in ``dtype`` (int8 by default)."""
    return (unpack_codes(packed, k).to(torch.int16) - 1).to(dtype)


__all__ = [
    "WEIGHTS_PER_WORD",
    "T2_SHIFTS",
    "padded_k",
    "words_per_row",
    "pack_t2",
    "unpack_t2",
    "unpack_codes",
]
