"""Front door of a step's tail: the final RMSNorm, the LM head and the greedy choice, in one call.

Every decode step ends with these three ops on the rows whose choice is read. Each is cheap natively (the norm
~1 µs, the argmax ~20 µs) but costs 20–50 µs of Python and torch around it, with the caches cold after the layers
(bench/glue.py: 100 µs of a SmolLM2 step's ~0.55 ms host glue). The ``cpu`` backend runs all three in one native
call (``norm_head_argmax`` in csrc/cpu/w2a8_module.cpp: the same three functions in the same order, so the same
bits); everywhere else — another backend chosen for any of the three, other dtypes, gradients — they run one
after the other through :func:`~bitmtp.ops.norm.rms_norm`, :func:`~bitmtp.ops.linear.dense_linear` and
:func:`~bitmtp.ops.choose.argmax_prob`, which is also the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bitmtp.errors import ShapeError
from bitmtp.formats.ggml_blocks import BlockWeight
from bitmtp.ops import registry
from bitmtp.ops.choose import argmax_prob
from bitmtp.ops.linear import dense_linear
from bitmtp.ops.norm import rms_norm


def norm_head_argmax(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor | None, *,
                     blocks: BlockWeight | None = None, bias: torch.Tensor | None = None,
                     head_backend: str | None = None, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                     logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tok int64[M], prob float32[M], logits float32[M, N])`` of the rows ``x [M, K]`` (the last layer's
    outputs): ``logits = dense_linear(rms_norm(x, norm_weight, eps), weight, bias, blocks=blocks)`` and each
    row's argmax and softmax probability (:func:`~bitmtp.ops.choose.argmax_prob`), bit for bit.

    ``weight`` / ``blocks`` / ``bias`` / ``head_backend``: the LM head as :func:`~bitmtp.ops.linear.dense_linear`
    takes it (the norm and the choice use the automatic backend, as a decoder step does). ``out``: ``(tok, prob)``
    buffers to write into (as :func:`~bitmtp.ops.choose.argmax_prob`'s); ``logits_out``: a float32 ``[M, N]``
    buffer for the logits (else a new tensor)."""
    if x.dim() != 2:
        raise ShapeError(f"x: expected rows [M, K], got {tuple(x.shape)}")
    m, k = x.shape
    n = blocks.shape[0] if blocks is not None else (weight.shape[0] if weight is not None and weight.dim() == 2
                                                   else None)
    if n is None:
        raise ShapeError("weight: expected a 2-D [N, K] tensor, or blocks=")
    if logits_out is not None and (logits_out.dtype != torch.float32 or tuple(logits_out.shape) != (m, n)):
        raise ShapeError(f"logits_out: expected float32 [{m}, {n}], got {logits_out.dtype} "
                         f"{tuple(logits_out.shape)}")
    if out is not None:
        tok, prob = out
        if (tok.dtype, prob.dtype, tuple(tok.shape), tuple(prob.shape)) != (torch.long, torch.float32, (m,), (m,)):
            raise ShapeError(f"out: expected (int64 [{m}], float32 [{m}]), got ({tok.dtype} {tuple(tok.shape)}, "
                             f"{prob.dtype} {tuple(prob.shape)})")
    head_k = blocks.shape[1] if blocks is not None else weight.shape[1]
    if norm_weight.shape != (k,) or head_k != k:
        raise ShapeError(f"x [{m}, {k}]: the norm weight {tuple(norm_weight.shape)} and the head's K={head_k} "
                         f"must match its K")
    if m == 0:  # no row is read (a step of prompt rows none of which is a prompt's last)
        return _choose(x.new_zeros((0, n), dtype=torch.float32), out, logits_out)
    owner, blocks_op = _tail_owner(x.device, blocks, head_backend)
    if owner is not None:
        got = owner.norm_head_argmax(x, norm_weight, eps, weight, blocks if blocks_op else None, bias, out, logits_out)
        if got is not None:
            return got
    return _choose(dense_linear(rms_norm(x, norm_weight, eps), weight, bias, backend=head_backend, blocks=blocks),
                   out, logits_out)


def _tail_owner(dev: torch.device, blocks: BlockWeight | None, head_backend: str | None) -> tuple[object, bool]:
    """``(backend, reads blocks)``: the backend object whose ``norm_head_argmax`` runs the three ops in one call
    when the registry chooses it for all three on ``dev`` (else None), and whether its head op reads ``blocks``."""
    blocks_op = blocks is not None and dev.type == "cpu"
    owner = getattr(registry.select("rms_norm", dev), "__self__", None)
    if getattr(owner, "norm_head_argmax", None) is None \
            or getattr(registry.select("dense_linear_blocks" if blocks_op else "dense_linear", dev, head_backend),
                       "__self__", None) is not owner \
            or getattr(registry.select("argmax_prob", dev), "__self__", None) is not owner:
        return None, blocks_op
    return owner, blocks_op


@dataclass(frozen=True)
class NativeTail:
    """A step's tail as the fused CPU layers' call takes it (``ext.fused_layers``' ``tail_*`` arguments): the
    final norm's weight, the LM head's weight / blocks and bias as pointers, with the tensors they point into
    (``keep``). Made by :func:`native_tail`; the call then gives :func:`norm_head_argmax`'s bits."""

    norm: int
    eps: float
    w: int
    n: int
    bias: int
    fmt: int
    keep: tuple


def native_tail(norm_weight: torch.Tensor, eps: float, weight: torch.Tensor | None, *,
                blocks: BlockWeight | None = None, bias: torch.Tensor | None = None,
                head_backend: str | None = None) -> NativeTail | None:
    """The tail's operands for the fused CPU layers' call, when :func:`norm_head_argmax` on float32 rows would run
    its three ops in one ``cpu`` backend call (the registry chooses it for all three, float32 contiguous operands,
    no gradients); None otherwise (the caller runs :func:`norm_head_argmax` after the layers)."""
    cpu = torch.device("cpu")
    if torch.is_grad_enabled() and norm_weight.requires_grad:
        return None
    owner, blocks_op = _tail_owner(cpu, blocks, head_backend)
    operands = getattr(owner, "tail_operands", None)
    got = operands(norm_weight, weight, blocks if blocks_op else None, bias) if operands is not None else None
    if got is None:
        return None
    w, n, b, fmt = got
    # aliases of the tensors, not the tensors: a tensor whose .data is replaced later keeps pointing here at memory
    # that is still alive (the caller asks again to follow the change: Decoder.invalidate_native)
    keep = tuple(t.detach() for t in (norm_weight, weight, bias, None if blocks is None else blocks.data)
                 if t is not None)
    return NativeTail(norm_weight.data_ptr(), float(eps), w, n, b, fmt, keep)


def _choose(logits: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor] | None,
            logits_out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(tok, prob, logits)`` from computed logits: as float32, into ``logits_out`` when given, and their choice."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    if logits_out is not None:
        logits_out.copy_(logits)
        logits = logits_out
    tok, prob = argmax_prob(logits, out=out)
    return tok, prob, logits


def choose_logits(logits: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
                  logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`norm_head_argmax` returns, for logits an LM head that is not a dense projection computed."""
    return _choose(logits, out, logits_out)


__all__ = ["NativeTail", "choose_logits", "native_tail", "norm_head_argmax"]
