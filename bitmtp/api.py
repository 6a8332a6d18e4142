"""Public entry points: :func:`load` and :func:`generate`.

Concurrency: on the CPU, ``ar`` and ``auto`` generations decode as sequences of the model's batch engine
(:meth:`BitMTPModel.batcher`, ``bitmtp.runtime.batch``): calls from several threads on one model share its
forward passes. The solo engine (``model.engine``: the other policies and runtimes, ``batcher=False``) owns one
KV store, and one generation owns it at a time (``bitmtp.runtime.engine``): calls on it serialize, and a stream
keeps it until it is exhausted or closed. :meth:`BitMTPModel.session` gives a caller its own stores over the
same weights, to decode concurrently.
"""

from __future__ import annotations

import bisect
import contextvars
import dataclasses
import inspect
import logging
import numbers
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bitmtp.decoding.config import DecodingConfig
from bitmtp.decoding.drafters import (
    DRAFTER_NAMES,
    CombinedDrafter,
    Drafter,
    LookupDrafter,
    drafter_for,
)
from bitmtp.decoding.policies import Policy, resolve_policy
from bitmtp.decoding.sampling import SamplingParams
from bitmtp.errors import BitMTPError, DeviceError, DTypeError, FormatError, ShapeError, TokenIdError
from bitmtp.formats.adapters import AdapterConfig, load_adapter
from bitmtp.model.adapters import build_adapter
from bitmtp.model.args import ModelArgs
from bitmtp.model.decoder import Decoder
from bitmtp.model.loaders import from_safetensors_dir, from_transformers
from bitmtp.runtime.batch import BatchEngine
from bitmtp.runtime.calibration import CostTable
from bitmtp.runtime.decode import DecodeStats, GenerationResult
from bitmtp.runtime.engine import Engine, Generation

log = logging.getLogger("bitmtp")

#: the default block size when neither the call nor the adapter names one
DEFAULT_BLOCK_SIZE = 8


def _is_int(x: Any) -> bool:
    """A Python / numpy integer or a one-element integer tensor (not a bool)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, numbers.Integral):
        return True
    return isinstance(x, torch.Tensor) and x.numel() == 1 and x.dim() <= 1 and not x.is_floating_point() \
        and not x.is_complex() and x.dtype != torch.bool


def _describe(x: Any) -> str:
    text = repr(x)
    return f"{text[:40]}… ({type(x).__name__})" if len(text) > 40 else f"{text} ({type(x).__name__})"


def _array_ids(arr: Any, name: str) -> list:
    """A tensor / numpy array of token ids → a flat list, checking dtype and shape ([T] or [1, T])."""
    if isinstance(arr, torch.Tensor):
        bad = arr.dtype == torch.bool or arr.is_floating_point() or arr.is_complex()
        dtype = str(arr.dtype).replace("torch.", "")
    else:
        kind = getattr(arr.dtype, "kind", "?")  # numpy: i/u are integers; b is bool
        bad, dtype = kind not in "iu" or kind == "", str(arr.dtype)
    if bad:
        raise DTypeError(f"{name}: token ids must be integers, got an array of dtype {dtype}; "
                         f"convert with .long() / .astype('int64') if the values are ids")
    shape = tuple(int(s) for s in arr.shape)
    if len(shape) == 2:
        if shape[0] != 1:
            raise ShapeError(f"{name}: batch of {shape[0]} (shape {list(shape)}): bitmtp decodes one sequence; "
                             "call once per row")
        arr = arr[0]
    elif len(shape) != 1:
        raise ShapeError(f"{name}: expected token ids of shape [T] or [1, T], got shape {list(shape)}")
    return arr.tolist()


def prompt_ids(input_ids: Any, vocab_size: int, name: str = "input_ids") -> list[int]:
    """``input_ids`` as a list of ints: a 1-D sequence (list, tuple, range, 1-D tensor or numpy array)
    or a ``[1, T]`` tensor / array / nested list; every id in ``[0, vocab_size)``.

    Raises ShapeError for a batch of several rows, DTypeError for non-integer ids (floats, bools,
    text), :class:`TokenIdError` for ids outside the vocabulary and BitMTPError for an empty prompt.
    """
    if isinstance(input_ids, (str, bytes)):
        raise DTypeError(f"{name}: got text {_describe(input_ids)}; pass text as prompt=, token ids as {name}=")
    if isinstance(input_ids, Mapping):
        raise DTypeError(f"{name}: got a mapping (a tokenizer's BatchEncoding?); pass its ['input_ids'] instead")
    if isinstance(input_ids, torch.Tensor) or (hasattr(input_ids, "dtype") and hasattr(input_ids, "shape")
                                               and hasattr(input_ids, "tolist")):
        items = _array_ids(input_ids, name)
    elif isinstance(input_ids, Iterable):
        items = list(input_ids)
        nested = [x for x in items if isinstance(x, (list, tuple)) or (getattr(x, "ndim", 0) >= 1 and not _is_int(x))]
        if items and len(nested) == len(items):  # [[ids]]: a batch written as nested lists
            if len(items) != 1:
                raise ShapeError(f"{name}: batch of {len(items)}: bitmtp decodes one sequence; call once per row")
            inner = items[0]
            items = _array_ids(inner, name) if hasattr(inner, "tolist") else list(inner)
    else:
        raise DTypeError(f"{name}: expected a sequence of token ids, got {_describe(input_ids)}")
    ids = []
    for i, x in enumerate(items):
        if not _is_int(x):
            raise DTypeError(f"{name}: element {i} is {_describe(x)}; token ids are integers")
        ids.append(int(x))
    if not ids:
        raise BitMTPError(f"{name}: the prompt is empty; give at least one token id")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise TokenIdError(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}); "
                           "they must come from this model's tokenizer")
    return ids


def _check_max_new_tokens(max_new_tokens: Any) -> None:
    """``max_new_tokens``: an int >= 1 (not a bool, a float or text)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise BitMTPError(f"max_new_tokens: must be an integer >= 1, got {_describe(max_new_tokens)}; e.g. "
                          "max_new_tokens=128")


def _check_messages(messages: Sequence[Any]) -> None:
    """Chat messages: a non-empty list of ``{"role": str, "content": str}`` dicts."""
    if len(messages) == 0:
        raise BitMTPError("prompt: the chat is empty; give at least one message "
                          "like {'role': 'user', 'content': '...'}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise BitMTPError(f"prompt: message {i} is {_describe(msg)}, not a dict; "
                              "write each message as {'role': ..., 'content': ...}")
        for key in ("role", "content"):
            if key not in msg:
                raise BitMTPError(f"prompt: message {i} has no {key!r}; "
                                  "write each message as {'role': ..., 'content': ...}")
            if not isinstance(msg[key], str):
                raise BitMTPError(f"prompt: message {i}'s {key!r} is {_describe(msg[key])}; it must be a str")
            _check_text(msg[key], f"message {i}'s {key!r}")


#: a lone surrogate: what Python makes of bytes that are not valid UTF-8 (``errors="surrogateescape"``, e.g.
#: stdin and file names under the C / POSIX locale), which no tokenizer can encode
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(text: str, where: str) -> None:
    """Refuse text holding a lone surrogate (a BitMTPError naming where and the fix, not the tokenizer's
    TypeError)."""
    bad = _LONE_SURROGATE.search(text)
    if bad is not None:
        raise BitMTPError(f"prompt: {where} is not valid Unicode text: it holds the lone surrogate "
                          f"U+{ord(bad.group(0)):04X} at index {bad.start()} (bytes that were not valid UTF-8, "
                          "decoded with errors='surrogateescape'); decode the bytes with errors='replace', or "
                          "drop the character")


