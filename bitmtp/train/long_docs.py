"""A held-out long-document prompt set: a document of 500–1500 tokens, then a request about it.

Each prompt is one user message: a document, a blank line, then a request to summarise it, answer a
question from it, list what it describes or rewrite its example. Answers copy spans of the document
(names, signatures, example code), which is where prompt-lookup drafting — and any drafter that can
copy from the context — should gain most over AR. ``python -m bitmtp eval-acceptance --prompts docs``
and ``bench --prompts docs`` run it (``bitmtp.train.evaluate.prompt_ids(model, "docs", count)``); the
prompts are up to ~1550 tokens long, so load the model with ``--capacity 2048`` (the default 1024 is
too small).

**Where the texts come from.** The docstrings of Python 3.11's standard library (read from CPython
3.11.7): module docstrings and the docstrings of named functions, classes and methods, as
``inspect.cleandoc`` gives them. In the API documents each part starts with the object's signature
(``inspect.signature``). 14 documents, each from a different module: API/code-heavy ones (json, re,
shutil, collections, concurrent.futures, tempfile, tarfile, ssl) and prose-heavy or mixed ones
(logging, doctest, site, random, sched, email). They are stored in ``bitmtp/data/long_docs.jsonl``
(package data, one document per line, in order) and read from there, never from the running Python's
standard library, so the prompts (and results measured on them) are the same on every machine and
every Python version. Token counts with the SmolLM2 tokenizer: documents 605–1476 tokens; whole
prompts (chat template and request included) 661–1546 (``tests/train/test_long_docs.py`` checks
500–1500 and < 1700).

**License.** These texts are part of Python and are used under the PSF License Agreement version 2.
``bitmtp/data/LICENSE-PSF.txt``, beside the data, reproduces that agreement with PSF's notice of
copyright ("Copyright (c) 2001, ..., 2023 Python Software Foundation; All Rights Reserved") and the
summary of changes its clause 3 asks for: excerpts only; docstrings dedented and trailing spaces
dropped; a signature put above each function's docstring (defaults that print as object addresses
written by name, e.g. ``copy_function=copy2``; lines over 100 characters wrapped); parts joined by two
blank lines.

**Held out.** Every document comes from a file of the held-out split of the ``stdlib`` corpus
(``bitmtp.train.data.is_heldout``: json/__init__.py, re/__init__.py, logging/__init__.py,
collections/__init__.py, concurrent/futures/_base.py, email/_header_value_parser.py, doctest.py,
site.py, ssl.py, shutil.py, tempfile.py, tarfile.py, random.py, sched.py — the split the ``code``
prompts come from too; the tests check it). ``train`` reads only the train split of
``stdlib`` (``cli_train`` passes ``split="train"``) and ``distill`` builds its prompts from the train
split only, so the shipped adapters — trained on the stdlib train split and on distill corpora of it,
as their ``adapter_config.json`` records — never saw these texts. Two limits: the base model's own
pretraining data very likely includes Python's documentation, and training on a user's own files or
folders (``--data``) is not split. Python's ``LICENSE.txt`` is not used as a document: it is in the
train split.
"""

from __future__ import annotations

import json
from importlib.resources import files

from bitmtp.errors import BitMTPError

#: the documents: ``title`` ("<module>: <what>", the module the docstrings are read from), ``request``
#: (what the prompt asks; names the document quotes are in backticks) and ``text`` (the document)
DOCUMENTS: list[dict[str, str]] = [
    # one JSON object per line, split on "\n" only: str.splitlines would also split inside a text at U+2028
    # or U+0085, which JSON leaves unescaped
    json.loads(line) for line in (files("bitmtp") / "data" / "long_docs.jsonl").read_text(encoding="utf-8").split("\n")
    if line]


def document_prompts(count: int | None = None) -> list[list[dict[str, str]]]:
    """Chat messages for the first ``count`` documents (all of them when None, or when ``count`` is
    larger): one user message each, the document text, a blank line, then the request."""
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise BitMTPError(f"count: expected a whole number >= 1, or None for all {len(DOCUMENTS)} documents, "
                          f"got {count!r}")
    docs = DOCUMENTS if count is None else DOCUMENTS[:count]
    return [[{"role": "user", "content": f"{d['text']}\n\n{d['request']}"}] for d in docs]
