"""The cpu attention kernel's own arithmetic replayed in numpy (tests/ops/test_attention.py checks the
kernel's bits against it, tests/ops/test_attention_depth.py its accuracy)."""

from __future__ import annotations

import numpy as np

#: kAttnChunk (csrc/cpu/attention.h): the softmax chunks, at fixed absolute KV positions
CHUNK = 128


def attn_exp(x: np.ndarray | float) -> np.ndarray:
    """The kernels' exponential (csrc/cpu/vec_exp.inc, vec_exp), operation by operation in numpy float32."""
    f = np.float32
    x = np.asarray(x, np.float32)
    under = x < f(-87.33654)
    x = np.where(x > f(88.0), f(88.0), x)
    x = np.where(under, f(0), x)
    magic = f(12582912.0)
    t = x * f(1.44269504088896341) + magic
    n = t - magic
    r = (x - n * f(0.693359375)) - n * f(-2.12194440e-4)
    p = np.full_like(x, f(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    y = (p * (r * r) + r) + f(1.0)
    e = ((t.view(np.int32) - np.int32(0x4B400000) + np.int32(127)) << np.int32(23)).view(np.float32)
    return np.where(under, f(0), y * e).astype(np.float32)
