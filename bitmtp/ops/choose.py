"""Front door of the greedy choice: each logits row's argmax token and its softmax probability.

Every step ends with it (``bitmtp.runtime.graphs``, ``bitmtp.decoding.drafters``): the argmax is the
token a greedy row commits, the probability what ``policy="auto"`` and the ``top2`` schedule weigh.
"""

from __future__ import annotations

import torch

from bitmtp.errors import ShapeError
from bitmtp.ops import registry


def argmax_prob(logits: torch.Tensor, *, backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tok int64[M], prob float32[M])`` of ``logits[M, V]`` (V >= 1): each row's argmax and its softmax
    probability ``1 / sum(exp(logits - max))``.

    Ties go to the first index, a row holding NaN picks its first NaN with probability NaN, and a row of
    ``-inf`` only or holding ``+inf`` has probability NaN (softmax is undefined there). The ``cpu``
    backend (csrc/cpu/argmax_prob.h) runs on the extension's thread team with the same bits whatever
    the thread count or the number of rows; the ``torch`` reference is ``softmax(logits).max(-1)`` in
    float32, which can pick a later index only where softmax rounds two different logits to one
    probability.
    """
    if logits.dim() != 2 or logits.shape[1] == 0 or not logits.dtype.is_floating_point:
        raise ShapeError(f"logits: expected a floating [M, V >= 1] tensor, got {logits.dtype} {tuple(logits.shape)}")
    return registry.select("argmax_prob", logits.device, backend)(logits)