@dataclass
class BitMTPModel:
    """A loaded model: decoder, tokenizer (when the source has one) and a decode engine."""

    decoder: Decoder
    tokenizer: Any
    source: str
    engine: Engine
    drafter: Drafter | None = None
    adapter_config: AdapterConfig | None = None
    #: the attached adapter's tensors as loaded (what :meth:`save_gguf` packs)
    adapter_tensors: dict[str, torch.Tensor] | None = None
    #: ``tokenizer.*`` fields of a GGUF source, written back unchanged by :meth:`save_gguf`
    gguf_tokenizer_fields: dict[str, Any] | None = None
    #: the offload plan of a ``runtime="vulkan"`` model (``bitmtp.runtime.vulkan.planner.OffloadPlan``)
    plan: Any = None
    #: batch engines by max_batch (:meth:`batcher`): a session gets its own
    _batchers: dict[int, BatchEngine] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def args(self) -> ModelArgs:
        return self.decoder.args

    def session(self) -> BitMTPModel:
        """A view of this model with its own KV store and graph pool, to decode concurrently with it.

        The view shares the decoder's weights, the tokenizer and the attached adapter (nothing is
        copied: a step only reads them), but :func:`generate` calls on different sessions never wait
        for each other and never touch each other's KV rows. Attaching or detaching an adapter on a
        session affects that session only. Each session allocates a KV store of the same capacity
        (``engine.kv.nbytes``) and its own batch engines (:meth:`batcher`). Solo-engine calls on ONE model or
        session serialize instead (one generation owns a KV store at a time); batches of one on it share
        steps. Not available for ``runtime="vulkan"`` models (the Vulkan device holds one copy of the model
        and its KV): their calls serialize.
        """
        if self.plan is not None or self.engine.runtime == "vulkan":  # a Vulkan model has its plan
            raise BitMTPError("session: a runtime='vulkan' model keeps one KV store on its Vulkan device; calls "
                              "on it serialize. Load the model again for an independent copy")
        return dataclasses.replace(self, engine=self.engine.sibling())

    def batcher(self, max_batch: int = 8) -> BatchEngine:
        """The engine that decodes up to ``max_batch`` sequences of this model together (one forward pass a
        step for all of them; ``bitmtp.runtime.batch``), made on first use with its own KV store: rows for
        ``max_batch`` sequences of the model's capacity (on the CPU only rows written take memory). What
        :func:`generate` with ``prompts=[...]`` and ``bitmtp serve`` decode on."""
        if self.plan is not None or self.engine.runtime != "torch":
            raise BitMTPError("batch: batched decoding runs on the torch runtime; this model runs on "
                              f"runtime={self.engine.runtime!r} (its prompts decode one at a time)")
        eng = self._batchers.get(max_batch)
        if eng is None:
            eng = self._batchers[max_batch] = BatchEngine(
                self.decoder, capacity=self.engine.capacity, max_batch=max_batch, kv_dtype=self.engine.kv.k[0].dtype,
                solo_chunk=self.engine.prefill_chunk)
        return eng

    def decoding_config(self, **options: Any) -> DecodingConfig:
        """:func:`decoding_config` for this model: the decoding options of :func:`generate`, validated once."""
        return decoding_config(self, **options)

    def calibrate(self, *, rebuild: bool = False, progress: bool = False) -> CostTable:
        """Measure (or read from the cache) the step costs ``policy="auto"`` plans with, now.

        These are the solo engine's (``generate(..., batcher=False)``, the GPU and Vulkan runtimes): a batch of one
        — ``auto``'s default on the CPU — prices its rows by the steps its batch engine has run instead
        (``decoding.batch_plan.StepCost``). The first solo ``auto`` generation of 64 tokens or more on a machine
        measures them itself (~5 s on 2 CPU cores, then cached under ``bitmtp.runtime.calibration.cache_dir()``);
        call this first — ``bitmtp serve`` does at startup — so that no request pays for it. ``rebuild=True``
        measures again even with a cached table (the machine changed load, a new build); ``progress`` shows a
        progress bar. Returns the :class:`~bitmtp.runtime.calibration.CostTable` (``bitmtp info --calibrate`` prints
        it). Waits while a generation runs on this model in another thread (the measurement uses its KV store)."""
        return self.engine.calibrate(rebuild=rebuild, progress=progress)

    def recommended(self, policy: str | None = None, block_size: int | None = None) -> tuple[str, int | None]:
        """``(policy, block_size)`` to decode with when the caller left them open (None): ``"auto"`` —
        lossless, drafting (lookup, and the adapter's mask drafts when one is attached) only where the
        step costs measured on this machine say it pays, AR otherwise — with the adapter's D."""
        return policy or "auto", block_size

    def load_adapter(self, adapter: str | Path | tuple[AdapterConfig, dict[str, torch.Tensor]] | None) -> None:
        """Attach an MTP adapter (a folder written by ``bitmtp.formats.adapters.save_adapter``, or a
        ``(config, tensors)`` pair); ``None`` detaches. The base model is untouched either way. Anything else
        (a number, a pair of strings) is a BitMTPError naming the forms accepted."""
        if adapter is None:
            self.drafter, self.adapter_config, self.adapter_tensors = None, None, None
            return
        config, tensors = load_adapter(adapter) if isinstance(adapter, (str, Path)) else _adapter_pair(adapter)
        module = build_adapter(config, tensors, self.args, dtype=self.decoder.dtype, device=self.decoder.device)
        self.drafter, self.adapter_config = drafter_for(self.decoder, module), config
        self.adapter_tensors = dict(tensors)

    def save_gguf(self, path: str | Path, *, adapter: bool = True, overwrite: bool = False, name: str | None = None,
                  progress: bool = True, plain: bool = False) -> Path:
        """Write this model as one GGUF file (see ``bitmtp.formats.gguf``): the base weights (ternary as
        TQ2_0 where the layout allows), the tokenizer, and — with ``adapter=True`` and an adapter attached —
        the MTP adapter under ``bitmtp.mtp.*`` with ``bitmtp.speculative.*`` metadata. Atomic; an existing
        file is replaced only with ``overwrite=True``. ``plain=True`` writes a file stock llama.cpp loads (it
        refuses extra tensors): no adapter and no exact-scale tensors (ternary scales rounded to fp16).
        A path in a folder that cannot take a file (``/proc/x.gguf``, a read-only folder) is a BitMTPError
        before anything is encoded; a write that fails midway (a full disk) raises its OSError and leaves
        nothing behind."""
        from bitmtp.model.gguf_io import export_gguf

        packed = None
        if adapter and not plain and self.adapter_config is not None:
            packed = (self.adapter_config, self.adapter_tensors)
        return export_gguf(self.decoder, path,
                           adapter=packed, tokenizer=self.tokenizer, tokenizer_fields=self.gguf_tokenizer_fields,
                           name=name or Path(str(self.source)).stem, overwrite=overwrite, progress=progress,
                           plain=plain)

    def check_ids(self, input_ids: Any) -> list[int]:
        """The prompt's token ids as a list of ints (see :func:`prompt_ids` for what is accepted)."""
        return prompt_ids(input_ids, self.args.vocab_size)

    def eos_ids(self, eos_token_id: Any) -> list[int]:
        """Stop token ids: the model's (None), one id, or a sequence / 1-D tensor of ids."""
        if eos_token_id is None:
            return list(self.args.eos_token_id)
        if _is_int(eos_token_id):
            items = [eos_token_id]
        elif isinstance(eos_token_id, (str, bytes, Mapping)) or not isinstance(eos_token_id, Iterable):
            raise DTypeError(f"eos_token_id: expected a token id or a list of ids, got {_describe(eos_token_id)}")
        else:
            items = eos_token_id.reshape(-1).tolist() if isinstance(eos_token_id, torch.Tensor) else list(eos_token_id)
        ids = []
        for i, x in enumerate(items):
            if not _is_int(x):
                raise DTypeError(f"eos_token_id: element {i} is {_describe(x)}; token ids are integers")
            ids.append(int(x))
        vocab = self.args.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise TokenIdError(f"eos_token_id: {bad[:5]} are outside the vocabulary [0, {vocab}) and could never "
                               "be generated; pass ids of this model's tokenizer ([] for no stop token)")
        return ids

    def encode(self, prompt: str | list[dict[str, str]], *, special_tokens_in_content: bool = False) -> list[int]:
        """Token ids of a string, or of chat messages (a list of ``{"role", "content"}`` dicts) through the
        tokenizer's chat template (with the generation prompt). :func:`generate`, ``bitmtp chat`` and
        ``bitmtp serve`` encode their prompts here.

        Args:
            prompt: the text (tokenized as written: special-token strings in it are the special tokens
                they spell, BOS / EOS added as the tokenizer adds them), or chat messages.
            special_tokens_in_content: chat messages only. False (the default): special-token strings
                inside the messages (``<|im_start|>system`` typed in a user's text) are tokenized as plain
                text, so only the chat template's own markers become special tokens and no message can
                forge a turn (``bitmtp.formats.chat_text``); messages without such strings give exactly
                the ids they always gave. True: they are parsed as the special tokens they spell (the
                behaviour before; for callers who write turns into a message on purpose).

        Raises BitMTPError for a model without a tokenizer, malformed messages or text that is not valid
        Unicode (a lone surrogate), and DTypeError for a prompt that is neither text nor messages.
        """
        if self.tokenizer is None:
            raise BitMTPError("prompt: this model has no tokenizer; pass input_ids instead")
        if not isinstance(special_tokens_in_content, bool):
            raise BitMTPError(f"special_tokens_in_content: must be True or False, got "
                              f"{_describe(special_tokens_in_content)}")
        if isinstance(prompt, (list, tuple)):
            _check_messages(prompt)
            if not special_tokens_in_content:
                from bitmtp.formats.chat_text import encode_chat

                ids = encode_chat(self.tokenizer, list(prompt), add_generation_prompt=True)
                if ids is not None:  # None: no special-token text in the messages, encoded as always below
                    return ids
            ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # a BatchEncoding
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        if not isinstance(prompt, str):
            raise DTypeError(f"prompt: expected text or a list of chat messages, got {_describe(prompt)}")
        _check_text(prompt, "the text")
        return [int(i) for i in self.tokenizer(prompt)["input_ids"]]

    def generate_ar(self, input_ids: Sequence[int], max_new_tokens: int = 128,
                    eos_token_id: int | list[int] | None = None) -> GenerationResult:
        """Greedy AR decoding on bitmtp's runtime (the baseline the MTP policies are measured against)."""
        _check_max_new_tokens(max_new_tokens)
        return self.engine.generate_ar(self.check_ids(input_ids), max_new_tokens, self.eos_ids(eos_token_id))


