"""Training data from local files only: text or code files, folders of them, or JSONL.

* A text/code file is one document.
* A ``.jsonl`` file holds one document per line: ``{"text": ...}``, ``{"messages": [...]}`` (chat,
  rendered with the tokenizer's chat template) or ``{"tokens": [...]}`` (token ids, used as they are:
  what ``python -m bitmtp distill`` writes).
* A folder is searched recursively for files with a known text extension (:data:`TEXT_SUFFIXES`).
* ``"stdlib"`` names the corpus every machine has: Python's standard-library sources.

Documents are tokenized, joined with the end-of-sequence token, and cut into windows of
``seq_len`` tokens. Files that are not UTF-8 are skipped with one warning naming them. Nothing is
ever downloaded.
"""

from __future__ import annotations

import json
import logging
import random
import sysconfig
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from bitmtp.errors import BitMTPError

log = logging.getLogger("bitmtp.train")

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".hpp", ".js", ".ts", ".java", ".go", ".rs",
                 ".sh", ".toml", ".cfg", ".ini", ".yaml", ".yml", ".json", ".jsonl", ".html", ".css", ".tex")
STDLIB = "stdlib"


def stdlib_path() -> Path:
    """Python's standard-library source folder (present on every machine with Python)."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(path: Path) -> bool:
    """The evaluation split: one file in ten by a hash of its name (stable across machines)."""
    return zlib.crc32(path.name.encode()) % 10 == 0


def iter_files(sources: Iterable[str | Path], *, split: str = "all", shuffle_seed: int | None = None
               ) -> Iterator[Path]:
    """Files named by ``sources`` (files, folders searched recursively, or ``"stdlib"``), sorted or
    shuffled by ``shuffle_seed``; ``split`` = ``"train"`` / ``"heldout"`` keeps one side of
    :func:`is_heldout` for the ``"stdlib"`` corpus (whose held-out tenth is the evaluation's code
    prompts); the user's own files and folders are always used whole."""
    for src in sources:
        path = stdlib_path() if str(src) == STDLIB else Path(src)
        if not path.exists():
            raise BitMTPError(f"data: {path} does not exist")
        if path.is_file():
            yield path
            continue
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                       and "site-packages" not in p.parts)
        if split != "all" and str(src) == STDLIB:
            files = [p for p in files if is_heldout(p) == (split == "heldout")]
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(files)
        yield from files


def iter_python_lines(sources: Iterable[str | Path], *, split: str = "all", shuffle_seed: int | None = None
                      ) -> Iterator[list[str]]:
    """The lines of each readable UTF-8 ``.py`` file of the sources (see :func:`iter_files`); others are skipped."""
    for path in iter_files(sources, split=split, shuffle_seed=shuffle_seed):
        if path.suffix != ".py":
            continue
        try:
            yield path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue


def iter_documents(sources: Iterable[str | Path], tokenizer: Any = None, skipped: list[Path] | None = None,
                   **file_options) -> Iterator[str | list[int]]:
    """Documents of the sources — texts, or token-id lists from JSONL ``tokens`` records; non-UTF-8
    files are skipped (and appended to ``skipped``)."""
    for path in iter_files(sources, **file_options):
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            if skipped is not None:
                skipped.append(path)
            continue
        if path.suffix.lower() == ".jsonl":
            yield from _jsonl_documents(path, text, tokenizer)
        elif text.strip():
            yield text


def _jsonl_records(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed record)`` of each non-blank line of a JSONL file's ``text``."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise BitMTPError(f"data: {path}:{lineno} is not valid JSON ({exc.msg})") from exc


def _is_token_list(ids: Any) -> bool:
    return isinstance(ids, list) and bool(ids) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)


def _jsonl_documents(path: Path, text: str, tokenizer: Any) -> Iterator[str | list[int]]:
    for lineno, rec in _jsonl_records(path, text):
        if isinstance(rec, dict) and isinstance(rec.get("tokens"), list):
            ids = rec["tokens"]
            if not _is_token_list(ids):
                raise BitMTPError(f"data: {path}:{lineno} 'tokens' must be a non-empty list of token ids (ints >= 0)")
            yield ids
        elif isinstance(rec, dict) and isinstance(rec.get("text"), str):
            yield rec["text"]
        elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
            if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
                raise BitMTPError(f"data: {path}:{lineno} has chat messages but the model has no chat template")
            yield tokenizer.apply_chat_template(rec["messages"], tokenize=False)
        else:
            raise BitMTPError(f"data: {path}:{lineno} needs a 'text' string, a 'messages' list or a 'tokens' list")


