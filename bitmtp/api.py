"""Public entry points: :func:`load` and :func:`generate`."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bitmtp.decoding.drafters import Drafter, drafter_for
from bitmtp.decoding.policies import POLICIES
from bitmtp.errors import BitMTPError, FormatError
from bitmtp.formats.adapters import AdapterConfig, load_adapter
from bitmtp.model.adapters import build_adapter
from bitmtp.model.args import ModelArgs
from bitmtp.model.decoder import Decoder
from bitmtp.model.loaders import from_safetensors_dir, from_transformers
from bitmtp.runtime.decode import DecodeStats, GenerationResult
from bitmtp.runtime.engine import Engine

log = logging.getLogger("bitmtp")

#: the default block size when neither the call nor the adapter names one
DEFAULT_BLOCK_SIZE = 8


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
    #: the offload plan of a ``backend="wgpu"`` model (``bitmtp.offload.OffloadPlan``)
    plan: Any = None

    @property
    def args(self) -> ModelArgs:
        return self.decoder.args

    def recommended(self, policy: str | None = None, block_size: int | None = None) -> tuple[str, int | None]:
        """``(policy, block_size)`` to decode with when the caller left them open (None): what the
        attached adapter's training record recommends (the policy and block size that measured
        fastest on its machine, ``training.recommended``), else ``"hybrid"`` with the adapter's D;
        ``"ar"`` without an adapter. A block size is only taken from the record for its own policy."""
        if self.drafter is None:
            return policy or "ar", block_size
        rec = (self.adapter_config.training or {}).get("recommended") or {} if self.adapter_config else {}
        chosen = policy or rec.get("policy") or "hybrid"
        if block_size is None and chosen == rec.get("policy"):
            block_size = rec.get("block_size")
        return chosen, block_size

    def load_adapter(self, adapter: str | Path | tuple[AdapterConfig, dict[str, torch.Tensor]] | None) -> None:
        """Attach an MTP adapter (a folder written by ``bitmtp.formats.adapters.save_adapter``, or a
        ``(config, tensors)`` pair); ``None`` detaches. The base model is untouched either way."""
        if adapter is None:
            self.drafter, self.adapter_config, self.adapter_tensors = None, None, None
            return
        config, tensors = load_adapter(adapter) if isinstance(adapter, (str, Path)) else adapter
        module = build_adapter(config, tensors, self.args, dtype=self.decoder.dtype, device=self.decoder.device)
        self.drafter, self.adapter_config = drafter_for(self.decoder, module), config
        self.adapter_tensors = dict(tensors)

    def save_gguf(self, path: str | Path, *, adapter: bool = True, overwrite: bool = False, name: str | None = None,
                  progress: bool = True, plain: bool = False) -> Path:
        """Write this model as one GGUF file (see ``bitmtp.formats.gguf``): the base weights (ternary as
        TQ2_0 where the layout allows), the tokenizer, and — with ``adapter=True`` and an adapter attached —
        the MTP adapter under ``bitmtp.mtp.*`` with ``bitmtp.speculative.*`` metadata. Atomic; an existing
        file is replaced only with ``overwrite=True``. ``plain=True`` writes a file stock llama.cpp loads (it
        refuses extra tensors): no adapter and no exact-scale tensors (ternary scales rounded to fp16)."""
        from bitmtp.model.gguf_io import export_gguf

        packed = None
        if adapter and not plain and self.adapter_config is not None:
            packed = (self.adapter_config, self.adapter_tensors)
        return export_gguf(self.decoder, path,
                           adapter=packed, tokenizer=self.tokenizer, tokenizer_fields=self.gguf_tokenizer_fields,
                           name=name or Path(str(self.source)).stem, overwrite=overwrite, progress=progress,
                           plain=plain)

    def check_ids(self, input_ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in input_ids]
        vocab = self.args.vocab_size
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise BitMTPError(f"input_ids: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if not ids:
            raise BitMTPError("input_ids: the prompt is empty")
        return ids

    def eos_ids(self, eos_token_id: int | Sequence[int] | None) -> list[int]:
        if eos_token_id is None:
            return list(self.args.eos_token_id)
        return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]

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
        return self.engine.generate_ar(self.check_ids(input_ids), max_new_tokens, self.eos_ids(eos_token_id))


def _gguf_tokenizer(path: Path, files: dict[str, Any] | None) -> Any:
    """The tokenizer of a GGUF file: rebuilt from ``bitmtp.tokenizer.files`` when bitmtp wrote it, else
    through transformers' GGUF tokenizer converter (llama / qwen3 files); None (with a warning) otherwise."""
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
                write_tokenizer_files(files, Path(tmp))
                return AutoTokenizer.from_pretrained(tmp)
            except Exception as exc:  # transformers raises many types for bad tokenizer files
                raise FormatError(f"{path}: the tokenizer stored in bitmtp.tokenizer.files cannot be loaded "
                                  f"({type(exc).__name__}: {exc})") from exc
    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # e.g. an architecture transformers' GGUF reader does not know
        log.warning("%s: no tokenizer could be built from the GGUF metadata (%s: %s); pass tokenizer= or input_ids",
                    path, type(exc).__name__, exc)
        return None