def _adapter_pair(adapter: Any) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """``adapter`` checked as a ``(config, tensors)`` pair (what ``bitmtp.formats.adapters.load_adapter``
    returns); anything else is a BitMTPError naming the forms :meth:`BitMTPModel.load_adapter` takes."""
    forms = ("an adapter folder (str or Path), a (config, tensors) pair from "
             "bitmtp.formats.adapters.load_adapter, or None to detach")
    if not isinstance(adapter, (tuple, list)) or len(adapter) != 2:
        raise BitMTPError(f"adapter: expected {forms}; got {_describe(adapter)}")
    config, tensors = adapter
    if not isinstance(config, AdapterConfig):
        raise BitMTPError(f"adapter: the pair's first item must be an AdapterConfig, got {_describe(config)}; "
                          f"pass {forms}")
    if not isinstance(tensors, Mapping) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in tensors.items()):
        raise BitMTPError(f"adapter: the pair's second item must be a dict of name -> torch.Tensor, got "
                          f"{_describe(tensors)}; pass {forms}")
    return config, dict(tensors)


def _gguf_tokenizer(path: Path, files: dict[str, Any] | None, meta: Mapping[str, Any] | None = None) -> Any:
    """The tokenizer of a GGUF file: rebuilt from ``bitmtp.tokenizer.files`` when bitmtp wrote it; else built
    from the already-parsed ``tokenizer.ggml.*`` metadata ``meta`` by ``bitmtp.formats.gguf_tokenizer`` (byte-level
    BPE: no second parse of the file, no transformers import — ~6 s of SmolLM2's cold start); else through
    transformers' GGUF tokenizer converter (other vocabularies); None (with a warning) otherwise."""
    if not files and meta is not None:
        from bitmtp.formats.gguf_tokenizer import tokenizer_from_gguf

        tok, why_not = tokenizer_from_gguf(meta, str(path))
        if tok is not None:
            return tok
        log.debug("%s: tokenizer not built from the GGUF metadata (%s); using transformers' GGUF converter",
                  path, why_not)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        log.warning("%s: transformers is not installed, so the model has no tokenizer (pass input_ids)", path)
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if files:
        import tempfile

        from bitmtp.formats.gguf_vocab import write_tokenizer_files

        with tempfile.TemporaryDirectory(prefix="bitmtp-tok-") as tmp:
            try:
                write_tokenizer_files(files, Path(tmp))  # FormatError for anything but tokenizer data
            except FormatError as exc:
                raise FormatError(f"{path}: {exc}") from exc
            try:
                # a file the GGUF carries must never run: no auto_map / custom tokenizer code
                return AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
            except Exception as exc:  # transformers raises many types for bad tokenizer files
                raise FormatError(f"{path}: the tokenizer stored in bitmtp.tokenizer.files cannot be loaded "
                                  f"({type(exc).__name__}: {exc})") from exc
    try:
        return _transformers_gguf_tokenizer(path)
    except Exception as exc:  # e.g. an architecture transformers' GGUF reader does not know
        log.warning("%s: no tokenizer could be built from the GGUF metadata (%s: %s); pass tokenizer= or input_ids",
                    path, type(exc).__name__, exc)
        return None


def _transformers_gguf_tokenizer(path: Path) -> Any:
    """transformers' tokenizer of a GGUF file. On transformers ≥ 5 every GGUF vocabulary becomes a
    ``TokenizersBackend`` built from the file's ``tokenizer.*`` metadata, which ``PreTrainedTokenizerFast``
    builds directly; ``AutoTokenizer`` builds the same one only after reading the model config through gguf-py's
    full parse of the file (~20 s for a 128k-token vocabulary; ~1 s for a small one), and refuses an architecture
    whose config transformers does not know (``bitnet``) although its vocabulary is an ordinary one. Older
    transformers pick a model-specific tokenizer class, so they keep ``AutoTokenizer``."""
    import transformers

    if int(transformers.__version__.split(".")[0]) >= 5:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, trust_remote_code=False)


#: whether ``backend="wgpu"``'s deprecation was reported in this process (it is, once)
_WGPU_BACKEND_WARNED = False


def _warn_wgpu_backend() -> None:
    """Report once per process that ``backend="wgpu"`` is spelled ``runtime="vulkan"`` now: a
    DeprecationWarning (for test suites and ``-W error``) and a log line (for everyone else)."""
    global _WGPU_BACKEND_WARNED
    if _WGPU_BACKEND_WARNED:
        return
    _WGPU_BACKEND_WARNED = True
    import warnings

    msg = ("backend='wgpu' is deprecated: the Vulkan path is a runtime, not a kernel backend; use "
           "bitmtp.load(..., runtime='vulkan') (CLI: --runtime vulkan). It runs the same way")
    warnings.warn(msg, DeprecationWarning, stacklevel=4)  # at the caller of load()
    log.warning("bitmtp: %s", msg)


def _runtime_of(runtime: Any, backend: Any) -> tuple[str, Any]:
    """``(runtime, backend)`` of a :func:`load` call: ``runtime`` checked against the engine's runtimes,
    the deprecated ``backend="wgpu"`` turned into ``runtime="vulkan"`` (warned once) with the automatic
    kernel backend for the host-side modules."""
    from bitmtp.runtime.engine import RUNTIMES

    if not isinstance(runtime, str) or runtime not in RUNTIMES:
        raise BitMTPError(f"runtime: expected one of {', '.join(map(repr, RUNTIMES))} ('torch': CPU or CUDA through "
                          f"the kernel backends; 'vulkan': whole layers on a Vulkan device), got {runtime!r}")
    if backend == "wgpu":
        _warn_wgpu_backend()
        return "vulkan", None  # the host-side modules (CPU-offloaded layers) use the automatic CPU kernels
    return runtime, backend


def _all_half_rows(decoder: Decoder) -> bool:
    """Every dense projection (LM head included) is held as bf16 / f16 rows (a half checkpoint loaded for float32
    compute): the Vulkan runtime uploads those 16-bit values as they are."""
    from bitmtp.formats.ggml_blocks import HALF_FORMATS
    from bitmtp.model.layers import DenseLinear

    dense = [m for m in decoder.modules() if isinstance(m, DenseLinear)]
    return bool(dense) and all(m.blocks is not None and m.blocks.fmt in HALF_FORMATS for m in dense)


def _wgpu_plan(decoder: Decoder, capacity: int, m_max: int, vram_budget: Any, cpu_layers: int | None):
    """The offload plan of a Vulkan-runtime model, checked against the device (errors show the plan)."""
    from bitmtp.errors import BackendUnavailableError
    from bitmtp.runtime.vulkan.planner import DEFAULT_VRAM_BUDGET, parse_bytes, plan_offload
    from bitmtp.wgsl_fallback.runner import default_runner

    try:
        budget = DEFAULT_VRAM_BUDGET if vram_budget is None else parse_bytes(vram_budget)
    except BitMTPError as exc:
        raise BitMTPError(f"vram_budget: {exc}") from exc
    # dense weights keep a bf16/f16 model's 16 bits on the device (else float32); the KV cache is float32
    dense_bytes = 2 if decoder.dtype in (torch.bfloat16, torch.float16) or _all_half_rows(decoder) else 4
    kw = dict(capacity=capacity, m_max=m_max, dense_dtype_bytes=dense_bytes, kv_dtype_bytes=4, ternary=decoder.ternary,
              force_cpu_layers=cpu_layers)
    try:
        runner = default_runner()
    except BackendUnavailableError as exc:
        plan = plan_offload(decoder.args, budget, **kw)  # no device: no binding limit to split against
        raise BackendUnavailableError(f"{exc}\nThe plan that could not run:\n{plan.table()}") from exc
    plan = plan_offload(decoder.args, budget, max_binding_bytes=runner.max_binding_bytes, **kw)
    if not plan.lm_head_on_gpu:
        raise BitMTPError("vram_budget: the plan puts the LM head on the CPU, which the Vulkan runtime does not run "
                          f"yet; raise the budget.\n{plan.table()}")
    return plan


