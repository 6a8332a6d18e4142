"""The GPU step's fused kernels: a decoder layer in 9 launches, a step's ends in 4 (DESIGN.md, "The GPU step").

Every kernel takes the step's rows padded to a fixed ``ROWS = 16`` (rows ≥ M masked; the row-wise kernels run one
program per live row and leave the padding rows' buffers as they are: every reader masks them): the same compiled
kernel runs every width 1..16, so a row's arithmetic — each product, each reduction's order — cannot depend
on the width it ran in. Integer accumulators are exact whatever the order (split-K partials are added with
integer atomics); float reductions run in a fixed order over fixed tiles. That is invariant (1) of the design
by construction: a verify row equals the AR row bit for bit.

* :func:`norm_quant` — RMSNorm (float64 sum of squares, as ``bitmtp.ops.reference.rms_norm_reference``) and the
  per-token int8 quantization (``bitmtp.formats.quantize.quantize_activations``) of a row, in one program
  per row; either part may be off (the final norm stores floats).
* :func:`w2a8_fused` — W2A8 on int8 ``tl.dot`` (tensor cores on a GPU; codes decoded once per tile), split-K
  with exact int32 partials added atomically; the last program of an output tile runs the epilogue:
  ``store`` (y), ``residual`` (x += y in place), ``glu`` (act(gate)·up from the gate and up rows of one
  gate_up projection; relu² or SiLU in float64) or ``qkv`` (RoPE on the q / k heads, q stored, k and v
  written into the KV cache at each row's slot). It then zeroes its partials and counter for the next launch.
* :func:`attention_partial` / :func:`attention_combine` — split-KV flash decoding: one program per
  (KV head, split) reads each KV row once for every query row and head of its group; splits sit at fixed
  absolute positions; the combine (one program per row, splits in order) quantizes the row for the output
  projection (optionally after BitNet's sub-norm).
* :func:`embed_rows`, :func:`head_partial` / :func:`head_combine` — the token embedding, and the LM head
  with the first argmax, its softmax probability and the runner-up fused (a vocabulary block per program,
  then one program per row over the blocks in order).

Reference: bitmtp.ops.reference.rms_norm_reference, bitmtp.model.layers.silu, bitmtp.model.layers.relu2
Reference: bitmtp.model.layers.apply_rope, bitmtp.formats.quantize.quantize_activations
Reference: bitmtp.ops.reference.w2a8_linear_q_reference, bitmtp.ops.reference.attention_reference
Reference: bitmtp.ops.choose.argmax_prob
Test: tests/triton_kernels/test_layers.py, tests/runtime/test_gpu_step.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: rows every kernel computes (a step's width M ≤ ROWS; rows ≥ M are masked): one compiled kernel per shape
ROWS = 16
#: epilogues of :func:`w2a8_fused`
EPILOGUES = {"store": 0, "residual": 1, "glu": 2, "qkv": 3}
#: activations of the ``glu`` epilogue
ACTIVATIONS = {"relu2": 0, "silu": 1}
#: K elements a W2A8 program consumes per ``tl.dot`` (a multiple of 32: int8 MMA's k)
BLOCK_K = 64
#: KV rows per attention split (fixed: the split positions are absolute, so a row's bits never depend on
#: the segment or the width) and per block inside a split
ATTN_SPLIT = 256
ATTN_BLOCK = 64
#: vocabulary rows per LM-head program
HEAD_BLOCK = 128
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: (v + magic) - magic rounds |v| < 2^22 half to even in float32
#: launch option of the kernels that quantize: no FMA contraction, so ``(h · s + magic) − magic`` rounds the rounded
#: product as torch does (an FMA would round the exact product: a different int8 now and then)
NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _store_out(ptrs, y, mask):
    """Store float32 ``y`` in the output's dtype. bf16 is rounded to nearest-even by hand on the
    bit pattern (the interpreter truncates fp32 -> bf16; GPUs round), so both agree with torch."""
    if ptrs.dtype.element_ty == tl.bfloat16:
        bits = y.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536  # -65536 == 0xFFFF0000
        tl.store(ptrs, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)
    else:
        tl.store(ptrs, y.to(ptrs.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------- norm + quant
@triton.jit
def _quant_row(h, mask, q_ptr, s_ptr):
    """int8 quantization of one float32 row ``h`` (masked lanes 0): bits of quantize_activations."""
    amax = tl.max(tl.where(mask, tl.abs(h), 0.0), axis=0)
    sc = tl.div_rn(1.0, tl.maximum(amax, 1e-5)) * 127.0  # torch: reciprocal, then * 127
    v = (h * sc + _MAGIC) - _MAGIC
    q = tl.minimum(tl.maximum(v, -128.0), 127.0)
    tl.store(q_ptr, q.to(tl.int8), mask=mask)
    tl.store(s_ptr, sc)


@triton.jit
def _lora_down(h, mask, row, M, K, a_ptr, t_ptr, FIRST, RT, RT_PAD: tl.constexpr):
    """t[row, j] = Σ_k h[k] · A[j, k] for a mask row (row ≥ FIRST): the gated LoRA's down-projection of the
    row this program holds whole, one rank at a time (fixed order: the same bits at any width)."""
    if (row >= FIRST) & (row < M):
        offs = tl.arange(0, mask.shape[0])
        for j in range(0, RT):
            a = tl.load(a_ptr + j * K + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(t_ptr + row * RT_PAD + j, tl.sum(a * h, axis=0))


@triton.jit
def _norm_quant_kernel(x_ptr, w_ptr, q_ptr, s_ptr, f_ptr, a_ptr, t_ptr, M, K, stride_x, stride_f, eps, FIRST, RT,
                       BLOCK: tl.constexpr, NORM: tl.constexpr, QUANT: tl.constexpr, STORE_F: tl.constexpr,
                       LORA: tl.constexpr, RT_PAD: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    h = tl.load(x_ptr + row * stride_x + offs, mask=offs < tl.where(row < M, K, 0), other=0.0).to(tl.float32)
    if NORM:
        hd = h.to(tl.float64)
        var = (tl.sum(hd * hd, axis=0) / K).to(tl.float32)
        inv = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        h = w * (h * inv)
    if STORE_F:
        tl.store(f_ptr + row * stride_f + offs, h, mask=mask)  # padding rows: zeros (their input is masked)
    if QUANT:
        _quant_row(h, mask, q_ptr + row * K + offs, s_ptr + row)
    if LORA:
        _lora_down(h, mask, row, M, K, a_ptr, t_ptr, FIRST, RT, RT_PAD)


def _lora_args(lora, dummy):
    """(A, t, first row, rank, RT_PAD, on) of an optional gated-LoRA down-projection ``lora = (A [RT, K], t
    [ROWS, RT_PAD], first_row)``."""
    if lora is None:
        return dummy, dummy, 0, 0, 16, False
    a, t, first = lora
    return a, t, first, a.shape[0], t.shape[1], True


def norm_quant(launch, x, weight, eps, *, m, q=None, s=None, f=None, lora=None):
    """``m`` programs over rows ``x[:m, K]`` (rows ≥ ``m`` left as they are): RMSNorm with ``weight`` (None:
    none) then int8 quantization into ``q[ROWS, K]`` / ``s[ROWS]`` (None: none) and/or the float32 rows
    into ``f[ROWS, K]``; with ``lora = (A, t, first_row)`` also the gated LoRA's ``t = h · Aᵀ`` of the mask rows
    (rows ≥ first_row). ``m``: the step's width (a Python int: graphs capture one runner per width)."""
    k = x.shape[1]
    a, t, first, rt, rt_pad, on = _lora_args(lora, x)
    launch("norm_quant", _norm_quant_kernel, (m,), x, weight if weight is not None else x,
           q if q is not None else x, s if s is not None else x, f if f is not None else x, a, t, m, k,
           x.stride(0), f.stride(0) if f is not None else 0, float(eps), first, rt,
           BLOCK=triton.next_power_of_2(k), NORM=weight is not None, QUANT=q is not None, STORE_F=f is not None,
           LORA=on, RT_PAD=rt_pad, **NO_FMA)


