"""Front doors of the linear ops: validate, pick a backend, run.

``w2a8_linear`` is what models call. ``w2a8_accumulate`` exposes the exact integer accumulators
that every backend must reproduce bit for bit (the tests compare those).
"""

from __future__ import annotations

import importlib

import torch

from bitmtp.errors import ShapeError
from bitmtp.formats.ggml_blocks import BlockWeight
from bitmtp.ops import registry, validate


def act_quant(x: torch.Tensor, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token absmax int8 quantization of ``x[..., K]``: ``(x_q int8[..., K], s float32[...])``.

    ``s = 127 / max(|x|, 1e-5)``; ``x ≈ x_q / s``.
    """
    x = validate.activations(x)
    return registry.select("act_quant", x.device, backend)(x)


def w2a8_accumulate(
    x_q: torch.Tensor,
    weight: torch.Tensor,
    *,
    k: int | None = None,
    group_size: int | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact per-group accumulators ``int32[M, N, n_groups]`` of ``x_q[M, K]`` against T2 ``weight``.

    ``acc[m, n, g] = Σ_{k∈g} c[n,k]·x_q[m,k] − Σ_{k∈g} x_q[m,k]`` with codes ``c = w + 1``. Without
    ``group_size`` there is one group spanning K.
    """
    x_q = validate.quantized_activations(x_q)
    w = validate.packed_weight(weight)
    k = validate.in_features(k, x_q.shape[1], w, "x_q")
    group_size = k if group_size is None else int(group_size)
    if group_size < k and group_size % 16:
        raise ShapeError(f"group_size: must be a multiple of 16, got {group_size}")
    validate.same_device(x_q=x_q, weight=w, out=out)
    if out is not None:
        shape = (x_q.shape[0], w.shape[0], -(-k // group_size))
        if out.dtype != torch.int32 or tuple(out.shape) != shape or not out.is_contiguous():
                raise ShapeError(f"out: expected a contiguous int32 tensor of shape {shape}")
    return registry.select("w2a8_accumulate", x_q.device, backend)(x_q.contiguous(), w, k, group_size, out=out)


def w2a8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    *,
    k: int | None = None,
    group_size: int | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """W2A8 linear: per-token int8 activations times T2 ternary weights, fused scale epilogue.

    Args:
        x: activations ``[..., K]`` (float32 / bf16 / fp16 / float64).
        weight: T2 words ``int32[N, ceil(K/16)]`` from :func:`bitmtp.formats.pack_t2`.
        scales: ``float32[1 | N, n_groups]`` multiplicative weight scales (see formats.scales).
        k: input features when ``x`` is not the source of truth (defaults to ``x.shape[-1]``).
        group_size: scale group size G (inferred from ``scales`` when it divides K evenly).
        bias: optional ``[N]`` added after the epilogue.
        out_dtype: output dtype (default ``x.dtype``).
        backend: ``"torch"``, ``"triton"``, ``"cpu"``, ``"cuda"``…; default ``BITMTP_BACKEND`` or automatic.

    Returns:
        ``y[..., N] = Σ_g acc_g · scale[n, g] / s_x`` (+ bias).
    """
    x = validate.activations(x)
    w = validate.packed_weight(weight)
    n = w.shape[0]
    k = validate.in_features(k, x.shape[-1], w)
    s, g = validate.weight_scales(scales, n, k, group_size)
    b = validate.bias_vector(bias, n)
    dtype = validate.out_dtype(out_dtype, x.dtype)
    device = validate.same_device(x=x, weight=w, scales=s, bias=b)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    linear_q = registry.select("w2a8_linear_q", device, backend)
    # the backend that runs the kernel quantizes inside the same call where it can (cpu: torch-op
    # quantization cost 3x the kernel at M = 1, 2560 x 6912); an op replaced through registry.override
    # (a plain function) keeps the two-call path
    fused = getattr(getattr(linear_q, "__self__", None), "w2a8_linear", None)
    if fused is not None and x2.shape[0] >= 1:
        return fused(x2, w, s, k, g, b, dtype).reshape(*lead, n)
    x_q, act_scale = registry.select("act_quant", device, backend)(x2)
    y = linear_q(x_q.contiguous(), act_scale, w, s, k, g, b, dtype)
    return y.reshape(*lead, n)


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None, *, backend: str | None = None,
    blocks: BlockWeight | None = None,
) -> torch.Tensor:
    """The dense fallback path: ``x @ weight.T (+ bias)`` in the weight's dtype (LM head, embeddings-side
    projections and non-ternary checkpoints).

    ``blocks``: the same weight in GGML blocks (``bitmtp.formats.ggml_blocks``, an exact encoding of
    ``weight``). For CPU tensors the ``dense_linear_blocks`` op runs instead; the ``cpu`` backend reads
    the blocks (bit-identical to its float32 kernel, fewer bytes), other backends use ``weight``.
    ``weight`` may be None when ``blocks`` are given (a GGUF weight never dequantized, ``model.layers.LazyWeight``):
    a backend that computes from floats then dequantizes the blocks for this call (callers that run such a
    backend repeatedly keep a float weight instead, see :func:`dense_reads_blocks`)."""
    x = validate.activations(x)
    if weight is None:
        if blocks is None:
            raise ShapeError("weight: None needs blocks= (the weight's GGML blocks); pass one of them")
        n, k = blocks.shape
        if x.shape[-1] != k:
            raise ShapeError(f"x: last dimension {x.shape[-1]} does not match the blocks' K={k}")
        b = validate.bias_vector(bias, n)
        device = validate.same_device(x=x, bias=b, blocks=blocks.data)
        if device.type != "cpu":
            raise ShapeError(f"blocks: GGML block weights run on the CPU, got tensors on {device}; pass a float weight")
        return registry.select("dense_linear_blocks", device, backend)(x, None, blocks, b)
    w = validate.tensor("weight", weight)
    if w.dtype not in validate.FLOAT_DTYPES or w.dim() != 2:
        raise ShapeError(f"weight: expected a 2-D float [N, K] tensor, got {w.dtype} {tuple(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise ShapeError(f"x: last dimension {x.shape[-1]} does not match weight K={w.shape[1]}")
    b = validate.bias_vector(bias, w.shape[0])
    device = validate.same_device(x=x, weight=w, bias=b)
    if blocks is not None and device.type == "cpu":
        if tuple(blocks.shape) != tuple(w.shape) or blocks.data.device != device:
            raise ShapeError(f"blocks: a {blocks.shape} {blocks.fmt} weight on {blocks.data.device} does not encode "
                             f"weight {tuple(w.shape)} on {device}")
        return registry.select("dense_linear_blocks", device, backend)(x, w, blocks, b)
    return registry.select("dense_linear", device, backend)(x, w, b)


def dense_reads_blocks(device: torch.device, backend: str | None = None) -> bool:
    """Whether :func:`dense_linear` with ``blocks`` on ``device`` (and ``backend``) runs the native kernels that
    read the blocks themselves (the ``cpu`` backend) — False where the op computes from a float weight (the torch
    reference, another device, an injected override), so a caller holding only blocks makes that weight once."""
    if device.type != "cpu":
        return False
    impl = registry.select("dense_linear_blocks", device, backend)
    return getattr(getattr(impl, "__self__", None), "name", None) == "cpu"


def _attention_layout() -> tuple[int, int]:
    """(lanes, chunk) of the native CPU attention (the extension's ``ATTENTION_LANES`` / ``ATTENTION_CHUNK``), or
    the layout it is built with when it is not installed."""
    try:
        ext = importlib.import_module("bitmtp._cpu_w2a8")
    except ImportError:
        return 16, 128
    return int(ext.ATTENTION_LANES), int(ext.ATTENTION_CHUNK)


#: the CPU attention kernel's summation structure (csrc/cpu/attention.h, attention_body.inc): a query row's
#: softmax runs per chunk of ATTENTION_CHUNK KV rows, and inside a chunk KV row l's weight is summed in lane
#: l mod ATTENTION_LANES. A KV row moved by a multiple of the lanes inside its chunk, with nothing between
#: its old and new place visible, gives every query row that sees it the same bits (the ``top2`` schedule's
#: runner-up row relies on it: ``bitmtp.decoding.onepass.top2_layout``)
#: — read from the extension, which exports its own ``kAttnTile`` / ``kAttnChunk`` (``csrc/cpu/attention.h``), so
#: a change there reaches the planner. Without the extension the torch attention runs, whose bits do not depend
#: on where a row sits; the planner then lays rows out as the extension would, so plans are the same everywhere
ATTENTION_LANES, ATTENTION_CHUNK = _attention_layout()


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              *, backend: str | None = None) -> torch.Tensor:
    """Masked GQA attention of ``q[M, H, D]`` over KV rows ``[0, L)`` of ``k, v[KVH, S, D]``.

    ``mask[M, L]`` (bool) says which KV rows each query row sees. KV rows a query row does not see are
    ignored exactly on every backend, whatever they hold (NaN and Inf included): rows past the committed
    length keep what rejected drafts or an earlier sequence wrote. A NaN/Inf in a row it does see
    makes its output non-finite. On the ``cpu`` backend every row is computed independently of the
    others and of L (see csrc/cpu/attention.cpp).

    Edges, the same on every backend (``bitmtp.ops.reference.attention_reference``): a query row whose mask
    allows no KV row (and every row when L = 0) outputs zeros; M = 0 query rows give an empty
    ``[0, H, D]`` output. K/V need at least one KV head.
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("mask", mask)):
        validate.tensor(name, t)
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ShapeError(f"q/k/v: expected q[M, H, D] and k, v[KVH, S, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    m, h, d = q.shape
    if k.shape[0] == 0:
        raise ShapeError(f"k: has no KV heads (shape {tuple(k.shape)}); K/V are [KVH >= 1, S, D]")
    if k.shape[2] != d or h % k.shape[0]:
        raise ShapeError(f"k: shape {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != m or mask.shape[1] > k.shape[1]:
        raise ShapeError(f"mask: expected bool [M={m}, L <= {k.shape[1]}], got {mask.dtype} {tuple(mask.shape)}")
    device = validate.same_device(q=q, k=k, v=v, mask=mask)
    return registry.select("attention", device, backend)(q, k, v, mask, scale)
