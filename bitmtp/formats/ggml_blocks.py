"""GGML's Q4_0 / Q4_1 / Q8_0 block formats, and bfloat16 / float16 rows, for dense weights kept packed on the CPU.

A GGUF checkpoint like SmolLM2-135M-Instruct.Q4_1.gguf stores its projections as Q4_1 blocks and
its embedding as Q8_0. Loading dequantizes them to float32 (transformers does the same), and a
float32 decode step then streams 538 MB for a 135M model. Kept in their blocks, the same weights
are 96 MB: the CPU kernels (csrc/cpu/dense_cpu.h) decode each block with exactly gguf-py's float32
operations and run the float32 kernel's accumulation on the result, so a packed projection's output
is bit-identical to the float32 one. Nothing about the model's numbers changes — only the bytes a
step reads.

Packing is lossless or not at all: :func:`pack_lossless` finds block parameters that reproduce a
float32 tensor bit for bit (it recognizes tensors that came from these formats, whoever dequantized
them) and returns None for anything else, e.g. a checkpoint trained in float.

Block layouts (32 weights of one row, little-endian; gguf-py's ``quants.py``):

- ``q4_1``: float16 d, float16 m, 16 bytes of nibbles; weight j = d·q + m, q = byte[j mod 16] >> 4·(j ≥ 16) & 15
- ``q8_0``: float16 d, 32 int8; weight j = d·q_j
- ``q4_0``: float16 d, 16 bytes of nibbles; weight j = d·(q − 8), q as in q4_1
- ``bf16`` / ``f16``: 32 bfloat16 / IEEE float16 values (64 bytes, no scale): a half-precision checkpoint's rows as
  they lie (BitNet b1.58-2B-4T's bf16 embedding and tied LM head; a GGUF's F16 / BF16 tensors). Widening to
  float32 is exact, so the kernels read half the bytes of the float32 weight for the same results bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bitmtp.errors import FormatError, ShapeError

BLOCK = 32
#: bytes per block of 32 weights
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34, "bf16": 64, "f16": 64}
#: weight-format codes of csrc/cpu/dense_cpu.h (DenseFormat)
FORMAT_CODES = {"q4_1": 1, "q8_0": 2, "q4_0": 3, "bf16": 4, "f16": 5}
#: tried in this order by pack_lossless: fewest bytes first (bf16 before f16: its decode is one shift)
FORMATS = ("q4_0", "q4_1", "q8_0", "bf16", "f16")
#: what ``DenseLinear.pack_blocks`` looks for next to a float32 weight it keeps: the GGML formats only. Half rows
#: there would add half the float32 bytes (a float32 model upcast from bf16, e.g. one transformers loaded in
#: float32, shares its tensors with bitmtp); half checkpoints get half rows instead of float32 copies at load
GGML_FORMATS = ("q4_0", "q4_1", "q8_0")
#: the formats that are plain half-precision rows (no scales), with their torch dtype
HALF_FORMATS = {"bf16": torch.bfloat16, "f16": torch.float16}
#: byte offsets of the float16 scale fields (``d``, and ``m`` / ``dmin`` where the type has one) inside one
#: block of each GGML type whose values are ``scale · small integer (+ offset)`` (gguf-py's ``quants.py``
#: ``dequantize_blocks``). Every value of such a block is finite exactly when these fields are: the integer
#: factors are bounded (≤ 63 · 31), so no finite float16 scale overflows float32. Checking them is the
#: cheapest complete finiteness check of a block tensor — 2–4 bytes per 18–210.
F16_SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "TQ1_0": (52,), "TQ2_0": (64,),
}
_SAMPLE_ROWS = 8  # a cheap first look before a whole tensor is checked
_CHUNK_ROWS = 256  # ~0.6 MB of float32 rows at K = 576: the in-place passes stay in L2


@dataclass(frozen=True)
class BlockWeight:
    """A dense ``[N, K]`` weight in GGML blocks: ``data`` is ``uint8 [N, K / 32 · bytes per block]``."""

    fmt: str
    data: torch.Tensor
    shape: tuple[int, int]

    def __post_init__(self):
        if self.fmt not in BLOCK_BYTES:
            raise ShapeError(f"fmt: expected one of {FORMATS}, got {self.fmt!r}")
        n, k = self.shape
        if k % BLOCK:
            raise ShapeError(f"{self.fmt}: K={k} is not a multiple of {BLOCK}")
        want = (n, k // BLOCK * BLOCK_BYTES[self.fmt])
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want or not self.data.is_contiguous():
            raise ShapeError(f"{self.fmt}: expected contiguous uint8 data of shape {want}, got "
                             f"{self.data.dtype} {tuple(self.data.shape)}")

    @property
    def code(self) -> int:
        return FORMAT_CODES[self.fmt]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float16 ``[..., B]`` → its little-endian bytes ``uint8 [..., B, 2]``."""
    return v.to(torch.float16).contiguous().view(torch.uint8).reshape(*v.shape, 2)


