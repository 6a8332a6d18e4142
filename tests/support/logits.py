"""A decoder's logits at every position of a prompt, in one causal prefill step."""

from __future__ import annotations

import torch

from bitmtp.model.decoder import StepInputs
from bitmtp.runtime import KVStore


def full_logits(decoder, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` logits of ``decoder`` on ``ids`` (a fresh 256-row KV store, causal mask)."""
    a = decoder.args
    kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, 256, 16)
    pos = torch.arange(len(ids))
    mask = torch.arange(256)[None, :] <= pos[:, None]
    return decoder(StepInputs(torch.tensor(ids), pos, mask), kv)
