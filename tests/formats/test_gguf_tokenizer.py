"""The GGUF tokenizer built from parsed metadata (bitmtp/formats/gguf_tokenizer.py) against transformers'
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, the path it replaces on load.

Rule: the same ``tokenizers`` pipeline (its JSON), and the same ids and text — encode with and without special
tokens, decode with and without them, the chat template rendered and tokenized — on the real SmolLM2 file and on
small synthetic byte-level vocabularies that vary what the builder reads (pre-tokenizer split, BOS/EOS flags,
user-defined tokens, tokens outside the byte alphabet). Vocabularies the builder does not handle return a reason
(the caller falls back to transformers), never a different tokenizer.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from bitmtp.formats.gguf import read_gguf
from bitmtp.formats.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf
from tests.support.smollm2 import smollm2_or_skip

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

TEXTS = [
    "Hi",
    "Hello, world! How's it going? I'm fine; you'd think so.",
    "  leading spaces\tand\ttabs\n\n\ntrailing newlines   \n",
    "héllo wörld — “quotes” «guillemets» 日本語のテキスト 한국어 العربية 🤖👍🏽 e\u0301",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\nclass A(B):\n\tpass\n",
    "numbers 1234567 3.14159 -42 1e-5 0x1F and 12,345,678",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b <|im_end|>c<repo_name>",
    "     ",
    "\r\n\r\n \u00a0\u2003 zero\u200bwidth",
    "x" * 300 + " " + "ab" * 100,
    "",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 🤖\n  there"},
     {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "def f():\n\treturn 1"}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "<|im_end|> inside text"}],
]


def _ids(out):
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def assert_same(ours: GGUFTokenizer, ref, chats=CHATS, texts=TEXTS) -> None:
    """Our tokenizer and transformers' agree on everything bitmtp (and a user) asks of a tokenizer."""
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for text in texts:
        assert ours(text)["input_ids"] == _ids(ref(text)), text
        assert ours.encode(text, add_special_tokens=False) == list(ref.encode(text, add_special_tokens=False)), text
    ids = list(range(0, len(ref), max(1, len(ref) // 500))) + [0, 1, 2, 3, len(ref) - 1]
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip)
        for text in texts:
            enc = _ids(ref(text))
            assert ours.decode(enc, skip_special_tokens=skip) == ref.decode(enc, skip_special_tokens=skip)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert len(ours) == len(ref)
    if ref.chat_template:
        for chat in chats:
            for gen in (False, True):
                want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
                assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == want
                got = ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True)
                assert got == _ids(ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True))


def _auto(path: Path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)


# --- the real model ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_or_skip()
    ours, why = tokenizer_from_gguf(read_gguf(path).meta, str(path))
    assert why is None and ours is not None
    return ours, _auto(path)


def test_smollm2_tokenizer_equals_transformers(smollm2):
    assert_same(*smollm2)


def test_smollm2_chat_prompt_ids(smollm2):
    """The ids bitmtp's CLI feeds the model for "Hi" (system prompt from the template, generation prompt)."""
    ours, _ = smollm2
    ids = ours.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert ids[:3] == [1, 9690, 198] and ids[-6:] == [2, 198, 1, 520, 9531, 198] and len(ids) == 31
    assert ours.decode(ids, skip_special_tokens=True).startswith("system\nYou are a helpful AI assistant")


# --- synthetic vocabularies ----------------------------------------------------------------------------------

CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def trained():
    """A byte-level BPE trained on varied text: its vocabulary (by id) and merges."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=CONTROL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(TEXTS * 3 + ["the quick brown fox jumps over the lazy dog " * 5], trainer)
    spec = json.loads(core.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["merges"]]
    return tokens, merges


def _write(path: Path, tokens: list[str], merges: list[str] | None, types: list[int], pre: str | None,
           add_bos: bool | None, add_eos: bool | None, model: str = "gpt2", bos: int = 1, eos: int = 2) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16)):
        w.add_uint32(f"llama.{key}", value)
    w.add_uint32("llama.attention.head_count", 2)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    w.add_unk_token_id(0)
    w.add_pad_token_id(eos)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    return _finish(w, path)


def _finish(w, path: Path) -> Path:
    """The chat template, then the file written and closed."""
    w.add_chat_template(TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("pre", ["smollm", "default", "llama-bpe", "gpt-4o", "tekken", None])
@pytest.mark.parametrize("add_bos,add_eos", [(None, None), (True, False), (False, True), (True, True)])
def test_synthetic_vocabulary_equals_transformers(tmp_path, trained, pre, add_bos, add_eos):
    tokens, merges = trained
    # a user-defined token (matched whole, not special) and tokens outside the byte alphabet (respelled)
    tokens = tokens + ["<think>", "héllo", "日本"]
    types = [3 if t in CONTROL else 1 for t in tokens[:-3]] + [4, 1, 1]
    path = _write(tmp_path / "v.gguf", tokens, merges, types, pre, add_bos, add_eos)
    ours, why = tokenizer_from_gguf(read_gguf(path).meta, str(path))
    assert why is None, why
    texts = TEXTS + ["I <think> therefore héllo 日本", "<think><think>x"]
    assert_same(ours, _auto(path), texts=texts)


@pytest.mark.parametrize("case, expected", [
    ("llama", "tokenizer.ggml.model = 'llama'"),
    ("no merges", "no tokenizer.ggml.merges"),
    ("qwen2", "tokenizer.ggml.pre = 'qwen2'"),
    ("bos not control", "the bos token"),
    ("bos out of range", "tokenizer.ggml.bos_token_id = 999"),
    ("types short", "token_type does not list one type per token"),
    ("bad merge", "merge 'a b c'"),
])
def test_unsupported_vocabularies_give_a_reason(trained, case, expected):
    tokens, merges = trained
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in CONTROL else 1 for t in tokens],
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    if case == "llama":
        meta["tokenizer.ggml.model"] = "llama"
    elif case == "no merges":
        del meta["tokenizer.ggml.merges"]
    elif case == "qwen2":
        meta["tokenizer.ggml.pre"] = "qwen2"
    elif case == "bos not control":
        meta["tokenizer.ggml.bos_token_id"] = 100
    elif case == "bos out of range":
        meta["tokenizer.ggml.bos_token_id"] = 999
    elif case == "types short":
        meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:-1]
    elif case == "bad merge":
        meta["tokenizer.ggml.merges"] = merges[:5] + ["a b c"]
    tok, why = tokenizer_from_gguf(meta, "x.gguf")
    assert tok is None and expected in why


def test_load_falls_back_to_transformers_with_a_debug_line(tmp_path, trained, monkeypatch, caplog):
    """A vocabulary the builder declines goes through AutoTokenizer (same ids), and a debug line says why."""
    import bitmtp.api as api
    import bitmtp.formats.gguf_tokenizer as gt

    tokens, merges = trained
    path = _write(tmp_path / "v.gguf", tokens, merges, [3 if t in CONTROL else 1 for t in tokens], "smollm",
                  None, None)
    monkeypatch.setattr(gt, "tokenizer_from_gguf", lambda meta, source: (None, "declined for the test"))
    with caplog.at_level(logging.DEBUG, logger="bitmtp"):
        tok = api._gguf_tokenizer(path, None, read_gguf(path).meta)
    assert not isinstance(tok, GGUFTokenizer) and tok is not None
    assert any("declined for the test" in r.getMessage() and "transformers" in r.getMessage() for r in caplog.records)
    ours, _ = tokenizer_from_gguf(read_gguf(path).meta, str(path))
    assert ours("the lazy dog <|im_end|>")["input_ids"] == _ids(tok("the lazy dog <|im_end|>"))


def test_chat_template_sandbox_and_missing_template(trained):
    tokens, merges = trained
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": [3 if t in CONTROL else 1 for t in tokens],
            "tokenizer.chat_template": "{{ messages.__class__.__mro__ }}"}
    tok, _ = tokenizer_from_gguf(meta)
    import jinja2

    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    del meta["tokenizer.chat_template"]
    tok, _ = tokenizer_from_gguf(meta)
    with pytest.raises(ValueError, match="no tokenizer.chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def _write_sentencepiece(path: Path, arch: str, vocab: int = 600) -> Path:
    """A GGUF holding only a SentencePiece-style ("llama") vocabulary — byte tokens, a few pieces, scores — for
    architecture ``arch`` (its ``{arch}.*`` model keys are there; no tensors)."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁the", "▁a", "▁lazy", "▁dog", "▁quick", "▁brown", "▁fox", "▁h", "ello", "▁w", "orld", "▁", "e", "t"]
    tokens += pieces + [f"x{i}" for i in range(vocab - len(tokens) - len(pieces))]
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in (("block_count", 1), ("context_length", 64), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 2)):
        w.add_uint32(f"{arch}.{key}", value)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab - 259))
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(1, vocab - 258)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    return _finish(w, path)


SP_TEXTS = ["hello world the lazy dog", " the  quick brown fox\n", "héllo <s> </s> wörld 🙂", ""]


def test_sentencepiece_vocabulary_through_transformers_equals_autotokenizer(tmp_path):
    """A vocabulary the builder declines (SentencePiece) gets transformers' tokenizer from the file's metadata
    (``api._transformers_gguf_tokenizer``): the ids, text, special tokens and chat prompt AutoTokenizer gives."""
    from transformers import AutoTokenizer

    import bitmtp.api as api

    path = _write_sentencepiece(tmp_path / "sp.gguf", "llama")
    ours = api._gguf_tokenizer(path, None, read_gguf(path).meta)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SP_TEXTS:
        ids = _ids(ours(text))
        assert ids == _ids(ref(text)) and ours.decode(ids) == ref.decode(ids)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, attr) == getattr(ref, attr), attr
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(chat, tokenize=False)


def test_vocabulary_of_an_architecture_transformers_does_not_load(tmp_path):
    """A ``bitnet`` GGUF with an ordinary SentencePiece vocabulary has a tokenizer (AutoTokenizer refused the
    architecture, leaving the model without one): the same ids as the same vocabulary in a ``llama`` file."""
    import bitmtp.api as api

    bitnet = _write_sentencepiece(tmp_path / "bitnet.gguf", "bitnet")
    (tmp_path / "llama").mkdir()
    llama = _write_sentencepiece(tmp_path / "llama" / "sp.gguf", "llama")
    a = api._gguf_tokenizer(bitnet, None, read_gguf(bitnet).meta)
    b = api._gguf_tokenizer(llama, None, read_gguf(llama).meta)
    assert a is not None
    assert all(_ids(a(t)) == _ids(b(t)) for t in SP_TEXTS)