def _wgpu_plan(decoder: Decoder, capacity: int, m_max: int, vram_budget: Any, cpu_layers: int | None):
    """The offload plan of a wgpu model, checked against the device (errors show the plan)."""
    from bitmtp.errors import BackendUnavailableError
    from bitmtp.offload import DEFAULT_VRAM_BUDGET, parse_bytes, plan_offload
    from bitmtp.wgsl_fallback.runner import default_runner

    try:
        budget = DEFAULT_VRAM_BUDGET if vram_budget is None else parse_bytes(vram_budget)
    except BitMTPError as exc:
        raise BitMTPError(f"vram_budget: {exc}") from exc
    # dense weights keep a bf16/f16 model's 16 bits on the device (else float32); the KV cache is float32
    dense_bytes = 2 if decoder.dtype in (torch.bfloat16, torch.float16) else 4
    kw = dict(capacity=capacity, m_max=m_max, dense_dtype_bytes=dense_bytes, kv_dtype_bytes=4, ternary=decoder.ternary,
              force_cpu_layers=cpu_layers)
    try:
        runner = default_runner()
    except BackendUnavailableError as exc:
        plan = plan_offload(decoder.args, budget, **kw)  # no device: no binding limit to split against
        raise BackendUnavailableError(f"{exc}\nThe plan that could not run:\n{plan.table()}") from exc
    plan = plan_offload(decoder.args, budget, max_binding_bytes=runner.max_binding_bytes, **kw)
    if not plan.lm_head_on_gpu:
        raise BitMTPError("vram_budget: the plan puts the LM head on the CPU, which the wgpu backend does not run "
                          f"yet; raise the budget.\n{plan.table()}")
    return plan


