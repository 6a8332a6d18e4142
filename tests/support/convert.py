"""Helpers of the convert tests: a tiny float GGUF source, and a write that fails or stalls half-way.

The interrupted-write helpers are importable by name because a child process (started by
tests/test_cli_convert.py to be killed mid-write) imports them.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import numpy as np
import torch

from bitmtp.formats import gguf as G
from bitmtp.model.args import ModelArgs
from bitmtp.model.gguf_io import export_gguf
from bitmtp.model.loaders import build_decoder


def float_source(path: Path, family: str, tied: bool, seed: int) -> Path:
    """A tiny float32 model (random weights, K multiples of 32) written as a GGUF file."""
    config = dict(model_type=family, vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied)
    args = ModelArgs.from_hf_config(config, source="test")
    g = torch.Generator().manual_seed(seed)
    h, i, q, kv = args.hidden_size, args.intermediate_size, args.q_size, args.kv_size
    shapes = {"model.embed_tokens.weight": (args.vocab_size, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    for n in range(args.num_layers):
        p = f"model.layers.{n}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
        if family == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (args.head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (args.head_dim,)
    state = {name: (1 + 0.2 * torch.randn(s, generator=g)) if len(s) == 1 else 0.3 * torch.randn(s, generator=g)
             for name, s in shapes.items()}
    decoder = build_decoder(args, state, source="test")
    return export_gguf(decoder, path, progress=False)


def stalling(mode: str, marker: Path | None = None) -> type[np.ndarray]:
    """An array type whose ``tofile`` (gguf's writer calls it for the tensor data) writes half of its bytes,
    then fails (``exception``), raises a signal at its own process, or marks a file and stalls (``wait``)."""

    class Stalling(np.ndarray):
        def tofile(self, f):
            raw = np.asarray(self).reshape(-1)
            raw[: raw.size // 2].tofile(f)
            f.flush()
            if mode == "exception":
                raise OSError(28, "No space left on device")
            if mode == "wait":
                marker.touch()
                time.sleep(120)
                return
            sig = getattr(signal, mode)
            if sig != signal.SIGINT and signal.getsignal(sig) == signal.SIG_DFL:
                raise AssertionError(f"no {mode} handler during the write: the signal would kill the process")
            signal.raise_signal(sig)  # its Python handler runs before the next bytecode
            raise AssertionError(f"{mode} did not interrupt the write")

    return Stalling


def slow_at(tensor_index: int, array_type: type[np.ndarray]):
    """A stand-in for ``G.numpy_of`` returning the ``tensor_index``-th dense tensor as ``array_type``."""
    real, calls = G.numpy_of, []

    def numpy_of(t):
        calls.append(1)
        data, raw = real(t)
        return (data.view(array_type) if len(calls) == tensor_index else data), raw

    return numpy_of
