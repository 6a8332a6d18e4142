"""``TernaryLinear``: an ``nn.Module`` holding T2-packed ternary weights and their scales."""

from __future__ import annotations

import torch
from torch import nn

from bitmtp.errors import DTypeError, ShapeError
from bitmtp.formats.quantize import absmean_ternarize, dequantize_ternary
from bitmtp.formats.scales import resolve_group_size
from bitmtp.formats.ternary import pack_t2, unpack_t2, words_per_row
from bitmtp.ops.linear import w2a8_linear


class TernaryLinear(nn.Module):
    """A W2A8 linear layer: ``y = w2a8_linear(x, weight, scales) (+ bias)``.

    Buffers (saved in ``state_dict``): ``weight`` — T2 words ``int32[out, ceil(in/16)]``; ``scales`` —
    ``float32[1 | out, n_groups]``; ``bias`` — optional ``[out]``.

    Args:
        in_features, out_features: layer shape.
        weight, scales: packed weights and scales (e.g. from :meth:`from_float` or a checkpoint).
        group_size: scale group size (defaults to in_features, i.e. per-tensor / per-row).
        bias: optional bias.
        backend: pin a backend for this layer (default: ``BITMTP_BACKEND`` or automatic).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        weight: torch.Tensor,
        scales: torch.Tensor,
        *,
        group_size: int | None = None,
        bias: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        if weight.dtype == torch.uint32:
            weight = weight.view(torch.int32)
        if weight.dtype != torch.int32:
            raise DTypeError(f"weight: expected T2 int32 words, got {weight.dtype}")
        expected = (out_features, words_per_row(in_features))
        if tuple(weight.shape) != expected:
            raise ShapeError(
                f"weight: expected shape {expected} for {in_features}->{out_features}, got {tuple(weight.shape)}"
            )
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.group_size = resolve_group_size(scales, out_features, in_features, group_size)
        self.backend = backend
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scales", scales.contiguous())
        if bias is not None:
            if bias.shape != (out_features,):
                raise ShapeError(f"bias: expected shape ({out_features},), got {tuple(bias.shape)}")
            self.register_buffer("bias", bias.detach().clone())
        else:
            self.bias = None

    @classmethod
    def from_float(
        cls,
        linear: nn.Linear,
        *,
        granularity: str = "tensor",
        group_size: int | None = None,
        backend: str | None = None,
    ) -> TernaryLinear:
        """Ternarize an ``nn.Linear`` by absmean (per tensor, row or group) and pack it."""
        if not isinstance(linear, nn.Linear):
            raise DTypeError(f"linear: expected torch.nn.Linear, got {type(linear).__name__}")
        q, scales = absmean_ternarize(linear.weight, granularity, group_size)
        bias = None if linear.bias is None else linear.bias.detach().float()
        return cls(
            linear.in_features,
            linear.out_features,
            pack_t2(q),
            scales,
            group_size=group_size if granularity == "group" else None,
            bias=bias,
            backend=backend,
        ).to(linear.weight.device)

    def ternary_weight(self) -> torch.Tensor:
        """The ternary matrix ``int8[out, in]``."""
        return unpack_t2(self.weight, self.in_features)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(c − 1) · scale`` as a dense ``[out, in]`` matrix."""
        return dequantize_ternary(self.ternary_weight(), self.scales, self.group_size, dtype)

    def to_float(self, dtype: torch.dtype = torch.float32) -> nn.Linear:
        """An ``nn.Linear`` holding the dequantized weights (it does not quantize activations)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=dtype,
                        device=self.weight.device)
        with torch.no_grad():
            lin.weight.copy_(self.dequantized_weight(dtype))
            if self.bias is not None:
                lin.bias.copy_(self.bias.to(dtype))
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return w2a8_linear(
            x, self.weight, self.scales, k=self.in_features, group_size=self.group_size, bias=self.bias,
            backend=self.backend,
        )

    def extra_repr(self) -> str:
        if self.scales.numel() == 1:
            kind = "tensor"
        else:
            kind = "row" if self.scales.shape[1] == 1 else f"group={self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"scales={kind}, bias={self.bias is not None}"
        )