def _check_vocab(ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is not None and max(ids) >= vocab_size:
        raise BitMTPError(f"data: token id {max(ids)} is outside the model's vocabulary ({vocab_size}); "
                          f"was this corpus made with another model?")


def training_windows(sources: Iterable[str | Path], tokenizer: Any, seq_len: int, *, answer_only: bool = False,
                     **options) -> tuple[list[list[int]], list[list[bool]] | None]:
    """``(windows, anchor masks)`` for :func:`bitmtp.train.train`: :func:`answer_windows` when ``answer_only``,
    else :func:`token_windows` and no masks (``options``: their shared keyword arguments)."""
    if answer_only:
        return answer_windows(sources, seq_len, **options)
    return token_windows(sources, tokenizer, seq_len, **options), None


def iter_answer_records(sources: Iterable[str | Path], **file_options) -> Iterator[tuple[list[int], int]]:
    """``(tokens, prompt_tokens)`` of each distill record (JSONL ``tokens`` + ``prompt_tokens``, as
    ``bitmtp distill`` writes) in the sources; anything else is a :class:`BitMTPError` naming the file and line."""
    for path in iter_files(sources, **file_options):
        if path.suffix.lower() != ".jsonl":
            raise BitMTPError(f"data: {path} is not a distill corpus (JSONL records with 'tokens' and 'prompt_tokens', "
                              f"made by `bitmtp distill`); answer-only training needs to know where answers start")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise BitMTPError(f"data: {path} is not UTF-8") from exc
        for lineno, rec in _jsonl_records(path, text):
            ids = rec.get("tokens") if isinstance(rec, dict) else None
            if not _is_token_list(ids):
                raise BitMTPError(f"data: {path}:{lineno} needs 'tokens', a non-empty list of token ids (ints >= 0)")
            pt = rec.get("prompt_tokens")
            if not isinstance(pt, int) or isinstance(pt, bool) or not 0 <= pt < len(ids):
                raise BitMTPError(f"data: {path}:{lineno} needs 'prompt_tokens', an int in [0, {len(ids)}) (where the "
                                  f"answer starts), got {pt!r}; records of `bitmtp distill` have it")
            yield ids, pt


def answer_windows(sources: Iterable[str | Path], seq_len: int, *, max_context: int, eos_token_id: int | None = None,
                   max_tokens: int | None = None, split: str = "all", shuffle_seed: int | None = None,
                   vocab_size: int | None = None) -> tuple[list[list[int]], list[list[bool]]]:
    """Windows of ``seq_len`` tokens made of whole distill records, and per window the positions where a
    draft block may be anchored: the record's answer tokens (a block anchored at t drafts t + 2 …, as a
    decode step whose last committed token is t does).

    Unlike :func:`token_windows` (one stream cut every ``seq_len`` tokens), a record is never split
    across windows, so every anchor sees its own prompt — as decoding always does — and no block is
    anchored in a prompt (decoding never drafts the user's text; in the session-15 corpora that was 29 %
    of the tokens). Records follow one another (each ended by ``eos_token_id`` when given) while they fit;
    a window's unused tail repeats the end token (or the last token) and anchors nowhere. A record longer
    than a window keeps its first ``seq_len`` tokens (and is left out when they are all prompt).
    """
    if seq_len > max_context:
        raise BitMTPError(f"seq_len: {seq_len} tokens is longer than the model's context ({max_context})")
    if seq_len < 8:
        raise BitMTPError(f"seq_len: must be >= 8, got {seq_len}")
    windows: list[list[int]] = []
    masks: list[list[bool]] = []
    cur: list[int] = []
    cur_mask: list[bool] = []

    def close() -> None:
        if cur and any(cur_mask):
            fill = int(eos_token_id) if eos_token_id is not None else cur[-1]
            pad = seq_len - len(cur)
            windows.append(cur + [fill] * pad)
            masks.append(cur_mask + [False] * pad)
        cur.clear()
        cur_mask.clear()

    for ids, pt in iter_answer_records(sources, split=split, shuffle_seed=shuffle_seed):
        _check_vocab(ids, vocab_size)
        rec = list(ids) + ([int(eos_token_id)] if eos_token_id is not None else [])
        rec_mask = [False] * pt + [True] * (len(ids) - pt) + [False] * (len(rec) - len(ids))
        rec, rec_mask = rec[:seq_len], rec_mask[:seq_len]
        if len(cur) + len(rec) > seq_len:
            close()
        cur.extend(rec)
        cur_mask.extend(rec_mask)
        if max_tokens is not None and len(windows) * seq_len >= max_tokens:
            break
    close()
    if not windows:
        raise BitMTPError("data: the corpus has no record with an answer token (nothing to anchor a draft block on)")
    return windows, masks


def token_windows(sources: Iterable[str | Path], tokenizer: Any, seq_len: int, *, max_context: int,
                  eos_token_id: int | None = None, max_tokens: int | None = None, split: str = "all",
                  shuffle_seed: int | None = None, vocab_size: int | None = None) -> list[list[int]]:
    """Tokenize the corpus and cut it into windows of ``seq_len`` tokens.

    Raises :class:`BitMTPError` for an empty corpus, for ``seq_len`` beyond the model's context, for
    token ids outside ``vocab_size`` (when given), or when the corpus yields not even one full window.
    """
    if seq_len > max_context:
        raise BitMTPError(f"seq_len: {seq_len} tokens is longer than the model's context ({max_context})")
    if seq_len < 8:
        raise BitMTPError(f"seq_len: must be >= 8, got {seq_len}")
    if tokenizer is None:
        raise BitMTPError("data: training on text needs the model's tokenizer")
    skipped: list[Path] = []
    stream: list[int] = []
    windows: list[list[int]] = []
    docs = 0
    for doc in iter_documents(sources, tokenizer, skipped, split=split, shuffle_seed=shuffle_seed):
        docs += 1
        if isinstance(doc, list):
            _check_vocab(doc, vocab_size)
            stream.extend(doc)
        else:
            stream.extend(tokenizer(doc)["input_ids"])
        if eos_token_id is not None:
            stream.append(int(eos_token_id))
        while len(stream) >= seq_len:
            windows.append(stream[:seq_len])
            del stream[:seq_len]
        if max_tokens is not None and len(windows) * seq_len >= max_tokens:
            break
    if skipped:
        names = ", ".join(str(p) for p in skipped[:5]) + (f" (+{len(skipped) - 5} more)" if len(skipped) > 5 else "")
        log.warning("data: skipped %d file(s) that are not UTF-8: %s", len(skipped), names)
    if docs == 0:
        raise BitMTPError("data: the corpus is empty (no readable text in the given files)")
    if not windows:
        raise BitMTPError(f"data: the corpus has fewer than seq_len={seq_len} tokens")
    return windows