def quantize_rows(x: torch.Tensor, q: torch.Tensor | None = None, s: torch.Tensor | None = None):
    """Per-token int8 quantization of ``x[M, K]`` (any M; float32 / bf16 / fp16 rows), one program a row:
    ``(q int8[M, K], s float32[M])``, the bits of ``quantize_activations``. What the triton and cuda backends'
    ``act_quant`` run (one launch where the torch reference took eight)."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device) if q is None else q
    s = torch.empty((m,), dtype=torch.float32, device=x.device) if s is None else s
    if m:
        _norm_quant_kernel[(m,)](x, x, q, s, x, x, x, m, k, x.stride(0), 0, 0.0, 0, 0,
                                 BLOCK=triton.next_power_of_2(k), NORM=False, QUANT=True, STORE_F=False, LORA=False,
                                 RT_PAD=16, **NO_FMA)
    return q, s


# ------------------------------------------------------------------------------------------------ W2A8
@triton.jit
def _dot_rows(xq_ptr, w_ptr, rows, r_mask, k0, k_end, M, K, KW, BLOCK_N: tl.constexpr):
    """int32 [ROWS, BLOCK_N] partial of x_q[:, k0 : min(k0 + BLOCK_K, k_end)] against the T2 rows ``rows``, with
    the −Σx fold; codes decoded once for all rows."""
    offs_m = tl.arange(0, 16)
    offs_j = tl.arange(0, 4)  # BLOCK_K / 16 words
    wj = k0 // 16 + offs_j
    words = tl.load(w_ptr + rows[:, None] * KW + wj[None, :], mask=r_mask[:, None] & (wj[None, :] < KW), other=0)
    i = tl.arange(0, 16)
    shifts = (i % 4) * 8 + (i // 4) * 2
    codes = tl.reshape((words[:, :, None] >> shifts[None, None, :]) & 3, [BLOCK_N, 64]).to(tl.int8)
    offs_k = k0 + tl.arange(0, 64)
    # rows ≥ M are not read (zeros): an M = 1 step moves one row of activations, not 16
    xk = tl.load(xq_ptr + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_end),
                 other=0)
    acc = tl.dot(xk, tl.trans(codes), out_dtype=tl.int32)
    return acc - tl.sum(xk.to(tl.int32), axis=1)[:, None]


@triton.jit
def _scaled(acc_ptr, s_ptr, xs_ptr, rows, r_mask, M, N, NG, stride_sn):
    """y[ROWS, BLOCK] = Σ_g acc_g · scale[row, g] / s_x (float32, groups in order) from the int32 partials (rows
    ≥ M are neither read nor meaningful)."""
    offs_m = tl.arange(0, 16)
    y = tl.zeros([16, rows.shape[0]], dtype=tl.float32)
    for g in range(NG):
        acc = tl.load(acc_ptr + (offs_m[:, None] * N + rows[None, :]) * NG + g,
                      mask=(offs_m[:, None] < M) & r_mask[None, :], other=0, volatile=True)
        sc = tl.load(s_ptr + rows * stride_sn + g, mask=r_mask, other=0.0)
        y += acc.to(tl.float32) * sc[None, :]
    xs = tl.load(xs_ptr + offs_m, mask=offs_m < M, other=1.0)
    return y / xs[:, None]


@triton.jit
def _clear(acc_ptr, rows, r_mask, M, N, NG):
    """Zero the partials of rows < M (the only ones the atomics touched)."""
    offs_m = tl.arange(0, 16)
    for g in range(NG):
        tl.store(acc_ptr + (offs_m[:, None] * N + rows[None, :]) * NG + g, tl.zeros([16, rows.shape[0]], tl.int32),
                 mask=(offs_m[:, None] < M) & r_mask[None, :])


@triton.jit
def _silu64(g):
    gd = g.to(tl.float64)
    return (gd / (1.0 + tl.exp(-gd))).to(tl.float32)


@triton.jit
def _lora_up(y, rows, r_mask, M, t_ptr, b_ptr, FIRST, RT, RT_PAD: tl.constexpr, scaling):
    """y + scaling · t · Bᵀ on the mask rows (rows in [FIRST, M)); the other rows keep their bits (the gate)."""
    offs_m = tl.arange(0, 16)
    gate = (offs_m >= FIRST) & (offs_m < M)
    d = tl.zeros(y.shape, dtype=tl.float32)
    for j in range(0, RT):
        tj = tl.load(t_ptr + offs_m * RT_PAD + j, mask=gate, other=0.0)
        bj = tl.load(b_ptr + rows * RT + j, mask=r_mask, other=0.0).to(tl.float32)
        d += tj[:, None] * bj[None, :]
    return tl.where(gate[:, None], y + d * scaling, y)


@triton.jit
def _head_norm(y_a, y_b, a_mask, w_ptr, offs_b, HALF, HD, eps):
    """RMSNorm over one head (its halves ``y_a`` / ``y_b``, masked lanes 0): ``model.layers.rms_norm``'s rule —
    the mean of squares summed in float64, rounded to float32 — for Qwen3's q / k norms."""
    da = tl.where(a_mask[None, :], y_a, 0.0).to(tl.float64)
    db = tl.where(a_mask[None, :], y_b, 0.0).to(tl.float64)
    var = ((tl.sum(da * da, axis=1) + tl.sum(db * db, axis=1)) / HD).to(tl.float32)
    inv = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
    w_a = tl.load(w_ptr + offs_b, mask=a_mask, other=0.0).to(tl.float32)
    w_b = tl.load(w_ptr + HALF + offs_b, mask=a_mask, other=0.0).to(tl.float32)
    return w_a[None, :] * (y_a * inv[:, None]), w_b[None, :] * (y_b * inv[:, None])


