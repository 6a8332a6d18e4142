"""The ``triton`` backend: width-specialized W2A8 kernels from ``bitmtp.triton_kernels``.

Runs on CUDA tensors, or on CPU tensors when ``TRITON_INTERPRET=1`` was set before triton was
imported (the interpreter: slow, for tests).
"""

from __future__ import annotations

import os

import torch


class TritonBackend:
    name = "triton"

    def __init__(self) -> None:
        from bitmtp import triton_kernels  # raises ImportError when triton is missing

        self._kernels = triton_kernels

    def availability(self, device: torch.device) -> tuple[bool, str]:
        if device.type == "cuda":
            if not torch.cuda.is_available():
                return False, "no CUDA device visible to torch"
            return True, "triton on CUDA"
        if device.type == "cpu":
            if os.environ.get("TRITON_INTERPRET") == "1":
                return True, "triton interpreter (TRITON_INTERPRET=1)"
            return False, "Triton needs a GPU; set TRITON_INTERPRET=1 before import to interpret it on the CPU"
        return False, f"no Triton support for device type {device.type!r}"

    def act_quant(self, x):
        """Per-token int8 quantization in one Triton launch (``triton_kernels.layers.quantize_rows``), not
        eight torch ops; the reference's bits."""
        from bitmtp.triton_kernels.layers import quantize_rows

        lead, k = x.shape[:-1], x.shape[-1]
        q, s = quantize_rows(x.reshape(-1, k).contiguous())
        return q.reshape(*lead, k), s.reshape(lead)

    def w2a8_accumulate(self, x_q, packed, k, group_size, out=None):
        m, n, ng = x_q.shape[0], packed.shape[0], -(-k // group_size)
        if out is None:
            out = torch.empty((m, n, ng), dtype=torch.int32, device=x_q.device)
        ones = torch.ones((1, ng), dtype=torch.float32, device=x_q.device)
        s = torch.ones((m,), dtype=torch.float32, device=x_q.device)
        self._kernels.w2a8_matmul(x_q, s, packed, ones, k, group_size, acc_out=out)
        return out

    def w2a8_linear_q(self, x_q, act_scale, packed, scales, k, group_size, bias, out_dtype, out=None):
        if out is None:
            out = torch.empty((x_q.shape[0], packed.shape[0]), dtype=out_dtype, device=x_q.device)
        self._kernels.w2a8_matmul(x_q, act_scale, packed, scales, k, group_size, bias=bias, out=out)
        return out

    def attention(self, q, k, v, mask, scale):
        """Row-deterministic attention (triton_kernels/attention.py): one program per (row, head),
        fixed KV blocks, so a row's output never depends on the step's width or segment. The edges as
        the reference defines them: M = 0 (or H, D = 0) gives the empty output, a row that sees no KV row
        (every row when L = 0) zeros."""
        if not (k.is_contiguous() and v.is_contiguous()):
            from bitmtp.errors import LayoutError

            raise LayoutError("k/v: KV buffers must be contiguous")
        if q.numel() == 0:  # an empty grid: nothing to launch
            return torch.empty_like(q)
        if mask.shape[1] == 0:  # no KV rows: every row fully masked
            return torch.zeros_like(q)
        out = self._kernels.attention_rows(q.contiguous(), k, v, mask.contiguous(), scale)
        # the kernel divides by its softmax total, 0 for a fully masked row (0 / 0 = NaN): zeros there, by a
        # select on the device (no host sync, so CUDA graphs still capture it); other rows keep their bits
        return out.masked_fill_(~mask.any(dim=1)[:, None, None], 0.0)
