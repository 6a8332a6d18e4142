"""Width-specialized W2A8 linear in Triton.

Two kernels share one contract (``acc`` / ``y`` as in :mod:`bitmtp.ops.reference`):

* ``_w2a8_decode_kernel`` — decode widths M ≤ 16. M is a ``tl.constexpr`` (one compiled kernel per
  width, M1 in the BitMTP paper). A program owns BLOCK_N output rows; for every K tile it loads each
  packed T2 word once, decodes its sixteen 2-bit codes once in registers, and applies them to all M
  activation rows (a [M_PAD, BLOCK_N, BLOCK_K] multiply-reduce), so weight traffic is independent
  of M.
* ``_w2a8_tiled_kernel`` — prefill widths M ≥ 17: BLOCK_M×BLOCK_N tiles with ``tl.dot`` on int8
  operands (int32 accumulate, tensor cores on GPUs).

Both accumulate Σ c·x_q with unsigned codes c ∈ {0,1,2} and subtract Σ x_q per group (the "−Σx"
fold, so the codes never need a signed decode), then fuse the epilogue
``y = Σ_g acc_g · w_scale[n, g] / s_x[m] (+ bias)`` in float32. With ``acc_out`` given they also
write the exact int32 per-group accumulators ``[M, N, n_groups]`` used by the bit-exactness tests.

Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
Test: tests/ops/test_w2a8_linear.py
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bitmtp.triton_kernels import layers as _layers
from bitmtp.triton_kernels.layers import _store_out


@dataclass(frozen=True)
class KernelConfig:
    """Launch configuration for one width bucket."""

    kind: str  # "decode" or "tiled"
    block_n: int
    block_kw: int  # K tile in 32-bit words (16 weights each)
    block_m: int = 0  # tiled kernel only
    num_warps: int = 4


#: Width buckets of the issue: 1, 2–4, 5–8, 9–16 use the decode kernel; ≥ 17 the tiled one.
#: The K tile shrinks as M grows so the [M_PAD, BLOCK_N, BLOCK_K] product stays ≈ 16K elements
#: (≈ 128 int32 registers per thread at 4 warps).
WIDTH_BUCKETS: tuple[tuple[int, int, KernelConfig], ...] = (
    (1, 1, KernelConfig("decode", block_n=64, block_kw=16)),
    (2, 4, KernelConfig("decode", block_n=64, block_kw=4)),
    (5, 8, KernelConfig("decode", block_n=32, block_kw=4)),
    (9, 16, KernelConfig("decode", block_n=32, block_kw=2)),
    (17, 1 << 30, KernelConfig("tiled", block_n=64, block_kw=4, block_m=32)),
)


#: The tiled kernel with BLOCK_M = 16: ``tl.dot`` (tensor cores on a GPU) for a width the decode buckets
#: would multiply-reduce on CUDA cores — weights decoded once per program for all ≤ 16 tokens, as there.
SMALL_TILED = KernelConfig("tiled", block_n=64, block_kw=4, block_m=16)

#: The first width 2..16 that :data:`SMALL_TILED` runs instead of the decode buckets (17: none of them).
#: The first GPU run (H200, session 14) measured the decode buckets at t8/t1 = 4.5–9.75 and t16/t1 =
#: 5.7–9.5 (bench/kernels/test_bench_cuda.py), so that benchmark also times :data:`SMALL_TILED` at M = 8
#: and 16 (``triton_tiled``); a GPU session moves this default from those figures.
TILED_FROM = 17


#: Widths 1..SPLITK_UP_TO run the split-K tensor-core kernel of the fused GPU step
#: (``triton_kernels.layers.w2a8_fused``, epilogue "store": int8 ``tl.dot`` for every width, K split across
#: programs with exact integer partials, so enough programs fill the SMs at M = 1). 0: never, until a GPU run
#: measures it faster than the decode buckets (``bench/kernels/test_bench_cuda.py`` times ``triton_splitk``).
SPLITK_UP_TO = 0


def config_for_width(m: int, tiled_from: int | None = None) -> KernelConfig:
    """The kernel configuration for replay width ``m`` (``tiled_from``: :data:`TILED_FROM` unless given)."""
    first = TILED_FROM if tiled_from is None else tiled_from
    if first < 2:
        raise ValueError(f"tiled_from: the decode kernel always runs width 1; expected >= 2, got {first}")
    if first <= m <= 16:
        return SMALL_TILED
    for lo, hi, cfg in WIDTH_BUCKETS:
        if lo <= m <= hi:
            return cfg
    raise ValueError(f"m: width must be >= 1, got {m}")


@triton.jit
def _decode_codes(words, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr):
    """[BLOCK_N, BLOCK_KW] T2 words -> [BLOCK_N, BLOCK_KW*16] codes (k = 16j + i)."""
    i = tl.arange(0, 16)
    shifts = (i % 4) * 8 + (i // 4) * 2  # weight i = 4s + b sits at bit 8b + 2s
    codes = (words[:, :, None] >> shifts[None, None, :]) & 3
    return tl.reshape(codes, [BLOCK_N, BLOCK_KW * 16])


@triton.jit
def _finish_group(acc, y, acc_ptr, s_ptr, offs_m, offs_n, m_mask, n_mask, N, NG, g, stride_sn,
                  WRITE_ACC: tl.constexpr, WRITE_OUT: tl.constexpr):
    """Group g is summed (−Σx folded): store the exact accumulators and/or add acc·scale into y."""
    if WRITE_ACC:
        tl.store(acc_ptr + (offs_m[:, None] * N + offs_n[None, :]) * NG + g, acc,
                 mask=m_mask[:, None] & n_mask[None, :])
    if WRITE_OUT:
        sc = tl.load(s_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
        y += acc.to(tl.float32) * sc[None, :]
    return y


@triton.jit
def _epilogue(y, xs_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS: tl.constexpr):
    """y / s_x (+ bias), stored in the output dtype."""
    xs = tl.load(xs_ptr + offs_m, mask=m_mask, other=1.0)
    y = y / xs[:, None]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_out(out_ptr + offs_m[:, None] * N + offs_n[None, :], y, m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w2a8_decode_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, acc_ptr,
    N, K, KW, G, NG, stride_sn,
    M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    HAS_BIAS: tl.constexpr, WRITE_ACC: tl.constexpr, WRITE_OUT: tl.constexpr,
):
    BLOCK_K: tl.constexpr = BLOCK_KW * 16
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, M_PAD)
    m_mask = offs_m < M
    offs_j = tl.arange(0, BLOCK_KW)
    offs_kl = tl.arange(0, BLOCK_K)
    y = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for g in range(NG):
        k_lo = g * G
        k_hi = tl.minimum(k_lo + G, K)
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.int32)
        xsum = tl.zeros([M_PAD], dtype=tl.int32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            wj = k0 // 16 + offs_j
            words = tl.load(
                w_ptr + offs_n[:, None] * KW + wj[None, :],
                mask=n_mask[:, None] & (wj[None, :] < KW),
                other=0,
            )
            codes = _decode_codes(words, BLOCK_N, BLOCK_KW)  # decoded once, used for all M rows
            offs_k = k0 + offs_kl
            xk = tl.load(
                xq_ptr + offs_m[:, None] * K + offs_k[None, :],
                mask=m_mask[:, None] & (offs_k[None, :] < k_hi),
                other=0,
            ).to(tl.int32)
            acc += tl.sum(codes[None, :, :] * xk[:, None, :], axis=2)
            xsum += tl.sum(xk, axis=1)
        y = _finish_group(acc - xsum[:, None], y, acc_ptr, s_ptr, offs_m, offs_n, m_mask, n_mask, N, NG, g,
                          stride_sn, WRITE_ACC, WRITE_OUT)
    if WRITE_OUT:
        _epilogue(y, xs_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS)


@triton.jit
def _w2a8_tiled_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, acc_ptr,
    M, N, K, KW, G, NG, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    HAS_BIAS: tl.constexpr, WRITE_ACC: tl.constexpr, WRITE_OUT: tl.constexpr,
):
    BLOCK_K: tl.constexpr = BLOCK_KW * 16
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_j = tl.arange(0, BLOCK_KW)
    offs_kl = tl.arange(0, BLOCK_K)
    y = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(NG):
        k_lo = g * G
        k_hi = tl.minimum(k_lo + G, K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        xsum = tl.zeros([BLOCK_M], dtype=tl.int32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            wj = k0 // 16 + offs_j
            words = tl.load(
                w_ptr + offs_n[:, None] * KW + wj[None, :],
                mask=n_mask[:, None] & (wj[None, :] < KW),
                other=0,
            )
            codes = _decode_codes(words, BLOCK_N, BLOCK_KW).to(tl.int8)  # [BLOCK_N, BLOCK_K]
            offs_k = k0 + offs_kl
            xk = tl.load(
                xq_ptr + offs_m[:, None] * K + offs_k[None, :],
                mask=m_mask[:, None] & (offs_k[None, :] < k_hi),
                other=0,
            )
            acc = tl.dot(xk, tl.trans(codes), acc, out_dtype=tl.int32)
            xsum += tl.sum(xk.to(tl.int32), axis=1)
        y = _finish_group(acc - xsum[:, None], y, acc_ptr, s_ptr, offs_m, offs_n, m_mask, n_mask, N, NG, g,
                          stride_sn, WRITE_ACC, WRITE_OUT)
    if WRITE_OUT:
        _epilogue(y, xs_ptr, bias_ptr, out_ptr, offs_m, offs_n, m_mask, n_mask, N, HAS_BIAS)


def w2a8_matmul(
    x_q: torch.Tensor,
    act_scale: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    k: int,
    group_size: int,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    acc_out: torch.Tensor | None = None,
    tiled_from: int | None = None,
) -> None:
    """Launch the W2A8 kernel for ``x_q[M, K]`` against T2 ``packed[N, ceil(K/16)]``.

    Writes ``out[M, N]`` (float epilogue) and/or ``acc_out int32[M, N, n_groups]``. Inputs must be
    contiguous, on one device, already validated (``bitmtp.ops`` does that); this layer only launches.
    ``tiled_from``: see :func:`config_for_width`.
    """
    m, kk = x_q.shape
    n, kw = packed.shape
    ng = scales.shape[1]
    stride_sn = 0 if scales.shape[0] == 1 else ng
    if m <= SPLITK_UP_TO and out is not None and acc_out is None and bias is None:
        _splitk(x_q, act_scale, packed, scales, kk, group_size, out)
        return
    cfg = config_for_width(m, tiled_from)
    dummy = act_scale  # any valid pointer for arguments a constexpr switch leaves unused
    args = (
        x_q, act_scale, packed, scales,
        bias if bias is not None else dummy,
        out if out is not None else dummy,
        acc_out if acc_out is not None else dummy,
    )
    flags = dict(HAS_BIAS=bias is not None, WRITE_ACC=acc_out is not None, WRITE_OUT=out is not None)
    if cfg.kind == "decode":
        grid = (triton.cdiv(n, cfg.block_n),)
        _w2a8_decode_kernel[grid](
            *args, n, kk, kw, group_size, ng, stride_sn,
            M=m, M_PAD=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_kw,
            num_warps=cfg.num_warps, **flags,
        )
    else:
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
        _w2a8_tiled_kernel[grid](
            *args, m, n, kk, kw, group_size, ng, stride_sn,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_KW=cfg.block_kw,
            num_warps=cfg.num_warps, **flags,
        )


def _splitk(x_q, act_scale, packed, scales, k, group_size, out) -> None:
    """``out = W2A8(x_q)`` through the fused step's split-K kernel (:data:`SPLITK_UP_TO`): zeroed int32 partials and
    counters for this call, K split so that the output tiles × slices fill the GPU's SMs about twice."""
    m, n = x_q.shape[0], packed.shape[0]
    dev = x_q.device
    units = _layers.w2a8_units(n, "store")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
    splits = max(1, min(-(-2 * sms // units), k // 256))
    acc = torch.zeros((_layers.ROWS, n, scales.shape[1]), dtype=torch.int32, device=dev)
    counter = torch.zeros(units, dtype=torch.int32, device=dev)

    def launch(name, kernel, grid, *args, **kwargs):
        kernel[grid](*args, **kwargs)

    _layers.w2a8_fused(launch, x_q, act_scale, packed, scales, k, group_size, acc, counter, m=m, epilogue="store",
                      out=out, splits=splits)


__all__ = ["KernelConfig", "SMALL_TILED", "SPLITK_UP_TO", "TILED_FROM", "WIDTH_BUCKETS", "config_for_width", "w2a8_matmul"]