def _device(device: Any) -> torch.device:
    """``device`` as a torch.device bitmtp can run on (CPU, or CUDA when it is there)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceError(f"device: {device!r} is not a device ({exc}); use 'cpu' or 'cuda'") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"device: {str(device)!r} was requested but CUDA is not available here (no NVIDIA GPU "
                              "or driver, or a CPU-only torch build); use device='cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceError(f"device: {str(device)!r} does not exist; this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    elif dev.type != "cpu":
        raise DeviceError(f"device: bitmtp runs on 'cpu' or 'cuda', got {str(device)!r}")
    return dev


#: ``load(dtype=...)``: the dense compute dtypes
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtype(dtype: Any) -> None:
    """``dtype``: None or one of :data:`DTYPES` (a name like ``"float16"`` is refused with the spelling to use)."""
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES):
        return
    names = ", ".join(str(d) for d in DTYPES)
    hint = f"; write torch.{dtype}" if isinstance(dtype, str) and getattr(torch, dtype, None) in DTYPES else ""
    raise DTypeError(f"dtype: the dense compute dtype must be one of {names} (or None: float32), got "
                     f"{_describe(dtype)}{hint}")


def _check_sizes(capacity: Any, m_max: Any) -> None:
    for name, value in (("capacity", capacity), ("m_max", m_max)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise BitMTPError(f"{name}: must be an integer >= 1, got {_describe(value)}")


def _available_bytes(device: torch.device) -> int | None:
    """Memory a new allocation can take on ``device`` (None when it cannot be told): free GPU memory,
    or the host's available memory bounded by this process's cgroup limit."""
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except Exception:  # noqa: BLE001 - a driver that cannot tell: skip the check
            return None
    found: list[int] = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:  # a container's limit can be far below the host's free memory
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text().strip()))
    except (OSError, ValueError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            return None
    return max(0, min(found))


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**26 else f"{n / 2**20:.1f} MiB"


def _capacity_bytes(args: ModelArgs, capacity: int, m_max: int, dtype: torch.dtype) -> tuple[int, int]:
    """``(bytes per row, total)``: the KV store (K and V, every layer, ``capacity + m_max`` rows in
    ``dtype``) plus the float32 RoPE cos/sin tables the decoder builds for as many positions."""
    kv_row = 2 * args.num_layers * args.num_kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()
    row = kv_row + 2 * args.head_dim * 4
    return row, row * (capacity + m_max)


def _check_capacity_fits(args: ModelArgs, capacity: int, m_max: int, dtype: torch.dtype,
                         device: torch.device) -> None:
    """Refuse a capacity whose KV store and RoPE tables cannot fit in the device's available memory,
    before anything of that size is allocated."""
    row, need = _capacity_bytes(args, capacity, m_max, dtype)
    avail = _available_bytes(device)
    if avail is None or need <= avail:
        return
    fits = max(0, int(avail * 0.8) // row - m_max)  # leave room for activations and everything else
    hint = (f"{_capacity_option(min(fits, args.max_position_embeddings))} or less fits" if fits >= 1
            else "no capacity fits in what is left")
    raise BitMTPError(f"{_capacity_option()}: {capacity} tokens need {_gib(need)} for the KV store and RoPE tables "
                      f"({row} bytes per token), but only {_gib(avail)} is available on {device}; {hint} "
                      f"(the model's context length is {args.max_position_embeddings} tokens, and generation "
                      "stops at capacity anyway)")


def _source_args(source: Any, rows: int) -> ModelArgs | None:
    """The model's shape, read cheaply before loading it (for the capacity check); None when the
    source does not tell it cheaply or is broken (the loader then reports what is wrong)."""
    try:
        if isinstance(source, (str, Path)):
            path = Path(source)
            if path.is_dir() and (path / "config.json").is_file():
                import json

                return ModelArgs.from_hf_config(json.loads((path / "config.json").read_text()), source=str(path))
            if path.is_file() and path.suffix == ".gguf" and rows > 1 << 16:  # small capacities need no pre-read
                from bitmtp.formats.gguf import read_gguf
                from bitmtp.model.gguf_io import args_from_gguf

                return args_from_gguf(read_gguf(path))
            return None
        config = getattr(source, "config", None)
        return None if config is None else ModelArgs.from_hf_config(config, source=type(source).__name__)
    except Exception:  # noqa: BLE001 - any failure here is reported by the loader itself
        return None


#: ``load(kv_type=...)``: the KV store's element types by name
KV_TYPES = {"f32": torch.float32, "f16": torch.float16}


def _kv_dtype(kv_type: str | None) -> torch.dtype | None:
    if kv_type is None:
        return None
    if not isinstance(kv_type, str) or kv_type.lower() not in KV_TYPES:
        raise BitMTPError(f"kv_type: expected one of {', '.join(map(repr, KV_TYPES))} (or None: the model's dtype), "
                          f"got {kv_type!r}")
    return KV_TYPES[kv_type.lower()]


def _engine(decoder: Decoder, capacity: int, m_max: int, **kw: Any) -> Engine:
    """The engine, with an allocator failure for its KV store reported against ``capacity``."""
    try:
        return Engine(decoder, capacity=capacity, m_max=m_max, **kw)
    except RuntimeError as exc:  # torch.OutOfMemoryError and the CPU allocator's "can't allocate memory"
        if "memory" not in str(exc).lower() and "alloc" not in str(exc).lower():
            raise
        _, need = _capacity_bytes(decoder.args, capacity, m_max, kw.get("kv_dtype") or decoder.dtype)
        raise BitMTPError(f"capacity: allocating the KV store for {capacity} tokens ({need} bytes, {_gib(need)}) "
                          f"failed on {decoder.device} ({str(exc).splitlines()[0][:200]}); lower capacity") from exc


def load(source: Any, *, backend: str | None = None, quantize: str | None = None, capacity: int = 2048,
         dtype: torch.dtype | None = None, device: str | torch.device = "cpu", m_max: int = 31,
         tokenizer: Any = None, adapter: str | Path | None = "auto", vram_budget: int | str | None = None,
         cpu_layers: int | None = None, runtime: str = "torch", kv_type: str | None = None) -> BitMTPModel:
    """Load a model for bitmtp.

    Args:
        source: a Hugging Face checkpoint folder (safetensors + config.json), a ``.gguf`` file, or a
            live transformers ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``BitNetForCausalLM``.
        backend: kernel backend for the linear layers (default: automatic / ``BITMTP_BACKEND``).
            ``"wgpu"`` is the deprecated spelling of ``runtime="vulkan"`` (it warns once per process).
        quantize: ``"ternary"`` to ternarize float linear weights by absmean (per tensor); default
            keeps them as the checkpoint stores them.
        capacity: maximum tokens (prompt + generated) of the KV store, an integer >= 1; a capacity whose
            KV store does not fit in the available memory is refused before it is allocated.
        dtype: dense compute dtype: ``torch.float32`` (the default), ``torch.float16`` or ``torch.bfloat16``.
        device: ``"cpu"`` or ``"cuda"`` (DeviceError when CUDA is not available).
        m_max: widest replay step: 2D − 1 for block size D (the default, 31, covers D ≤ 16).
        tokenizer: override the tokenizer (e.g. for a live model object).
        adapter: an MTP adapter folder (``mask-block`` or ``heads``) to draft with; ``"auto"`` (the
            default) arms the adapter a GGUF file carries (``bitmtp.speculative.*`` or Divine's
            ``divine.speculative.*`` keys), else attaches a shipped adapter when one was trained on exactly
            this model (same shape and weight fingerprint, see ``bitmtp.shipped``); ``None`` attaches none.
        vram_budget: ``runtime="vulkan"``: device memory to use, in bytes or as text ("3.9GB", "512MiB");
            default 3.9 GB (a 4 GB laptop GPU). ``bitmtp.runtime.vulkan.planner.plan_offload`` places the
            layers.
        cpu_layers: ``runtime="vulkan"``: force the last N layers onto the CPU whatever the budget.
        runtime: where the steps run: ``"torch"`` (the default: CPU or CUDA, through the kernel
            backends) or ``"vulkan"``: whole decoder layers on a Vulkan device through WGSL shaders
            (any GPU with a Vulkan driver; Mesa lavapipe on a CPU), with the layers that do not fit
            ``vram_budget`` on the CPU. A model whose layers compute something the Vulkan runtime does
            not implement (an activation, a norm) is refused with
            ``bitmtp.model.families.UnsupportedLayer``.
        kv_type: the KV store's element type, :data:`KV_TYPES`: ``"f32"`` or ``"f16"`` (llama.cpp's default:
            half the memory per token, and decode at depth reads half the bytes); default the model's dtype.
            f16 rounds K/V once when written, so tokens may differ from f32's; speculative == AR still holds.
    """
    device = _device(device)
    _check_dtype(dtype)
    _check_sizes(capacity, m_max)
    capacity, m_max = int(capacity), int(m_max)
    kv_dtype = _kv_dtype(kv_type)
    runtime, backend = _runtime_of(runtime, backend)
    vulkan = runtime == "vulkan"
    if vulkan and kv_dtype is not None and kv_dtype != (dtype or torch.float32):
        raise BitMTPError(f"kv_type: runtime='vulkan' keeps K/V in the model's dtype; drop kv_type={kv_type!r} "
                          "or use runtime='torch'")
    early = _source_args(source, capacity + m_max)
    if early is not None:  # before the loader builds RoPE tables of capacity + m_max rows
        _check_capacity_fits(early, capacity, m_max, kv_dtype or dtype or torch.float32, device)
    if vulkan:
        if device.type != "cpu":
            raise BitMTPError("device: runtime='vulkan' loads the model on the CPU (the Vulkan device holds its "
                              "copy); leave device='cpu'")
    elif vram_budget is not None or cpu_layers is not None:
        raise BitMTPError("vram_budget / cpu_layers: only meaningful with runtime='vulkan' (whole layers on a "
                          "Vulkan device); add runtime='vulkan' or drop them")
    if backend is not None:
        from bitmtp.ops.registry import backend_names

        if not isinstance(backend, str) or backend not in backend_names():
            raise BitMTPError(f"backend: expected one of {backend_names() + ['wgpu']} (or None for the automatic "
                              f"choice; `python -m bitmtp info` says which can run here; 'wgpu' is the deprecated "
                              f"spelling of runtime='vulkan'), got {backend!r}")
    dtype = dtype or torch.float32
    packed_adapter, gguf_fields = None, None
    kwargs = dict(quantize=quantize, dtype=dtype, backend=backend, max_positions=capacity + m_max)
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise BitMTPError(f"source: {path} does not exist")
        if path.is_file() and path.suffix == ".gguf":
            from bitmtp.model.gguf_io import read_model

            gguf_model = read_model(path, **kwargs)
            decoder, packed_adapter = gguf_model.decoder, gguf_model.adapter
            gguf_fields = gguf_model.tokenizer_fields
            tok = tokenizer
            if tok is None and (gguf_model.tokenizer_files or "tokenizer.ggml.model" in gguf_fields):
                tok = _gguf_tokenizer(path, gguf_model.tokenizer_files, gguf_model.contents.meta)
        elif path.is_dir():
            decoder = from_safetensors_dir(path, **kwargs)
            tok = tokenizer
            if tok is None and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
                from transformers import AutoTokenizer

                try:  # never run code the folder carries (auto_map): transformers refuses it
                    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
                except Exception as exc:  # transformers raises many types for bad tokenizer files
                    raise FormatError(f"{path}: the tokenizer files cannot be loaded ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0]}); bitmtp never runs a tokenizer's custom code. "
                                      "Pass tokenizer= to bitmtp.load, or input_ids to generate") from exc
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
    plan = None
    if vulkan:
        from bitmtp.runtime.vulkan.device import EXECUTOR, VULKAN_ACTIVATIONS, VULKAN_NORMS

        # before the device is opened and the plan made: UnsupportedLayer names the feature
        decoder.args.layer_spec.check(EXECUTOR, VULKAN_ACTIVATIONS, VULKAN_NORMS)
        plan = _wgpu_plan(decoder, capacity, m_max, vram_budget, cpu_layers)
    _check_capacity_fits(decoder.args, capacity, m_max, kv_dtype or decoder.dtype, decoder.device)
    engine = _engine(decoder, capacity, m_max, runtime=runtime,
                     gpu_layers=len(plan.gpu_layers) if plan is not None else None, kv_dtype=kv_dtype)
    model = BitMTPModel(decoder, tok if tokenizer is None else tokenizer, name, engine,
                        gguf_tokenizer_fields=gguf_fields, plan=plan)
    if adapter == "auto" and packed_adapter is not None:
        adapter = packed_adapter  # a GGUF that carries an MTP adapter arms it
    elif adapter == "auto":
        from bitmtp.model.adapters import base_fingerprint
        from bitmtp.shipped import find_shipped

        adapter = find_shipped(decoder.args, base_fingerprint(decoder))
    if adapter is not None:
        model.load_adapter(adapter)
    return model


@dataclass
class GenerateOutput:
    """What :func:`generate` returns: the generated text (when the model has a tokenizer), its token
    ids (prompt excluded), why it stopped and the decoding stats."""

    text: str | None
    token_ids: list[int]
    stop_reason: str  # "eos" | "max_new_tokens" | "capacity" | "stop" (a stop string; the text ends before it)
    stats: DecodeStats
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    #: per token id, the log-probability it was chosen with (``logprobs=True``), else None
    logprobs: list[float] | None = None
    #: the sampling seed (given or drawn; pass it again to reproduce the text), None when greedy
    seed: int | None = None
    #: per token id, where it came from (``bitmtp.decoding.origins``): "ar" (the model's own next token),
    #: "lookup" / "mask" / "heads" / "runner_up" (a draft the model confirmed: what saved forward passes)
    origins: list[str] = field(default_factory=list)
    #: per token id, the decode iteration that committed it (0: the prefill's; equal steps: one iteration)
    steps: list[int] = field(default_factory=list)

    @property
    def tokens_per_second(self) -> float:
        return self.stats.tokens_per_second


@dataclass(frozen=True)
class Span:
    """A piece of streamed text and the token that produced it (:attr:`TextStream.spans`): ``origin`` as in
    :attr:`GenerateOutput.origins`, ``step`` the iteration that committed the token. A token whose text is
    split between two pieces (held back, or a character spread over tokens) gives a span in each."""

    text: str
    origin: str
    step: int

    def as_dict(self) -> dict[str, Any]:
        return {"text": self.text, "origin": self.origin, "step": self.step}


def resolve_drafter(model: BitMTPModel, policy: Policy, drafter: Any = None) -> tuple[Any, list[str]]:
    """The drafter a drafting ``policy`` runs with, and notes for the stats. ``drafter``: a
    :class:`~bitmtp.decoding.drafters.Drafter` (as it is), a name of
    ``bitmtp.decoding.drafters.DRAFTER_NAMES`` (``"adapter"``, ``"lookup"``, ``"lookup+adapter"``), or
    None for the policy's default (the adapter's; ``auto``: lookup + the adapter's mask drafts). Anything
    else is a BitMTPError, whatever the policy."""
    if drafter is not None and not isinstance(drafter, (str, Drafter, CombinedDrafter)):
        raise BitMTPError(f"drafter: expected one of {', '.join(map(repr, DRAFTER_NAMES))}, a "
                          f"bitmtp.decoding.drafters.Drafter, or None (the policy's default); got {_describe(drafter)}")
    if not policy.drafts:
        return None, []
    name = policy.default_drafter if drafter is None else drafter
    if not isinstance(name, str):
        return name, []
    if name not in DRAFTER_NAMES:
        raise BitMTPError(f"drafter: expected one of {', '.join(map(repr, DRAFTER_NAMES))} or a "
                          f"bitmtp.decoding.drafters.Drafter, got {name!r}")
    if name == "adapter":
        return model.drafter, []
    lookup = LookupDrafter(model.decoder)
    if name == "lookup":
        return lookup, []
    adapter = model.drafter
    if adapter is None:
        return lookup, [f"{policy.name}: no MTP adapter is attached; drafting by prompt lookup only"]
    if not adapter.fused_drafts:
        return lookup, [f"{policy.name}: the {adapter.kind} adapter drafts in the two-pass schedule only; drafting by "
                        "prompt lookup only"]
    if not model.engine.pool.fused_steps:
        return lookup, [f"{policy.name}: runtime={model.engine.runtime!r} runs no adapter drafts in one pass; drafting "
                        "by prompt lookup only"]
    return CombinedDrafter(lookup, adapter), []


def resolve_decoding(model: BitMTPModel, policy: str | Policy, block_size: int | None = None, tau: Any = None,
                     min_prefix: Any = None, drafter: Any = None, schedule: Any = None) -> tuple[Policy, int]:
    """The policy to decode with, bound to its block size, and that block size D: what :func:`generate`
    and ``bitmtp.patch`` run. ``policy``: a registered name (``bitmtp.decoding.policy_names()``) with the
    loose ``tau`` / ``min_prefix``, or a :class:`~bitmtp.decoding.Policy` instance; ``block_size``:
    2..16, default the adapter's D (else 8); ``drafter``: the one a drafting policy will use (the
    model's by default). Raises BitMTPError naming the argument at fault and the fix."""
    pol = resolve_policy(policy, tau=tau, min_prefix=min_prefix, schedule=schedule)
    default = model.adapter_config.block_size if model.adapter_config else DEFAULT_BLOCK_SIZE
    d = default if block_size is None else block_size
    if isinstance(d, bool) or not isinstance(d, int) or not 2 <= d <= 16:
        raise BitMTPError(f"block_size: D must be an integer in 2..16, got {block_size!r}")
    if pol.drafts:
        if drafter is None:
            if _COMMAND_LINE.get():
                raise BitMTPError(f"--policy {pol.name} drafts tokens and needs an MTP adapter: pass --adapter DIR "
                                  "(no shipped adapter matches this model), draft by prompt lookup (--drafter "
                                  "lookup), or use --policy auto or ar")
            raise BitMTPError(f"policy: {pol.name!r} drafts tokens and needs an MTP adapter; load one with "
                              "bitmtp.load(..., adapter=PATH) or model.load_adapter(PATH), draft by prompt lookup "
                              "(drafter='lookup'), or use policy='auto' or 'ar'")
        if d > drafter.max_block:
            raise BitMTPError(f"block_size: the loaded {drafter.kind} adapter drafts at most D={drafter.max_block}, "
                              f"got {d}")
    return pol.bind(d), d