def load(source: Any, *, backend: str | None = None, quantize: str | None = None, capacity: int = 2048,
         dtype: torch.dtype | None = None, device: str | torch.device = "cpu", m_max: int = 31,
         tokenizer: Any = None, adapter: str | Path | None = "auto", vram_budget: int | str | None = None,
         cpu_layers: int | None = None) -> BitMTPModel:
    """Load a model for bitmtp.

    Args:
        source: a Hugging Face checkpoint folder (safetensors + config.json), a ``.gguf`` file, or a
            live transformers ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` / ``BitNetForCausalLM``.
        backend: kernel backend for the linear layers (default: automatic / ``BITMTP_BACKEND``), or
            ``"wgpu"``: whole decoder layers on a Vulkan device through WGSL shaders (any GPU with a Vulkan
            driver; Mesa lavapipe on a CPU), with the layers that do not fit ``vram_budget`` on the CPU.
        quantize: ``"ternary"`` to ternarize float linear weights by absmean (per tensor); default
            keeps them as the checkpoint stores them.
        capacity: maximum tokens (prompt + generated) of the KV store.
        dtype: dense compute dtype (default float32).
        device: ``"cpu"`` or ``"cuda"``.
        m_max: widest replay step: 2D − 1 for block size D (the default, 31, covers D ≤ 16).
        tokenizer: override the tokenizer (e.g. for a live model object).
        adapter: an MTP adapter folder (``mask-block`` or ``heads``) to draft with; ``"auto"`` (the
            default) arms the adapter a GGUF file carries (``bitmtp.speculative.*`` or Divine's
            ``divine.speculative.*`` keys), else attaches a shipped adapter when one was trained on exactly
            this model (same shape and weight fingerprint, see ``bitmtp.shipped``); ``None`` attaches none.
        vram_budget: ``backend="wgpu"``: device memory to use, in bytes or as text ("3.9GB", "512MiB");
            default 3.9 GB (a 4 GB laptop GPU). ``bitmtp.offload.plan_offload`` places the layers.
        cpu_layers: ``backend="wgpu"``: force the last N layers onto the CPU whatever the budget.
    """
    wgpu = backend == "wgpu"
    if wgpu:
        if torch.device(device).type != "cpu":
            raise BitMTPError("device: backend='wgpu' loads the model on the CPU (the Vulkan device holds its copy)")
        backend = None  # the host-side modules (CPU-offloaded layers) use the automatic CPU kernels
    elif vram_budget is not None or cpu_layers is not None:
        raise BitMTPError("vram_budget / cpu_layers: only meaningful with backend='wgpu'")
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
                tok = _gguf_tokenizer(path, gguf_model.tokenizer_files)
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
    plan = _wgpu_plan(decoder, capacity, m_max, vram_budget, cpu_layers) if wgpu else None
    engine = Engine(decoder, capacity=capacity, m_max=m_max, device_backend="wgpu" if wgpu else None,
                    gpu_layers=len(plan.gpu_layers) if plan is not None else None)
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
    stop_reason: str
    stats: DecodeStats
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.stats.tokens_per_second


