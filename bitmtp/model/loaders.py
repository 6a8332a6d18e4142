"""Build a :class:`Decoder` from a checkpoint: an HF safetensors folder, a live transformers model,
or (through ``bitmtp.model.gguf_io``, bitmtp's own GGUF reader) a GGUF file. The tensors a layer needs
come from the family registry (``bitmtp.model.families``): its projections and its norm slots.

Linear weights become :class:`TernaryLinear` when the checkpoint is ternary (BitNet packed uint8
+ ``weight_scale``) or when ``quantize="ternary"`` asks for absmean ternarization; otherwise they
stay dense. Embeddings and the LM head always stay dense (tied when the config says so: one
tensor, no copy).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from bitmtp.errors import BitMTPError, FormatError, ShapeError
from bitmtp.formats.bitnet import LINEAR_CLASSES, bitnet_scale_to_multiplier, bitnet_to_t2
from bitmtp.formats.ggml_blocks import BLOCK, HALF_FORMATS, BlockWeight, dequantize, from_half
from bitmtp.formats.quantize import absmean_ternarize
from bitmtp.formats.scales import check_finite
from bitmtp.formats.ternary import pack_t2, words_per_row
from bitmtp.model.args import ModelArgs
from bitmtp.model.decoder import MLP, Attention, Decoder, Layer
from bitmtp.model.families import NORM_NAMES, get_family, norm_size
from bitmtp.model.layers import DenseLinear, LazyWeight
from bitmtp.ops import TernaryLinear

QUANTIZE_MODES = (None, "ternary")
#: Tensors some checkpoints carry that the decoder recomputes.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class _Tensors:
    """Checkpoint tensors by name, tracking which were used (so extras can be reported)."""

    def __init__(self, tensors: dict[str, torch.Tensor | BlockWeight], source: str):
        self.t = {k: v for k, v in tensors.items() if not k.endswith(IGNORED_SUFFIXES)}
        self.source = source
        self.used: set[str] = set()
        self._last: tuple[str, torch.Tensor] | None = None  # the latest dequantized block weight

    def has(self, name: str) -> bool:
        return name in self.t

    def blocks(self, name: str) -> BlockWeight | None:
        """The tensor as blocks the CPU kernels read: a GGUF file's blocks, or a bfloat16 / float16 CPU matrix as
        ``bf16`` / ``f16`` rows (widening is exact: the same results as its float32 copy, half the bytes). A
        copy of the half tensor: a live model handed to ``bitmtp.load`` may change its own weights later."""
        x = self.t.get(name)
        if isinstance(x, BlockWeight):
            return x
        if isinstance(x, torch.Tensor) and x.dtype in HALF_FORMATS.values() and x.dim() == 2 \
                and x.device.type == "cpu" and x.shape[1] % BLOCK == 0:
            return from_half(x.detach().clone())
        return None

    def get(self, name: str, shape: tuple[int, ...] | None = None, floating: bool = False) -> torch.Tensor:
        if name not in self.t:
            raise FormatError(f"{self.source}: missing tensor {name!r}")
        x = self.t[name]
        if isinstance(x, BlockWeight):  # dequantized when asked for (only the latest one is kept here), so
            if self._last is None or self._last[0] != name:  # each part's float32 copy lives only until fused
                self._last = (name, dequantize(x))
            x = self._last[1]
        if floating and not x.is_floating_point():  # an integer tensor would load as its integers, silently
            raise FormatError(f"{self.source}: tensor {name!r} has dtype {x.dtype}; a float tensor is expected "
                              "(the file's header and data disagree, or this is not a checkpoint of this model)")
        if shape is not None and tuple(x.shape) != tuple(shape):
            raise ShapeError(f"{self.source}: tensor {name!r} has shape {tuple(x.shape)}, expected {tuple(shape)}")
        self.used.add(name)
        return x

    def check_all_used(self) -> None:
        extra = sorted(set(self.t) - self.used)
        if extra:
            more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
            raise FormatError(f"{self.source}: unexpected tensors {extra[:5]}{more}; is this the right architecture?")


def _linear(ts: _Tensors, prefix: str, n: int, k: int, *, bias: bool, quantize: str | None, dtype: torch.dtype,
            backend: str | None, linear_class: str):
    w = ts.get(prefix + ".weight")
    b = None
    if bias:
        ternary = quantize is not None or w.dtype in (torch.uint8, torch.int32)
        b = ts.get(prefix + ".bias", (n,), floating=True).to(torch.float32 if ternary else dtype)
    if w.dtype == torch.uint8:  # BitNet packed: [ceil(N/4), K] + weight_scale
        if tuple(w.shape) != (-(-n // 4), k):
            raise ShapeError(f"{ts.source}: packed tensor {prefix + '.weight'!r} has shape {tuple(w.shape)}, "
                             f"expected {(-(-n // 4), k)}")
        scale = ts.get(prefix + ".weight_scale", floating=True)
        packed, scales = bitnet_to_t2(w, scale, out_features=n, linear_class=linear_class)
        return TernaryLinear(k, n, packed, scales, bias=b, backend=backend)
    if w.dtype == torch.int32:  # T2 words (GGUF ternary, see model/gguf_io.py) + float32 [N_s, n_groups] scales
        if tuple(w.shape) != (n, words_per_row(k)):
            raise ShapeError(f"{ts.source}: T2 tensor {prefix + '.weight'!r} has shape {tuple(w.shape)}, "
                             f"expected {(n, words_per_row(k))}")
        scale = ts.get(prefix + ".weight_scale", floating=True).to(torch.float32).contiguous()
        return TernaryLinear(k, n, w.contiguous(), scale, bias=b, backend=backend)
    if tuple(w.shape) != (n, k):
        raise ShapeError(f"{ts.source}: tensor {prefix + '.weight'!r} has shape {tuple(w.shape)}, expected {(n, k)}")
    ts.get(prefix + ".weight", floating=True)
    if ts.has(prefix + ".weight_scale"):  # AutoBitLinear offline: ternary float weights times weight_scale
        scale = ts.get(prefix + ".weight_scale", floating=True)
        packed = pack_t2(w.float())
        return TernaryLinear(k, n, packed, bitnet_scale_to_multiplier(scale, "autobitlinear"), bias=b, backend=backend)
    if quantize == "ternary":
        q, scales = absmean_ternarize(w.float(), "tensor")
        return TernaryLinear(k, n, pack_t2(q), scales, bias=b, backend=backend)
    return DenseLinear(w.to(dtype), b, backend=backend)


def build_decoder(args: ModelArgs, tensors: dict[str, torch.Tensor | BlockWeight], *, source: str,
                  quantize: str | None = None, dtype: torch.dtype = torch.float32, backend: str | None = None,
                  linear_class: str = "bitlinear", max_positions: int | None = None) -> Decoder:
    """Assemble a decoder from HF-named tensors (``model.layers.{i}.self_attn.q_proj.weight``, …).

    A dense weight may come as a :class:`~bitmtp.formats.ggml_blocks.BlockWeight` (a GGUF file's Q4_0 / Q4_1 /
    Q8_0 tensor as it lies in the file). For a float32 model it stays those blocks (:class:`LazyWeight`): the
    projection (fused q/k/v and gate/up: the parts' blocks concatenated), the embedding and the LM head hold no
    float copy, the CPU kernels read the blocks, and a float path dequantizes a weight when it first asks for it.
    Other dtypes and ``quantize="ternary"`` dequantize at build. Float dense projections are fitted by
    ``DenseLinear.pack_blocks`` where a block encoding is lossless; ``BITMTP_DENSE_BLOCKS=0`` keeps every dense
    projection on float32 weights and kernels (blocks dequantized at build).
    """
    if quantize not in QUANTIZE_MODES:
        raise BitMTPError(f"quantize: expected one of {QUANTIZE_MODES}, got {quantize!r}")
    ts = _Tensors(tensors, source)
    a = args
    h = a.hidden_size
    use_blocks = os.environ.get("BITMTP_DENSE_BLOCKS", "").strip() != "0"
    # blocks and half rows stay as they are for a float32 build: the embedding and LM head always, the dense
    # projections unless quantize= turns them ternary
    lazy_ok = use_blocks and dtype == torch.float32

    def lazy(name: str, shape: tuple[int, int]) -> LazyWeight | None:
        """The tensor as a lazy weight where it is blocks this build keeps, else None."""
        bw = ts.blocks(name) if lazy_ok else None
        if bw is None:
            return None
        if tuple(bw.shape) != tuple(shape):
            raise ShapeError(f"{ts.source}: tensor {name!r} has shape {tuple(bw.shape)}, expected {tuple(shape)}")
        ts.used.add(name)
        return LazyWeight(bw)

    def vec(name: str, size: int) -> torch.Tensor:
        return ts.get(name, (size,), floating=True).to(dtype)

    def lin(prefix: str, n: int, k: int, bias: bool = False):
        src = None if quantize is not None or ts.has(prefix + ".weight_scale") else lazy(prefix + ".weight", (n, k))
        if src is not None:
            b = ts.get(prefix + ".bias", (n,), floating=True).to(dtype) if bias else None
            return DenseLinear(None, b, backend=backend, blocks=src)
        return _linear(ts, prefix, n, k, bias=bias, quantize=quantize, dtype=dtype, backend=backend,
                       linear_class=linear_class)

    embed_src = lazy("model.embed_tokens.weight", (a.vocab_size, h))
    embed = embed_src if embed_src is not None else \
        ts.get("model.embed_tokens.weight", (a.vocab_size, h), floating=True).to(dtype)
    slots = get_family(a.family).layer_norms
    layers = []
    for i in range(a.num_layers):
        p = f"model.layers.{i}."
        ab = a.attention_bias
        qkv = [lin(p + "self_attn.q_proj", a.q_size, h, ab), lin(p + "self_attn.k_proj", a.kv_size, h, ab),
               lin(p + "self_attn.v_proj", a.kv_size, h, ab)]
        attn = Attention(a, *qkv, lin(p + "self_attn.o_proj", h, a.q_size, ab))
        gate_up = [lin(p + "mlp.gate_proj", a.intermediate_size, h, a.mlp_bias),
                   lin(p + "mlp.up_proj", a.intermediate_size, h, a.mlp_bias)]
        mlp = MLP(a, *gate_up, lin(p + "mlp.down_proj", h, a.intermediate_size, a.mlp_bias))
        del qkv, gate_up  # the parts' float weights (if any) go as soon as their fused copy exists
        norms = {n: vec(p + NORM_NAMES[n][0], norm_size(n, a)) for n in slots}
        layers.append(Layer(a, attn, mlp, norms))
    norm = vec("model.norm.weight", h)
    if a.tie_word_embeddings:
        if ts.has("lm_head.weight") and lazy("lm_head.weight", (a.vocab_size, h)) is None:
            ts.get("lm_head.weight", (a.vocab_size, h), floating=True)  # some tied checkpoints store it anyway
        # one weight for both: the lazy blocks (one float tensor if it is ever made) or the float embedding
        head = DenseLinear(None, backend=backend, blocks=embed) if isinstance(embed, LazyWeight) else \
            DenseLinear(embed, backend=backend)
    else:
        head_src = lazy("lm_head.weight", (a.vocab_size, h))
        head = DenseLinear(None, backend=backend, blocks=head_src) if head_src is not None else \
            DenseLinear(ts.get("lm_head.weight", (a.vocab_size, h), floating=True).to(dtype), backend=backend)
    ts.check_all_used()
    decoder = Decoder(a, embed, layers, norm, head, max_positions=max_positions)
    decoder.backend = backend
    if use_blocks:  # lossless only: a float checkpoint keeps float32 kernels
        for mod in decoder.modules():
            if isinstance(mod, DenseLinear) and mod.blocks is None:
                mod.pack_blocks()
        decoder.invalidate_native()
    return decoder


def _linear_class(config: dict[str, Any], source: str = "config") -> str:
    qc = config.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise FormatError(f"{source}: quantization_config: expected an object, got {qc!r}")
    if qc.get("quant_method") != "bitnet":
        return "bitlinear"
    cls = qc.get("linear_class", "bitlinear")
    if cls not in LINEAR_CLASSES:
        raise FormatError(f"{source}: quantization_config.linear_class: expected one of {LINEAR_CLASSES}, got {cls!r}")
    return cls


def check_finite_tensors(tensors: dict[str, torch.Tensor], source: str) -> None:
    """FormatError naming the first tensor holding Inf or NaN: one pass per floating tensor as stored
    (float16/bfloat16 are not widened; BitNet's packed uint8 codes are skipped, their float
    ``weight_scale`` is checked). On SmolLM2-sized checkpoints this is a small fraction of the load
    (see ``formats.scales.check_finite``)."""
    for name, t in tensors.items():
        check_finite(t, f"{source}: tensor {name!r}")


def from_transformers(model: Any, **kwargs: Any) -> Decoder:
    """Convert a live transformers ``*ForCausalLM`` (Llama, Qwen3, BitNet) to a bitmtp decoder.

    Dense weights are converted once (a copy in ``dtype``; with the model's own dtype and device
    torch may return the same storage). Ternary BitNet weights are repacked to T2.
    """
    config = model.config.to_dict()
    source = type(model).__name__
    args = ModelArgs.from_hf_config(config, source=source)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    check_finite_tensors(state, source)
    kwargs.setdefault("linear_class", _linear_class(config, source))
    return build_decoder(args, state, source=type(model).__name__, **kwargs)


def read_safetensors_dir(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``config.json`` and every ``*.safetensors`` tensor of an HF checkpoint folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FormatError(f"{path}: no config.json (is this a Hugging Face checkpoint folder?)")
    try:
        config = json.loads(cfg_path.read_bytes())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit number
        raise FormatError(f"{cfg_path}: not valid JSON ({exc}); restore the checkpoint's config.json") from exc
    if not isinstance(config, dict):
        raise FormatError(f"{cfg_path}: expected a JSON object of model hyperparameters (as transformers' "
                          f"save_pretrained writes), got {type(config).__name__}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FormatError(f"{path}: no *.safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            part = load_file(str(f))
        except (SafetensorError, OSError, ValueError, RuntimeError, TypeError) as exc:
            raise FormatError(f"{f}: cannot read safetensors file ({exc}); truncated or corrupt? "
                              "Re-download the checkpoint") from exc
        dup = sorted(set(part) & set(tensors))
        if dup:
            raise FormatError(f"{f}: tensor {dup[0]!r} also appears in another *.safetensors file of {path}")
        check_finite_tensors(part, str(f))
        tensors.update(part)
    return config, tensors


def from_safetensors_dir(path: str | Path, **kwargs: Any) -> Decoder:
    path = Path(path)
    config, tensors = read_safetensors_dir(path)
    args = ModelArgs.from_hf_config(config, source=str(path / "config.json"))
    kwargs.setdefault("linear_class", _linear_class(config, str(path / "config.json")))
    return build_decoder(args, tensors, source=str(path), **kwargs)