def decoding_config(model: BitMTPModel, *, max_new_tokens: int = 128, policy: str | Policy = "auto",
                    block_size: int | None = None, tau: float | None = None, min_prefix: int | None = None,
                    eos_token_id: int | Sequence[int] | None = None, drafter: Drafter | str | None = None,
                    schedule: str | None = None, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    min_p: float = 0.0, repetition_penalty: float = 1.0, presence_penalty: float = 0.0,
                    frequency_penalty: float = 0.0, seed: int | None = None, stop: str | Sequence[str] | None = None,
                    logprobs: bool = False) -> DecodingConfig:
    """The decoding options of :func:`generate` (documented there), validated once into a frozen
    :class:`~bitmtp.decoding.config.DecodingConfig`: the policy bound to its block size, the drafter it runs with,
    the sampling parameters, EOS ids and stop strings. What ``generate(..., config=...)``, the command line,
    ``bitmtp serve`` and ``bitmtp.patch`` decode with; a bad option is a BitMTPError naming it."""
    if not isinstance(model, BitMTPModel):
        raise BitMTPError(f"model: expected a model from bitmtp.load(), got {type(model).__name__}")
    _check_max_new_tokens(max_new_tokens)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                              frequency_penalty=frequency_penalty, seed=seed)
    stops = _check_stop(stop, model)
    if not isinstance(logprobs, bool):
        raise BitMTPError(f"logprobs: must be True or False, got {logprobs!r}")
    pol = resolve_policy(policy, tau=tau, min_prefix=min_prefix, schedule=schedule)
    chosen, notes = resolve_drafter(model, pol, drafter)
    pol, d = resolve_decoding(model, pol, block_size, drafter=chosen)
    return DecodingConfig(pol, d, chosen, sampling, int(max_new_tokens), tuple(model.eos_ids(eos_token_id)), stops,
                          logprobs, tuple(notes))


