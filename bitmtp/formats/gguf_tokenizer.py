"""A GGUF file's tokenizer, built from its ``tokenizer.ggml.*`` metadata with the ``tokenizers`` library.

transformers builds the same tokenizer through ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, but that
parses the whole file a second time (~5 s for SmolLM2-135M on a 2-core machine) and imports transformers
(~1 s): most of a cold start. :func:`tokenizer_from_gguf` takes the metadata :func:`bitmtp.formats.gguf.read_gguf`
has already parsed and builds exactly what transformers' GGUF converter builds (``transformers.integrations.gguf``:
``byte_level_tokenizer`` → ``GPT2Tokenizer``, then ``add_gguf_special_tokens``, ``set_split_regex`` and the
BOS/EOS post-processor of ``TokenizersBackend``) for the vocabularies it knows:

* ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE: SmolLM2, GPT-2, Llama-3, the files bitmtp's export writes)
  with ``tokenizer.ggml.merges``;
* a ``tokenizer.ggml.pre`` that transformers splits with GPT-2's regex (every name outside its split table,
  e.g. ``smollm``, ``default``, ``gpt-2``) or with one of the split regexes copied below (``llama-bpe`` & co.);
* BOS / EOS / UNK / PAD ids that name tokens marked CONTROL (they are special either way then).

Anything else — SentencePiece (``llama``), unigram (``t5``), a vocabulary without merges, a pre-tokenizer
split this module does not copy — returns a reason instead, and the caller falls back to transformers.
tests/formats/test_gguf_tokenizer.py compares both builders on the real SmolLM2 file: the tokenizers' JSON,
and encode / decode / chat template on a varied text set.

:class:`GGUFTokenizer` has the slice of a transformers tokenizer bitmtp and its users call: ``tok(text)``,
``encode``, ``decode``, ``apply_chat_template`` (the file's ``tokenizer.chat_template`` rendered with jinja2
in a sandbox configured as transformers configures it), the special tokens and their ids, and
``backend_tokenizer``. Nothing is compiled at load: the chat template is compiled on first use.
"""

from __future__ import annotations

import gc
import json
import logging
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from typing import Any

log = logging.getLogger("bitmtp")

