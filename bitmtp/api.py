"""Public entry points: :func:`load` (and, through the returned model, AR generation)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bitmtp.errors import BitMTPError, FormatError
from bitmtp.model.args import ModelArgs
from bitmtp.model.decoder import Decoder
from bitmtp.model.loaders import from_safetensors_dir, from_transformers
from bitmtp.runtime.engine import Engine, GenerationResult


@dataclass
class BitMTPModel:
    """A loaded model: decoder, tokenizer (when the source has one) and a decode engine."""

    decoder: Decoder
    tokenizer: Any
    source: str
    engine: Engine

    @property
    def args(self) -> ModelArgs:
        return self.decoder.args

    def encode(self, prompt: str | list[dict[str, str]]) -> list[int]:
        """Token ids of a string, or of chat messages through the tokenizer's chat template."""
        if self.tokenizer is None:
            raise BitMTPError("prompt: this model has no tokenizer; pass input_ids instead")
        if isinstance(prompt, list):
            ids = self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # a BatchEncoding
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in self.tokenizer(prompt)["input_ids"]]

    def generate_ar(self, input_ids: list[int], max_new_tokens: int = 128,
                    eos_token_id: int | list[int] | None = None) -> GenerationResult:
        """Greedy AR decoding on bitmtp's runtime (the baseline the MTP policies are measured against)."""
        if eos_token_id is None:
            eos = list(self.args.eos_token_id)
        else:
            eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        vocab = self.args.vocab_size
        bad = [i for i in input_ids if not 0 <= int(i) < vocab]
        if bad:
            raise BitMTPError(f"input_ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        return self.engine.generate_ar(input_ids, max_new_tokens, eos)


def _gguf_via_transformers(path: Path):
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise BitMTPError("loading GGUF needs transformers, gguf and accelerate: pip install 'bitmtp[hf]'") from exc
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    except Exception as exc:  # transformers raises many types for bad files
        raise FormatError(f"{path}: cannot read GGUF ({type(exc).__name__}: {exc})") from exc
    return hf, tok


def load(source: Any, *, backend: str | None = None, quantize: str | None = None, capacity: int = 2048,
         dtype: torch.dtype | None = None, device: str | torch.device = "cpu", m_max: int = 16,
         tokenizer: Any = None) -> BitMTPModel:
    """Load a model for bitmtp.

    Args:
        source: a Hugging Face checkpoint folder (safetensors + config.json), a ``.gguf`` file, or a
            live transformers ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``BitNetForCausalLM``.
        backend: kernel backend for the linear layers (default: automatic / ``BITMTP_BACKEND``).
        quantize: ``"ternary"`` to ternarize float linear weights by absmean (per tensor); default
            keeps them as the checkpoint stores them.
        capacity: maximum tokens (prompt + generated) of the KV store.
        dtype: dense compute dtype (default float32).
        device: ``"cpu"`` or ``"cuda"``.
        m_max: widest replay step.
        tokenizer: override the tokenizer (e.g. for a live model object).
    """
    dtype = dtype or torch.float32
    kwargs = dict(quantize=quantize, dtype=dtype, backend=backend, max_positions=capacity + m_max)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise BitMTPError(f"source: {path} does not exist")
        if path.is_file() and path.suffix == ".gguf":
            hf, tok = _gguf_via_transformers(path)
            decoder = from_transformers(hf, **kwargs)
            del hf
        elif path.is_dir():
            decoder = from_safetensors_dir(path, **kwargs)
            tok = tokenizer
            if tok is None and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(path))
        else:
            raise BitMTPError(f"source: {path} is neither a checkpoint folder nor a .gguf file")
        name = str(path)
    elif hasattr(source, "config") and hasattr(source, "state_dict"):
        decoder = from_transformers(source, **kwargs)
        tok = tokenizer
        name = type(source).__name__
    else:
        raise BitMTPError(f"source: expected a path or a transformers model, got {type(source).__name__}")
    decoder = decoder.to(device)
    engine = Engine(decoder, capacity=capacity, m_max=m_max)
    return BitMTPModel(decoder, tok if tokenizer is None else tokenizer, name, engine)
