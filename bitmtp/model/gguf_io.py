"""Decoder ⇄ GGUF: export a decoder (plus an MTP adapter and a tokenizer) and read it back.

The file layout, the ternary codecs and the speculative keys are ``bitmtp.formats.gguf``'s; this
module walks the decoder (splitting its fused q/k/v and gate/up projections back into the separate
tensors llama.cpp expects) and rebuilds a decoder through ``model.loaders.build_decoder``.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bitmtp.errors import BitMTPError, FormatError
from bitmtp.formats import gguf as G
from bitmtp.formats.adapters import AdapterConfig, BaseShape, check_tensors
from bitmtp.formats.ggml_blocks import BLOCK, BLOCK_BYTES, HALF_FORMATS, BlockWeight, pack_lossless
from bitmtp.formats.gguf_vocab import ggml_tokenizer_fields, tokenizer_files
from bitmtp.formats.ternary import unpack_t2
from bitmtp.model.args import ModelArgs, check_int, check_real
from bitmtp.model.decoder import Decoder
from bitmtp.model.families import NORM_NAMES, Norm, family_of_gguf_arch, get_family, supported_gguf_archs
from bitmtp.model.fuse import Stacked
from bitmtp.model.layers import DenseLinear
from bitmtp.model.loaders import build_decoder
from bitmtp.ops import TernaryLinear

log = logging.getLogger("bitmtp")

#: GGUF files (and llama.cpp) quantize everything else in "file type" terms; ours mixes types per tensor
GENERAL_QUANTIZATION_VERSION = 2


@dataclass
class _Ternary:
    """One ternary projection as stored: codes ``[N, K]`` int8, float32 scales, group size."""

    codes: torch.Tensor
    scales: torch.Tensor
    group_size: int


def _compact(scales: torch.Tensor) -> torch.Tensor:
    """Per-row scales that are all equal become one shared row (per-tensor), as checkpoints store them."""
    if scales.shape[0] > 1 and bool((scales == scales[:1]).all()):
        return scales[:1].contiguous()
    return scales.contiguous()


#: the GGML type each ``ggml_blocks`` format is written as
_BLOCK_TYPE = {"q4_0": "Q4_0", "q4_1": "Q4_1", "q8_0": "Q8_0", "bf16": "BF16", "f16": "F16"}


def _rows_of(bw: BlockWeight, rows: slice) -> BlockWeight:
    """Rows ``rows`` of a block weight (blocks never cross rows, so this is a byte slice)."""
    data = bw.data[rows].contiguous()
    return BlockWeight(bw.fmt, data, (data.shape[0], bw.shape[1]))


#: one projection part as :func:`_split` returns it: ``(weight, bias)``
Part = tuple[_Ternary | BlockWeight | torch.Tensor, torch.Tensor | None]


def _split(module: nn.Module, sizes: list[int], blocks: bool = False) -> list[Part]:
    """``(weight, bias)`` per part of a row-fused projection (sizes: rows of each part).

    With ``blocks``, a dense part whose values a GGML block encoding reproduces exactly comes as
    :class:`BlockWeight`: rows of the copy the decoder keeps (``Decoder.pack_dense_blocks``), else a lossless
    fit of the part alone (parts of different formats fuse into a float matrix without blocks; a model loaded
    with ``BITMTP_DENSE_BLOCKS=0`` has none). A float checkpoint's parts are rejected on their first rows.
    """
    if isinstance(module, Stacked):
        return [_split(p, [s], blocks)[0] for p, s in zip(module.parts, sizes, strict=True)]
    if sum(sizes) != module.out_features:
        raise BitMTPError(f"projection has {module.out_features} rows, expected {sum(sizes)}")
    out: list[Part] = []
    kept = module.blocks if blocks and isinstance(module, DenseLinear) else None
    start = 0
    for n in sizes:
        rows = slice(start, start + n)
        bias = None if module.bias is None else module.bias.detach()[rows].cpu()
        if isinstance(module, TernaryLinear):
            codes = unpack_t2(module.weight[rows].cpu(), module.in_features)
            scales = module.scales if module.scales.shape[0] == 1 else module.scales[rows]
            out.append((_Ternary(codes, _compact(scales.detach().float().cpu()), module.group_size), bias))
        elif isinstance(module, DenseLinear):
            if kept is not None:  # the blocks' rows: a lazy weight is never dequantized for the export
                out.append((_rows_of(kept, rows), bias))
            else:
                weight = module.weight.detach()[rows].cpu()
                bw = pack_lossless(weight) if blocks else None
                out.append((weight if bw is None else bw, bias))
        else:
            raise BitMTPError(f"GGUF export: cannot write a projection of type {type(module).__name__}")
        start += n
    return out


def _embedding(decoder: Decoder, blocks: bool) -> BlockWeight | torch.Tensor:
    """The token embedding, as the blocks it came from where ``blocks`` and a lossless encoding exists: a
    tied head holds them already (same storage as the embedding), an untied embedding is fitted here."""
    if blocks and decoder.embed_blocks is not None:  # held as the file's blocks (never dequantized)
        return decoder.embed_blocks
    embed = decoder.embed.detach()
    if not blocks:
        return embed
    head = decoder.lm_head
    if isinstance(head, DenseLinear) and head.blocks is not None and head.weight.shape == embed.shape \
            and head.weight.data_ptr() == embed.data_ptr():
        return head.blocks
    bw = pack_lossless(embed.cpu())
    return embed if bw is None else bw


def decoder_state(decoder: Decoder, *, blocks: bool = False) -> dict[str, Any]:
    """Every base tensor of ``decoder`` under its transformers name; ternary weights as ``_Ternary``.

    With ``blocks=True`` (what export writes), dense weights whose values a Q4_0 / Q4_1 / Q8_0 block
    encoding reproduces exactly come as :class:`~bitmtp.formats.ggml_blocks.BlockWeight`: a GGUF source's
    quantized projections are written back as the same blocks instead of float32.
    """
    a = decoder.args
    state: dict[str, Any] = {"model.embed_tokens.weight": _embedding(decoder, blocks)}

    def put(prefix: str, part) -> None:
        weight, bias = part
        state[prefix + ".weight"] = weight
        if bias is not None:
            state[prefix + ".bias"] = bias

    for i, layer in enumerate(decoder.layers):
        p = f"model.layers.{i}."
        def norm(*slots: Norm, layer=layer, p=p) -> None:  # in the order of the original export (GGUF tensor order)
            for slot in slots:
                if layer.norm(slot) is not None:
                    state[p + NORM_NAMES[slot][0]] = layer.norm(slot).detach()

        norm(Norm.ATTN_IN)
        for name, part in zip(("q_proj", "k_proj", "v_proj"),
                              _split(layer.attn.qkv_proj, [a.q_size, a.kv_size, a.kv_size], blocks), strict=True):
            put(p + "self_attn." + name, part)
        put(p + "self_attn.o_proj", _split(layer.attn.o_proj, [a.hidden_size], blocks)[0])
        norm(Norm.Q, Norm.K, Norm.ATTN_SUB, Norm.MLP_IN)
        for name, part in zip(("gate_proj", "up_proj"),
                              _split(layer.mlp.gate_up_proj, [a.intermediate_size] * 2, blocks), strict=True):
            put(p + "mlp." + name, part)
        put(p + "mlp.down_proj", _split(layer.mlp.down_proj, [a.hidden_size], blocks)[0])
        norm(Norm.MLP_SUB, Norm.MLP_OUT)
    state["model.norm.weight"] = decoder.norm.detach()
    if not a.tie_word_embeddings:
        head = decoder.lm_head
        if isinstance(head, DenseLinear):
            state["lm_head.weight"] = _split(head, [head.out_features], blocks)[0][0]
        else:
            state["lm_head.weight"] = head.weight.detach()
    return state


def _hyperparameters(args: ModelArgs, arch: str) -> dict[str, G.GGUFField]:
    f = G.field
    keys = {
        f"{arch}.context_length": f(int(args.max_position_embeddings)),
        f"{arch}.embedding_length": f(int(args.hidden_size)),
        f"{arch}.block_count": f(int(args.num_layers)),
        f"{arch}.feed_forward_length": f(int(args.intermediate_size)),
        f"{arch}.attention.head_count": f(int(args.num_heads)),
        f"{arch}.attention.head_count_kv": f(int(args.num_kv_heads)),
        f"{arch}.attention.layer_norm_rms_epsilon": f(float(args.rms_norm_eps)),
        f"{arch}.rope.freq_base": f(float(args.rope_theta)),
        f"{arch}.rope.dimension_count": f(int(args.head_dim)),
        f"{arch}.attention.key_length": f(int(args.head_dim)),
        f"{arch}.attention.value_length": f(int(args.head_dim)),
        f"{arch}.vocab_size": f(int(args.vocab_size)),
    }
    return keys


def _tensors_out(args: ModelArgs, state: dict[str, Any], adapter, exact_scales: bool) -> Iterator[G.TensorOut]:
    """The tensors to write, from :func:`decoder_state` (computed once: it unpacks every ternary weight)."""
    family = get_family(args.family)
    for hf, value in state.items():
        name = family.gguf_name(hf)
        heads = family.qk_permute_heads(args, hf)
        if isinstance(value, _Ternary):
            codes, scales = value.codes, value.scales
            if value.scales.shape[1] > 1 and codes.shape[1] % value.scales.shape[1]:
                raise BitMTPError(f"{hf}: GGUF export needs scale groups that divide K")
            if heads is not None:
                codes = G.permute_rows(codes, heads)
                scales = G.permute_rows(scales, heads) if scales.shape[0] > 1 else scales
            data, kind = G.encode_ternary(codes, scales, value.group_size)
            yield G.TensorOut(name, data, None if kind == "F32" else kind)
            if exact_scales:
                yield G.TensorOut(G.scale_name(name), scales.numpy())
            continue
        if isinstance(value, BlockWeight):  # the source's own blocks, byte for byte (rows permuted like floats)
            data = (value.data if heads is None else G.permute_rows(value.data, heads)).contiguous().numpy()
            if value.fmt in HALF_FORMATS:  # half rows: typed values, as numpy_of writes a half tensor
                data = data.view(np.float16 if value.fmt == "f16" else np.uint16)
            yield G.TensorOut(name, data, _BLOCK_TYPE[value.fmt])
            continue
        t = value
        if heads is not None:
            t = G.permute_rows(t, heads)
        if t.dim() == 1:  # norms and biases: F32, as llama.cpp expects
            t = t.to(torch.float32)
        data, raw = G.numpy_of(t)
        yield G.TensorOut(name, data, raw)
    if adapter is not None:
        _, tensors = adapter
        for name, t in tensors.items():
            data, raw = G.numpy_of(t)
            yield G.TensorOut(G.MTP_PREFIX + name, data, raw)


def _check_destination(path: Any) -> None:
    """Refuse, before any tensor is encoded, a path whose folder cannot take a new file (``/proc/x.gguf``, a
    read-only folder): a BitMTPError naming the file, where the write itself would raise a bare OSError
    (FileNotFoundError for ``/proc``) after the encoding. A probe file is created there and removed; missing
    folders are created, as the write creates them."""
    if not isinstance(path, (str, os.PathLike)):
        raise BitMTPError(f"path: expected a file path (str or pathlib.Path), got {type(path).__name__}")
    path = Path(path)
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
    except OSError as exc:
        raise BitMTPError(f"{path}: cannot create a file in {folder} ({exc.strerror or exc}); give a path in a "
                          "folder you can write to") from exc
    os.close(fd)
    os.unlink(probe)


def export_gguf(decoder: Decoder, path: str | Path, *,
                adapter: tuple[AdapterConfig, dict[str, torch.Tensor]] | None = None,
                tokenizer: Any = None, tokenizer_fields: dict[str, G.GGUFField] | None = None,
                name: str | None = None, overwrite: bool = False, progress: bool = True,
                plain: bool = False) -> Path:
    """Write ``decoder`` (+ ``adapter`` and ``tokenizer``) as one GGUF file. See ``bitmtp.formats.gguf``.

    Args:
        adapter: ``(config, tensors)`` of an MTP adapter to pack under ``bitmtp.mtp.*``; None writes a
            plain model.
        tokenizer: a transformers tokenizer; its files go into ``bitmtp.tokenizer.files`` and, unless
            ``tokenizer_fields`` are given, its vocabulary into ``tokenizer.ggml.*`` (BPE tokenizers).
        tokenizer_fields: ``tokenizer.*`` fields to write unchanged (from a GGUF source).
        overwrite: replace an existing file (atomically).
        plain: write only tensors llama.cpp's loader creates (it refuses files with extra tensors): no
            adapter and no ``bitmtp.scale.*`` tensors, so ternary weights keep only their fp16 block scales
            (bitmtp reads TQ2_0 back as ternary with those; Q4_0/F32-stored ones come back dense).
    """
    args = decoder.args
    if plain and adapter is not None:
        raise BitMTPError("plain=True writes no MTP adapter (llama.cpp refuses extra tensors); pass adapter=None")
    _check_destination(path)
    arch = get_family(args.family).gguf_arch
    if adapter is not None:
        config, tensors = adapter
        config.check_base(args)
        check_tensors(config, tensors)
    fields: dict[str, G.GGUFField] = {
        "general.name": G.field(name or f"bitmtp-{args.family}"),
        "general.quantization_version": G.field(GENERAL_QUANTIZATION_VERSION),
        G.KEY_FORMAT_VERSION: G.field(G.FORMAT_VERSION),
        G.KEY_MODEL_ARGS: G.field(json.dumps(args.to_dict())),
    }
    fields.update(_hyperparameters(args, arch))
    if tokenizer_fields:
        fields.update({k: v for k, v in tokenizer_fields.items() if k.startswith("tokenizer.")})
    elif tokenizer is not None:
        vocab_fields, why_not = ggml_tokenizer_fields(tokenizer, args.vocab_size)
        if why_not:
            log.warning("GGUF export: %s; llama.cpp-family readers will not find a vocabulary "
                        "(bitmtp still reads the tokenizer from %s)", why_not, G.KEY_TOKENIZER_FILES)
        fields.update({k: G.field(v) if not isinstance(v, G.GGUFField) else v for k, v in vocab_fields.items()})
    if tokenizer is not None:
        files = tokenizer_files(tokenizer)
        if files:
            fields[G.KEY_TOKENIZER_FILES] = G.field(json.dumps(files))
    if adapter is not None:
        fields.update({k: G.field(v) for k, v in G.speculative_metadata(adapter[0]).items()})
    state = decoder_state(decoder, blocks=True)
    n_tensors = len(state) + (0 if plain else sum(isinstance(v, _Ternary) for v in state.values())) + (
        len(adapter[1]) if adapter is not None else 0)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_tensors, desc=f"encoding {Path(path).name}", unit="tensor", leave=False)
    try:
        return G.write_gguf(path, arch, fields.items(), _tensors_out(args, state, adapter, not plain),
                            overwrite=overwrite, progress=(lambda _n: bar.update(1)) if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------

@dataclass
class GGUFModel:
    """What a GGUF file holds, as bitmtp objects."""

    decoder: Decoder
    adapter: tuple[AdapterConfig, dict[str, torch.Tensor]] | None
    contents: G.GGUFContents

    @property
    def tokenizer_files(self) -> dict[str, Any] | None:
        f = self.contents.fields.get(G.KEY_TOKENIZER_FILES)
        if f is None:
            return None
        where = f"{self.contents.path}: {G.KEY_TOKENIZER_FILES}"
        if not isinstance(f.value, str):
            raise FormatError(f"{where}: expected a JSON string, got {type(f.value).__name__}; re-export the file")
        try:
            return json.loads(f.value)
        except (ValueError, RecursionError) as exc:
            raise FormatError(f"{where} is not valid JSON ({exc}); re-export the file") from exc

    @property
    def tokenizer_fields(self) -> dict[str, G.GGUFField]:
        return {k: v for k, v in self.contents.fields.items() if k.startswith("tokenizer.")}


_MISSING = object()


def _gguf_real(value: Any, name: str) -> float:
    """A float metadata value: GGUF stores them as FLOAT32/FLOAT64, so an integer here means a corrupt type tag
    (a FLOAT32 epsilon read as UINT32 is ~10⁹), not a number to convert."""
    if not isinstance(value, float):
        raise FormatError(f"{name}: expected a FLOAT32 value, got {value!r} ({type(value).__name__})")
    return check_real(value, name)


def _meta(meta: dict[str, Any], key: str, src: str, check: Any, default: Any = _MISSING, **limits: Any) -> Any:
    """A metadata value checked by ``check`` (``check_int`` / ``check_real``); FormatError naming the key
    when it is missing (without a default), of the wrong type or out of range."""
    if key not in meta:
        if default is _MISSING:
            raise FormatError(f"{src}: missing metadata key {key!r}")
        return default
    try:
        return check(meta[key], key, **limits)
    except FormatError as exc:
        raise FormatError(f"{src}: metadata {exc}") from None


#: ``{arch}.*`` keys the export writes beside ``bitmtp.model_args``, and the ModelArgs field each restates
_RESTATED = {"block_count": "num_layers", "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
             "attention.head_count": "num_heads", "attention.head_count_kv": "num_kv_heads",
             "attention.key_length": "head_dim", "vocab_size": "vocab_size",
             "context_length": "max_position_embeddings"}
#: float keys (stored as float32)
_RESTATED_F32 = {"attention.layer_norm_rms_epsilon": "rms_norm_eps", "rope.freq_base": "rope_theta"}


def _args_from_json(meta: dict[str, Any], arch: str, family: str, src: str) -> ModelArgs:
    """ModelArgs from ``bitmtp.model_args``, cross-checked against the ``{arch}.*`` keys that restate it (what
    llama.cpp-family readers see): a corrupted digit in either shows as an inconsistency, not a different model."""
    key = G.KEY_MODEL_ARGS
    try:
        values = G.json_metadata(meta[key])
        if not isinstance(values, dict):
            raise FormatError(f"expected a JSON object, got {type(values).__name__}")
        fields = set(ModelArgs.__dataclass_fields__)
        required = {n for n, f in ModelArgs.__dataclass_fields__.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        unknown, missing = sorted(set(values) - fields), sorted(required - set(values))
        if unknown or missing:
            raise FormatError(f"unknown fields {unknown}, missing fields {missing}")
        args = ModelArgs(**values)
    except FormatError as exc:
        raise FormatError(f"{src}: metadata {key}: {exc}; re-export the file") from None
    if args.family != family:
        raise FormatError(f"{src}: inconsistent metadata: {key} says family {args.family!r}, "
                          f"general.architecture says {arch!r}")
    said = {f"{arch}.{k}": (getattr(args, f), _meta(meta, f"{arch}.{k}", src, check_int, None))
            for k, f in _RESTATED.items()}
    said.update({f"{arch}.{k}": (float(np.float32(getattr(args, f))),
                                 _meta(meta, f"{arch}.{k}", src, _gguf_real, None)) for k, f in _RESTATED_F32.items()})
    for k, (mine, theirs) in said.items():
        if theirs is not None and mine != theirs:
            raise FormatError(f"{src}: inconsistent metadata: {k} = {theirs!r} but {key} says {mine!r}; the file "
                              "is corrupt (re-export it)")
    return args


def args_from_gguf(contents: G.GGUFContents) -> ModelArgs:
    """ModelArgs from ``bitmtp.model_args`` when present, else from llama.cpp's hyperparameter keys.

    Every key read is checked for type and range (FormatError naming the key), and the vocabulary size
    against the embedding's rows.
    """
    meta, src = contents.meta, str(contents.path)
    arch = meta.get("general.architecture")
    fam = family_of_gguf_arch(arch) if isinstance(arch, str) else None
    if fam is None:
        raise FormatError(f"{src}: GGUF architecture (general.architecture) {arch!r} is not supported (supported: "
                          f"{', '.join(supported_gguf_archs())})")
    family = fam.name
    version = _meta(meta, G.KEY_FORMAT_VERSION, src, check_int, None)
    if version is not None and version > G.FORMAT_VERSION:
        raise FormatError(f"{src}: {G.KEY_FORMAT_VERSION} = {version} is newer than this bitmtp reads "
                          f"({G.FORMAT_VERSION}); upgrade bitmtp")
    if G.KEY_MODEL_ARGS in meta:
        args = _args_from_json(meta, arch, family, src)
    else:
        args = _args_from_keys(meta, arch, family, contents, src)
    embed = contents.tensors.get("token_embd.weight")
    if embed is not None and len(embed.shape) == 2 and embed.shape[0] != args.vocab_size:
        raise FormatError(f"{src}: tensor 'token_embd.weight' has {embed.shape[0]} rows but the metadata says the "
                          f"vocabulary has {args.vocab_size} tokens; the file is inconsistent (re-export it)")
    return args


def _args_from_keys(meta: dict[str, Any], arch: str, family: str, contents: G.GGUFContents, src: str) -> ModelArgs:
    def key(name: str, check: Any = check_int, default: Any = _MISSING, **limits: Any) -> Any:
        return _meta(meta, f"{arch}.{name}", src, check, default, **limits)

    heads = key("attention.head_count")
    hidden = key("embedding_length")
    embed = contents.tensors.get("token_embd.weight")
    vocab = key("vocab_size", default=None)
    if vocab is None and "tokenizer.ggml.tokens" in meta:
        tokens = meta["tokenizer.ggml.tokens"]
        if not isinstance(tokens, list):
            raise FormatError(f"{src}: metadata tokenizer.ggml.tokens: expected an array of strings, "
                              f"got {type(tokens).__name__}")
        vocab = len(tokens)
    if vocab is None and embed is not None:
        vocab = embed.shape[0]
    token_id = dict(minimum=0)
    eos = _meta(meta, "tokenizer.ggml.eos_token_id", src, check_int, None, **token_id)
    config = {
        "model_type": family,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", default=heads),
        "head_dim": key("attention.key_length", default=None) or key("rope.dimension_count", default=None)
        or hidden // heads,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", _gguf_real, 1e-6),
        "rope_theta": key("rope.freq_base", _gguf_real, 10000.0),
        "max_position_embeddings": key("context_length", default=4096),
        "tie_word_embeddings": "output.weight" not in contents.tensors,
        "attention_bias": "blk.0.attn_q.bias" in contents.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in contents.tensors,
        "bos_token_id": _meta(meta, "tokenizer.ggml.bos_token_id", src, check_int, None, **token_id),
        "eos_token_id": eos,
    }
    return ModelArgs.from_hf_config(config, source=src)  # hidden_act: the family's default


def _is_ternary(contents: G.GGUFContents, name: str) -> bool:
    t = contents.tensors[name]
    return t.type_name in ("TQ1_0", "TQ2_0") or G.scale_name(name) in contents.tensors


def _file_blocks(t: G.GGUFTensor, heads: int | None) -> BlockWeight | None:
    """A 2-D Q4_0 / Q4_1 / Q8_0 (or F16 / BF16) tensor as a :class:`BlockWeight` over the file's memory map (no
    copy; the q/k rows llama.cpp permutes are put back in order, a copy of those few rows' bytes); None for
    other tensors.
    The decoder's CPU kernels read these blocks (``build_decoder`` keeps them as lazy weights) instead of
    re-fitting them to dequantized floats (``ggml_blocks.pack_lossless``, ~2 s of SmolLM2's load)."""
    fmt = t.type_name.lower()
    if fmt not in BLOCK_BYTES or len(t.shape) != 2:
        return None
    raw = t.data
    if fmt in HALF_FORMATS:  # F16 / BF16 rows: kept as they lie when K is a multiple of 32 (else float32)
        if t.shape[1] % BLOCK or (raw.dtype != np.uint8 and not raw.dtype.isnative):
            return None
        raw = raw.view(np.uint8)  # F16 arrives typed over the map: its bytes, [N, 2K]
    data = torch.from_numpy(raw)  # uint8 [N, K / 32 · bytes per block], writable (a copy-on-write map)
    if heads is not None:
        data = G.unpermute_rows(data, heads)
    return BlockWeight(fmt, data.contiguous(), (t.shape[0], t.shape[1]))


def read_model(path: str | Path, **build_kwargs: Any) -> GGUFModel:
    """Read a GGUF file into a decoder (+ its packed adapter). ``build_kwargs`` go to ``build_decoder``.

    The file is parsed once (``formats.gguf.read_gguf``: a memory map, the header checked against its size,
    so a truncated or misaligned file is a FormatError here, never a SIGBUS later). Q4_0 / Q4_1 / Q8_0 dense
    weights stay the file's blocks (:func:`_file_blocks`) and, for a float32 load, nothing else: the CPU kernels
    read them, the embedding lookup dequantizes the rows it needs, and no float copy exists unless a float path
    asks for one (``model.layers.LazyWeight``). Every tensor is checked for Inf/NaN on its smallest representation
    (``formats.gguf.check_finite``: the float16 scales of block types, float tensors as stored) before it is
    decoded. On SmolLM2-135M Q4_1 (210 Q4_1 + 1 Q8_0 + 61 F32 tensors, 98 MB): the parse ~0.05 s, the checks
    ~0.1 s, concatenating the fused q/k/v and gate/up blocks a few tens of ms; dequantizing to float32 (~0.5 s
    and ~540 MB, what this load did before) no longer happens.
    """
    contents = G.read_gguf(path)
    src = str(contents.path)
    args = args_from_gguf(contents)
    family = get_family(args.family)
    hf: dict[str, torch.Tensor | BlockWeight] = {}
    mtp: dict[str, torch.Tensor] = {}
    for name, t in contents.tensors.items():
        G.check_finite(t, src)
        if name in contents.extents:  # the check read every page (block scales are in every page): give them back,
            contents.release([name])  # a step faults the ones it reads back in (the page cache has them)
    for name, t in contents.tensors.items():
        if name.startswith(G.SCALE_PREFIX):
            if G.weight_of_scale(name) not in contents.tensors:
                raise FormatError(f"{src}: scale tensor {name!r} has no weight tensor")
            continue
        if name.startswith((G.MTP_PREFIX, G.DIVINE_MTP_PREFIX)):
            mtp[name] = G.dense_tensor(t)
            continue
        if name in G.IGNORED_TENSORS:
            continue
        target = family.hf_name(name)
        if target is None:
            raise FormatError(f"{src}: unexpected tensor {name!r} (type {t.type_name}) for a {args.family} model")
        heads = family.qk_permute_heads(args, target)
        if target.endswith("_proj.weight") and _is_ternary(contents, name):
            if len(t.shape) != 2:
                raise FormatError(f"{src}: ternary tensor {name!r} must be 2-D, has shape {t.shape}")
            exact = contents.tensors.get(G.scale_name(name))
            exact_scales = None if exact is None else G.dense_tensor(exact).to(torch.float32)
            words, scales, _group = G.decode_ternary_t2(t.data, t.type_name, t.shape[0], t.shape[1], name,
                                                         exact_scales)
            if heads is not None:  # rows are independent in T2 words as in codes
                words = G.unpermute_rows(words, heads)
                scales = G.unpermute_rows(scales, heads) if scales.shape[0] > 1 else scales
            hf[target] = words.contiguous()
            hf[target.replace(".weight", ".weight_scale")] = scales.contiguous()
            continue
        bw = _file_blocks(t, heads)
        if bw is not None:  # the file's blocks as they lie (rows unpermuted): build_decoder keeps them as they are
            hf[target] = bw
            continue
        value = G.dense_tensor(t)
        if heads is not None:
            value = G.unpermute_rows(value, heads)
        hf[target] = value
    build_kwargs.setdefault("linear_class", "bitlinear")
    decoder = build_decoder(args, hf, source=src, **build_kwargs)
    del hf  # the parts' blocks: fused or permuted ones are copies now
    adapter = G.adapter_from_gguf(contents.meta, mtp, BaseShape.of(args), src)
    _release_copied(contents, decoder)
    return GGUFModel(decoder, adapter, contents)


def _release_copied(contents: G.GGUFContents, decoder: Decoder) -> None:
    """Give back the resident pages of every tensor the decoder does not read from the file's map (its data
    was converted or copied: norms, fused q/k/v and gate/up, permuted rows, ternary codes). Only blocks used
    as they lie (o_proj, down_proj, the embedding / LM head on SmolLM2) stay mapped-in. On SmolLM2-135M Q4_1
    this takes ~60 MB off the peak RSS: the file's pages that loading read once and nothing reads again."""
    if contents.buffer is None or not contents.extents:
        return
    base = np.frombuffer(contents.buffer, dtype=np.uint8, count=1).ctypes.data
    used = sorted([m.blocks.data.data_ptr() for m in decoder.modules()
                   if isinstance(m, DenseLinear) and m.blocks is not None]
                  + ([decoder.embed_blocks.data.data_ptr()] if decoder.embed_blocks is not None else []))
    kept = set()
    for name, (start, n) in contents.extents.items():
        lo = base + start
        at = bisect.bisect_left(used, lo)
        if at < len(used) and used[at] < lo + n:
            kept.add(name)
    contents.release(name for name in contents.extents if name not in kept)


__all__ = ["export_gguf", "read_model", "args_from_gguf", "decoder_state", "GGUFModel"]