@triton.jit
def _epilogue(y_a, y_b, unit, offs_b, rows_a, rows_b, a_mask, M, out_ptr, stride_o, pos_ptr, slot_ptr, cos_ptr,
              sin_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr, eps, lb_ptr, lt_ptr, FIRST, RT, scaling, HALF_OR_I, HQ, HKV,
              S_ROWS, HD, EPI: tl.constexpr, ACT: tl.constexpr, TWO: tl.constexpr, LORA: tl.constexpr,
              RT_PAD: tl.constexpr, QK_NORM: tl.constexpr):
    """A projection's float32 rows ``y_a`` (and ``y_b``: the up rows of a gate, a head's second half) → their
    destination: store, residual add, gated activation, or (q / k norm +) RoPE + q store / KV write
    (``EPILOGUES``); with ``LORA`` the gated LoRA's up-projection is added to the mask rows first."""
    if LORA:  # the gated LoRA's up-projection, mask rows only
        y_a = _lora_up(y_a, rows_a, a_mask, M, lt_ptr, lb_ptr, FIRST, RT, RT_PAD, scaling)
        if TWO:
            y_b = _lora_up(y_b, rows_b, a_mask, M, lt_ptr, lb_ptr, FIRST, RT, RT_PAD, scaling)
    offs_m = tl.arange(0, 16)
    m_mask = offs_m[:, None] < M
    if EPI == 0:  # in the output's dtype (bf16 rounded to nearest even on every path, the interpreter's too)
        _store_out(out_ptr + offs_m[:, None] * stride_o + rows_a[None, :], y_a, m_mask & a_mask[None, :])
    elif EPI == 1:
        ptrs = out_ptr + offs_m[:, None] * stride_o + rows_a[None, :]
        res = tl.load(ptrs, mask=m_mask & a_mask[None, :], other=0.0)
        tl.store(ptrs, res + y_a, mask=m_mask & a_mask[None, :])
    elif EPI == 2:
        if ACT == 0:
            r = tl.maximum(y_a, 0.0)
            act = r * r
        else:
            act = _silu64(y_a)
        tl.store(out_ptr + offs_m[:, None] * stride_o + rows_a[None, :], act * y_b, mask=m_mask & a_mask[None, :])
    else:
        mm = offs_m < M
        if QK_NORM:  # Qwen3: a q or k head's RMSNorm before its rotation
            if unit < HQ:
                y_a, y_b = _head_norm(y_a, y_b, a_mask, qn_ptr, offs_b, HALF_OR_I, HD, eps)
            elif unit < HQ + HKV:
                y_a, y_b = _head_norm(y_a, y_b, a_mask, kn_ptr, offs_b, HALF_OR_I, HD, eps)
        if unit < HQ + HKV:  # q or k head: rotate-half RoPE at each row's position
            pos = tl.load(pos_ptr + offs_m, mask=mm, other=0)
            c = tl.load(cos_ptr + pos[:, None] * HD + offs_b[None, :], mask=mm[:, None] & a_mask[None, :], other=0.0)
            sn = tl.load(sin_ptr + pos[:, None] * HD + offs_b[None, :], mask=mm[:, None] & a_mask[None, :],
                         other=0.0)
            lo = y_a * c - y_b * sn
            hi = y_b * c + y_a * sn
        else:
            lo = y_a
            hi = y_b
        full = mm[:, None] & a_mask[None, :]
        if unit < HQ:
            base = out_ptr + offs_m[:, None] * stride_o + unit * HD + offs_b[None, :]
            tl.store(base, lo, mask=full)
            tl.store(base + HALF_OR_I, hi, mask=full)
        else:
            slot = tl.load(slot_ptr + offs_m, mask=mm, other=0)
            if unit < HQ + HKV:
                dst = kc_ptr + ((unit - HQ) * S_ROWS + slot[:, None]) * HD + offs_b[None, :]
            else:
                dst = vc_ptr + ((unit - HQ - HKV) * S_ROWS + slot[:, None]) * HD + offs_b[None, :]
            tl.store(dst, lo.to(dst.dtype.element_ty), mask=full)
            tl.store(dst + HALF_OR_I, hi.to(dst.dtype.element_ty), mask=full)


@triton.jit
def _unit_rows(unit, N, HALF_OR_I, HD, BLOCK_N: tl.constexpr, EPI: tl.constexpr):
    """The output rows of program ``unit``: (rows_a, mask, rows_b) — rows_b the up rows of a gate or a head's
    second half."""
    offs_b = tl.arange(0, BLOCK_N)
    if EPI == 3:
        rows_a = unit * HD + offs_b  # a head's first half; v heads are rows like any other
        a_mask = offs_b < HALF_OR_I
    else:
        rows_a = unit * BLOCK_N + offs_b
        a_mask = rows_a < (HALF_OR_I if EPI == 2 else N)
    return rows_a, a_mask, rows_a + HALF_OR_I


