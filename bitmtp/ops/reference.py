"""Pure-torch references of the ops. Every backend is tested against these.

The W2A8 contract (DESIGN.md "Activations"):

* ``acc[m, n, g] = Σ_{k∈g} c[n,k]·x_q[m,k] − Σ_{k∈g} x_q[m,k]`` — exact integers (int64 here), where
  ``c = w + 1`` are the T2 codes and the second sum folds the code offset;
* ``y[m, n] = Σ_g acc[m, n, g] · w_scale[n, g] / s[m] (+ bias[n])`` — computed here in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bitmtp.formats.quantize import quantize_activations
from bitmtp.formats.ternary import unpack_codes


def act_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 quantization: ``(x_q int8[..., K], s float32[...])``."""
    return quantize_activations(x)


def w2a8_accumulate_reference(x_q: torch.Tensor, packed: torch.Tensor, k: int, group_size: int) -> torch.Tensor:
    """Exact per-group integer accumulators ``int64[M, N, n_groups]`` (int64 accumulation)."""
    codes = unpack_codes(packed, k).to(torch.int64)  # [N, K]
    xq = x_q.to(torch.int64)  # [M, K]
    groups = []
    for lo in range(0, k, group_size):
        hi = min(lo + group_size, k)
        xg = xq[:, lo:hi]
        groups.append(xg @ codes[:, lo:hi].T - xg.sum(dim=1, keepdim=True))
    return torch.stack(groups, dim=-1)


def w2a8_linear_q_reference(
    x_q: torch.Tensor,
    act_scale: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    k: int,
    group_size: int,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """W2A8 linear on pre-quantized activations with a float64 epilogue, cast to ``out_dtype``."""
    acc = w2a8_accumulate_reference(x_q, packed, k, group_size).to(torch.float64)  # [M, N, G]
    n = packed.shape[0]
    w_scale = scales.to(torch.float64).expand(n, scales.shape[1])  # [N, G]
    y = (acc * w_scale.unsqueeze(0)).sum(dim=-1) / act_scale.to(torch.float64).unsqueeze(-1)
    if bias is not None:
        y = y + bias.to(torch.float64)
    return y.to(out_dtype)


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Masked multi-head attention with GQA: ``q[M, H, D]`` against KV rows ``[0, L)`` of
    ``k, v[KVH, S, D]`` under ``mask[M, L]`` (True = visible); float32 math, output in q's dtype.

    Masked KV rows are ignored exactly, whatever they hold: rows past the committed length inside the
    read segment keep what rejected drafts or an earlier, longer sequence wrote, NaN and Inf included.
    A masked score is replaced, never added to; and because ``0 · NaN`` and ``0 · Inf`` are NaN inside
    ``probs @ V``, non-finite V entries are zeroed before that product. So that this never hides real
    corruption, a *visible* V row holding NaN/Inf turns the scores of the rows that see it into NaN
    (their whole head output is NaN). With finite inputs the result is bit-identical to the plain
    formula: ``+0`` is added to each score and ``nan_to_num`` leaves finite values as they are.
    No host sync (a data-dependent branch would break CUDA graph capture): the safe form always runs.

    Edge cases, the definition every backend follows (``bitmtp.ops.attention``):

    * a *fully masked* query row — its mask allows no KV row (``L = 0`` makes every row one) — outputs
      exact zeros on every head, as flash-attention kernels define it: softmax over an empty set has no
      value, and 0 (the empty sum of ``p · V``) is what the online-softmax kernels produce when their
      normaliser stays 0. The plain formula would give NaN (``-inf - -inf``); the runtime never builds
      such a row, but an op given one must not depend on the backend. Other rows are not touched:
      their bits are those of the formula above.
    * ``M = 0`` (no query rows) returns an empty ``[0, H, D]`` output.
    """
    m, h, d = q.shape
    kvh, length = k.shape[0], mask.shape[1]
    g = h // kvh
    keys, values = k[:, :length].float(), v[:, :length].float()
    qh = q.float().view(m, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * m, d)
    # [KVH, L]: +0 for a finite V row, NaN for a row holding NaN/Inf (x - x is NaN exactly then).
    # Float ops only: elementwise ops producing bool masks cost several times more on CPU.
    row_bad = (values - values).sum(-1)
    scores = (torch.matmul(qh, keys.transpose(1, 2)) * scale).view(kvh, g, m, length) + row_bad[:, None, None, :]
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(kvh, g * m, length)
    out = torch.matmul(probs, torch.nan_to_num(values, nan=0.0, posinf=0.0, neginf=0.0))
    out = out.view(kvh, g, m, d).permute(2, 0, 1, 3).reshape(m, h, d).to(q.dtype)
    # a fully masked row's softmax is NaN (all scores -inf): zeros instead (the definition above). A select,
    # not a multiply (0 * NaN is NaN) and not a branch (no host sync); rows that see a KV row keep their bits
    return torch.where(mask.any(dim=1)[:, None, None], out, 0.0)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMSNorm as transformers' Llama/Qwen3/BitNet RMSNorm computes it (float32 values,
    weight applied after casting back), except that the mean of squares is summed in float64 and
    then rounded to float32. That makes the statistic independent of the summation order, so the
    fused native layers (csrc/cpu/layers.cpp, a sequential double sum) get the same float32 value
    as this function: in ternary models a 1-ulp difference here can flip an int8 activation. The ``cpu``
    backend's ``rms_norm`` (``bitmtp.ops.norm``) is the fused layers' own norm, bit-exact with this."""
    dtype = x.dtype
    xf = x.float()
    var = xf.double().pow(2).mean(-1, keepdim=True).float()
    xf = xf * torch.rsqrt(var + eps)
    return weight * xf.to(dtype)


def argmax_prob_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax and softmax probability, ``(tok int64[M], prob float32[M])``: the float32
    ``softmax(logits).max(-1)`` every step used before the CPU kernel (and still runs on GPUs, where it is
    two kernels). csrc/cpu/argmax_prob.h picks the first index of the logits' max and is compared to a
    float64 evaluation of ``1 / sum(exp(x - max))`` (tests/ops/test_argmax_prob.py)."""
    prob, tok = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    return tok, prob


def dense_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The dense path (embeddings-side projections, LM head, non-ternary checkpoints)."""
    return F.linear(x.to(weight.dtype), weight, bias)


__all__ = [
    "rms_norm_reference",
    "act_quant_reference",
    "w2a8_accumulate_reference",
    "w2a8_linear_q_reference",
    "dense_linear_reference",
    "attention_reference",
]
