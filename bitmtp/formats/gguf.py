"""GGUF files: a bitmtp model (base + MTP adapter) as one file llama.cpp-family tools read as a plain model.

This module is the file layer: names, the ternary block codecs, speculative metadata, reading and
atomic writing. ``bitmtp.model.gguf_io`` turns decoders into these pieces and back.

**Tensors** carry llama.cpp's names (``token_embd``, ``output_norm``, ``output`` (absent when tied),
``blk.{i}.attn_norm|ffn_norm|attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down``, Qwen3's
``attn_q_norm|attn_k_norm``, BitNet's ``attn_sub_norm|ffn_sub_norm``); the name map and the
architecture names live in the family registry (``bitmtp.model.families``). For families that say so
(``llama``) the rows of ``attn_q``/``attn_k`` are permuted within each head as llama.cpp's converter
does (its RoPE rotates neighbouring pairs, transformers' rotates halves); reading undoes it.

**Ternary projections** are stored in the densest GGML type whose blocks fit the scale layout:

* ``TQ2_0`` (2.06 bits/weight) when K % 256 == 0 and every 256-weight block lies inside one scale
  group (per-tensor, per-row, or groups that are multiples of 256): code ``c = w + 1`` at 2 bits,
  block scale ``d = fp16(scale)``;
* ``Q4_0`` (4.5 bits/weight) when K and the group size are multiples of 32 (Bonsai's group 128):
  ``q = w + 8``, ``d = fp16(scale)``;
* ``F32`` (``w · scale``) otherwise.

**Scale conversion.** bitmtp's scales are float32 and multiplicative (``W = w · scale``; a BitNet
``bitlinear`` checkpoint's ``weight_scale`` is the inverse, see ``formats/bitnet.py``). GGML block
scales are fp16, so a plain reader gets ``w · fp16(scale)`` — the base model up to the fp16 rounding of
each scale (relative error ≤ 2⁻¹¹). bitmtp keeps the exact scales beside each ternary tensor as an
F32 tensor ``bitmtp.scale.<name without .weight>`` of shape ``[N_s, n_groups]``; its presence marks the tensor as
ternary, and the codes come back exactly from the blocks, so export → load is bit-exact. A foreign
TQ1_0/TQ2_0 tensor without it is read as ternary with the block scales.

**Dense tensors** whose values Q4_0 / Q4_1 / Q8_0 blocks reproduce exactly (a quantized GGUF source's
projections and embedding, which the decoder keeps as blocks: ``bitmtp.formats.ggml_blocks``) are written
as those blocks; other dense tensors in the model's dtype (F32/F16/BF16). Both round-trip exactly; norms
are F32.

**Metadata**: ``general.*``, the ``{arch}.*`` hyperparameters llama.cpp reads, ``tokenizer.ggml.*``
and ``tokenizer.chat_template``; ``bitmtp.model_args`` (JSON of ``ModelArgs``: exact round trip of
what the GGML keys cannot say, e.g. llama3 RoPE scaling) and ``bitmtp.tokenizer.files`` (JSON: the
tokenizer's own files, so bitmtp rebuilds exactly the tokenizer it exported).

**Speculative metadata** (present when an adapter is packed)::

    bitmtp.speculative.architecture    "mask-block" | "heads"
    bitmtp.speculative.block_size      D
    bitmtp.speculative.num_heads       D − 1 (drafted tokens after the AR token)
    bitmtp.speculative.rank            LoRA rank / heads' projection dim
    bitmtp.speculative.projection_dim  = rank
    bitmtp.speculative.discount_gamma  γ of the training loss
    bitmtp.speculative.shared_lm_head  true (both kinds draft through the base LM head)
    bitmtp.speculative.config          JSON of the whole AdapterConfig (targets, α, fingerprint, …)

and the adapter's tensors as ``bitmtp.mtp.<name>`` (``bitmtp.mtp.mask_embedding``,
``bitmtp.mtp.layers.3.q.lora_A``, ``bitmtp.mtp.heads.0.down``, …). Reading also accepts the Divine
document's ``divine.speculative.*`` keys (``architecture: "mtp"`` = heads; ``num_heads`` M → D = M + 1;
``projection_dim`` = rank) and tensors ``divine.mtp.{k}.proj_down|proj_up|norm.weight``.

Writing is atomic (temporary file beside the target, then rename); nothing is left behind on an error,
KeyboardInterrupt, SIGTERM or SIGHUP (see :func:`write_gguf`).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import json
import math
import mmap
import os
import signal
import struct
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bitmtp.errors import BitMTPError, FormatError, ShapeError
from bitmtp.formats.adapters import (
    AdapterConfig,
    BaseShape,
    _int_field,
    _real_field,
    adapter_config_from_dict,
    check_tensors,
)
from bitmtp.formats.ggml_blocks import (
    BLOCK,
    BLOCK_BYTES,
    F16_SCALE_OFFSETS,
    BlockWeight,
    check_block_scales,
    dequantize,
)

SCALE_PREFIX = "bitmtp.scale."
MTP_PREFIX = "bitmtp.mtp."
DIVINE_MTP_PREFIX = "divine.mtp."
SPEC = "bitmtp.speculative."
DIVINE_SPEC = "divine.speculative."
KEY_MODEL_ARGS = "bitmtp.model_args"
KEY_TOKENIZER_FILES = "bitmtp.tokenizer.files"
KEY_FORMAT_VERSION = "bitmtp.format_version"
FORMAT_VERSION = 1
#: tensors some GGUF files carry that bitmtp recomputes (llama3 RoPE frequencies come from model_args)
IGNORED_TENSORS = ("rope_freqs.weight",)

TQ_BLOCK = 256
Q4_BLOCK = 32

def scale_name(weight_name: str) -> str:
    """Name of the exact-scale tensor of a ternary weight: ``blk.0.attn_q.weight`` → ``bitmtp.scale.blk.0.attn_q``
    (no ``.weight`` suffix, so readers that match ``.attn_q.`` to permute q rows leave it alone)."""
    return SCALE_PREFIX + weight_name.removesuffix(".weight")


def weight_of_scale(name: str) -> str:
    """Inverse of :func:`scale_name`."""
    return name[len(SCALE_PREFIX):] + ".weight"


def permute_rows(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation (halves → interleaved pairs within each head), on dim 0."""
    n = x.shape[0]
    if n % (2 * n_head):
        raise ShapeError(f"permute_rows: {n} rows do not split into {n_head} heads of even size")
    return x.reshape(n_head, 2, n // n_head // 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def unpermute_rows(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`permute_rows`."""
    n = x.shape[0]
    if n % (2 * n_head):
        raise ShapeError(f"unpermute_rows: {n} rows do not split into {n_head} heads of even size")
    return x.reshape(n_head, n // n_head // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


# --------------------------------------------------------------------------------------------------
# Ternary codecs
# --------------------------------------------------------------------------------------------------

def _gguf():
    try:
        import gguf
    except ImportError as exc:
        raise BitMTPError("GGUF support needs the gguf package: pip install 'bitmtp[hf]' (or pip install gguf)") \
            from exc
    return gguf


def ternary_type_name(k: int, group_size: int) -> str:
    """The GGML type a ternary ``[N, k]`` tensor with scale groups of ``group_size`` is stored as."""
    if k % TQ_BLOCK == 0 and group_size % TQ_BLOCK == 0:
        return "TQ2_0"
    if k % Q4_BLOCK == 0 and group_size % Q4_BLOCK == 0:
        return "Q4_0"
    return "F32"


def _block_scales(scales: torch.Tensor, n: int, k: int, group_size: int, block: int) -> torch.Tensor:
    """float32 ``[N, K/block]``: the scale of each block (blocks never straddle groups here)."""
    starts = torch.arange(0, k, block)
    return scales.expand(n, scales.shape[1])[:, starts // group_size]


def encode_ternary(w: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[np.ndarray, str]:
    """GGUF bytes of a ternary matrix ``w`` (int8 ``[N, K]``, values −1/0/1) with float32 ``scales``.

    Returns ``(array, type_name)``: a uint8 ``[N, bytes_per_row]`` array for ``TQ2_0``/``Q4_0`` (the
    writer derives the logical shape), or float32 ``[N, K]`` for ``F32``.
    """
    n, k = w.shape
    kind = ternary_type_name(k, group_size)
    if kind != "F32":
        block = TQ_BLOCK if kind == "TQ2_0" else Q4_BLOCK
        d = _block_scales(scales, n, k, group_size, block)
        d16 = d.to(torch.float16)
        if not bool(torch.isfinite(d16).all()) or bool((d16 == 0).any()):
            kind = "F32"  # a scale fp16 cannot hold (overflow/underflow): keep exact values
    if kind == "F32":
        expanded = scales.expand(n, scales.shape[1]).repeat_interleave(group_size, dim=1)[:, :k]
        return (w.to(torch.float32) * expanded).contiguous().numpy(), kind
    nb = k // block
    d_bytes = d16.contiguous().view(torch.uint8).reshape(n, nb, 2).numpy()
    if kind == "TQ2_0":
        # block element i = 128c + 32j + l sits in byte 32c + l at bit 2j
        codes = (w.to(torch.int16) + 1).to(torch.uint8).reshape(n, nb, 2, 4, 32).numpy()
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        qs = np.bitwise_or.reduce(codes << shifts, axis=3).reshape(n, nb, 64)
        blocks = np.concatenate([qs, d_bytes], axis=-1)  # qs then d
    else:
        # Q4_0: d first; element l < 16 in the low nibble of byte l, element l + 16 in its high nibble
        q = (w.to(torch.int16) + 8).to(torch.uint8).reshape(n, nb, 2, 16).numpy()
        qs = q[:, :, 0, :] | (q[:, :, 1, :] << 4)
        blocks = np.concatenate([d_bytes, qs], axis=-1)
    return np.ascontiguousarray(blocks.reshape(n, -1)), kind


def _codes_from_blocks(data: np.ndarray, kind: str, n: int, k: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w int8 [N, K], d float32 [N, n_blocks])`` from TQ2_0 / Q4_0 bytes."""
    raw = np.asarray(data, dtype=np.uint8).reshape(n, -1)
    if kind == "TQ2_0":
        nb = k // TQ_BLOCK
        blocks = raw.reshape(n, nb, 66)
        qs, d = blocks[..., :64], blocks[..., 64:]
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        codes = (qs.reshape(n, nb, 2, 1, 32) >> shifts) & 0x3
        codes = codes.reshape(n, k).astype(np.int8)
        if (codes == 3).any():
            raise FormatError(f"tensor {name!r}: TQ2_0 data holds the invalid 2-bit code 3")
        w = codes - 1
    else:
        nb = k // Q4_BLOCK
        blocks = raw.reshape(n, nb, 18)
        d, qs = blocks[..., :2], blocks[..., 2:]
        q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, k).astype(np.int8) - 8
        if ((q < -1) | (q > 1)).any():
            raise FormatError(f"tensor {name!r}: Q4_0 data marked ternary holds values outside -1, 0, 1")
        w = q
    dd = np.ascontiguousarray(d).view(np.float16).reshape(n, nb).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(w)), torch.from_numpy(dd)


def _tq2_0_t2_words(data: np.ndarray, n: int, k: int, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(T2 words int32 [N, K/16], block scales float32 [N, K/256], live bool [N, K/256])`` straight from
    TQ2_0 bytes, in uint8 arithmetic: no int8/int64 code matrix (``formats.ternary.pack_t2``'s route took
    ~40 s for BitNet-2B's 2.1 G weights, this one a few seconds).

    TQ2_0 keeps, per 256-weight block, 64 bytes where byte 32h + j holds weights 128h + 32s + j at bits 2s
    (s = 0..3), codes c = w + 1 — T2's own codes; then a float16 scale. T2 puts weight 16j + 4s + b of a row at
    bit 8b + 2s of word j, so each T2 byte gathers four codes 4 apart. ``live``: a block with a nonzero weight
    (a code other than 1) — the others carry no scale information."""
    nb = k // TQ_BLOCK
    blocks = np.asarray(data, dtype=np.uint8).reshape(n, nb, 66)
    qs = blocks[..., :64]
    # code 3 (invalid) in any field: both bits of a field set
    if ((qs & (qs >> 1)) & 0x55).any():
        raise FormatError(f"tensor {name!r}: TQ2_0 data holds the invalid 2-bit code 3")
    live = ((qs ^ 0x55) != 0).any(axis=-1)  # a field != 01 is a nonzero weight
    d = np.ascontiguousarray(blocks[..., 64:]).view(np.float16).reshape(n, nb).astype(np.float32)
    words = np.empty((n, k // 16), dtype="<i4")
    native = _native("tq2_0_to_t2")
    if native is not None:
        src = np.ascontiguousarray(np.asarray(data, dtype=np.uint8).reshape(n, nb * 66))
        native(src.ctypes.data, n, k, words.ctypes.data, max(1, torch.get_num_threads()))
        return words, d, live
    return _tq2_0_t2_words_numpy(qs, n, k, words), d, live


def _tq2_0_t2_words_numpy(qs: np.ndarray, n: int, k: int, words: np.ndarray) -> np.ndarray:
    """:func:`_tq2_0_t2_words`'s word packing in numpy (no extension; ~0.08 s per 17.7 M weights, the
    extension's ``tq2_0_to_t2`` ~20x less): fills and returns ``words``."""
    nb = k // TQ_BLOCK
    out = words.view(np.uint8).reshape(n, k // 16, 4)
    rows = max(1, (1 << 18) // k)  # row chunks of ~256 KiB of codes: the passes below stay in L2 (2x faster)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        # codes [r, nb, h, s, j] -> weights 128h + 32s + j of the block, i.e. k order within the block
        codes = np.empty((r1 - r0, nb, 2, 4, 32), dtype=np.uint8)
        q = qs[r0:r1].reshape(r1 - r0, nb, 2, 32)
        for sh in range(4):
            np.bitwise_and(q >> (2 * sh), 3, out=codes[:, :, :, sh, :])
        c = codes.reshape(r1 - r0, k // 16, 4, 4)  # [r, word, s', b]: weight 16·word + 4s' + b
        o = out[r0:r1]
        np.left_shift(c[:, :, 3, :], 6, out=o)  # byte b of each word: the four codes 4 apart
        for sh in (2, 1):
            o |= c[:, :, sh, :] << (2 * sh)
        o |= c[:, :, 0, :]
    return words


def _scales_from_live(live: torch.Tensor, d: torch.Tensor, k: int, block: int) -> tuple[torch.Tensor, int]:
    """:func:`_scales_from_blocks` from the blocks' liveness (any nonzero weight) instead of the weights."""
    n = d.shape[0]
    if not bool(live.any()):
        return torch.ones(1, 1), k
    if bool((d[live] <= 0).any()) or not bool(torch.isfinite(d[live]).all()):
        raise FormatError("ternary block scales must be finite and positive")
    first = torch.where(live, d, torch.full_like(d, float("nan")))
    row = torch.nanmedian(first, dim=1).values  # a live scale per row (NaN for an all-zero row)
    row = torch.where(torch.isnan(row), torch.ones_like(row), row)
    if bool((~live | (d == row[:, None])).all()):
        if bool((row == row[0]).all()):
            return row[:1].reshape(1, 1).contiguous(), k
        return row.reshape(n, 1).contiguous(), k
    return torch.where(live, d, row[:, None]).contiguous(), block


def decode_ternary_t2(data: np.ndarray, kind: str, n: int, k: int, name: str,
                      exact_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(T2 words int32 [N, K/16], scales float32, group_size)`` of a ternary tensor stored as ``kind``:
    :func:`decode_ternary` followed by ``pack_t2``, with TQ2_0 (llama.cpp's ternary type, the common case)
    converted byte to byte by :func:`_tq2_0_t2_words`. Same words, scales, group and errors as the long way."""
    if kind != "TQ2_0" or k % TQ_BLOCK:
        from bitmtp.formats.ternary import pack_t2

        w, scales, group = decode_ternary(data, kind, n, k, name, exact_scales)
        return pack_t2(w), scales, group
    words, d_np, live_np = _tq2_0_t2_words(data, n, k, name)
    words_t, d, live = torch.from_numpy(words), torch.from_numpy(d_np), torch.from_numpy(live_np)
    if exact_scales is None:
        scales, group = _scales_from_live(live, d, k, TQ_BLOCK)
        return words_t, scales, group
    return words_t, exact_scales, _check_exact_scales(exact_scales, live, d, kind, TQ_BLOCK, n, k, name)


def _check_exact_scales(exact_scales: torch.Tensor, live: torch.Tensor, d: torch.Tensor, kind: str, block: int,
                        n: int, k: int, name: str) -> int:
    """The group size of ``exact_scales`` (the ``bitmtp.scale.*`` tensor), after checking that its groups do not
    straddle ``kind``'s blocks and that it agrees (fp16 rounding apart) with the live blocks' scales ``d``."""
    group = _exact_group(exact_scales, n, k, name)
    if group % block:
        raise FormatError(f"tensor {name!r}: scale groups of {group} straddle {kind} blocks of {block}")
    want = _block_scales(exact_scales, n, k, group, block).to(torch.float16).to(torch.float32)
    if not bool((~live | (want == d)).all()):
        raise FormatError(f"tensor {name!r}: its {SCALE_PREFIX}* scales disagree with the {kind} block scales")
    return group


def _scales_from_blocks(w: torch.Tensor, d: torch.Tensor, block: int) -> tuple[torch.Tensor, int]:
    """The most compact ``(scales, group_size)`` consistent with per-block scales ``d`` (blocks whose
    weights are all zero carry no scale information)."""
    n, k = w.shape
    return _scales_from_live(w.reshape(n, d.shape[1], block).ne(0).any(-1), d, k, block)


def decode_ternary(data: np.ndarray, kind: str, n: int, k: int, name: str,
                   exact_scales: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(w int8 [N, K], scales float32, group_size)`` of a ternary tensor stored as ``kind``.

    ``exact_scales`` (the ``bitmtp.scale.*`` tensor) wins over the blocks' fp16 scales; it must agree with
    them (fp16 rounding apart) or the file is inconsistent.
    """
    if kind in ("TQ2_0", "Q4_0"):
        block = TQ_BLOCK if kind == "TQ2_0" else Q4_BLOCK
        if k % block:
            raise FormatError(f"tensor {name!r}: {kind} needs K to be a multiple of {block}, got {k}")
        w, d = _codes_from_blocks(data, kind, n, k, name)
        if exact_scales is None:
            scales, group = _scales_from_blocks(w, d, block)
            return w, scales, group
        live = w.reshape(n, -1, block).ne(0).any(-1)
        return w, exact_scales, _check_exact_scales(exact_scales, live, d, kind, block, n, k, name)
    if kind == "TQ1_0":
        gguf = _gguf()
        values = torch.from_numpy(np.ascontiguousarray(gguf.dequantize(data, gguf.GGMLQuantizationType.TQ1_0)))
        values = values.reshape(n, k).to(torch.float32)
        d = values.abs().reshape(n, k // TQ_BLOCK, TQ_BLOCK).amax(-1)
        safe = torch.where(d > 0, d, torch.ones_like(d)).repeat_interleave(TQ_BLOCK, dim=1)
        w = torch.round(values / safe).to(torch.int8)
        if exact_scales is not None:
            return w, exact_scales, _exact_group(exact_scales, n, k, name)
        scales, group = _scales_from_blocks(w, d, TQ_BLOCK)
        return w, scales, group
    if exact_scales is None:
        raise FormatError(f"tensor {name!r}: a {kind} tensor is ternary only with a {scale_name(name)} tensor")
    if kind not in ("F32", "F16"):
        raise FormatError(f"tensor {name!r}: ternary weights (those with a {scale_name(name)} tensor) are read "
                          f"from TQ1_0, TQ2_0, Q4_0, F32 or F16 data, not {kind}; the file is corrupt or was written "
                          "by another tool — re-export it with bitmtp")
    values = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(n, k)
    group = _exact_group(exact_scales, n, k, name)
    expanded = exact_scales.expand(n, exact_scales.shape[1]).repeat_interleave(group, dim=1)[:, :k]
    ratio = values / expanded
    w = torch.round(ratio)
    if bool(((w.abs() > 1) | ((ratio - w).abs() > 1e-3)).any()):
        raise FormatError(f"tensor {name!r}: values are not ternary multiples of its {SCALE_PREFIX}* scales")
    return w.to(torch.int8), exact_scales, group


def _exact_group(scales: torch.Tensor, n: int, k: int, name: str) -> int:
    if scales.dim() != 2 or scales.shape[0] not in (1, n) or k % scales.shape[1]:
        raise FormatError(f"{scale_name(name)}: shape {tuple(scales.shape)} does not fit a [{n}, {k}] weight "
                          f"(expected [1 or {n}, n_groups] with n_groups dividing {k})")
    if not bool(torch.isfinite(scales).all()) or bool((scales <= 0).any()):
        raise FormatError(f"{scale_name(name)}: scales must be finite and positive")
    return k // scales.shape[1]


# --------------------------------------------------------------------------------------------------
# Speculative metadata
# --------------------------------------------------------------------------------------------------

def speculative_metadata(config: AdapterConfig) -> dict[str, Any]:
    """The ``bitmtp.speculative.*`` keys of an adapter."""
    return {
        SPEC + "architecture": config.kind,
        SPEC + "block_size": int(config.block_size),
        SPEC + "num_heads": int(config.num_heads),
        SPEC + "rank": int(config.rank),
        SPEC + "projection_dim": int(config.rank),
        SPEC + "discount_gamma": float(config.discount_gamma),
        SPEC + "shared_lm_head": True,
        SPEC + "config": json.dumps(asdict(config)),
    }


def adapter_from_gguf(meta: dict[str, Any], tensors: dict[str, torch.Tensor], base: BaseShape,
                      source: str) -> tuple[AdapterConfig, dict[str, torch.Tensor]] | None:
    """The adapter packed in a GGUF (bitmtp or Divine keys), validated against its tensors; None if absent.

    ``tensors`` holds only the file's ``bitmtp.mtp.*`` / ``divine.mtp.*`` tensors (full names).
    """
    has_bitmtp = any(k.startswith(SPEC) for k in meta)
    has_divine = any(k.startswith(DIVINE_SPEC) for k in meta)
    mtp = {k: v for k, v in tensors.items() if k.startswith(MTP_PREFIX)}
    divine = {k: v for k, v in tensors.items() if k.startswith(DIVINE_MTP_PREFIX)}
    if not has_bitmtp and not has_divine:
        if mtp or divine:
            raise FormatError(f"{source}: holds MTP tensors ({next(iter(mtp or divine))!r}, …) but no "
                              f"{SPEC}* / {DIVINE_SPEC}* metadata saying what they are")
        return None
    if has_bitmtp:
        return _bitmtp_adapter(meta, mtp, base, source)
    return _divine_adapter(meta, divine, base, source)


def _need(meta: dict[str, Any], key: str, source: str, check: Callable[..., Any] | None = None,
          default: Any = None, **limits: Any) -> Any:
    """A metadata value, checked by ``check`` (``_int_field`` / ``_real_field``) when given; FormatError naming
    the key when it is missing (and has no ``default``), of the wrong type or out of range."""
    if key not in meta:
        if default is not None:
            return default
        raise FormatError(f"{source}: missing metadata key {key!r}")
    if check is None:
        return meta[key]
    try:
        return check(meta[key], key, **limits)
    except FormatError as exc:
        raise FormatError(f"{source}: metadata {exc}") from None


def json_metadata(raw: Any) -> Any:
    """The parsed value of a JSON-string metadata key (``bitmtp.model_args``, ``bitmtp.speculative.config``).
    Raises FormatError saying what is wrong; callers prefix the file and key."""
    if not isinstance(raw, str):
        raise FormatError(f"expected a JSON string, got {type(raw).__name__}")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"not valid JSON ({exc})") from None


def _bitmtp_adapter(meta, mtp, base, source):
    kind = _need(meta, SPEC + "architecture", source)
    block = _need(meta, SPEC + "block_size", source, _int_field, lo=2, hi=16)
    if SPEC + "config" in meta:
        try:
            parsed = json_metadata(meta[SPEC + "config"])
        except FormatError as exc:
            raise FormatError(f"{source}: metadata {SPEC}config: {exc}") from None
        config = adapter_config_from_dict(parsed, f"{source}: metadata {SPEC}config")
    else:
        rank = _need(meta, SPEC + ("rank" if SPEC + "rank" in meta else "projection_dim"), source, _int_field)
        gamma = _need(meta, SPEC + "discount_gamma", source, _real_field, 0.8, hi=1.0)
        try:
            config = AdapterConfig(kind=kind, block_size=block, rank=rank, base=base, discount_gamma=gamma)
        except FormatError as exc:
            raise FormatError(f"{source}: metadata {SPEC}*: {exc}") from None
    checks = {"architecture": (kind, config.kind), "block_size": (block, config.block_size)}
    if SPEC + "num_heads" in meta:
        checks["num_heads"] = (_need(meta, SPEC + "num_heads", source, _int_field), config.num_heads)
    for key in ("rank", "projection_dim"):
        if SPEC + key in meta:
            checks[key] = (_need(meta, SPEC + key, source, _int_field), config.rank)
    for key, (said, actual) in checks.items():
        if said != actual:
            raise FormatError(f"{source}: inconsistent metadata: {SPEC}{key} = {said!r} but the adapter "
                              f"config says {actual!r}")
    adapter = {k[len(MTP_PREFIX):]: v for k, v in mtp.items()}
    check_tensors(config, adapter, source=f"{source} ({MTP_PREFIX}* tensors, {SPEC}block_size={block})")
    return config, adapter


_DIVINE_PARTS = {"proj_down.weight": "down", "proj_up.weight": "up", "norm.weight": "norm"}


def _divine_adapter(meta, divine, base, source):
    arch = _need(meta, DIVINE_SPEC + "architecture", source)
    if arch != "mtp":
        raise FormatError(f"{source}: {DIVINE_SPEC}architecture = {arch!r}; bitmtp reads Divine's 'mtp' heads")
    heads = _need(meta, DIVINE_SPEC + "num_heads", source, _int_field, hi=15)
    rank = _need(meta, DIVINE_SPEC + "projection_dim", source, _int_field)
    gamma = _need(meta, DIVINE_SPEC + "discount_gamma", source, _real_field, 0.9, hi=1.0)
    config = AdapterConfig(kind="heads", block_size=heads + 1, rank=rank, base=base, discount_gamma=gamma)
    adapter = {}
    for name, t in divine.items():
        rest = name[len(DIVINE_MTP_PREFIX):]
        idx, _, part = rest.partition(".")
        if not idx.isdigit() or part not in _DIVINE_PARTS:
            raise FormatError(f"{source}: unexpected Divine tensor {name!r}")
        adapter[f"heads.{int(idx)}.{_DIVINE_PARTS[part]}"] = t
    check_tensors(config, adapter, source=f"{source} ({DIVINE_MTP_PREFIX}* tensors, "
                                          f"{DIVINE_SPEC}num_heads={heads})")
    return config, adapter


# --------------------------------------------------------------------------------------------------
# Reading and writing
# --------------------------------------------------------------------------------------------------

@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: its GGML type name, logical PyTorch-order shape and raw data."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


@dataclass
class GGUFField:
    """A metadata value with its GGUF types (kept so a re-export writes it back unchanged)."""

    value: Any
    vtype: Any
    sub_type: Any = None


@dataclass
class GGUFContents:
    path: Path
    fields: dict[str, GGUFField]
    tensors: dict[str, GGUFTensor]
    #: the file's memory map (what the tensors' arrays view) and each tensor's byte range in it
    buffer: Any = dataclasses.field(default=None, repr=False)
    extents: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict, repr=False)

    @property
    def meta(self) -> dict[str, Any]:
        return {k: f.value for k, f in self.fields.items()}

    def release(self, names: Iterable[str]) -> int:
        """Drop this process's resident pages of the named tensors' data (``madvise(MADV_DONTNEED)`` on the
        whole pages inside each range): for tensors that were copied (converted, permuted, fused) and whose
        mapped bytes nothing reads any more. Their arrays stay valid — a later read faults the pages back in
        from the file — but they no longer count in the process's RSS. Returns the bytes released (0 where
        the platform has no ``madvise``)."""
        advise = getattr(self.buffer, "madvise", None)
        flag = getattr(mmap, "MADV_DONTNEED", None)
        if advise is None or flag is None:
            return 0
        page = mmap.PAGESIZE
        released = 0
        for name in names:
            start, n = self.extents[name]
            lo, hi = -(-start // page) * page, (start + n) // page * page
            if hi > lo:
                advise(flag, lo, hi - lo)
                released += hi - lo
        return released

    @property
    def architecture(self) -> str:
        return str(self.meta.get("general.architecture", ""))


#: GGUF metadata value type tags: fixed-size scalars as struct codes, and the two variable-size types
_SCALAR_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS
_MIN_KV_BYTES = 8 + 4 + 1  # empty key, value type tag, a one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dimension, type tag, data offset
#: tensor types exposed as typed numpy arrays (as gguf-py's reader does); the others as raw block bytes
_NATIVE_DTYPES = {"F32": "f4", "F16": "f2", "F64": "f8", "I8": "i1", "I16": "i2", "I32": "i4", "I64": "i8"}


class ValueType(enum.IntEnum):
    """GGUF metadata value types, with gguf-py's ``GGUFValueType`` names and values (an IntEnum, so the two
    compare equal): reading a file needs no gguf-py, whose import alone costs ~0.3 s of a ~2 s cold start."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


#: GGML tensor types by tag: ``(name, weights per block, bytes per block)``, as gguf-py's
#: ``GGMLQuantizationType`` / ``GGML_QUANT_SIZES`` (tags this table lacks are looked up there)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
_TYPE_SIZES = {name: (block, size) for name, block, size in GGML_TYPES.values()}


def _ggml_type(raw: int) -> tuple[str, int, int] | None:
    """``(name, block, type_size)`` of GGML type tag ``raw``; gguf-py is asked only for a tag this module's
    table lacks (a type newer than it). None when neither knows it."""
    if raw in GGML_TYPES:
        return GGML_TYPES[raw]
    try:
        gguf = _gguf()
        q = gguf.GGMLQuantizationType(raw)
        block, size = gguf.GGML_QUANT_SIZES[q]
    except (BitMTPError, ValueError, KeyError):
        return None
    return q.name, block, size


def type_size(type_name: str) -> tuple[int, int]:
    """``(weights per block, bytes per block)`` of a GGML type name."""
    if type_name in _TYPE_SIZES:
        return _TYPE_SIZES[type_name]
    gguf = _gguf()
    return tuple(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]])


class _Cursor:
    """Bounds-checked reads of a GGUF header from the file's memory map (or bytes).

    Every length and count is checked against the bytes left in the file before anything is read or
    allocated, so a corrupt field (a string length of 2⁶⁰, an array count larger than the file) raises a
    FormatError naming the key instead of a MemoryError, a hang or a read past the end.
    """

    def __init__(self, buf: Any, size: int, path: Path):
        self.buf, self.size, self.path = buf, size, path
        self.pos = 0
        self.endian = "<"
        self.ctx = "header"  # what is being read, for error messages

    def fail(self, what: str) -> FormatError:
        return FormatError(f"{self.path}: {self.ctx}: {what}; the file is truncated or corrupt "
                           "(re-download or re-export it)")

    def left(self) -> int:
        return self.size - self.pos

    def take(self, n: int, what: str) -> tuple[Any, int]:
        """``(buffer, offset)`` of the next ``n`` bytes (no copy), after checking they exist."""
        if n > self.left():
            raise self.fail(f"{what} needs {n} bytes at offset {self.pos}, past the end of the file "
                            f"({self.size} bytes)")
        off = self.pos
        self.pos += n
        return self.buf, off

    def unpack(self, code: str, what: str) -> Any:
        size = struct.calcsize("<" + code)
        buf, off = self.take(size, what)
        return struct.unpack_from(self.endian + code, buf, off)[0]

    def string(self, what: str) -> str:
        n = self.unpack("Q", f"{what} length")
        if n > self.left():
            raise self.fail(f"{what} length {n} runs past the end of the file ({self.left()} bytes left)")
        buf, off = self.take(n, what)
        try:
            return bytes(buf[off:off + n]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc})") from exc

    def strings(self, count: int) -> list[str]:
        """``count`` strings in a row (an array's elements), read by the native extension when it is built
        (``gguf_strings`` in ``csrc/cpu/w2a8_module.cpp``: ~10 ms for SmolLM2's 49k tokens + 49k merges), else
        by :meth:`strings_python`; a bad element is named by the Python reader either way."""
        native = _native("gguf_strings")
        if native is not None and count:
            try:
                out, pos = native(self.buf, self.pos, count, self.size, self.endian == ">")
            except (ValueError, TypeError, BufferError):
                return self.strings_python(count)  # raises the FormatError that names the element
            self.pos = pos
            return out
        return self.strings_python(count)

    def strings_python(self, count: int) -> list[str]:
        """:meth:`strings` in Python: :meth:`string`'s checks in one tight loop — SmolLM2's 49k tokens and
        49k merges took ~0.2 s through :meth:`string`, ~0.06 s here."""
        buf, size, pos = self.buf, self.size, self.pos
        length = struct.Struct(self.endian + "Q").unpack_from
        out = []
        append = out.append
        try:
            for i in range(count):
                if pos + 8 > size:
                    self.pos = pos
                    raise self.fail(f"array element length needs 8 bytes at offset {pos}, past the end of the "
                                    f"file ({size} bytes; element {i})")
                n = length(buf, pos)[0]
                pos += 8
                if n > size - pos:
                    self.pos = pos
                    raise self.fail(f"array element length {n} runs past the end of the file "
                                    f"({size - pos} bytes left; element {i})")
                append(buf[pos:pos + n].decode("utf-8"))
                pos += n
        except UnicodeDecodeError as exc:
            self.pos = pos
            raise self.fail(f"array element is not valid UTF-8 ({exc}; element {len(out)})") from exc
        self.pos = pos
        return out

    def value(self, vtype: int) -> tuple[Any, int | None]:
        """A metadata value of type tag ``vtype`` and its array item type (None for scalars)."""
        if vtype in _SCALAR_CODES:
            return self.unpack(_SCALAR_CODES[vtype], "value"), None
        if vtype == _STRING:
            return self.string("string value"), None
        if vtype != _ARRAY:
            raise self.fail(f"unknown value type tag {vtype} (GGUF knows 0..12)")
        itype = self.unpack("I", "array item type")
        count = self.unpack("Q", "array count")
        if itype == _ARRAY:
            raise self.fail("nested arrays are not supported (GGUF readers refuse them too)")
        if itype not in _SCALAR_CODES and itype != _STRING:
            raise self.fail(f"unknown array item type tag {itype} (GGUF knows 0..12)")
        item = 8 if itype == _STRING else struct.calcsize("<" + _SCALAR_CODES[itype])  # a string: ≥ its length
        if count > self.left() // item:
            raise self.fail(f"array count {count} is impossible: {self.left()} bytes are left in the file")
        if itype == _STRING:
            return self.strings(count), itype
        code = _SCALAR_CODES[itype]
        buf, off = self.take(count * item, "array data")
        np_code = "u1" if code == "?" else np.dtype(code).str[1:]
        arr = np.frombuffer(buf, dtype=np.dtype(np_code).newbyteorder(self.endian), count=count, offset=off)
        return (arr != 0).tolist() if code == "?" else arr.tolist(), itype


def _native(name: str) -> Any:
    """The extension's GGUF helper ``bitmtp._cpu_w2a8.<name>`` (``gguf_strings``, ``tq2_0_to_t2``), or None
    when the extension is not built (or ``BITMTP_PURE_GGUF=1`` asks for the Python versions)."""
    if os.environ.get("BITMTP_PURE_GGUF") == "1":
        return None
    try:
        return getattr(importlib.import_module("bitmtp._cpu_w2a8"), name)
    except (ImportError, AttributeError):  # not built, or an older build without the helper
        return None


@dataclass
class _TensorInfo:
    name: str
    type_name: str  # GGML type name ("Q4_1", "F32", …)
    dims: tuple[int, ...]  # GGML order (innermost first)
    offset: int  # relative to the data section
    n_bytes: int


def _map(path: Path) -> tuple[Any, int]:
    """``(buffer, size)``: the whole file mapped copy-on-write (``MAP_PRIVATE``: the arrays over it are
    writable, so torch takes them without a copy, and nothing is ever written back), or ``b""`` for an
    empty file (which cannot be mapped). Pages are read when touched: a header parse reads the header."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return b"", 0
        try:
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), size
        except (OSError, ValueError) as exc:
            raise FormatError(f"{path}: cannot be memory-mapped ({exc})") from exc


def _parse_header(path: Path, buf: Any, size: int) -> tuple[dict[str, GGUFField], list[_TensorInfo], int, str]:
    """Metadata, tensor infos, the data section's offset and the byte order of a GGUF file mapped at
    ``buf``, every count, length, type tag and tensor extent checked against the file size. Reads (touches)
    the header only."""
    vt = ValueType
    c = _Cursor(buf, size, path)
    magic, off = c.take(4, "magic")
    if bytes(magic[off:off + 4]) != b"GGUF":
        raise FormatError(f"{path}: not a GGUF file (starts with {bytes(magic[off:off + 4])!r}, expected "
                          "b'GGUF')")
    version = c.unpack("I", "version")
    if version & 0xFFFF == 0:  # written big-endian
        c.endian, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
    if version not in (2, 3):
        raise FormatError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors = c.unpack("Q", "tensor count")
    n_kv = c.unpack("Q", "metadata count")
    if n_kv > c.left() // _MIN_KV_BYTES or n_tensors > c.left() // _MIN_TENSOR_INFO_BYTES:
        raise c.fail(f"{n_kv} metadata entries and {n_tensors} tensors cannot fit in {size} bytes")
    fields: dict[str, GGUFField] = {}
    for i in range(n_kv):
        c.ctx = f"metadata entry {i}"
        key = c.string("key")
        c.ctx = f"metadata key {key!r}"
        if key in fields:
            raise c.fail("the key appears twice")
        vtype = c.unpack("I", "value type")
        value, itype = c.value(vtype)
        fields[key] = GGUFField(value, vt(vtype), None if itype is None else vt(itype))
    infos: list[_TensorInfo] = []
    names: set[str] = set()
    for i in range(n_tensors):
        c.ctx = f"tensor info {i}"
        name = c.string("name")
        c.ctx = f"tensor {name!r}"
        if name in names:
            raise c.fail("the name appears twice")
        names.add(name)
        n_dims = c.unpack("I", "dimension count")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise c.fail(f"{n_dims} dimensions (GGUF tensors have 1 to {_MAX_DIMS})")
        dims = tuple(c.unpack("Q", "dimension") for _ in range(n_dims))
        raw_type = c.unpack("I", "type")
        offset = c.unpack("Q", "data offset")
        kind = _ggml_type(raw_type)
        if kind is None:
            raise c.fail(f"unknown GGML type {raw_type} (a newer format than this gguf package knows, or "
                         "corruption)")
        type_name, block, type_size_ = kind
        if 0 in dims:
            raise c.fail(f"empty dimension in shape {dims}")
        if dims[0] % block:
            raise c.fail(f"rows of {dims[0]} elements are not whole {type_name} blocks of {block}")
        n_bytes = math.prod(dims) // block * type_size_
        if n_bytes > size:
            raise c.fail(f"shape {dims} of {type_name} needs {n_bytes} bytes, more than the whole file")
        infos.append(_TensorInfo(name, type_name, dims, offset, n_bytes))
    c.ctx = "general.alignment"
    alignment = 32
    if "general.alignment" in fields:
        a = fields["general.alignment"]
        if a.vtype != vt.UINT32 or not isinstance(a.value, int) or a.value <= 0 or a.value & (a.value - 1):
            raise c.fail(f"must be a power of two stored as UINT32, got {a.value!r} ({a.vtype.name})")
        alignment = a.value
    data_start = -(-c.pos // alignment) * alignment
    # Every tensor inside the file, aligned, and the data section tiled exactly as llama.cpp's and gguf-py's
    # writers lay it out: each tensor at the first aligned offset after the previous one, nothing after the
    # last but padding. Stricter than llama.cpp's reader, and it is what turns a flipped type tag, dimension
    # or offset (a tensor that shrank, moved or overlaps) into an error instead of a shifted read — and,
    # with the whole extent checked against the mapped size, what keeps a truncated file from a SIGBUS.
    for t in infos:  # first each tensor on its own, so the message names the tensor whose entry is wrong
        where = f"{path}: tensor {t.name!r}: data offset {t.offset}"
        if t.offset % alignment:
            raise FormatError(f"{where} is not a multiple of the alignment {alignment}; the file is corrupt")
        start = data_start + t.offset
        if start + t.n_bytes > size:
            raise FormatError(f"{where}: data [{start}, {start + t.n_bytes}) runs past the end of the file "
                              f"({size} bytes); the file is truncated (re-download or re-export it)")
    expect, prev = 0, None
    for t in sorted(infos, key=lambda t: t.offset):
        where = f"{path}: tensor {t.name!r}: data offset {t.offset}"
        if t.offset != expect:
            after = "the start of the data section" if prev is None else f"tensor {prev!r}"
            raise FormatError(f"{where} should be {expect}, the first aligned offset after {after} "
                              f"({'overlap' if t.offset < expect else 'gap'}); the file is corrupt")
        expect, prev = -(-(t.offset + t.n_bytes) // alignment) * alignment, t.name
    if infos and size > data_start + expect:  # beyond the last tensor's padding
        raise FormatError(f"{path}: {size - data_start - expect} bytes after the last tensor ({prev!r}); a tensor's "
                          "type or shape in the header does not match its data — the file is corrupt")
    return fields, infos, data_start, c.endian


def read_gguf(path: str | Path) -> GGUFContents:
    """Read a GGUF file's metadata and tensor index in one pass over its memory map; tensor data stays
    mapped (arrays over the map: nothing is read until used, and block data is used as it lies).

    The header is parsed here (not by gguf-py's reader, whose import alone costs ~0.3 s) so that every
    count, length and tensor extent is checked against the mapped size *before* any tensor is touched: a
    corrupt, misaligned or truncated file raises a FormatError naming the key or tensor, never a hang, a
    MemoryError or a SIGBUS. The map is copy-on-write (see :func:`_map`).
    """
    path = Path(path)
    if not path.is_file():
        raise BitMTPError(f"{path}: no such file")
    buf, size = _map(path)
    fields, infos, data_start, endian = _parse_header(path, buf, size)
    tensors: dict[str, GGUFTensor] = {}
    for t in infos:
        raw = np.frombuffer(buf, dtype=np.uint8, count=t.n_bytes, offset=data_start + t.offset)
        shape = tuple(reversed(t.dims))  # PyTorch order
        native = _NATIVE_DTYPES.get(t.type_name)
        if native is not None:
            data = raw.view(np.dtype(native).newbyteorder(endian)).reshape(shape)
        else:
            block, size_ = _TYPE_SIZES.get(t.type_name) or type_size(t.type_name)
            data = raw.reshape(*shape[:-1], shape[-1] // block * size_)
        tensors[t.name] = GGUFTensor(t.name, t.type_name, shape, data)
    extents = {t.name: (data_start + t.offset, t.n_bytes) for t in infos}
    return GGUFContents(path, fields, tensors, buf if isinstance(buf, mmap.mmap) else None, extents)


def check_finite(t: GGUFTensor, source: str) -> None:
    """FormatError naming the tensor when it holds Inf or NaN, checked on its smallest representation.

    Block types are checked through their float16 scales only (``ggml_blocks.F16_SCALE_OFFSETS``: a block's
    values are finite exactly when its scales are), float tensors as stored, integer tensors not at all;
    other block types (IQ*, MXFP4, …) are dequantized first, the one case that costs a float32 copy.
    Random bytes in block data usually show here: about 1 in 32 random float16s is Inf or NaN.
    """
    what = f"{source}: tensor {t.name!r}"
    if t.type_name in F16_SCALE_OFFSETS:
        check_block_scales(t.data, t.type_name, type_size(t.type_name)[1], what)
        return
    if t.type_name in ("I8", "I16", "I32", "I64"):
        return
    if t.type_name in ("F32", "F16", "F64"):  # as stored (numpy: the data is a read-only memory map)
        values = np.asarray(t.data).reshape(-1)
        bad = ~np.isfinite(values)
    elif t.type_name == "BF16":  # as stored: Inf and NaN are the bfloat16s whose exponent bits are all ones
        values = np.asarray(t.data).view(np.uint16).reshape(-1)
        bad = (values & 0x7F80) == 0x7F80
        values = dense_tensor(t).reshape(-1).float().numpy() if bad.any() else values
    else:  # other block types: a dequantized float32 copy
        values = dense_tensor(t).reshape(-1).numpy()
        bad = ~np.isfinite(values)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise FormatError(f"{what} holds a non-finite value ({float(values[at])} at flat index {at}); the weights "
                          "are corrupt — re-download or re-export the file")


def dense_tensor(t: GGUFTensor) -> torch.Tensor:
    """A float tensor of the GGUF tensor's logical shape (F32/F16/BF16 as stored; Q4_0/Q4_1/Q8_0 dequantized
    to float32 by ``ggml_blocks.dequantize`` — gguf-py's arithmetic, bit for bit, ~4x faster —, other types by
    the gguf package)."""
    if t.type_name in ("I8", "I16", "I32", "I64"):
        raise FormatError(f"tensor {t.name!r}: GGML type {t.type_name} holds integers, not weights (bitmtp reads "
                          "float and block-quantized tensors); the file is corrupt or not a model")
    if t.type_name == "F32":
        return torch.from_numpy(np.array(t.data, dtype=np.float32)).reshape(t.shape)
    if t.type_name == "F16":
        return torch.from_numpy(np.array(t.data, dtype=np.float16)).reshape(t.shape)
    if t.type_name == "BF16":
        raw = np.array(t.data).view(np.uint16).astype(np.int16)
        return torch.from_numpy(raw).view(torch.bfloat16).reshape(t.shape)
    fmt = t.type_name.lower()
    if fmt in BLOCK_BYTES:
        k = t.shape[-1]
        bw = BlockWeight(fmt, torch.from_numpy(np.ascontiguousarray(t.data).reshape(-1, k // BLOCK * BLOCK_BYTES[fmt])),
                         (math.prod(t.shape) // k, k))
        return dequantize(bw).reshape(t.shape)
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[t.type_name]
    try:
        values = gguf.dequantize(t.data, qtype)
    except NotImplementedError as exc:
        raise FormatError(f"tensor {t.name!r}: GGML type {t.type_name} cannot be dequantized here") from exc
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(t.shape)


@dataclass
class TensorOut:
    """A tensor to write: ``data`` is float/int numpy, or uint8 block bytes with ``type_name`` set."""

    name: str
    data: np.ndarray
    type_name: str | None = None


def numpy_of(t: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """``(array, raw type name or None)`` for writing a dense torch tensor as it is."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy(), "BF16"
    if t.dtype in (torch.float32, torch.float16):
        return t.numpy(), None
    raise FormatError(f"dtype {t.dtype}: GGUF export writes float32, float16 or bfloat16 dense tensors")


#: signals whose default action kills the process; while a file is written they raise instead (if no one
#: installed a handler of their own), so the ``except`` below removes the temporary file
_FATAL_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))


def _raise_on_signal(signum: int, frame: Any) -> None:
    # SystemExit, not an Exception subclass: nothing on the way up swallows it, and the process still ends
    # with the status a shell reports for a signal death (128 + signum) once the cleanup has run
    raise SystemExit(128 + signum)


@contextmanager
def _signals_raise() -> Iterator[None]:
    """Inside the block, fatal signals left at their default action raise ``SystemExit`` (restored after).
    Only the main thread can install handlers; elsewhere the block changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {}
    for sig in _FATAL_SIGNALS:
        if signal.getsignal(sig) == signal.SIG_DFL:
            saved[sig] = signal.signal(sig, _raise_on_signal)
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)


def write_gguf(path: str | Path, arch: str, fields: Iterable[tuple[str, GGUFField]],
               tensors: Iterable[TensorOut], *, overwrite: bool = False,
               progress: Callable[[str], None] | None = None) -> Path:
    """Write a GGUF file atomically: a temporary file beside ``path``, renamed into place when complete.

    The temporary file is removed on every exit Python sees: an exception (from ``tensors`` too: it is
    consumed during the write), KeyboardInterrupt, and SIGTERM / SIGHUP, which raise ``SystemExit(128 +
    signum)`` during the write when they have no handler of their own. Only SIGKILL (or a crash of the
    interpreter) can leave a ``.<name>.*.tmp`` file behind.
    """
    gguf = _gguf()
    path = Path(path)
    if path.exists() and not overwrite:
        raise BitMTPError(f"{path}: already exists; pass overwrite=True (--overwrite) to replace it")
    if path.exists() and not path.is_file():
        raise BitMTPError(f"{path}: exists and is not a file")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    writer = None
    with _signals_raise():
        try:
            fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            os.close(fd)
            tmp = Path(tmp_name)
            writer = gguf.GGUFWriter(str(tmp), arch)
            for key, f in fields:
                if key == "general.architecture":
                    continue
                vt = gguf.GGUFValueType  # fields read by read_gguf carry ValueType: the same values
                writer.add_key_value(key, f.value, vt(int(f.vtype)),
                                     sub_type=None if f.sub_type is None else vt(int(f.sub_type)))
            for t in tensors:
                if t.type_name is not None and t.type_name not in gguf.GGMLQuantizationType.__members__:
                    raise FormatError(f"tensor {t.name!r}: unknown GGML type {t.type_name!r}; use one of "
                                      f"{', '.join(gguf.GGMLQuantizationType.__members__)}")
                raw = None if t.type_name is None else gguf.GGMLQuantizationType[t.type_name]
                writer.add_tensor(t.name, t.data, raw_dtype=raw)
                if progress is not None:
                    progress(t.name)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            for f in (getattr(writer, "fout", None) or []):  # an open handle would keep the unlinked bytes
                f.close()
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            raise
    return path


def field(value: Any, kind: str | None = None) -> GGUFField:
    """A metadata field with its GGUF type chosen from the Python value (``kind`` forces one, e.g. 'uint32')."""
    gguf = _gguf()
    vt = gguf.GGUFValueType
    if kind is not None:
        return GGUFField(value, vt[kind.upper()])
    if isinstance(value, bool):
        return GGUFField(value, vt.BOOL)
    if isinstance(value, int):
        return GGUFField(value, vt.UINT32 if value >= 0 else vt.INT32)
    if isinstance(value, float):
        return GGUFField(value, vt.FLOAT32)
    if isinstance(value, str):
        return GGUFField(value, vt.STRING)
    if isinstance(value, (list, tuple)):
        if not value:
            raise FormatError("metadata arrays must not be empty")
        return GGUFField(list(value), vt.ARRAY, vt.get_type(value[0]))
    raise FormatError(f"metadata value of type {type(value).__name__} cannot be written to GGUF")


__all__ = [
    "SCALE_PREFIX",
    "MTP_PREFIX",
    "scale_name",
    "weight_of_scale",
    "permute_rows",
    "unpermute_rows",
    "ternary_type_name",
    "encode_ternary",
    "decode_ternary",
    "speculative_metadata",
    "adapter_from_gguf",
    "read_gguf",
    "check_finite",
    "write_gguf",
    "dense_tensor",
    "GGUFContents",
    "GGUFTensor",
    "GGUFField",
    "ValueType",
    "GGML_TYPES",
    "type_size",
    "TensorOut",
    "field",
    "numpy_of",
]
