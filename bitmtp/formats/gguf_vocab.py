"""Tokenizers in GGUF files.

Two things are written for a tokenizer:

* ``tokenizer.ggml.*`` — the vocabulary as llama.cpp-family readers expect it (``model = "gpt2"`` for
  byte-level BPE: tokens by id, token types, merges, special ids, chat template). Only byte-level BPE
  tokenizers (Llama-3, Qwen, SmolLM2, GPT-2 style) are translated; other kinds are reported and skipped.
* ``bitmtp.tokenizer.files`` — the tokenizer's own files (``save_pretrained``), so bitmtp rebuilds
  exactly the tokenizer it exported, whatever its kind.
"""

from __future__ import annotations

import base64
import json
import tempfile
from pathlib import Path
from typing import Any

#: llama.cpp token types
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
#: llama.cpp refuses unknown pre-tokenizer names; "default" is accepted everywhere (it uses a generic regex)
DEFAULT_PRE = "default"


def tokenizer_files(tokenizer: Any) -> dict[str, dict[str, str]] | None:
    """``{file name: {"text": …} | {"base64": …}}`` of ``tokenizer.save_pretrained``; None if it cannot save."""
    save = getattr(tokenizer, "save_pretrained", None)
    if save is None:
        return None
    with tempfile.TemporaryDirectory(prefix="bitmtp-tok-") as tmp:
        save(tmp)
        files: dict[str, dict[str, str]] = {}
        for f in sorted(Path(tmp).rglob("*")):
            if not f.is_file():
                continue
            raw = f.read_bytes()
            rel = str(f.relative_to(tmp))
            try:
                files[rel] = {"text": raw.decode("utf-8")}
            except UnicodeDecodeError:
                files[rel] = {"base64": base64.b64encode(raw).decode("ascii")}
    return files or None


def write_tokenizer_files(files: dict[str, dict[str, str]], folder: Path) -> None:
    """Inverse of :func:`tokenizer_files`: recreate the files under ``folder``."""
    for rel, entry in files.items():
        target = (folder / rel).resolve()
        if folder.resolve() not in target.parents:
            raise ValueError(f"tokenizer file name {rel!r} escapes its folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        if "text" in entry:
            target.write_text(entry["text"], encoding="utf-8")
        else:
            target.write_bytes(base64.b64decode(entry["base64"]))


def ggml_tokenizer_fields(tokenizer: Any, vocab_size: int) -> tuple[dict[str, Any], str | None]:
    """``(fields, why_not)``: the ``tokenizer.ggml.*`` keys of a byte-level BPE tokenizer, padded to the
    model's ``vocab_size``; ``why_not`` says why no vocabulary was written (fields then hold only the
    chat template, if any)."""
    fields: dict[str, Any] = {}
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        fields["tokenizer.chat_template"] = template
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return fields, "the tokenizer is not a fast (tokenizers) tokenizer"
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return fields, f"{model.get('type')} tokenizers are not written as GGML vocabularies"
    if "ByteLevel" not in json.dumps(spec.get("pre_tokenizer")) + json.dumps(spec.get("decoder")):
        return fields, "only byte-level BPE tokenizers are written as GGML vocabularies"
    by_id: dict[int, tuple[str, int]] = {int(i): (tok, NORMAL) for tok, i in model["vocab"].items()}
    for added in spec.get("added_tokens") or []:
        by_id[int(added["id"])] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    if max(by_id) >= vocab_size:
        return fields, f"the tokenizer has ids up to {max(by_id)}, beyond the model's vocabulary of {vocab_size}"
    tokens, types = [], []
    for i in range(vocab_size):
        tok, kind = by_id.get(i, (f"[PAD{i}]", UNUSED))
        tokens.append(tok)
        types.append(kind)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    fields.update({
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": DEFAULT_PRE,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
    })
    if merges:
        fields["tokenizer.ggml.merges"] = merges
    for attr, key in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("unk_token_id", "unknown"),
                      ("pad_token_id", "padding")):
        value = getattr(tokenizer, attr, None)
        if isinstance(value, int) and 0 <= value < vocab_size:
            fields[f"tokenizer.ggml.{key}_token_id"] = value
    add_bos = getattr(tokenizer, "add_bos_token", None)
    if isinstance(add_bos, bool):
        fields["tokenizer.ggml.add_bos_token"] = add_bos
    return fields, None


__all__ = ["tokenizer_files", "write_tokenizer_files", "ggml_tokenizer_fields"]