@triton.jit
def _w2a8_fused_kernel(
    xq_ptr, xs_ptr, w_ptr, s_ptr, acc_ptr, cnt_ptr, out_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
    qn_ptr, kn_ptr, eps, lb_ptr, lt_ptr, M, N, K, KW, NG, GROUP_K, stride_sn, stride_o, SPLIT_K, HALF_OR_I, HQ, HKV,
    S_ROWS, HD, FIRST, RT, scaling,
    BLOCK_N: tl.constexpr, EPI: tl.constexpr, ACT: tl.constexpr, TWO: tl.constexpr, LORA: tl.constexpr,
    RT_PAD: tl.constexpr, QK_NORM: tl.constexpr,
):
    unit = tl.program_id(0)
    split = tl.program_id(1)
    offs_b = tl.arange(0, BLOCK_N)
    rows_a, a_mask, rows_b = _unit_rows(unit, N, HALF_OR_I, HD, BLOCK_N, EPI)
    b_mask = a_mask
    # split-K: this program's K range (whole groups when there are several, so partials stay per group)
    k_lo = split * SPLIT_K
    k_hi = tl.minimum(k_lo + SPLIT_K, K)
    offs_m = tl.arange(0, 16)
    for g in range(NG):
        g_lo = tl.maximum(k_lo, g * GROUP_K)
        g_hi = tl.minimum(k_hi, g * GROUP_K + GROUP_K)
        if g_lo < g_hi:
            acc_a = tl.zeros([16, BLOCK_N], dtype=tl.int32)
            acc_b = tl.zeros([16, BLOCK_N], dtype=tl.int32)
            for k0 in range(g_lo, g_hi, 64):
                acc_a += _dot_rows(xq_ptr, w_ptr, rows_a, a_mask, k0, g_hi, M, K, KW, BLOCK_N)
                if TWO:
                    acc_b += _dot_rows(xq_ptr, w_ptr, rows_b, b_mask, k0, g_hi, M, K, KW, BLOCK_N)
            live = (offs_m[:, None] < M) & a_mask[None, :]
            tl.atomic_add(acc_ptr + (offs_m[:, None] * N + rows_a[None, :]) * NG + g, acc_a, mask=live)
            if TWO:
                tl.atomic_add(acc_ptr + (offs_m[:, None] * N + rows_b[None, :]) * NG + g, acc_b, mask=live)
    # the last program of this unit (integer partials: their sum is exact in any order) runs the epilogue
    done = tl.atomic_add(cnt_ptr + unit, 1)
    if done == tl.num_programs(1) - 1:
        y_a = _scaled(acc_ptr, s_ptr, xs_ptr, rows_a, a_mask, M, N, NG, stride_sn)
        y_b = y_a
        if TWO:
            y_b = _scaled(acc_ptr, s_ptr, xs_ptr, rows_b, b_mask, M, N, NG, stride_sn)
        _epilogue(y_a, y_b, unit, offs_b, rows_a, rows_b, a_mask, M, out_ptr, stride_o, pos_ptr, slot_ptr, cos_ptr,
                  sin_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr, eps, lb_ptr, lt_ptr, FIRST, RT, scaling, HALF_OR_I, HQ,
                  HKV, S_ROWS, HD, EPI, ACT, TWO, LORA, RT_PAD, QK_NORM)
        # leave the partials and the counter zeroed for the next launch (no memset launch)
        _clear(acc_ptr, rows_a, a_mask, M, N, NG)
        if TWO:
            _clear(acc_ptr, rows_b, b_mask, M, N, NG)
        tl.store(cnt_ptr + unit, 0)


