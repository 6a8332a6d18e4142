"""Row-concatenation of projections that read the same input (q/k/v, gate/up).

One fused call instead of three (or two) saves the per-call cost — activation quantization,
Python dispatch, a thread fork-join — which on SmolLM2-sized layers (576×576, ~30 µs of weight
streaming) is a large share of a decode step. Rows stay independent, so results are unchanged:
ternary per-tensor scales become per-row scales of the fused matrix, and a dense matrix is the
plain concatenation. Dense parts held as GGML blocks fuse as their blocks' byte concatenation (lazy parts
stay lazy: no float copy is made; float parts with exact blocks keep the concatenated blocks beside the floats).
"""

from __future__ import annotations

import torch
from torch import nn

from bitmtp.formats.ggml_blocks import cat_rows
from bitmtp.model.layers import DenseLinear
from bitmtp.ops import TernaryLinear


class Stacked(nn.Module):
    """Fallback when parts cannot be fused (mixed kinds or layouts): run each, concatenate."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def _bias(parts, n_rows, dtype):
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias.to(dtype) if p.bias is not None else torch.zeros(n, dtype=dtype)
                      for p, n in zip(parts, n_rows, strict=True)])


def fuse_rows(parts: list[nn.Module]) -> nn.Module:
    """A module computing ``cat([p(x) for p in parts], -1)`` with one projection when possible."""
    if all(isinstance(p, DenseLinear) for p in parts):
        dtypes = {p.dtype for p in parts}
        if len(dtypes) == 1 and len({p.in_features for p in parts}) == 1:
            dtype = dtypes.pop()
            b = _bias(parts, [p.out_features for p in parts], dtype)
            kept = [p.blocks for p in parts]
            blocks = cat_rows(kept) if all(bw is not None for bw in kept) else None
            if blocks is not None and all(p.lazy for p in parts):  # GGUF blocks: concatenated, never dequantized
                return DenseLinear(None, b, backend=parts[0].backend, blocks=blocks)
            w = torch.cat([p.weight for p in parts], dim=0)
            return DenseLinear(w, b, backend=parts[0].backend, blocks=blocks)
    if all(isinstance(p, TernaryLinear) for p in parts):
        same = len({(p.in_features, p.group_size, p.scales.shape[1], p.backend) for p in parts}) == 1
        if same:
            k = parts[0].in_features
            w = torch.cat([p.weight for p in parts], dim=0)
            scales = torch.cat([p.scales.expand(p.out_features, p.scales.shape[1]) for p in parts], dim=0)
            b = _bias(parts, [p.out_features for p in parts], torch.float32)
            group = parts[0].group_size if parts[0].scales.shape[1] > 1 else None
            return TernaryLinear(k, w.shape[0], w, scales.contiguous(), group_size=group, bias=b,
                                 backend=parts[0].backend)
    return Stacked(parts)