#: decoding_config's options and their defaults: generate(..., config=...) refuses any other value beside it
_OPTION_DEFAULTS: dict[str, Any] = {k: p.default for k, p in inspect.signature(decoding_config).parameters.items()
                                    if p.kind is p.KEYWORD_ONLY}


def _config_of(model: BitMTPModel, config: Any, options: dict[str, Any]) -> DecodingConfig:
    """The config a :func:`generate` call decodes with: ``config`` as given (its options left at their
    defaults), or one built from ``options``."""
    if config is None:
        return decoding_config(model, **options)
    if not isinstance(config, DecodingConfig):
        raise BitMTPError(f"config: expected a DecodingConfig (bitmtp.decoding_config(model, ...)), got "
                          f"{_describe(config)}")
    given = [k for k, v in options.items()
             if not (v is _OPTION_DEFAULTS[k] or (type(v) is type(_OPTION_DEFAULTS[k]) and v == _OPTION_DEFAULTS[k]))]
    if given:
        raise BitMTPError(f"config: give the decoding options either in the config or as arguments, not both "
                          f"(also given: {', '.join(given)}); build the config with them instead")
    return config


def generate(model: BitMTPModel, prompt: str | list[dict[str, str]] | None = None, *,
             input_ids: Any = None, prompts: Sequence[Any] | None = None, max_batch: int = 8,
             batcher: bool | BatchEngine | None = None,
             max_new_tokens: int = 128, policy: str | Policy = "auto",
             block_size: int | None = None, tau: float | None = None, min_prefix: int | None = None,
             eos_token_id: int | Sequence[int] | None = None, stream: bool = False,
             drafter: Drafter | str | None = None, schedule: str | None = None,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
             seed: int | None = None, stop: str | Sequence[str] | None = None,
             logprobs: bool = False, config: DecodingConfig | None = None,
             special_tokens_in_content: bool = False) -> GenerateOutput | TextStream | list[GenerateOutput]:
    """Multi-token generation, greedy or sampled, of one prompt or a batch.

    Args:
        model: from :func:`load`, with an adapter unless ``policy="ar"``.
        prompt: text, or chat messages (``[{"role": ..., "content": ...}]``) which go through the
            tokenizer's chat template. Give either ``prompt`` or ``input_ids``. Special-token strings inside
            the messages (``<|im_start|>system`` in a user's text) are tokenized as plain text, so only the
            template's own markers are special tokens and no message can forge a turn; text given as a
            string is tokenized as written (see :meth:`BitMTPModel.encode`).
        special_tokens_in_content: True parses special-token strings inside chat messages as the special
            tokens they spell, as bitmtp did before (for messages that write turns on purpose); default False.
        input_ids: token ids of the prompt: a 1-D sequence, tensor or numpy array, or a ``[1, T]`` tensor
            or array (what a tokenizer's ``return_tensors`` gives); a batch of several rows is refused
            (give them as ``prompts``).
        prompts: several prompts decoded together (each a string, a chat message list or a list of token ids);
            returns one :class:`GenerateOutput` per prompt, in order, each exactly what the prompt gives alone
            (greedy, or sampled with the same ``seed``). With ``policy="auto"`` or ``"ar"`` up to ``max_batch``
            sequences decode in one forward pass a step (``bitmtp.runtime.batch``; ``auto`` does not draft
            inside a batch yet, which it also would not on two CPU cores at batch 8); more wait for a place (in
            waves). Other policies decode the prompts one at a time. Every prompt is checked first: one
            :class:`BitMTPError` lists the bad ones by index. ``stream=True`` is refused (one stream per call).
        max_batch: most prompts decoded together (1..16; ``prompts`` and ``batcher=True``).
        batcher: which engine decodes this prompt. None (the default): policies ``"ar"`` and ``"auto"`` (with its
            default drafters) on the CPU's torch runtime decode as a batch of one on ``model.batcher(max_batch)``
            — as fast as the solo engine, prefilling faster, and calls from other threads on the model share its
            forward passes (what ``bitmtp serve`` does with concurrent requests) — the rest on the solo engine
            (``bitmtp.api.batches_alone`` says which). True: that batch engine whatever the runtime; a
            :class:`~bitmtp.runtime.batch.BatchEngine` of this model: that one; False: the solo engine
            (``model.engine``: its one-pass mask blocks, trees and runner-ups, its calibrated plan). Every choice
            gives the same output.
        max_new_tokens: most tokens to generate.
        policy: a registered policy name (``bitmtp.decoding.policy_names()``): ``"auto"`` (the default:
            exactly AR greedy's output, drafting — by prompt lookup, and with the adapter's mask drafts when
            one is attached — only where this machine's measured step costs say it pays: a batch of one by
            the times of the steps its engine ran, the solo engine by a table it measures in a few seconds at
            its first use on a machine and caches), ``"ar"`` (one token per
            step, the baseline), ``"confidence"`` (commit the confident prefix, unverified),
            ``"speculative"`` (verify every block: exactly AR greedy's output) or ``"hybrid"``
            (confidence when at least ``min_prefix`` tokens are confident, else verify); or a
            :class:`bitmtp.decoding.Policy` instance such as ``HybridPolicy(tau=0.5)`` (then leave
            ``tau`` and ``min_prefix`` out).
        block_size: D, tokens drafted per iteration (2..16; default: the adapter's).
        tau: confidence threshold τ in (0, 1] (default 0.9).
        min_prefix: hybrid's m, any integer ≥ 0 (default max(2, D // 2)); m ≤ 1 is confidence-only,
            m > D speculative-only.
        eos_token_id: stop token(s) (default: the model's).
        stream: return an iterator of text pieces as they are committed instead of the result. Close a
            stream you stop reading (``stream.close()``, or use it as a context manager): a batch of one
            holds KV rows of the batch engine until then (other streams and calls go on beside it); a stream
            on the solo engine owns the model's KV store from its first piece until it is exhausted or
            closed — other threads' calls wait for it, and another solo generation on the same model in the
            same thread meanwhile raises BitMTPError (use ``model.session()`` to decode concurrently).
        drafter: draft with this drafter instead of the policy's default: ``"adapter"`` (the loaded
            adapter's), ``"lookup"`` (prompt lookup: continues the latest earlier occurrence of the text's
            last tokens; no adapter needed; verifying policies only), ``"lookup+adapter"`` (one pass:
            lookup when the context matches, the adapter's mask drafts otherwise), or a Drafter object
            (e.g. an ``OracleDrafter``).
        schedule: ``speculative``'s schedule: ``"two-pass"`` (default: a draft step, then a verify
            step), ``"one-pass"`` (one step verifies the previous guesses and drafts the next), ``"tree"``
            (one pass, mask rows after every row; mask-block adapters) or ``"top2"`` (one pass; the first
            mask-drafted guess is verified together with its runner-up, the mask row's second choice, in
            one more row; mask-block adapters, greedy decoding only).
        temperature: 0 (default) picks the most likely token; > 0 samples from softmax(logits / T). Every
            verifying policy (auto, speculative, hybrid's verified blocks) then commits exactly the tokens AR
            sampling with the same ``seed`` commits (``bitmtp.decoding.sampling``: one uniform per position,
            shared by drafts and targets); confidence/hybrid's unverified drafts are samples of the drafter.
            Any finite T ≥ 0 is accepted: T below 2^-126 ≈ 1.18e-38 (1e-40, 1e-300, 5e-324) is the greedy
            limit, decoded exactly as T = 0 (same tokens and logprobs, no seed); huge T (1e38, 1e308)
            samples uniformly from the tokens the filters keep.
        top_k, top_p, min_p: filters applied after the temperature, as in transformers (0, 1, 0: off).
        repetition_penalty: transformers' penalty over prompt and output tokens, any finite value > 0
            (1: off). Extreme values (1e-300, 1e300, subnormals) saturate a penalized logit at ±3.4e38
            (float32's largest) rather than overflow; tokens saturated alike tie (greedy: the lowest id).
        presence_penalty, frequency_penalty: OpenAI's penalties over output tokens, in [-2, 2] (0: off).
        seed: the sampling seed: the same seed gives the same text under every policy (None: a random
            one, returned in the output's ``seed``).
        stop: a string or strings that end generation when they appear in the text (matched in text, across
            token boundaries); the returned text ends before it (``stop_reason="stop"``) and a stream holds
            back text that could begin one. Needs a tokenizer.
        logprobs: also return each token's log-probability under the distribution it was chosen from:
            always a finite float (never -inf or NaN: a probability that underflowed float32 reads as
            log(2^-149) ≈ -103.3); with ``logprobs=False`` the output's ``logprobs`` is None.

        config: the decoding options above validated once (:func:`decoding_config`), e.g. built once and
            reused over many calls; the options themselves are then left out.

    Returns:
        a :class:`GenerateOutput` (text, token ids, stats), or with ``stream=True`` a :class:`TextStream`
        (an iterator of text pieces whose ``result`` is the GenerateOutput once it is exhausted).

    Thread safety: calls on one model from several threads give exactly what each gives alone. Batches of
    one (the default for ``ar`` and ``auto`` on the CPU) share forward passes, up to ``max_batch`` sequences a
    step; calls on the solo engine are serialized (each waits for its KV store) — ``model.session()`` runs
    those concurrently instead.
    """
    if not isinstance(model, BitMTPModel):
        raise BitMTPError(f"model: expected a model from bitmtp.load(), got {type(model).__name__}")
    if (prompt is not None) + (input_ids is not None) + (prompts is not None) != 1:
        raise BitMTPError("prompt/input_ids/prompts: give exactly one of them (prompts: a list of several)")
    cfg = _config_of(model, config, dict(
        max_new_tokens=max_new_tokens, policy=policy, block_size=block_size, tau=tau, min_prefix=min_prefix,
        eos_token_id=eos_token_id, drafter=drafter, schedule=schedule, temperature=temperature, top_k=top_k,
        top_p=top_p, min_p=min_p, repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty, seed=seed, stop=stop, logprobs=logprobs))
    if prompts is not None:
        if stream:
            raise BitMTPError("stream: a call with several prompts returns their outputs together; stream one "
                              "prompt per call (or serve them: bitmtp serve batches concurrent requests)")
        return _generate_batch(model, _batch_ids(model, prompts, special_tokens_in_content), max_batch, cfg)
    ids = model.check_ids(model.encode(prompt, special_tokens_in_content=special_tokens_in_content)
                          if prompt is not None else input_ids)
    if len(ids) > model.engine.capacity:
        raise BitMTPError(_capacity_advice(model, len(ids), cfg.max_new_tokens))
    # a runtime that cannot sample so says it now, not mid-stream (set_sampling itself runs inside the
    # generation, which owns the pool: another thread's generation may be running right now)
    model.engine.pool.check_sampling(cfg.sampling)
    chunks = start_generation(model, ids, cfg, batcher=batcher, max_batch=max_batch)
    if stream:
        if model.tokenizer is None:
            raise BitMTPError("stream: streaming text needs a tokenizer; use stream=False for token ids")
        return TextStream(model, chunks, cfg.stops)
    return _drain(model, chunks, cfg.stops)


