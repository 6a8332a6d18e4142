"""Helpers of the loader-validation and file-fuzzing tests (tests/model/): the prompt their logits are compared
on, the tiny adapter base shape, and where each GGUF header field lies (by gguf-py's reader, an implementation
independent of bitmtp's). Their file fixtures (``ckpt``, ``gguf_dense``, ``gguf_ternary``, ``adapter_dir``) are in
tests/model/conftest.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bitmtp.model.args import ModelArgs
from bitmtp.model.decoder import StepInputs
from bitmtp.runtime import KVStore

PROMPT = [1, 5, 7, 9, 11, 3, 4, 60, 33, 2]

#: the base shape of the ``adapter_dir`` fixture's adapter
ARGS = ModelArgs(family="llama", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, intermediate_size=96)


def logits(decoder) -> torch.Tensor:
    """The decoder's logits at every position of PROMPT (one prefill step on a fresh KV store)."""
    a = decoder.args
    kv = KVStore(a.num_layers, a.num_kv_heads, a.head_dim, 64, 16)
    pos = torch.arange(len(PROMPT))
    mask = torch.arange(64)[None, :] <= pos[:, None]
    return decoder(StepInputs(torch.tensor(PROMPT), pos, mask), kv)


def field_offsets(path: Path) -> dict[str, list[tuple[str, int, int]]]:
    """Where each header field lies, by gguf-py's reader: ``{key or tensor name: [(part, offset, size)]}``.

    Parts: ``key_len`` / ``key`` / ``type`` / ``value`` (``array_type``, ``count``, ``item``) for metadata;
    ``name_len`` / ``name`` / ``n_dims`` / ``dims`` / ``ttype`` / ``offset`` for tensor infos."""
    import gguf  # the test modules using this skip without gguf-py

    r = gguf.GGUFReader(str(path))
    base = r.data.ctypes.data

    def at(a: np.ndarray) -> tuple[int, int]:
        return a.ctypes.data - base, a.nbytes

    out: dict[str, list[tuple[str, int, int]]] = {}
    for key, f in r.fields.items():
        if key.startswith("GGUF."):
            continue
        names = ["key_len", "key", "type"]
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            names += ["array_type", "count"]
        elif f.types and f.types[0] == gguf.GGUFValueType.STRING:
            names += ["value_len"]
        parts = [(names[i] if i < len(names) else "item", *at(p)) for i, p in enumerate(f.parts)]
        out[key] = parts
    for t in r.tensors:
        names = ["name_len", "name", "n_dims", "dims", "ttype", "offset"]
        out["tensor:" + t.name] = [(n, *at(p)) for n, p in zip(names, t.field.parts, strict=True)]
    return out