def _check_policy_args(model: BitMTPModel, policy: str, block_size: int | None, tau: float,
                       min_prefix: int | None, drafter: Drafter | None) -> tuple[int, int]:
    if policy not in POLICIES:
        raise BitMTPError(f"policy: expected one of {POLICIES}, got {policy!r}")
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and 0 < tau <= 1):
        raise BitMTPError(f"tau: the confidence threshold must be in (0, 1], got {tau!r}")
    default = model.adapter_config.block_size if model.adapter_config else DEFAULT_BLOCK_SIZE
    d = default if block_size is None else block_size
    if isinstance(d, bool) or not isinstance(d, int) or not 2 <= d <= 16:
        raise BitMTPError(f"block_size: D must be an integer in 2..16, got {block_size!r}")
    m = max(2, d // 2) if min_prefix is None else min_prefix
    if isinstance(m, bool) or not isinstance(m, int) or m > d:
        raise BitMTPError(f"min_prefix: m must be an integer <= block_size ({d}), got {min_prefix!r}")
    if policy != "ar":
        if drafter is None:
            raise BitMTPError(f"policy: {policy!r} drafts tokens and needs an MTP adapter; load one with "
                              "bitmtp.load(..., adapter=PATH) or model.load_adapter(PATH), or use policy='ar'")
        if d > drafter.max_block:
            raise BitMTPError(f"block_size: the loaded {drafter.kind} adapter drafts at most D={drafter.max_block}, "
                              f"got {d}")
    return d, m


def generate(model: BitMTPModel, prompt: str | list[dict[str, str]] | None = None, *,
             input_ids: Sequence[int] | None = None, max_new_tokens: int = 128, policy: str = "hybrid",
             block_size: int | None = None, tau: float = 0.9, min_prefix: int | None = None,
             eos_token_id: int | Sequence[int] | None = None, stream: bool = False,
             drafter: Drafter | None = None) -> GenerateOutput | TextStream:
    """Greedy multi-token generation.

    Args:
        model: from :func:`load`, with an adapter unless ``policy="ar"``.
        prompt: text, or chat messages (``[{"role": ..., "content": ...}]``) which go through the
            tokenizer's chat template. Give either ``prompt`` or ``input_ids``.
        input_ids: token ids of the prompt.
        max_new_tokens: most tokens to generate.
        policy: ``"ar"`` (one token per step, the baseline), ``"confidence"`` (commit the confident
            prefix, unverified), ``"speculative"`` (verify every block: exactly AR greedy's output) or
            ``"hybrid"`` (confidence when at least ``min_prefix`` tokens are confident, else verify).
        block_size: D, tokens drafted per iteration (2..16; default: the adapter's).
        tau: confidence threshold τ in (0, 1].
        min_prefix: hybrid's m (default max(2, D // 2)); m ≤ 1 is confidence-only, m > D speculative-only.
        eos_token_id: stop token(s) (default: the model's).
        stream: return an iterator of text pieces as they are committed instead of the result.
        drafter: draft with this drafter instead of the loaded adapter's (e.g. an ``OracleDrafter``).

    Returns:
        a :class:`GenerateOutput` (text, token ids, stats), or with ``stream=True`` a :class:`TextStream`
        (an iterator of text pieces whose ``result`` is the GenerateOutput once it is exhausted).
    """
    if not isinstance(model, BitMTPModel):
        raise BitMTPError(f"model: expected a model from bitmtp.load(), got {type(model).__name__}")
    if (prompt is None) == (input_ids is None):
        raise BitMTPError("prompt/input_ids: give exactly one of them")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise BitMTPError(f"max_new_tokens: must be an integer >= 1, got {max_new_tokens!r}")
    drafter = drafter if drafter is not None else model.drafter
    d, m = _check_policy_args(model, policy, block_size, tau, min_prefix, drafter)
    ids = model.check_ids(model.encode(prompt) if prompt is not None else input_ids)
    if len(ids) > model.engine.capacity:
        raise BitMTPError(f"input_ids: prompt of {len(ids)} tokens exceeds capacity {model.engine.capacity}; "
                          f"load the model with bitmtp.load(..., capacity={len(ids) + max_new_tokens}) or more")
    chunks = model.engine.decode(ids, max_new_tokens=max_new_tokens, eos=model.eos_ids(eos_token_id),
                                 policy=policy, block_size=d, tau=float(tau), min_prefix=m, drafter=drafter)
    if stream:
        if model.tokenizer is None:
            raise BitMTPError("stream: streaming text needs a tokenizer; use stream=False for token ids")
        return TextStream(model, chunks)
    res = Engine.run(chunks)
    return _output(model, res)


def _output(model: BitMTPModel, res: GenerationResult) -> GenerateOutput:
    text = model.tokenizer.decode(res.tokens, skip_special_tokens=True) if model.tokenizer is not None else None
    return GenerateOutput(text, res.tokens, res.stop_reason, res.stats, res.prompt_tokens, res.prefill_seconds,
                          res.decode_seconds)


class TextStream:
    """The iterator ``generate(..., stream=True)`` returns: text pieces as they are committed.

    Decodes the whole output after each commit and yields the new suffix, holding back a trailing
    replacement character (a multi-byte character split across tokens). Once exhausted,
    :attr:`result` holds the same :class:`GenerateOutput` the call without ``stream`` returns.
    """

    def __init__(self, model: BitMTPModel, chunks: Iterator[list[int]]):
        self._model, self._chunks = model, chunks
        self._gen = self._pieces()
        self.result: GenerateOutput | None = None

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        return next(self._gen)

    def _pieces(self) -> Iterator[str]:
        tok = self._model.tokenizer
        tokens: list[int] = []
        sent = 0
        while True:
            try:
                chunk = next(self._chunks)
            except StopIteration as stop:
                res: GenerationResult = stop.value
                break
            if not chunk:
                continue
            tokens.extend(chunk)
            text = tok.decode(tokens, skip_special_tokens=True)
            if text.endswith("\ufffd"):
                continue
            if len(text) > sent:
                yield text[sent:]
                sent = len(text)
        self.result = _output(self._model, res)
        if len(self.result.text) > sent:
            yield self.result.text[sent:]
