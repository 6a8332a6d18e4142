"""Row-deterministic masked attention in Triton (the GPU counterpart of csrc/cpu/attention.cpp).

One program per (query row, head). It walks the KV rows in fixed blocks of BLOCK_L from row 0,
with an online softmax whose running max starts at a finite floor: a block with no visible row
adds exactly 0 and rescales by exactly 1, so the result does not depend on the segment length L,
and with one program per row it does not depend on the step's width M either. Bitwise equal rows
whatever the replay state is what lets speculative decoding equal AR greedy output exactly. Masked KV
rows are not loaded at all, so garbage in them (NaN, Inf) never matters.

Reference: bitmtp.ops.reference.attention_reference
Test: tests/ops/test_attention.py, tests/runtime/test_masked_rows.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: KV rows per block. Fixed: changing it changes the summation order (and so the low bits).
BLOCK_L = 64
_FLOOR = -1.0e30  # finite floor of the running max: exp(-inf - floor) == 0, never NaN


@triton.jit
def _attention_row_kernel(q_ptr, k_ptr, v_ptr, mask_ptr, out_ptr, H, S, L, scale, GROUP,
                          D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_L: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    offs_d = tl.arange(0, D_PAD)
    d_mask = offs_d < D
    q = tl.load(q_ptr + (row * H + head) * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    m_run = tl.full([1], -1.0e30, dtype=tl.float32)
    l_run = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    kv_base = kvh * S * D
    for l0 in range(0, L, BLOCK_L):
        offs_l = l0 + tl.arange(0, BLOCK_L)
        in_l = offs_l < L
        vis = tl.load(mask_ptr + row * L + offs_l, mask=in_l, other=0) != 0
        kv_off = kv_base + offs_l[:, None] * D + offs_d[None, :]
        # Masked KV rows are never read (they load as 0): what rejected drafts or a longer earlier
        # sequence left there, NaN/Inf included, cannot reach the sums (p = 0 times NaN would be NaN).
        kv_mask = (in_l & vis)[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_run, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_run - m_new)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_run = l_run * alpha + tl.sum(p, axis=0)
        m_run = m_new
    out = acc / l_run
    tl.store(out_ptr + (row * H + head) * D + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def attention_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """``q[M, H, D]`` over KV rows ``[0, L)`` of ``k, v[KVH, S, D]`` under ``mask[M, L]`` (bool).

    Inputs must be contiguous and on one device (``bitmtp.ops`` validates); rows with no visible
    KV row are not produced by the runtime (they would divide by zero).
    """
    m, h, d = q.shape
    kvh, s_rows, _ = k.shape
    length = mask.shape[1]
    if out is None:
        out = torch.empty_like(q)
    grid = (m, h)
    _attention_row_kernel[grid](q, k, v, mask.view(torch.uint8), out, h, s_rows, length, float(scale), h // kvh,
                                D=d, D_PAD=triton.next_power_of_2(d), BLOCK_L=BLOCK_L)
    return out
