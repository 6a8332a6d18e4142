"""Triton kernels of bitmtp, installed as ``bitmtp.triton_kernels``.

(Installed under bitmtp's namespace because Triton itself ships a top-level ``triton_kernels``.)
This is the kernel layer: it imports only torch and triton, never ``bitmtp.ops``. Importing it
requires triton; ``bitmtp.ops`` imports it lazily and reports when triton is missing.

On a machine without a GPU, set ``TRITON_INTERPRET=1`` before the first import to run the kernels
on CPU tensors through Triton's interpreter (slow; small shapes).

Reference: bitmtp.ops.reference.w2a8_linear_q_reference, bitmtp.ops.reference.attention_reference
Test: tests/ops/test_w2a8_linear.py, tests/ops/test_attention.py
"""

from bitmtp.triton_kernels.attention import attention_rows
from bitmtp.triton_kernels.w2a8 import (
    SMALL_TILED,
    WIDTH_BUCKETS,
    KernelConfig,
    config_for_width,
    w2a8_matmul,
)

__all__ = ["SMALL_TILED", "WIDTH_BUCKETS", "KernelConfig", "config_for_width", "w2a8_matmul", "attention_rows"]
