"""Front door of the greedy choice: each logits row's argmax token and its softmax probability.

Every step ends with it (``bitmtp.runtime.graphs``, ``bitmtp.decoding.drafters``): the argmax is the
token a greedy row commits, the probability what ``policy="auto"`` and the ``top2`` schedule weigh.
"""

from __future__ import annotations

import torch

from bitmtp.errors import ShapeError
from bitmtp.ops import registry


def argmax_prob(logits: torch.Tensor, *, backend: str | None = None,
                out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tok int64[M], prob float32[M])`` of ``logits[M, V]`` (V >= 1): each row's argmax and its softmax
    probability ``1 / sum(exp(logits - max))``.

    Ties go to the first index, a row holding NaN picks its first NaN with probability NaN, and a row of
    ``-inf`` only or holding ``+inf`` has probability NaN (softmax is undefined there). The ``cpu``
    backend (csrc/cpu/argmax_prob.h) runs on the extension's thread team with the same bits whatever
    the thread count or the number of rows; the ``torch`` reference is ``softmax(logits).max(-1)`` in
    float32, which can pick a later index only where softmax rounds two different logits to one
    probability. ``out``: ``(tok, prob)`` to write into (a step's static output buffers), returned.
    """
    if logits.dim() != 2 or logits.shape[1] == 0 or not logits.dtype.is_floating_point:
        raise ShapeError(f"logits: expected a floating [M, V >= 1] tensor, got {logits.dtype} {tuple(logits.shape)}")
    impl = registry.select("argmax_prob", logits.device, backend)
    if out is None:
        return impl(logits)
    tok, prob = out
    m = logits.shape[0]
    if (tok.dtype, prob.dtype, tuple(tok.shape), tuple(prob.shape)) != (torch.long, torch.float32, (m,), (m,)):
        raise ShapeError(f"out: expected (int64 [{m}], float32 [{m}]), got ({tok.dtype} {tuple(tok.shape)}, "
                         f"{prob.dtype} {tuple(prob.shape)})")
    # a backend that writes into out= (the cpu one: no temporaries, no copies) may still return new tensors
    takes_out = getattr(getattr(impl, "__self__", None), "argmax_prob_out", False)
    t, p = impl(logits, out=out) if takes_out else impl(logits)
    if t is not tok:
        tok.copy_(t)
        prob.copy_(p)
    return tok, prob
