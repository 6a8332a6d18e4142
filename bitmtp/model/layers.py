"""Small building blocks of the decoder: RMSNorm, activations, RoPE tables, dense linear module."""

from __future__ import annotations

import math

import torch
from torch import nn

from bitmtp.formats.ggml_blocks import FORMATS, BlockWeight, pack_lossless
from bitmtp.ops import dense_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMSNorm as transformers' Llama/Qwen3/BitNet RMSNorm computes it (float32 values,
    weight applied after casting back), except that the mean of squares is summed in float64 and
    then rounded to float32. That makes the statistic independent of the summation order, so the
    fused native layers (csrc/cpu/layers.cpp, a sequential double sum) get the same float32 value
    as this function: in ternary models a 1-ulp difference here can flip an int8 activation."""
    dtype = x.dtype
    xf = x.float()
    var = xf.double().pow(2).mean(-1, keepdim=True).float()
    xf = xf * torch.rsqrt(var + eps)
    return weight * xf.to(dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU evaluated in float64 and rounded to ``x``'s dtype: as order- and library-independent as
    :func:`rms_norm` (float32 ``exp`` differs by an ulp between torch's vector code and libm)."""
    return torch.nn.functional.silu(x.double()).to(x.dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """BitNet's squared ReLU, ``relu(x)²`` in ``x``'s dtype (exact: one rounding, as the native kernels do)."""
    return torch.relu(x).square()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (transformers' ``gelu_pytorch_tanh``), evaluated in float64 and
    rounded to ``x``'s dtype like :func:`silu`. Only the torch executor implements it."""
    return torch.nn.functional.gelu(x.double(), approximate="tanh").to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies (float32), with llama3 scaling when configured."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None or scaling.get("rope_type") != "llama3":
        return inv
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


def rope_tables(head_dim: int, theta: float, scaling: dict | None, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[positions, head_dim]`` (halves duplicated, transformers' layout)."""
    inv = rope_inv_freq(head_dim, theta, scaling)
    t = torch.arange(positions, dtype=torch.int64).float()
    freqs = torch.outer(t, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x[M, heads, D]`` rotated by per-row ``cos/sin[M, D]`` (rotate-half convention)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


class DenseLinear(nn.Module):
    """A dense projection (embedding-side, LM head, non-ternary checkpoints) through ``ops.dense_linear``.

    :meth:`pack_blocks` adds a GGML block copy of the weight when one reproduces it exactly
    (``bitmtp.formats.ggml_blocks``): CPU kernels then read the blocks — bit-identical results, a
    fraction of the bytes. ``weight`` stays the float tensor every other path uses; the blocks are
    dropped by themselves when ``weight`` is replaced, moved or modified in place.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.backend = backend
        self._blocks: tuple[BlockWeight, torch.Tensor, int, int] | None = None

    @property
    def blocks(self) -> BlockWeight | None:
        """The weight's GGML blocks, if packed and still the weight's exact encoding."""
        if self._blocks is None:
            return None
        bw, w, ptr, version = self._blocks
        if w is not self.weight or w.data_ptr() != ptr or w._version != version:
            self._blocks = None
            return None
        return bw

    def pack_blocks(self, formats: tuple[str, ...] = FORMATS) -> BlockWeight | None:
        """Keep a block copy of the weight when one of ``formats`` encodes it losslessly; returns it."""
        bw = pack_lossless(self.weight.detach(), formats)
        w = self.weight
        self._blocks = None if bw is None else (bw, w, w.data_ptr(), w._version)
        return bw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias, backend=self.backend, blocks=self.blocks)

    def extra_repr(self) -> str:
        blocks = self.blocks
        kept = "" if blocks is None else f", blocks={blocks.fmt}"
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}{kept}"