def _drain(model: BitMTPModel, chunks: Any, stops: tuple[str, ...]) -> GenerateOutput:
    """A generation's chunks (a ``Generation`` or ``BatchGeneration``) read to the end: its output, cut at the
    first stop string when there are some."""
    if stops:
        text_stream = TextStream(model, chunks, stops)
        for _ in text_stream:
            pass
        return text_stream.result
    return _output(model, Engine.run(chunks))


def batches_alone(model: BitMTPModel, cfg: DecodingConfig) -> bool:
    """Whether :func:`generate` decodes one prompt as a batch of one (``batcher=None``, the default): ``ar`` and
    ``auto`` with its default drafters (:attr:`DecodingConfig.drafts_as_a_batch`) on the CPU's torch runtime. There
    the batch engine decodes one sequence as fast as the solo engine (``auto``: 0.98-1.02x on code and on chat over
    three runs, ``bench/e2e/test_bench_batch.py::test_batch_of_one_vs_solo_auto``), prefills faster, and calls
    from other threads share its steps. The solo engine keeps the other policies (speculative / lossy schedules), other
    drafters and the GPU and Vulkan runtimes (CUDA graphs of the solo step; the batched GPU step is unmeasured)."""
    return (cfg.drafts_as_a_batch and model.plan is None and model.engine.runtime == "torch"
            and model.decoder.device.type == "cpu")


def start_generation(model: BitMTPModel, ids: list[int], cfg: DecodingConfig, *,
                     batcher: bool | BatchEngine | None = None, max_batch: int = 8) -> Any:
    """One prompt's generation (checked token ids) with ``cfg`` on the engine :func:`generate` picks for it
    (``batcher``: as there): an iterator of committed token chunks whose ``StopIteration.value`` is the
    :class:`~bitmtp.runtime.decode.GenerationResult`, with its ``stats`` filled as it runs — the solo engine's
    ``Generation`` or a batch engine's ``BatchGeneration``. What ``generate`` and the Hugging Face patch read."""
    eng = _engine_for(model, batcher, max_batch, cfg)
    return model.engine.decode(ids, **cfg.solo_kwargs()) if eng is None else eng.submit(ids, **cfg.batch_kwargs())


def _engine_for(model: BitMTPModel, batcher: Any, max_batch: int, cfg: DecodingConfig) -> BatchEngine | None:
    """The batch engine one prompt decodes on (None: the solo engine, ``model.engine``)."""
    if batcher is None:
        return model.batcher(max_batch) if batches_alone(model, cfg) else None
    if batcher is False:
        return None
    return _batcher_of(model, batcher, max_batch, cfg)


def _batcher_of(model: BitMTPModel, batcher: Any, max_batch: int, cfg: DecodingConfig) -> BatchEngine:
    """The batch engine ``generate(..., batcher=...)`` decodes on: checked against the model and the policy."""
    if not cfg.batchable:
        raise BitMTPError(f"batcher: a batch decodes policy 'ar' or 'auto' (AR's exact output); policy "
                          f"{cfg.policy.name!r} drafts, so decode it without batcher")
    if batcher is True:
        return model.batcher(max_batch)
    if not isinstance(batcher, BatchEngine):
        raise BitMTPError(f"batcher: expected None (the default), True, False or a BatchEngine (model.batcher()), "
                          f"got {_describe(batcher)}")
    if batcher.decoder is not model.decoder:
        raise BitMTPError("batcher: this batch engine belongs to another model; use model.batcher()")
    return batcher


def _batch_ids(model: BitMTPModel, prompts: Any, special_tokens_in_content: bool) -> list[list[int]]:
    """Every prompt's token ids, all checked first: one BitMTPError names each bad prompt by its index."""
    if isinstance(prompts, (str, bytes, Mapping)) or not isinstance(prompts, Sequence) or not len(prompts):
        raise BitMTPError(f"prompts: expected a non-empty list of prompts (strings, message lists or token id "
                          f"lists), got {_describe(prompts)}")
    out, bad = [], []
    cap = model.engine.capacity
    for i, p in enumerate(prompts):
        try:
            text = isinstance(p, str) or (isinstance(p, Sequence) and len(p) and isinstance(p[0], Mapping))
            ids = model.check_ids(model.encode(p, special_tokens_in_content=special_tokens_in_content)
                                  if text else p)
            if len(ids) > cap:  # (an empty prompt is check_ids' BitMTPError)
                bad.append(f"{i}: {len(ids)} tokens exceed the capacity of {cap}")
            out.append(ids)
        except BitMTPError as exc:
            bad.append(f"{i}: {exc}")
    if bad:
        raise BitMTPError(f"prompts: {len(bad)} of {len(prompts)} cannot be decoded — " + "; ".join(bad))
    return out


def _generate_batch(model: BitMTPModel, batch: list[list[int]], max_batch: int,
                    cfg: DecodingConfig) -> list[GenerateOutput]:
    """``generate(prompts=...)``: AR-exact policies on the batch engine, the others one prompt at a time."""
    pol, stops = cfg.policy, cfg.stops
    batched = cfg.batchable and model.plan is None and model.engine.runtime == "torch"
    if not batched:  # one at a time: each call exactly as generate() alone
        outs = []
        for ids in batch:
            outs.append(_drain(model, model.engine.decode(ids, **cfg.solo_kwargs()), stops))
            outs[-1].stats.notes.append(f"batch: policy {pol.name!r} decodes one prompt at a time (batched steps "
                                        "run policy 'ar' and 'auto')")
        return outs
    eng = model.batcher(max_batch)
    # auto's output is AR's exactly (greedy, or sampled with the same seed): in a batch it drafts by lookup and
    # the mask-block adapter's mask rows
    gens = [eng.submit(ids, **cfg.batch_kwargs()) for ids in batch]
    iters: list[Any] = [TextStream(model, g, stops) if stops else g for g in gens]
    results: list[GenerateOutput | None] = [None] * len(batch)
    active = list(range(len(batch)))
    try:
        while active:  # round robin: a sequence whose chunk is queued answers at once, else steps the batch
            for i in list(active):
                try:
                    next(iters[i])
                except StopIteration as stop:
                    results[i] = iters[i].result if stops else _output(model, stop.value)
                    active.remove(i)
    finally:
        for it in iters:
            it.close()
    drafting = " (auto: lookup guesses and the adapter's mask rows where a row pays)" if pol.name == "auto" else ""
    for out in results:
        out.stats.notes.append(f"batch: decoded with up to {eng.max_batch} sequences a step{drafting}")
    return results