def pack(fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> BlockWeight:
    """Blocks from codes ``q [N, K]`` (0..15 for q4_0 and q4_1, -128..127 for q8_0) and per-block float16
    ``d`` (and ``m`` for q4_1) ``[N, K / 32]``."""
    n, k = q.shape
    if fmt in HALF_FORMATS:
        raise ShapeError(f"{fmt}: rows of half-precision values have no codes or scales; use from_half(tensor)")
    if fmt not in BLOCK_BYTES:
        raise ShapeError(f"fmt: expected one of {FORMATS}, got {fmt!r}")
    if k % BLOCK:
        raise ShapeError(f"{fmt}: K={k} is not a multiple of {BLOCK}")
    b = k // BLOCK
    if tuple(d.shape) != (n, b) or (fmt == "q4_1" and (m is None or tuple(m.shape) != (n, b))):
        raise ShapeError(f"{fmt}: d (and m) must be [{n}, {b}]")
    lo, hi = (-128, 127) if fmt == "q8_0" else (0, 15)
    if int(q.min()) < lo or int(q.max()) > hi:
        raise ShapeError(f"{fmt}: codes must be in [{lo}, {hi}]")
    return _pack(fmt, q, d, m)


def _pack(fmt: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> BlockWeight:
    """:func:`pack` without the checks (codes known to be in range)."""
    n, k = q.shape
    qb = q.reshape(n, k // BLOCK, BLOCK)
    if fmt in ("q4_0", "q4_1"):
        nib = qb.to(torch.uint8)
        qs = nib[..., :16] | (nib[..., 16:] << 4)
        data = torch.cat([_f16_bytes(d)] + ([_f16_bytes(m)] if fmt == "q4_1" else []) + [qs], dim=-1)
    else:
        data = torch.cat([_f16_bytes(d), qb.to(torch.int8).view(torch.uint8)], dim=-1)
    return BlockWeight(fmt, data.reshape(n, -1).contiguous(), (n, k))


def from_half(t: torch.Tensor) -> BlockWeight:
    """A bfloat16 or float16 ``[N, K]`` CPU tensor as ``bf16`` / ``f16`` blocks, sharing its memory (no copy
    when ``t`` is contiguous); K must be a multiple of 32."""
    fmt = next((f for f, dt in HALF_FORMATS.items() if dt == t.dtype), None)
    if fmt is None or t.dim() != 2:
        raise ShapeError(f"from_half: expected a 2-D bfloat16 or float16 tensor, got {t.dtype} {tuple(t.shape)}")
    n, k = t.shape
    if k % BLOCK:
        raise ShapeError(f"{fmt}: K={k} is not a multiple of {BLOCK}")
    return BlockWeight(fmt, t.contiguous().view(torch.uint8).reshape(n, k * 2), (n, k))


#: rows dequantized per chunk: ~1.2 MB of float32 at K = 576, so each in-place pass stays in L2
_DEQUANT_ROWS = 512


def dequantize(bw: BlockWeight, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[N, K]`` (into ``out`` when given), computed as gguf-py computes it (``d * q``, then ``+ m``;
    q4_0's q is the code minus 8) — the reference the native kernels' block decoders match bit for bit.

    Written in place, chunk by chunk of rows: the codes are cast straight into the output, then scaled and
    offset there (no temporaries the size of the weight). On SmolLM2-135M's Q4_1 projections this takes
    ~0.35 s against ~1.6 s for the all-at-once version (one fresh tensor per step) on a busy 2-core machine.
    """
    n, k = bw.shape
    nb, bpb = k // BLOCK, BLOCK_BYTES[bw.fmt]
    if out is None:
        out = torch.empty(n, k, dtype=torch.float32)
    elif out.dtype != torch.float32 or tuple(out.shape) != (n, k) or not out.is_contiguous():
        raise ShapeError(f"out: expected a contiguous float32 [{n}, {k}] tensor, got {out.dtype} {tuple(out.shape)}")
    if bw.fmt in HALF_FORMATS:
        half = bw.data.view(HALF_FORMATS[bw.fmt]).view(n, k)
        for r0 in range(0, n, _DEQUANT_ROWS):
            out[r0:r0 + _DEQUANT_ROWS].copy_(half[r0:r0 + _DEQUANT_ROWS])
        return out
    raw_all = bw.data.reshape(n, nb, bpb)
    out3 = out.view(n, nb, BLOCK)
    for r0 in range(0, n, _DEQUANT_ROWS):
        raw, w = raw_all[r0:r0 + _DEQUANT_ROWS], out3[r0:r0 + _DEQUANT_ROWS]
        d = raw[..., 0:2].contiguous().view(torch.float16).float()
        if bw.fmt == "q8_0":
            w.copy_(raw[..., 2:].view(torch.int8))
            w.mul_(d)
            continue
        qs = raw[..., 4:20] if bw.fmt == "q4_1" else raw[..., 2:18]
        w[..., :16].copy_(qs & 15)
        w[..., 16:].copy_(qs >> 4)
        if bw.fmt == "q4_0":
            w.sub_(8)
            w.mul_(d)
        else:
            w.mul_(d)
            w.add_(raw[..., 2:4].contiguous().view(torch.float16).float())
    return out


def dequantize_rows(bw: BlockWeight, rows: torch.Tensor) -> torch.Tensor:
    """float32 ``[R, K]``: rows ``rows`` of :func:`dequantize` (bw), bit for bit, decoding only those rows' blocks
    (an embedding lookup of a few tokens reads a few KB instead of the whole matrix). The same float32 operations
    per weight as :func:`dequantize` (``d * q``, then ``+ m``), in fewer torch calls: this runs once per decode
    step (and per draft head), where the call overhead is the cost."""
    n, k = bw.shape
    nb, bpb = k // BLOCK, BLOCK_BYTES[bw.fmt]
    index = rows.reshape(-1).to(device=bw.data.device, dtype=torch.int64)
    if bw.fmt in HALF_FORMATS:
        return bw.data.view(HALF_FORMATS[bw.fmt]).view(n, k)[index].float()
    raw = bw.data.view(n, nb, bpb)[index]
    d = raw[..., 0:2].contiguous().view(torch.float16).float()
    if bw.fmt == "q8_0":
        w = raw[..., 2:].view(torch.int8).float()
        return w.mul_(d).view(-1, k)
    qs = raw[..., 4:20] if bw.fmt == "q4_1" else raw[..., 2:18]
    w = torch.cat((qs & 15, qs >> 4), dim=-1).float()
    if bw.fmt == "q4_0":
        w.sub_(8)
        return w.mul_(d).view(-1, k)
    w.mul_(d)
    return w.add_(raw[..., 2:4].contiguous().view(torch.float16).float()).view(-1, k)


def cat_rows(parts: list[BlockWeight]) -> BlockWeight | None:
    """The row concatenation of block weights (a fused q/k/v or gate/up projection), or None when their
    formats or widths differ. Blocks never cross rows, so this is a byte concatenation."""
    if not parts or len({(p.fmt, p.shape[1]) for p in parts}) != 1:
        return None
    data = torch.cat([p.data for p in parts]) if len(parts) > 1 else parts[0].data
    return BlockWeight(parts[0].fmt, data, (data.shape[0], parts[0].shape[1]))


def _f16_neighbours(v: torch.Tensor) -> list[torch.Tensor]:
    """float16 candidates around float32 ``v``: its rounding, then two ulps either side (as float32).
    The rounding is the block's d for every block of SmolLM2's GGUF; the others are a safety net."""
    h = v.to(torch.float16).view(torch.int16)
    return [(h + s).view(torch.float16).float() for s in (0, -1, 1, -2, 2)]


def _try(fmt: str, wb: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes for blocks ``wb [n, B, 32]`` with scale ``d`` (and ``m``) ``[n, B, 1]``, and which blocks
    they reproduce bit for bit ``[n, B]``. In-place steps: this runs over every weight at load."""
    safe = torch.where(d > 0, d, torch.ones_like(d))  # d = 0: a constant block, q = 0 (checked below)
    if fmt == "q4_1":
        q = wb - m
        q.div_(safe).round_().clamp_(0, 15)
        rec = q * d
        rec.add_(m)
    elif fmt == "q4_0":
        q = wb / torch.where(d != 0, d, torch.ones_like(d))
        q.round_().clamp_(-8, 7)
        rec = q * d
        q.add_(8)  # the stored code
    else:
        q = wb / safe
        q.round_().clamp_(-128, 127)
        rec = q * d
    ok = (rec.view(torch.int32) == wb.view(torch.int32)).all(-1) & ((d.squeeze(-1) >= 0) | (fmt == "q4_0"))
    return q, ok


def _fit_rows(fmt: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Codes and block parameters reproducing float32 rows ``w [n, K]`` exactly, or None."""
    n, k = w.shape
    wb = w.reshape(n, k // BLOCK, BLOCK)
    if fmt == "q4_0":  # llama.cpp's q4_0: the largest-magnitude weight v has code 0, so d = v / -8 exactly
        at = wb.abs().argmax(-1, keepdim=True)
        d = (wb.gather(-1, at) / -8).to(torch.float16).float()
        q, ok = _try(fmt, wb, d, None)
        if not bool(ok.all()):
            return None
        return q.reshape(n, k), d.squeeze(-1), None
    if fmt == "q4_1":
        lo, hi = wb.amin(-1, keepdim=True), wb.amax(-1, keepdim=True)
        m = lo.to(torch.float16).float()
        if not bool((m.view(torch.int32) == lo.view(torch.int32)).all()):  # the q = 0 weight is exactly m
            return None
        est = (hi - lo) / 15
    else:
        m = None
        est = wb.abs().amax(-1, keepdim=True) / 127
    cands = _f16_neighbours(est)
    q, ok = _try(fmt, wb, cands[0], m)
    d = cands[0].clone()
    if not bool(ok.all()):  # rare: retry only the blocks the first candidate missed
        bad = (~ok).nonzero(as_tuple=True)
        sub, msub = wb[bad].unsqueeze(0), None if m is None else m[bad].unsqueeze(0)
        done = torch.zeros(sub.shape[:2], dtype=torch.bool)
        qs, ds = q[bad].unsqueeze(0), d[bad].unsqueeze(0)
        for cand in cands[1:]:
            c = cand[bad].unsqueeze(0)
            qc, okc = _try(fmt, sub, c, msub)
            okc &= ~done
            qs = torch.where(okc[..., None], qc, qs)
            ds = torch.where(okc[..., None], c, ds)
            done |= okc
        if not bool(done.all()):
            return None
        q[bad], d[bad] = qs[0], ds[0]
    return q.reshape(n, k), d.squeeze(-1), None if m is None else m.squeeze(-1)


def _to_half_exactly(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``w`` (contiguous float32) as ``dtype`` when that round trip reproduces every value bit for bit, else None.
    A cheap look at the first rows first (a float-trained tensor fails there), then chunk by chunk."""
    head = w[:_SAMPLE_ROWS]
    if not torch.equal(head.to(dtype).float().view(torch.int32), head.view(torch.int32)):
        return None
    out = torch.empty(w.shape, dtype=dtype)
    for r0 in range(0, w.shape[0], _DEQUANT_ROWS):
        part = w[r0:r0 + _DEQUANT_ROWS]
        h = out[r0:r0 + _DEQUANT_ROWS]
        h.copy_(part)
        if not torch.equal(h.float().view(torch.int32), part.view(torch.int32)):
            return None
    return out


def pack_lossless(weight: torch.Tensor, formats: tuple[str, ...] = FORMATS) -> BlockWeight | None:
    """``weight`` (float32 ``[N, K]`` on the CPU) in the first of ``formats`` that reproduces every
    value bit for bit, or None when none does (or K is not a multiple of 32)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
        return None
    n, k = weight.shape
    if k % BLOCK or n == 0:
        return None
    w = weight.detach().contiguous()
    for fmt in formats:
        if fmt in HALF_FORMATS:
            half = _to_half_exactly(w, HALF_FORMATS[fmt])
            if half is not None:
                return from_half(half)
            continue
        if _fit_rows(fmt, w[:_SAMPLE_ROWS]) is None:
            continue
        parts = []
        for r0 in range(0, n, _CHUNK_ROWS):
            fit = _fit_rows(fmt, w[r0:r0 + _CHUNK_ROWS])
            if fit is None:
                break
            parts.append(_pack(fmt, *fit).data)
        else:
            return BlockWeight(fmt, torch.cat(parts) if len(parts) > 1 else parts[0], (n, k))
    return None


def block_scales(raw: np.ndarray, type_name: str, block_bytes: int) -> np.ndarray:
    """The float16 scale fields ``[n_blocks, n_fields]`` of a block tensor's raw bytes (any shape whose size
    is a whole number of ``block_bytes`` blocks), copied out of the (memory-mapped) data: 2 bytes per field."""
    offsets = F16_SCALE_OFFSETS[type_name]
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    fields = np.stack([blocks[:, o:o + 2] for o in offsets], axis=1)  # [n_blocks, n_fields, 2] (a copy)
    return np.ascontiguousarray(fields).view("<f2").reshape(len(blocks), len(offsets))


def check_block_scales(raw: np.ndarray, type_name: str, block_bytes: int, what: str) -> None:
    """FormatError naming ``what`` when a block scale of ``raw`` is Inf or NaN (every value of the tensor is
    finite otherwise, see :data:`F16_SCALE_OFFSETS`).

    One vectorized single-threaded numpy pass over the scales' bits (exponent all ones = Inf or NaN):
    on a 2-core machine shared with other work, torch's threaded ``isfinite`` on float16 was 25× slower
    (7 s vs 0.2 s over SmolLM2's 2.4 M scales, most of which is reading the file's pages)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    # each field read in place through a strided uint16 view (no copy): 18 ms over SmolLM2's scales, where
    # stacking the fields into a copy first took 53 ms (warm pages) — a tenth of the CLI's load
    if not any(((blocks[:, o:o + 2].view("<u2") & 0x7C00) == 0x7C00).any() for o in F16_SCALE_OFFSETS[type_name]):
        return
    d = block_scales(raw, type_name, block_bytes)
    bad = (d.view(np.uint16) & 0x7C00) == 0x7C00
    if bad.any():
        at = int(np.flatnonzero(bad.any(1))[0])
        raise FormatError(f"{what}: {type_name} block {at} has a non-finite float16 scale "
                          f"({d[at].astype(np.float32).tolist()}); the weights are corrupt — re-download or "
                          "re-convert the file")


__all__ = ["F16_SCALE_OFFSETS", "block_scales", "check_block_scales", "BLOCK",
           "BLOCK_BYTES", "FORMATS", "FORMAT_CODES", "BlockWeight", "pack", "dequantize", "dequantize_rows",
           "cat_rows", "pack_lossless", "from_half", "HALF_FORMATS", "GGML_FORMATS"]