#: llama.cpp token types (``tokenizer.ggml.token_type``)
CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: transformers' ``GGUF_PRE_TOKENIZER_SPLITS`` (5.x): the ``tokenizer.ggml.pre`` names it splits with a regex of
#: its own instead of GPT-2's; None marks the ones whose regex lives in a transformers model module (not copied
#: here: those files fall back to transformers)
SPLITS: dict[str, str | None] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "qwen35"), None),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character map (``bytes_to_unicode``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _token_id(meta: Mapping[str, Any], key: str, n: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < n:
        raise ValueError(f"tokenizer.ggml.{key} = {value!r} is not a token id of the {n}-token vocabulary")
    return value


def tokenizer_from_gguf(meta: Mapping[str, Any], source: str = "GGUF") -> tuple[GGUFTokenizer | None, str | None]:
    """``(tokenizer, None)`` built from a GGUF file's metadata values (``GGUFContents.meta``), or
    ``(None, why)`` when this builder does not handle the vocabulary (the caller then uses transformers)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        return None, f"tokenizer.ggml.model = {kind!r} (built here: 'gpt2', byte-level BPE)"
    tokens, merges = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        return None, "tokenizer.ggml.tokens is not a list of strings"
    if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        return None, "no tokenizer.ggml.merges (transformers derives them from the vocabulary)"
    pre = meta.get("tokenizer.ggml.pre")
    if pre in SPLITS and SPLITS[pre] is None:
        return None, f"tokenizer.ggml.pre = {pre!r} (its split regex is not copied here)"
    types = meta.get("tokenizer.ggml.token_type") or []
    if not isinstance(types, list) or (types and len(types) != len(tokens)):
        return None, "tokenizer.ggml.token_type does not list one type per token"
    n = len(tokens)
    try:
        ids = {name: _token_id(meta, key, n) for name, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"),
                                                               ("unk", "unknown_token_id"),
                                                               ("pad", "padding_token_id"))}
    except ValueError as exc:
        return None, str(exc)
    for name, i in ids.items():
        if i is not None and (not types or types[i] != CONTROL):
            return None, f"the {name} token {tokens[i]!r} is not marked CONTROL"
    flags = {}
    for key in ("add_bos_token", "add_eos_token"):
        value = meta.get(f"tokenizer.ggml.{key}", False)
        if not isinstance(value, bool):
            return None, f"tokenizer.ggml.{key} = {value!r} is not a bool"
        flags[key] = value
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        return None, "tokenizer.chat_template is not a string"
    try:
        with _no_gc():
            backend = _backend(tokens, merges, types, pre, ids, flags)
    except Exception as exc:  # noqa: BLE001 - the tokenizers library raises its own types for bad vocabularies
        return None, f"the tokenizers library refused the vocabulary ({type(exc).__name__}: {exc})"
    special = {name: tokens[i] for name, i in ids.items() if i is not None}
    return GGUFTokenizer(backend, special, template, source=source, **flags), None


def _backend(tokens: list[str], merges: list[str], types: list[int], pre: Any, ids: dict[str, int | None],
             flags: dict[str, bool]):
    """The ``tokenizers.Tokenizer`` transformers' GGUF converter builds (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    spelling = _byte_alphabet()
    alphabet = set(spelling.values())
    # byte_level_tokenizer: a token outside the byte alphabet is respelled from its UTF-8 bytes (a later
    # duplicate wins, as in transformers' dict comprehension)
    if set("".join(tokens)) <= alphabet:  # the usual case, checked at once (~5 ms, not ~40 ms token by token)
        vocab = dict(zip(tokens, range(len(tokens)), strict=True))
    else:
        vocab = {tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
                 for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    bad = next((m for m, p in zip(merges, pairs, strict=True) if len(p) != 2), None)
    if bad is not None:
        raise ValueError(f"merge {bad!r} is not two tokens separated by one space")
    backend = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    split = SPLITS.get(pre)
    if split is None:  # GPT2Tokenizer's own: GPT-2's regex inside ByteLevel
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:  # set_split_regex
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    # add_gguf_special_tokens: CONTROL tokens spelled in the byte alphabet are special; USER_DEFINED ones in
    # the vocabulary are plain added tokens (matched whole)
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types, strict=False)
               if k == CONTROL and set(t) <= alphabet]
    if control:
        backend.add_special_tokens(control)
    user = [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED]
    if user:
        known = backend.get_vocab(with_added_tokens=True)
        user = [AddedToken(t, normalized=False, special=False) for t in user if t in known]
    if user:
        backend.add_tokens(user)
    # TokenizersBackend.update_post_processor: BOS / EOS around each sequence as the file's flags say
    bos = tokens[ids["bos"]] if ids["bos"] is not None else None
    eos = tokens[ids["eos"]] if ids["eos"] is not None else None
    add_bos, add_eos = flags["add_bos_token"] and bos is not None, flags["add_eos_token"] and eos is not None
    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    specials = ([(bos, ids["bos"])] if add_bos else []) + ([(eos, ids["eos"])] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
    return backend


@contextmanager
def _no_gc():
    """The cyclic garbage collector paused: building ~50k merge tuples triggers a collection every 700
    allocations, which made splitting SmolLM2's merges 0.19 s instead of 0.02 s."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class GGUFTokenizer:
    """A byte-level BPE tokenizer from a GGUF file, with the transformers tokenizer calls bitmtp uses.

    Encoding and decoding are the ``tokenizers`` backend's (:attr:`backend_tokenizer`), built as
    transformers' GGUF converter builds it, so ids and text are the same as ``AutoTokenizer``'s.
    """

    def __init__(self, backend: Any, special: dict[str, str], chat_template: str | None, *, source: str = "GGUF",
                 add_bos_token: bool = False, add_eos_token: bool = False):
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.source = source
        self.add_bos_token, self.add_eos_token = add_bos_token, add_eos_token
        self.bos_token, self.eos_token = special.get("bos"), special.get("eos")
        self.unk_token, self.pad_token = special.get("unk"), special.get("pad")
        self._compiled: tuple[str, Any] | None = None

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id(self.eos_token)

    @property
    def unk_token_id(self) -> int | None:
        return self._id(self.unk_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id(self.pad_token)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (what a chat template sees as ``bos_token`` etc.)."""
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token, "unk_token": self.unk_token,
                 "pad_token": self.pad_token}
        return {k: v for k, v in named.items() if v is not None}

    @property
    def vocab_size(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the file's BOS / EOS when ``add_special_tokens`` and it asks for them).

        Encoded through ``encode_batch_fast`` (tokenizers >= 0.20; else ``encode_batch``): the same ids as
        ``encode``, with the GIL released while it works, so a long text (seconds of tokenizing) does not stop
        the process's other threads — a server's event loop. The fast variant keeps no character offsets, which
        halves the work and leaves little to free with the GIL held: a 9 MB text's result took 256 ms to free
        with offsets (a server's /health stalled that long), 6 ms without."""
        bt = self.backend_tokenizer
        batch = getattr(bt, "encode_batch_fast", None) or bt.encode_batch
        return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, list]:
        """``{"input_ids": ids, "attention_mask": ones}`` of a text (lists of them for a list of texts)."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        rows = [list(e.ids) for e in self.backend_tokenizer.encode_batch(list(text),
                                                                         add_special_tokens=add_special_tokens)]
        return {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """The text of token ids (a list, or a 1-D tensor / array)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self.backend_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def batch_decode(self, rows: Sequence[Any], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(r, skip_special_tokens) for r in rows]

    def _template(self, chat_template: str | None):
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(f"{self.source}: the GGUF file has no tokenizer.chat_template; pass chat_template=")
        if self._compiled is None or self._compiled[0] != template:
            self._compiled = (template, compile_chat_template(template))
        return self._compiled[1]

    def apply_chat_template(self, conversation: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
                            tokenize: bool = True, *, chat_template: str | None = None, tools: Any = None,
                            documents: Any = None, return_dict: bool = False, **kwargs: Any) -> Any:
        """The chat rendered with the file's template (as transformers renders it: the named special tokens,
        ``tools``, ``documents`` and ``kwargs`` visible to the template; message keys whose value is None
        dropped), then — with ``tokenize`` — encoded without adding special tokens. Returns the ids (a dict
        with ``input_ids`` and ``attention_mask`` with ``return_dict=True``) or, without ``tokenize``, the text."""
        messages = [{k: v for k, v in dict(m).items() if v is not None} for m in conversation]
        variables = {**self.special_tokens_map, **kwargs}
        text = self._template(chat_template).render(messages=messages, tools=tools, documents=documents,
                                                    add_generation_prompt=add_generation_prompt, **variables)
        if not tokenize:
            return text
        enc = self(text, add_special_tokens=False)
        return enc if return_dict else enc["input_ids"]

    def __repr__(self) -> str:
        return (f"GGUFTokenizer(source={self.source!r}, vocab={len(self)}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r})")


def compile_chat_template(template: str):
    """A chat template compiled in jinja2's immutable sandbox with the settings, filters and globals
    transformers gives templates (``trim_blocks``, ``lstrip_blocks``, loop controls, ``{% generation %}``
    blocks, ``tojson`` without HTML escaping, ``raise_exception``, ``strftime_now``, ``dict``, ``namespace``)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}…{% endgeneration %}``: renders its body (transformers tracks it for masks)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A namespace that refuses underscore names (no path to CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    return env.from_string(template)


__all__ = ["GGUFTokenizer", "tokenizer_from_gguf", "compile_chat_template", "SPLITS"]
