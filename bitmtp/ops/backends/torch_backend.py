"""The ``torch`` backend: the pure-torch references, usable on any device."""

from __future__ import annotations

import torch

from bitmtp.formats.ggml_blocks import dequantize
from bitmtp.ops import reference


class TorchBackend:
    name = "torch"

    def availability(self, device: torch.device) -> tuple[bool, str]:
        return True, "pure torch, always available"

    def act_quant(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return reference.act_quant_reference(x)

    def w2a8_accumulate(self, x_q, packed, k, group_size, out=None):
        acc = reference.w2a8_accumulate_reference(x_q, packed, k, group_size).to(torch.int32)
        if out is None:
            return acc
        out.copy_(acc)
        return out

    def w2a8_linear_q(self, x_q, act_scale, packed, scales, k, group_size, bias, out_dtype, out=None):
        y = reference.w2a8_linear_q_reference(x_q, act_scale, packed, scales, k, group_size, bias, out_dtype)
        if out is None:
            return y
        out.copy_(y)
        return out

    def dense_linear(self, x, weight, bias=None):
        return reference.dense_linear_reference(x, weight, bias)

    def dense_linear_blocks(self, x, weight, blocks, bias=None):
        """``blocks`` encode ``weight`` exactly (``bitmtp.formats.ggml_blocks``): the reference uses ``weight``, or
        the blocks dequantized for this call when ``weight`` is None."""
        return reference.dense_linear_reference(x, dequantize(blocks) if weight is None else weight, bias)

    def attention(self, q, k, v, mask, scale):
        return reference.attention_reference(q, k, v, mask, scale)

    def argmax_prob(self, logits):
        return reference.argmax_prob_reference(logits)

    def rms_norm(self, x, weight, eps):
        return reference.rms_norm_reference(x, weight, eps)