def _check_stop(stop: Any, model: BitMTPModel) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (None: none)."""
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) and x for x in items):
        raise BitMTPError(f"stop: expected a non-empty string or a list of them, got {stop!r}")
    if len(items) > 16:
        raise BitMTPError(f"stop: at most 16 stop strings, got {len(items)}")
    if items and model.tokenizer is None:
        raise BitMTPError("stop: stop strings are matched in the text and need a tokenizer; this model has none "
                          "(stop on token ids with eos_token_id instead)")
    return tuple(items)


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters of ``text`` could be the start of a stop string (held back by a stream)."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), keep, -1):
            if text.endswith(s[:k]):
                keep = k
                break
    return keep


def _capacity_advice(model: BitMTPModel, prompt_len: int, max_new_tokens: int) -> str:
    """The error for a prompt longer than the KV store, with a capacity to load with that the model
    supports (its context length) — not prompt + max_new_tokens blindly: generation stops at
    capacity anyway, so a huge max_new_tokens needs no huge store."""
    cap, ctx = model.engine.capacity, model.args.max_position_embeddings
    cli = _COMMAND_LINE.get()
    head = (f"{'--capacity: the' if cli else 'input_ids:'} prompt of {prompt_len} tokens exceeds the KV store's "
            f"capacity of {cap} tokens")
    if prompt_len >= ctx:
        return (f"{head}, and the model's context length of {ctx} tokens; shorten the prompt to under {ctx} "
                "tokens")
    want = min(prompt_len + max_new_tokens, ctx)
    how = f"run with --capacity {want}" if cli else f"load the model with bitmtp.load(..., capacity={want})"
    return (f"{head}; {how} (at most its context length, {ctx}; generation stops at capacity anyway, whatever "
            f"{'--max-new-tokens' if cli else 'max_new_tokens'} says) or shorten the prompt")


#: whether an error's advice is read on bitmtp's command line (flags: ``--capacity 4096``) rather than by a
#: Python caller (keywords: ``capacity=4096``); :func:`command_line_advice` sets it
_COMMAND_LINE: contextvars.ContextVar[bool] = contextvars.ContextVar("bitmtp_command_line_advice", default=False)


@contextmanager
def command_line_advice() -> Iterator[None]:
    """Inside the block, errors that advise a :func:`load` option spell it as the command line's flag
    (``--capacity 4096``) instead of the keyword (``bitmtp.load(..., capacity=4096)``). ``bitmtp.cli.main``
    runs every command inside it; the setting is the calling thread's (a ``contextvars`` variable)."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


def _capacity_option(value: int | None = None) -> str:
    """The capacity option as the reader writes it: ``capacity=N`` / ``--capacity N`` (no value: the name)."""
    if _COMMAND_LINE.get():
        return "--capacity" if value is None else f"--capacity {value}"
    return "capacity" if value is None else f"capacity={value}"


def _output(model: BitMTPModel, res: GenerationResult) -> GenerateOutput:
    text = model.tokenizer.decode(res.tokens, skip_special_tokens=True) if model.tokenizer is not None else None
    return GenerateOutput(text, res.tokens, res.stop_reason, res.stats, res.prompt_tokens, res.prefill_seconds,
                          res.decode_seconds, res.logprobs, res.seed, list(res.origins), list(res.steps))


class TextStream:
    """The iterator ``generate(..., stream=True)`` returns: text pieces as they are committed.

    Decodes the whole output after each commit and yields the new suffix, holding back a trailing
    replacement character (a multi-byte character split across tokens) and any trailing text that could
    begin a stop string. Once exhausted, :attr:`result` holds the same :class:`GenerateOutput` the call
    without ``stream`` returns.

    From its first piece until it is exhausted the stream owns the model's KV store: other threads'
    generations wait for it, and a generation started in the thread reading it raises BitMTPError.
    :meth:`close` (or leaving a ``with`` block, or dropping the stream) ends it early and releases
    the model; :attr:`result` then stays None.
    """

    def __init__(self, model: BitMTPModel, chunks: Generation, stops: tuple[str, ...] = ()):
        # no generator over self here: a stream must not sit in a reference cycle, so that dropping
        # it releases the model at once (the Generation releases the store when it is freed)
        self._model, self._chunks = model, chunks
        self._stops = stops
        self._tokens: list[int] = []
        self._sent = 0
        self._range = (0, 0)  # the last piece's [start, end) in the output's text
        self._ends: list[int] = []  # per token, where the text of the tokens up to it ends (computed on demand)
        self._done = False
        self._t0 = time.perf_counter()
        self.result: GenerateOutput | None = None

    def __iter__(self) -> TextStream:
        return self

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop generating and release the model's KV store (idempotent; a no-op once exhausted)."""
        self._done = True
        self._chunks.close()

    def __next__(self) -> str:
        tok = self._model.tokenizer
        while not self._done:
            try:
                chunk = next(self._chunks)
            except StopIteration as stop:
                self._done = True
                res: GenerationResult = stop.value
                self.result = _output(self._model, res)
                if len(self.result.text) > self._sent:
                    return self._piece(self.result.text, len(self.result.text))
                break
            if not chunk:
                continue
            self._tokens.extend(chunk)
            text = tok.decode(self._tokens, skip_special_tokens=True)
            if self._stops:
                hit = self._find_stop(text)
                if hit is not None:
                    self._stop_at(*hit)
                    if len(self.result.text) > self._sent:
                        return self._piece(self.result.text, len(self.result.text))
                    break
            if text.endswith("\ufffd"):
                continue
            upto = len(text) - _held_back(text, self._stops)
            if upto > self._sent:
                return self._piece(text, upto)
        raise StopIteration

    def _piece(self, text: str, upto: int) -> str:
        """``text[sent:upto]``, the next piece, marked as sent (:attr:`spans` reads its range)."""
        self._range = (self._sent, upto)
        self._sent = upto
        return text[self._range[0] : upto]

    @property
    def spans(self) -> list[Span]:
        """The last piece's text cut by the tokens that produced it, each with its origin and step
        (:class:`Span`; their texts concatenate to the piece). A token that adds no text of its own (a
        special token, the first bytes of a character spread over tokens) has no span. Computed when read:
        a stream whose spans are never read pays nothing for them."""
        start, end = self._range
        if end <= start:
            return []
        out = self._chunks.report.get("output")
        origins = self.result.origins if self.result is not None else out.origins if out is not None else []
        steps = self.result.steps if self.result is not None else out.steps if out is not None else []
        ends = self._ends
        tok = self._model.tokenizer
        res = self.result
        full = res.text if res is not None and res.text is not None and end <= len(res.text) else \
            tok.decode(self._tokens, skip_special_tokens=True)
        spans: list[Span] = []
        i = bisect.bisect_right(ends, start)  # the first token whose text ends after `start`
        while i < len(self._tokens):
            if i == len(ends):  # each token's end: where the text of the tokens up to it ends (stable part)
                stable = tok.decode(self._tokens[: i + 1], skip_special_tokens=True).rstrip("\ufffd")
                ends.append(max(len(stable), ends[-1] if ends else 0))
            lo, hi = max(start, ends[i - 1] if i else 0), min(end, ends[i])
            if hi > lo:
                spans.append(Span(full[lo:hi], origins[i] if i < len(origins) else "ar",
                                  steps[i] if i < len(steps) else 0))
            if ends[i] >= end:
                break
            i += 1
        covered = start + sum(len(sp.text) for sp in spans)
        if covered < end:  # text past every token's own end (a tokenizer whose whole decode differs): the last's
            last = spans.pop() if spans else Span("", origins[-1] if origins else "ar", steps[-1] if steps else 0)
            spans.append(Span(last.text + full[covered:end], last.origin, last.step))
        return spans

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in ``text`` (searched from just before the text already sent)."""
        start = max(0, self._sent - max(map(len, self._stops)))
        best = None
        for s in self._stops:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _stop_at(self, at: int, stop: str) -> None:
        """End the generation at a stop string found at ``at``: the text before it, the fewest tokens whose
        text contains it, and the model released."""
        tok = self._model.tokenizer
        end = at + len(stop)
        lo, hi = 1, len(self._tokens)  # the shortest token prefix whose text reaches the stop string's end
        while lo < hi:
            mid = (lo + hi) // 2
            if len(tok.decode(self._tokens[:mid], skip_special_tokens=True)) >= end:
                hi = mid
            else:
                lo = mid + 1
        report = self._chunks.report
        self._done = True
        self._chunks.close()
        out = report.get("output")
        logprobs = out.logprobs[:lo] if out is not None and out.logprobs is not None else None
        prefill = report.get("prefill_seconds", 0.0)
        decode_s = max(time.perf_counter() - self._t0 - prefill, 0.0)
        stats = self._chunks.stats
        stats.tokens = lo
        stats.seconds = decode_s
        text = tok.decode(self._tokens[:lo], skip_special_tokens=True)
        self.result = GenerateOutput(text[:at], self._tokens[:lo], "stop", stats, report.get("prompt_tokens", 0),
                                     prefill, decode_s, logprobs, report.get("seed"),
                                     list(out.origins[:lo]) if out is not None else [],
                                     list(out.steps[:lo]) if out is not None else [])
