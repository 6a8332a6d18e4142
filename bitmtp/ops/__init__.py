"""Ops: one function per op, a backend registry, and a pure-torch reference per op."""

from bitmtp.ops import backends as _backends  # noqa: F401  (registers the built-in backends)
from bitmtp.ops.choose import argmax_prob
from bitmtp.ops.linear import act_quant, attention, dense_linear, w2a8_accumulate, w2a8_linear
from bitmtp.ops.norm import rms_norm
from bitmtp.ops.registry import available_backends, backend_names, register_backend
from bitmtp.ops.ternary_linear import TernaryLinear

__all__ = [
    "act_quant",
    "argmax_prob",
    "attention",
    "dense_linear",
    "rms_norm",
    "w2a8_accumulate",
    "w2a8_linear",
    "available_backends",
    "backend_names",
    "register_backend",
    "TernaryLinear",
]
