"""Training losses shared by the adapter trainer (``bitmtp.train.trainer``) and the full fine-tune
(``bitmtp.train.full``). Kept apart from both so that neither imports the other for them (the
trainer loads ``full`` only for ``--mode full``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def weighted_block_ce(logits: torch.Tensor, targets: torch.Tensor, block_k: torch.Tensor, block_size: int,
                      gamma: float, n_blocks: int, soft: torch.Tensor | None = None,
                      soft_weight: float = 0.0, block_weight: torch.Tensor | None = None,
                      block_of_row: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP loss of a batch of draft blocks and the per-position top-1 accuracy.

    ``logits [B, R, V]`` and ``targets [B, R]``: ``R`` block rows, ``n_blocks`` blocks per window (of
    up to ``block_size − 1`` rows each); ``block_k [R]``: each row's draft position ``k`` in
    ``1 … block_size − 1``. The cross-entropy of a row is weighted by ``λ_k = γ^k`` (later positions
    matter less: a draft is accepted up to its first miss) and summed per block, then averaged over the
    ``B · n_blocks`` blocks.
    ``soft [B, R, V]`` (with ``soft_weight`` w > 0): the teacher's log-probabilities for each row; a
    row's loss is then ``(1 − w) · CE(target) + w · CE(softmax(soft))`` — the cross-entropy against the
    teacher's whole distribution (its KL up to a constant): Medusa-2's self-distillation, which tells a
    draft how close the runner-up was, not only which token won.
    ``block_weight [B, n_blocks]`` (0/1) with ``block_of_row [R]`` (each row's block): only the blocks of
    weight 1 count — the loss is then the mean over them, and the accuracy over their rows (answer-only
    training: blocks anchored outside an answer weigh 0).
    Returns ``(loss, acc)`` with ``acc [block_size − 1]`` the hit rate per position ``k`` (no grad;
    NaN for a position no row has).
    """
    ce = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(targets.shape)
    if soft is not None and soft_weight > 0:
        soft_ce = -(soft.float().exp() * F.log_softmax(logits.float(), -1)).sum(-1)
        ce = (1 - soft_weight) * ce + soft_weight * soft_ce
    weight = (gamma ** block_k.to(ce.dtype))[None]  # λ_k = γ^k
    if block_weight is None:
        loss = (ce * weight).sum() / (targets.shape[0] * n_blocks)
        keep = torch.ones_like(ce, dtype=torch.bool)
    else:
        row_w = block_weight.to(ce.dtype)[:, block_of_row]  # [B, R]
        loss = (ce * weight * row_w).sum() / block_weight.sum().clamp(min=1)
        keep = row_w > 0
    with torch.no_grad():
        hit = (logits.argmax(-1) == targets).float()
        acc = torch.stack([hit[:, block_k == k][keep[:, block_k == k]].mean() for k in range(1, block_size)])
    return loss, acc
