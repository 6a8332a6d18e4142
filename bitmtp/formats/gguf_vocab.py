"""Tokenizers in GGUF files.

Two things are written for a tokenizer:

* ``tokenizer.ggml.*`` — the vocabulary as llama.cpp-family readers expect it (``model = "gpt2"`` for
  byte-level BPE: tokens by id, token types, merges, special ids, chat template). Only byte-level BPE
  tokenizers (Llama-3, Qwen, SmolLM2, GPT-2 style) are translated; other kinds are reported and skipped.
* ``bitmtp.tokenizer.files`` — the tokenizer's own files (``save_pretrained``), so bitmtp rebuilds
  exactly the tokenizer it exported, whatever its kind.

A GGUF file is data from anywhere, so the files rebuilt from ``bitmtp.tokenizer.files`` are limited to
the tokenizer *data* files transformers writes (:data:`TOKENIZER_DATA_FILES`: vocabularies, merges,
configs, chat templates) at the top of the folder; a Python file, any other name, a path, or a
``tokenizer_config.json`` that names custom code (``auto_map``) is a FormatError — nothing a file
carries ever runs (the loader also passes ``trust_remote_code=False``).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from bitmtp.errors import FormatError

log = logging.getLogger("bitmtp")

#: the GGUF key the files travel under (named in errors)
FILES_KEY = "bitmtp.tokenizer.files"
#: what a tokenizer's ``save_pretrained`` writes that is data, never code: tokenizers' JSON, BPE and
#: WordPiece vocabularies and merges, SentencePiece models, configs and chat templates
TOKENIZER_DATA_FILES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model",
    "spiece.model", "sentencepiece.bpe.model", "sentencepiece.model", "spm.model", "bpe.codes",
})

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
            rel = f.relative_to(tmp).as_posix()
            if rel not in TOKENIZER_DATA_FILES:  # the reader refuses anything else: do not write it
                log.warning("tokenizer file %r is not a known tokenizer data file; not stored in the GGUF", rel)
                continue
            try:
                files[rel] = {"text": raw.decode("utf-8")}
            except UnicodeDecodeError:
                files[rel] = {"base64": base64.b64encode(raw).decode("ascii")}
    return files or None


def _file_bytes(name: str, entry: Any) -> bytes:
    """The content of one ``{"text": …} | {"base64": …}`` entry (FormatError when it is neither)."""
    if isinstance(entry, dict) and isinstance(entry.get("text"), str):
        return entry["text"].encode("utf-8")
    if isinstance(entry, dict) and isinstance(entry.get("base64"), str):
        try:
            return base64.b64decode(entry["base64"], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise FormatError(f"{FILES_KEY}: {name!r} is not valid base64 ({exc})") from exc
    raise FormatError(f"{FILES_KEY}: the entry of {name!r} must be {{'text': str}} or {{'base64': str}}, "
                      f"got {type(entry).__name__}")


def check_tokenizer_files(files: Any) -> dict[str, bytes]:
    """Validate ``bitmtp.tokenizer.files`` of an untrusted file; return ``{name: bytes}``.

    Refused (FormatError naming the file): a name that is not in :data:`TOKENIZER_DATA_FILES` — Python
    or any other code, unknown files, paths with separators or ``..`` — and a ``tokenizer_config.json``
    whose ``auto_map`` points at custom tokenizer code.
    """
    if not isinstance(files, dict) or not files:
        raise FormatError(f"{FILES_KEY}: expected a non-empty mapping of file name to content, "
                          f"got {type(files).__name__}")
    out: dict[str, bytes] = {}
    for name, entry in files.items():
        if not isinstance(name, str) or name not in TOKENIZER_DATA_FILES:
            raise FormatError(f"{FILES_KEY}: {name!r} is not a tokenizer data file (allowed: "
                              f"{', '.join(sorted(TOKENIZER_DATA_FILES))}); bitmtp never writes or runs code or "
                              "other files from a GGUF. Re-export the model with bitmtp (save_gguf) to fix the file")
        out[name] = _file_bytes(name, entry)
    config = out.get("tokenizer_config.json")
    if config is not None:
        try:
            parsed = json.loads(config.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"{FILES_KEY}: tokenizer_config.json is not valid JSON ({exc})") from exc
        if isinstance(parsed, dict) and parsed.get("auto_map"):
            raise FormatError(f"{FILES_KEY}: tokenizer_config.json names custom tokenizer code (auto_map = "
                              f"{parsed['auto_map']!r}); bitmtp never runs code a file carries. Use a tokenizer "
                              "transformers implements, or pass tokenizer= to bitmtp.load")
    return out


def write_tokenizer_files(files: Any, folder: Path) -> None:
    """Inverse of :func:`tokenizer_files`: recreate the files under ``folder``, after
    :func:`check_tokenizer_files` (FormatError for anything that is not tokenizer data)."""
    for name, raw in check_tokenizer_files(files).items():
        (folder / name).write_bytes(raw)


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


__all__ = ["TOKENIZER_DATA_FILES", "tokenizer_files", "check_tokenizer_files", "write_tokenizer_files",
           "ggml_tokenizer_fields"]