def w2a8_fused(launch, x_q, x_s, weight, scales, k, group_size, acc, counter, *, m, epilogue, out, splits,
               block_n=64, activation="relu2", inter=0, qkv=None, lora=None, qk_norm=None):
    """One W2A8 projection of the int8 rows ``x_q[ROWS, k]`` (scales ``x_s[ROWS]``) against T2 ``weight[N, KW]``
    with its epilogue (module docstring), in ``splits`` K-slices. ``acc int32[ROWS, N, n_groups]`` and
    ``counter int32[units]`` are zero on entry and left zero. ``epilogue``:

    * ``"store"`` / ``"residual"``: ``out[:m, :N]`` = y / += y;
    * ``"glu"``: ``out[:m, :inter]`` = act(y[:, :inter]) · y[:, inter:] (``N == 2 * inter``);
    * ``"qkv"``: ``qkv = (positions, slots, cos, sin, k_cache, v_cache, q_heads, kv_heads, head_dim)``; q
      heads (RoPE'd) into ``out[:m, :q_heads * head_dim]``, k (RoPE'd) and v into the caches at ``slots``;
      ``qk_norm = (q_weight [head_dim], k_weight [head_dim], eps)``: each q and k head RMS-normed before RoPE.

    ``lora = (B [N, RT], t [ROWS, RT_PAD], first_row, scaling)``: the gated LoRA's up-projection added to rows
    ``[first_row, m)`` before the epilogue (``t`` from :func:`norm_quant` / :func:`attention_split`).
    """
    n, kw = weight.shape
    ng = scales.shape[1]
    stride_sn = 0 if scales.shape[0] == 1 else ng
    epi = EPILOGUES[epilogue]
    split_k = k if splits <= 1 else -(-k // splits)
    if ng > 1:  # a K-slice covers whole groups
        split_k = -(-split_k // group_size) * group_size
    split_k = -(-split_k // BLOCK_K) * BLOCK_K
    n_splits = -(-k // split_k)
    dummy = x_s
    lb, lt, first, rt, rt_pad, lscale, on = _lora_up_args(lora, dummy)
    qn, kn, eps, norm_on = _qk_norm_args(qk_norm, dummy)
    if epi == 3:
        positions, slots, cos, sin, kc, vc, hq, hkv, hd = qkv
        units, half = hq + 2 * hkv, hd // 2
        grid = (units, n_splits)
        # a program per head: its two halves (tl.dot needs tiles of at least 16 columns: a smaller half is masked)
        launch("w2a8_qkv", _w2a8_fused_kernel, grid, x_q, x_s, weight, scales, acc, counter, out, positions, slots,
               cos, sin, kc, vc, qn, kn, eps, lb, lt, m, n, k, kw, ng, group_size, stride_sn, out.stride(0), split_k,
               half, hq, hkv, kc.shape[1], hd, first, rt, lscale, BLOCK_N=max(16, half), EPI=3, ACT=0, TWO=True,
               LORA=on, RT_PAD=rt_pad, QK_NORM=norm_on)
        return
    half_or_i = inter if epi == 2 else 0
    span = inter if epi == 2 else n
    grid = (triton.cdiv(span, block_n), n_splits)
    launch(f"w2a8_{epilogue}", _w2a8_fused_kernel, grid, x_q, x_s, weight, scales, acc, counter, out, dummy, dummy,
           dummy, dummy, dummy, dummy, dummy, dummy, 0.0, lb, lt, m, n, k, kw, ng, group_size, stride_sn,
           out.stride(0), split_k, half_or_i, 0, 0, 0, 1, first, rt, lscale, BLOCK_N=block_n, EPI=epi,
           ACT=ACTIVATIONS[activation], TWO=epi == 2, LORA=on, RT_PAD=rt_pad, QK_NORM=False)


def _qk_norm_args(qk_norm, dummy):
    """(q weight, k weight, eps, on) of an optional ``qk_norm = (q_weight, k_weight, eps)``."""
    if qk_norm is None:
        return dummy, dummy, 0.0, False
    qn, kn, eps = qk_norm
    return qn, kn, float(eps), True


def _lora_up_args(lora, dummy):
    """(B, t, first row, rank, RT_PAD, scaling, on) of an optional ``lora = (B [N, RT], t, first_row, scaling)``."""
    if lora is None:
        return dummy, dummy, 0, 0, 16, 1.0, False
    b, t, first, scaling = lora
    return b, t, first, b.shape[1], t.shape[1], float(scaling), True


def w2a8_units(n: int, epilogue: str, *, block_n: int = 64, inter: int = 0, heads: int = 0) -> int:
    """Programs along N of :func:`w2a8_fused` (the size its counter needs)."""
    if epilogue == "qkv":
        return heads
    return triton.cdiv(inter if epilogue == "glu" else n, block_n)


# ----------------------------------------------------------------------------------------------- dense
@triton.jit
def _fdot(xk, wk, acc, IEEE: tl.constexpr):
    """acc + xk[16, BK] · wk[BN, BK]ᵀ with float32 accumulation: on a GPU in the weight's dtype (bf16 / fp16
    tensor cores); float32 weights, and the interpreter (whose bf16 dot is wrong), take the same products in
    float32 (x rounded to the weight's dtype by hand first: the interpreter's cast truncates)."""
    if IEEE:
        if wk.dtype == tl.bfloat16:
            bits = xk.to(tl.int32, bitcast=True)
            xk = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
        elif wk.dtype != tl.float32:
            xk = xk.to(wk.dtype).to(tl.float32)
        return tl.dot(xk, tl.trans(wk.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(xk.to(wk.dtype), tl.trans(wk), acc)


@triton.jit
def _dense_fused_kernel(
    x_ptr, w_ptr, bias_ptr, part_ptr, cnt_ptr, out_ptr, pos_ptr, slot_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
    qn_ptr, kn_ptr, eps, lb_ptr, lt_ptr, M, N, K, stride_x, stride_o, SPLIT_K, HALF_OR_I, HQ, HKV, S_ROWS, HD, FIRST,
    RT, scaling,
    BLOCK_N: tl.constexpr, EPI: tl.constexpr, ACT: tl.constexpr, TWO: tl.constexpr, HAS_BIAS: tl.constexpr,
    IEEE: tl.constexpr, LORA: tl.constexpr, RT_PAD: tl.constexpr, QK_NORM: tl.constexpr,
):
    unit = tl.program_id(0)
    split = tl.program_id(1)
    offs_b = tl.arange(0, BLOCK_N)
    rows_a, a_mask, rows_b = _unit_rows(unit, N, HALF_OR_I, HD, BLOCK_N, EPI)
    offs_m = tl.arange(0, 16)
    k_lo = split * SPLIT_K
    k_hi = tl.minimum(k_lo + SPLIT_K, K)
    acc_a = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    acc_b = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, 64):
        offs_k = k0 + tl.arange(0, 64)
        k_mask = offs_k < k_hi
        xk = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :],
                     mask=(offs_m[:, None] < M) & k_mask[None, :], other=0.0).to(tl.float32)
        wa = tl.load(w_ptr + rows_a[:, None] * K + offs_k[None, :], mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        acc_a = _fdot(xk, wa, acc_a, IEEE)
        if TWO:
            wb = tl.load(w_ptr + rows_b[:, None] * K + offs_k[None, :], mask=a_mask[:, None] & k_mask[None, :],
                         other=0.0)
            acc_b = _fdot(xk, wb, acc_b, IEEE)
    # float partials are not associative: each split stores its own, the last program adds them in split order
    live = (offs_m[:, None] < M) & a_mask[None, :]
    base = part_ptr + split * 16 * N + offs_m[:, None] * N
    tl.store(base + rows_a[None, :], acc_a, mask=live)
    if TWO:
        tl.store(base + rows_b[None, :], acc_b, mask=live)
    done = tl.atomic_add(cnt_ptr + unit, 1)
    if done == tl.num_programs(1) - 1:
        y_a = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        y_b = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for sp in range(0, tl.num_programs(1)):
            src = part_ptr + sp * 16 * N + offs_m[:, None] * N
            y_a += tl.load(src + rows_a[None, :], mask=live, other=0.0, volatile=True)
            if TWO:
                y_b += tl.load(src + rows_b[None, :], mask=live, other=0.0, volatile=True)
        if HAS_BIAS:
            y_a += tl.load(bias_ptr + rows_a, mask=a_mask, other=0.0).to(tl.float32)[None, :]
            if TWO:
                y_b += tl.load(bias_ptr + rows_b, mask=a_mask, other=0.0).to(tl.float32)[None, :]
        if not TWO:
            y_b = y_a
        _epilogue(y_a, y_b, unit, offs_b, rows_a, rows_b, a_mask, M, out_ptr, stride_o, pos_ptr, slot_ptr, cos_ptr,
                  sin_ptr, kc_ptr, vc_ptr, qn_ptr, kn_ptr, eps, lb_ptr, lt_ptr, FIRST, RT, scaling, HALF_OR_I, HQ,
                  HKV, S_ROWS, HD, EPI, ACT, TWO, LORA, RT_PAD, QK_NORM)
        tl.store(cnt_ptr + unit, 0)


def dense_fused(launch, x, weight, bias, parts, counter, *, m, epilogue, out, splits, block_n=64,
                activation="relu2", inter=0, qkv=None, lora=None, qk_norm=None):
    """:func:`w2a8_fused` for a dense ``weight[N, K]`` (bf16 / fp16 / fp32) on float32 rows ``x[ROWS, ≥K]``, with an
    optional ``bias[N]``. ``parts``: float32 scratch of at least ``splits × ROWS × N`` (no zeroing needed);
    ``counter`` as for :func:`w2a8_fused`. Split-K partials are summed in split order by the tile's last program, so
    the result is the same whichever program finishes last."""
    n, k = weight.shape
    epi = EPILOGUES[epilogue]
    split_k = triton.cdiv(triton.cdiv(k, max(splits, 1)), 64) * 64
    n_splits = -(-k // split_k)
    ieee = weight.dtype == torch.float32 or weight.device.type == "cpu"
    lb, lt, first, rt, rt_pad, lscale, on = _lora_up_args(lora, x)
    qn, kn, eps, norm_on = _qk_norm_args(qk_norm if epi == 3 else None, x)
    flags = dict(EPI=epi, HAS_BIAS=bias is not None, IEEE=ieee, LORA=on, RT_PAD=rt_pad, QK_NORM=norm_on)
    b = bias if bias is not None else x
    if epi == 3:
        positions, slots, cos, sin, kc, vc, hq, hkv, hd = qkv
        half = hd // 2
        launch("dense_qkv", _dense_fused_kernel, (hq + 2 * hkv, n_splits), x, weight, b, parts, counter, out, positions,
               slots, cos, sin, kc, vc, qn, kn, eps, lb, lt, m, n, k, x.stride(0), out.stride(0), split_k, half, hq,
               hkv, kc.shape[1], hd, first, rt, lscale, BLOCK_N=max(16, half), ACT=0, TWO=True, **flags)
        return
    span = inter if epi == 2 else n
    launch(f"dense_{epilogue}", _dense_fused_kernel, (triton.cdiv(span, block_n), n_splits), x, weight, b, parts,
           counter, out, x, x, x, x, x, x, qn, kn, eps, lb, lt, m, n, k, x.stride(0), out.stride(0), split_k,
           inter if epi == 2 else 0, 0, 0, 0, 1, first, rt, lscale, BLOCK_N=block_n, ACT=ACTIVATIONS[activation],
           TWO=epi == 2, **flags)


# ------------------------------------------------------------------------------------------- attention
@triton.jit
def _attn_partial_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, pm_ptr, pl_ptr, pacc_ptr, M, L, S_ROWS, H, scale,
                         GROUP: tl.constexpr, D: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr,
                         BLOCK_L: tl.constexpr, NSPLIT_MAX):
    kvh = tl.program_id(0)
    sp = tl.program_id(1)
    r = tl.arange(0, R)  # r = row * GROUP + head within the group
    row = r // GROUP
    head = kvh * GROUP + r % GROUP
    live = row < M
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + (row[:, None] * H + head[:, None]) * D + offs_d[None, :], mask=live[:, None], other=0.0)
    m_run = tl.full([R], -1.0e30, dtype=tl.float32)
    l_run = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, D], dtype=tl.float32)
    for l0 in range(sp * SPLIT, sp * SPLIT + SPLIT, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        in_l = offs_l < L
        vis = tl.load(mask_ptr + row[:, None] * L + offs_l[None, :], mask=live[:, None] & in_l[None, :], other=0) != 0
        any_vis = tl.max(vis.to(tl.int32), axis=0) > 0  # a KV row some query row sees: read it, once
        kv_off = (kvh * S_ROWS + offs_l[:, None]) * D + offs_d[None, :]
        kk = tl.load(k_ptr + kv_off, mask=(in_l & any_vis)[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(kk), input_precision="ieee") * scale
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_run - m_new)
        vv = tl.load(v_ptr + kv_off, mask=(in_l & any_vis)[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, vv, input_precision="ieee")
        l_run = l_run * alpha + tl.sum(p, axis=1)
        m_run = m_new
    base = (kvh * NSPLIT_MAX + sp) * R + r
    tl.store(pm_ptr + base, m_run)
    tl.store(pl_ptr + base, l_run)
    tl.store(pacc_ptr + base[:, None] * D + offs_d[None, :], acc)


@triton.jit
def _attn_combine_kernel(pm_ptr, pl_ptr, pacc_ptr, w_ptr, q_ptr, s_ptr, f_ptr, a_ptr, t_ptr, stride_f, M, NSPLIT,
                         NSPLIT_MAX, eps, FIRST, RT,
                         H: tl.constexpr, H_PAD: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                         NORM: tl.constexpr, STORE_F: tl.constexpr, QUANT: tl.constexpr, LORA: tl.constexpr,
                         RT_PAD: tl.constexpr):
    row = tl.program_id(0)
    h = tl.arange(0, H_PAD)
    h_mask = h < H
    kvh = h // GROUP
    r = row * GROUP + h % GROUP
    offs_d = tl.arange(0, D)
    m_tot = tl.full([H_PAD], -1.0e30, dtype=tl.float32)
    for sp in range(0, NSPLIT):
        m_tot = tl.maximum(m_tot, tl.load(pm_ptr + (kvh * NSPLIT_MAX + sp) * R + r, mask=h_mask, other=-1.0e30))
    l_tot = tl.zeros([H_PAD], dtype=tl.float32)
    acc = tl.zeros([H_PAD, D], dtype=tl.float32)
    for sp in range(0, NSPLIT):  # in order: the same sum whatever else ran
        base = (kvh * NSPLIT_MAX + sp) * R + r
        w = tl.exp(tl.load(pm_ptr + base, mask=h_mask, other=-1.0e30) - m_tot)
        l_tot += tl.load(pl_ptr + base, mask=h_mask, other=0.0) * w
        acc += tl.load(pacc_ptr + base[:, None] * D + offs_d[None, :], mask=h_mask[:, None], other=0.0) * w[:, None]
    out = tl.where(l_tot[:, None] > 0, acc / tl.where(l_tot > 0, l_tot, 1.0)[:, None], 0.0)  # no visible row: 0
    out = tl.reshape(out, [H_PAD * D])
    offs = tl.arange(0, H_PAD * D)
    mask = offs < H * D
    out = tl.where(offs < tl.where(row < M, H * D, 0), out, 0.0)
    if NORM:
        od = out.to(tl.float64)
        var = (tl.sum(od * od, axis=0) / (H * D)).to(tl.float32)
        inv = tl.div_rn(1.0, tl.sqrt_rn(var + eps))
        wn = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        out = wn * (out * inv)
    if STORE_F:
        tl.store(f_ptr + row * stride_f + offs, out, mask=mask)
    if QUANT:
        _quant_row(out, mask, q_ptr + row * (H * D) + offs, s_ptr + row)
    if LORA:
        _lora_down(out, mask, row, M, H * D, a_ptr, t_ptr, FIRST, RT, RT_PAD)


def attention_split(launch, q, k_cache, v_cache, mask, scale, parts, *, m, nsplit_max, sub_norm, eps, q_out=None,
                    s_out=None, f_out=None, lora=None):
    """Attention of ``q[ROWS, H, D]`` over KV rows ``[0, L)`` (``L = mask.shape[1]``) of the caches
    ``[KVH, S, D]`` under ``mask[M, L]``, then (after ``sub_norm``: a weight, or None) the output rows' int8
    quantization into ``q_out[ROWS, H·D]`` / ``s_out[ROWS]`` and/or the float32 rows into ``f_out``. ``parts``:
    (m, l, acc) scratch of :func:`attention_scratch`. Two launches."""
    _, h, d = q.shape
    kvh, s_rows, _ = k_cache.shape
    group = h // kvh
    length = mask.shape[1]
    r = triton.next_power_of_2(ROWS * group)
    nsplit = triton.cdiv(length, ATTN_SPLIT)
    pm, pl, pacc = parts
    launch("attention_partial", _attn_partial_kernel, (kvh, nsplit), q, k_cache, v_cache, mask, pm, pl, pacc, m,
           length, s_rows, h, float(scale), GROUP=group, D=d, R=r, SPLIT=ATTN_SPLIT, BLOCK_L=ATTN_BLOCK,
           NSPLIT_MAX=nsplit_max)
    a, t, first, rt, rt_pad, on = _lora_args(lora, pm)
    launch("attention_combine", _attn_combine_kernel, (m,), pm, pl, pacc,
           sub_norm if sub_norm is not None else pm, q_out if q_out is not None else pm,
           s_out if s_out is not None else pm, f_out if f_out is not None else pm, a, t,
           f_out.stride(0) if f_out is not None else 0, m, nsplit, nsplit_max, float(eps), first, rt,
           H=h, H_PAD=triton.next_power_of_2(h), GROUP=group, D=d, R=r, NORM=sub_norm is not None,
           STORE_F=f_out is not None, QUANT=q_out is not None, LORA=on, RT_PAD=rt_pad, **NO_FMA)


def attention_scratch(kv_heads: int, heads: int, head_dim: int, rows: int, device) -> tuple[torch.Tensor, ...]:
    """The partials of :func:`attention_split` for a store of ``rows`` KV rows: (m, l, acc) float32."""
    r = triton.next_power_of_2(ROWS * (heads // kv_heads))
    nsplit = triton.cdiv(rows, ATTN_SPLIT)
    return (torch.empty(kv_heads * nsplit * r, dtype=torch.float32, device=device),
            torch.empty(kv_heads * nsplit * r, dtype=torch.float32, device=device),
            torch.empty(kv_heads * nsplit * r * head_dim, dtype=torch.float32, device=device))


# -------------------------------------------------------------------------------------- embedding and head
@triton.jit
def _embed_kernel(tok_ptr, emb_ptr, me_ptr, out_ptr, M, K, FIRST, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    if row < FIRST:
        tok = tl.load(tok_ptr + row + tl.zeros([1], tl.int32), mask=row + tl.zeros([1], tl.int32) < M, other=0)
        x = tl.load(emb_ptr + tok * K + offs, mask=offs < tl.where(row < M, K, 0), other=0.0).to(tl.float32)
    else:  # a mask row: the adapter's mask embedding
        x = tl.load(me_ptr + offs, mask=offs < tl.where(row < M, K, 0), other=0.0).to(tl.float32)
    tl.store(out_ptr + row * K + offs, x, mask=mask)


def embed_rows(launch, tokens, table, out, *, m, mask_embedding=None, first_mask_row=None):
    """``out[:m, K]`` = rows ``tokens[:m]`` of ``table[V, K]`` as float32 (rows ≥ m left as they are); rows from
    ``first_mask_row`` on take ``mask_embedding[K]`` instead."""
    k = table.shape[1]
    first = m if first_mask_row is None else first_mask_row
    launch("embed", _embed_kernel, (m,), tokens, table, mask_embedding if mask_embedding is not None else table,
           out, m, k, first, BLOCK=triton.next_power_of_2(k))


@triton.jit
def _head_tile(h_ptr, w_ptr, vb, V, K, BLOCK_V: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """Logits of the 16 rows ``h[16, K]`` over the vocabulary block ``vb`` (BLOCK_V columns, -inf past V): the
    same products in the same order for every row at every width."""
    offs_m = tl.arange(0, 16)
    offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    v_mask = offs_v < V
    logits = tl.zeros([16, BLOCK_V], dtype=tl.float32)
    for k0 in range(0, K, BK):
        offs_k = k0 + tl.arange(0, BK)
        k_mask = offs_k < K
        hk = tl.load(h_ptr + offs_m[:, None] * K + offs_k[None, :], mask=k_mask[None, :], other=0.0)
        wk = tl.load(w_ptr + offs_v[:, None] * K + offs_k[None, :], mask=v_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:  # float32 weights; or the interpreter, whose bf16 dot is wrong: the same products in float32
            if wk.dtype == tl.bfloat16:  # h rounded to bf16 by hand (the interpreter's cast truncates)
                bits = hk.to(tl.int32, bitcast=True)
                hk = ((bits + (0x7FFF + ((bits >> 16) & 1))) & -65536).to(tl.float32, bitcast=True)
            elif wk.dtype != tl.float32:
                hk = hk.to(wk.dtype).to(tl.float32)
            logits = tl.dot(hk, tl.trans(wk.to(tl.float32)), logits, input_precision="ieee")
        else:
            logits = tl.dot(hk.to(wk.dtype), tl.trans(wk), logits)
    return tl.where(v_mask[None, :], logits, float("-inf")), offs_v, v_mask


@triton.jit
def _head_partial_kernel(h_ptr, w_ptr, pmax_ptr, parg_ptr, p2v_ptr, p2i_ptr, psum_ptr, M, V, K, NVB,
                         BLOCK_V: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    vb = tl.program_id(0)
    offs_m = tl.arange(0, 16)
    logits, offs_v, v_mask = _head_tile(h_ptr, w_ptr, vb, V, K, BLOCK_V, BK, IEEE)
    mx = tl.max(logits, axis=1)
    idx = tl.where(logits == mx[:, None], offs_v[None, :], 2147483647)
    arg = tl.min(idx, axis=1)  # the first index of the block's max
    rest = tl.where(offs_v[None, :] == arg[:, None], float("-inf"), logits)
    mx2 = tl.max(rest, axis=1)
    arg2 = tl.min(tl.where(rest == mx2[:, None], offs_v[None, :], 2147483647), axis=1)
    ssum = tl.sum(tl.exp(logits - mx[:, None]), axis=1)
    live = offs_m < M
    o = offs_m * NVB + vb
    tl.store(pmax_ptr + o, mx, mask=live)
    tl.store(parg_ptr + o, arg, mask=live)
    tl.store(p2v_ptr + o, mx2, mask=live)
    tl.store(p2i_ptr + o, arg2, mask=live)
    tl.store(psum_ptr + o, ssum, mask=live)


@triton.jit
def _head_logits_kernel(h_ptr, w_ptr, out_ptr, M, V, K, stride_o, BLOCK_V: tl.constexpr, BK: tl.constexpr,
                        IEEE: tl.constexpr):
    vb = tl.program_id(0)
    offs_m = tl.arange(0, 16)
    logits, offs_v, v_mask = _head_tile(h_ptr, w_ptr, vb, V, K, BLOCK_V, BK, IEEE)
    tl.store(out_ptr + offs_m[:, None] * stride_o + offs_v[None, :], logits,
             mask=(offs_m[:, None] < M) & v_mask[None, :])


@triton.jit
def _head_combine_kernel(pmax_ptr, parg_ptr, p2v_ptr, p2i_ptr, psum_ptr, tok_ptr, prob_ptr, second_ptr, M, NVB,
                         NVB_PAD: tl.constexpr):
    row = tl.program_id(0)
    if row < M:
        b = tl.arange(0, NVB_PAD)
        bm = b < NVB
        o = row * NVB + b
        mx = tl.load(pmax_ptr + o, mask=bm, other=float("-inf"))
        g = tl.max(mx, axis=0)
        arg = tl.load(parg_ptr + o, mask=bm, other=2147483647)
        first = tl.min(tl.where(mx == g, arg, 2147483647), axis=0)  # blocks ascend: the first argmax
        total = tl.sum(tl.where(bm, tl.load(psum_ptr + o, mask=bm, other=0.0) * tl.exp(mx - g), 0.0), axis=0)
        # runner-up: the best of the argmax block's second and every other block's first
        own = arg == first
        cand_v = tl.where(own, tl.load(p2v_ptr + o, mask=bm, other=float("-inf")), mx)
        cand_i = tl.where(own, tl.load(p2i_ptr + o, mask=bm, other=2147483647), arg)
        best = tl.max(cand_v, axis=0)
        second = tl.min(tl.where(cand_v == best, cand_i, 2147483647), axis=0)
        tl.store(tok_ptr + row, first.to(tl.int64))
        tl.store(prob_ptr + row, tl.div_rn(1.0, total))
        tl.store(second_ptr + row, second.to(tl.int64))


def head_argmax(launch, hidden, weight, parts, tokens, probs, seconds, *, m):
    """The LM head over ``hidden[ROWS, K]`` (float32; cast to the weight's dtype unless that is float32) with
    ``weight[V, K]``, fused with each row's first argmax, its softmax probability and the runner-up, into
    ``tokens / probs / seconds [≥ m]``. ``parts``: :func:`head_scratch`. Two launches."""
    v, k = weight.shape
    nvb = triton.cdiv(v, HEAD_BLOCK)
    pmax, parg, p2v, p2i, psum = parts
    launch("head_partial", _head_partial_kernel, (nvb,), hidden, weight, pmax, parg, p2v, p2i, psum, m, v, k, nvb,
           BLOCK_V=HEAD_BLOCK, BK=64, IEEE=weight.dtype == torch.float32 or weight.device.type == "cpu")
    launch("head_combine", _head_combine_kernel, (m,), pmax, parg, p2v, p2i, psum, tokens, probs, seconds, m, nvb,
           NVB_PAD=triton.next_power_of_2(nvb))


def head_logits(launch, hidden, weight, out, *, m):
    """The LM head's float32 logits of rows ``hidden[:m]`` into ``out[:m, V]`` (rows ≥ m left as they are): the
    products :func:`head_argmax` ranks, for steps that sample or keep their logits. One launch."""
    v, k = weight.shape
    launch("head_logits", _head_logits_kernel, (triton.cdiv(v, HEAD_BLOCK),), hidden, weight, out, m, v, k,
           out.stride(0), BLOCK_V=HEAD_BLOCK, BK=64, IEEE=weight.dtype == torch.float32 or weight.device.type == "cpu")


def head_scratch(vocab: int, device) -> tuple[torch.Tensor, ...]:
    nvb = triton.cdiv(vocab, HEAD_BLOCK)
    f = dict(dtype=torch.float32, device=device)
    i = dict(dtype=torch.int32, device=device)
    return (torch.empty(ROWS * nvb, **f), torch.empty(ROWS * nvb, **i), torch.empty(ROWS * nvb, **f),
            torch.empty(ROWS * nvb, **i), torch.empty(ROWS * nvb, **f))


__all__ = ["ACTIVATIONS", "ATTN_SPLIT", "EPILOGUES", "dense_fused", "HEAD_BLOCK", "ROWS", "attention_scratch", "attention_split",
           "embed_rows", "head_argmax", "head_logits", "head_scratch", "norm_quant", "quantize_rows", "w2a8_fused",
           "w2a8_units"]
