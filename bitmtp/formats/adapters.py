"""MTP adapter files: what makes a base model MTP-capable, stored apart from the base.

An adapter is a folder with two files:

* ``adapter_config.json`` — kind, block size D, rank, targets, discount γ, and the base model's
  architecture and shape (so an adapter is never applied to a model it was not made for);
* ``adapter.safetensors`` — the tensors, named by kind:

  ``mask-block`` (a learned mask-token embedding + gated LoRA acting only on mask rows):
    ``mask_embedding [hidden]``, and for each layer i and target t in ``targets``:
    ``layers.{i}.{t}.lora_A [rank, in_t]`` and ``layers.{i}.{t}.lora_B [out_t, rank]``.

  ``heads`` (Divine recurrent residual draft heads sharing the LM head):
    for each head k < D − 1: ``heads.{k}.down [rank, 2·hidden]``, ``heads.{k}.up [hidden, rank]``,
    ``heads.{k}.norm [hidden]``.

Writes are atomic: both files go to a temporary folder beside the target, which is renamed into
place; an existing adapter is replaced only with ``overwrite=True``. Nothing half-written is left.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from bitmtp.errors import BitMTPError, FormatError, ShapeError
from bitmtp.formats.scales import check_finite

CONFIG_FILE = "adapter_config.json"
TENSOR_FILE = "adapter.safetensors"
KINDS = ("mask-block", "heads")
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
FORMAT_VERSION = 1
#: a family name (the registry, ``bitmtp.model.families``, sits above this file layer: the base model's
#: family is matched against it when the adapter is attached, ``AdapterConfig.check_base``)
_FAMILY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_MAX_SIZE = 2**31 - 1


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _int_field(value: Any, name: str, lo: int = 1, hi: int = _MAX_SIZE) -> int:
    """``value`` as an int in ``[lo, hi]``; FormatError naming the field otherwise (a string "8" is not 8:
    it would load and fail later, far from the file)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FormatError(f"{name}: expected an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise FormatError(f"{name}: must be in {lo}..{hi}, got {value}")
    return int(value)


def _real_field(value: Any, name: str, lo: float = 0.0, hi: float = math.inf) -> float:
    """``value`` as a finite float in ``(lo, hi]``; FormatError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FormatError(f"{name}: expected a number, got {_show(value)}")
    if not math.isfinite(value) or not lo < value <= hi:
        bound = f"({lo}, {hi}]" if math.isfinite(hi) else f"finite and > {lo}"
        raise FormatError(f"{name}: must be {bound}, got {value}")
    return float(value)


@dataclass
class BaseShape:
    """The base model an adapter was made for."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.family, str) or not _FAMILY_NAME.fullmatch(self.family):
            raise FormatError(f"base.family: expected a model family name such as 'llama', got {_show(self.family)}")
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "vocab_size"):
            setattr(self, name, _int_field(getattr(self, name), f"base.{name}"))

    @classmethod
    def of(cls, args: Any) -> BaseShape:
        """From a :class:`bitmtp.model.ModelArgs` (or anything with the same fields)."""
        return cls(args.family, args.hidden_size, args.intermediate_size, args.num_layers, args.num_heads,
                   args.num_kv_heads, args.head_dim, args.vocab_size)

    def target_shape(self, target: str) -> tuple[int, int]:
        """(in_features, out_features) of a projection target."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i),
                "down": (i, h)}[target]


@dataclass
class AdapterConfig:
    kind: str
    block_size: int
    rank: int
    base: BaseShape
    targets: list[str] = field(default_factory=lambda: list(TARGETS))
    discount_gamma: float = 0.8
    lora_alpha: float | None = None
    version: int = FORMAT_VERSION
    #: weight fingerprint of the base model (``bitmtp.model.adapters.base_fingerprint``): lets
    #: ``bitmtp.load`` attach a shipped adapter only to the exact model it was trained on
    fingerprint: str | None = None
    #: provenance written by the trainer: data, steps, tokens, minutes, machine, losses
    training: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.base, dict):
            fields = set(BaseShape.__dataclass_fields__)
            unknown, missing = sorted(set(self.base) - fields), sorted(fields - set(self.base))
            if unknown or missing:
                raise FormatError(f"base: {'unknown fields ' + str(unknown) if unknown else ''}"
                                  f"{' and ' if unknown and missing else ''}"
                                  f"{'missing fields ' + str(missing) if missing else ''}; expected {sorted(fields)}")
            self.base = BaseShape(**self.base)
        elif not isinstance(self.base, BaseShape):
            raise FormatError(f"base: expected an object with the base model's shape, got {_show(self.base)}")
        if not isinstance(self.kind, str) or self.kind not in KINDS:
            raise FormatError(f"kind: expected one of {KINDS}, got {self.kind!r}")
        self.block_size = _int_field(self.block_size, "block_size (D)", 2, 16)
        self.rank = _int_field(self.rank, "rank")
        if not isinstance(self.targets, (list, tuple)) or not all(isinstance(t, str) for t in self.targets):
            raise FormatError(f"targets: expected a list of names from {TARGETS}, got {_show(self.targets)}")
        self.targets = list(self.targets)
        if self.kind == "mask-block":
            bad = [t for t in self.targets if t not in TARGETS]
            # an empty list is a mask embedding without LoRA: the adapter of a ``full`` fine-tune, whose
            # mask rows run the (fine-tuned) base weights themselves
            if bad or len(set(self.targets)) != len(self.targets):
                raise FormatError(f"targets: expected distinct names from {TARGETS}, got {self.targets}")
        self.discount_gamma = _real_field(self.discount_gamma, "discount_gamma", 0.0, 1.0)
        if self.lora_alpha is not None:
            self.lora_alpha = _real_field(self.lora_alpha, "lora_alpha")
        self.version = _int_field(self.version, "version", 1, _MAX_SIZE)
        if self.version > FORMAT_VERSION:
            raise FormatError(f"version: format version {self.version} is newer than this bitmtp reads "
                              f"({FORMAT_VERSION}); upgrade bitmtp")
        if self.fingerprint is not None and not isinstance(self.fingerprint, str):
            raise FormatError(f"fingerprint: expected a string or null, got {_show(self.fingerprint)}")
        if self.training is not None and not isinstance(self.training, dict):
            raise FormatError(f"training: expected an object or null, got {_show(self.training)}")

    @property
    def num_heads(self) -> int:
        """Draft heads of a ``heads`` adapter: one per drafted token after d_1."""
        return self.block_size - 1

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        b = self.base
        if self.kind == "mask-block":
            shapes: dict[str, tuple[int, ...]] = {"mask_embedding": (b.hidden_size,)}
            for i in range(b.num_layers):
                for t in self.targets:
                    fin, fout = b.target_shape(t)
                    shapes[f"layers.{i}.{t}.lora_A"] = (self.rank, fin)
                    shapes[f"layers.{i}.{t}.lora_B"] = (fout, self.rank)
            return shapes
        shapes = {}
        for k in range(self.num_heads):
            shapes[f"heads.{k}.down"] = (self.rank, 2 * b.hidden_size)
            shapes[f"heads.{k}.up"] = (b.hidden_size, self.rank)
            shapes[f"heads.{k}.norm"] = (b.hidden_size,)
        return shapes

    def check_base(self, args: Any) -> None:
        """Raise naming the first field where ``args`` differs from the adapter's base."""
        mine, theirs = asdict(self.base), asdict(BaseShape.of(args))
        for key, val in mine.items():
            if theirs[key] != val:
                raise FormatError(f"adapter base.{key}: made for {val!r}, the model has {theirs[key]!r}")


def check_tensors(config: AdapterConfig, tensors: dict[str, torch.Tensor], source: str = "adapter") -> None:
    expected = config.expected_shapes()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise FormatError(f"{source}: missing tensor {missing[0]!r}{more}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise FormatError(f"{source}: unexpected tensor {extra[0]!r} for a {config.kind} adapter")
    for name, shape in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ShapeError(f"{source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape} "
                             f"(block_size={config.block_size}, rank={config.rank})")
        if not t.is_floating_point():
            raise FormatError(f"{source}: tensor {name!r} must be floating point, got {t.dtype}")
        check_finite(t, f"{source}: tensor {name!r}")


def save_adapter(path: str | Path, config: AdapterConfig, tensors: dict[str, torch.Tensor], *,
                 overwrite: bool = False) -> Path:
    """Write an adapter folder atomically (temporary folder, then rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    check_tensors(config, tensors, source="tensors")
    if path.exists() and not overwrite:
        raise BitMTPError(f"{path}: already exists; pass overwrite=True to replace it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / TENSOR_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(asdict(config), indent=2))
        # mkdtemp makes the folder private (0700): give the adapter ordinary permissions
        os.chmod(tmp, 0o755)
        for f in (TENSOR_FILE, CONFIG_FILE):
            os.chmod(tmp / f, 0o644)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old.", dir=path.parent))
            os.replace(path, old / "adapter")
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def adapter_config_from_dict(raw: Any, source: str) -> AdapterConfig:
    """An :class:`AdapterConfig` from parsed JSON, every field checked: FormatError naming ``source`` and the
    field (wrong type, out of range, unknown or missing) otherwise."""
    if not isinstance(raw, dict):
        raise FormatError(f"{source}: expected a JSON object of adapter fields (kind, block_size, rank, base, ...), "
                          f"got {type(raw).__name__}")
    fields = set(AdapterConfig.__dataclass_fields__)
    required = {"kind", "block_size", "rank", "base"}
    try:
        if "version" in raw:  # first, so a newer file's new fields get the "upgrade bitmtp" message
            v = _int_field(raw["version"], "version", 1, _MAX_SIZE)
            if v > FORMAT_VERSION:
                raise FormatError(f"format version {v} is newer than this bitmtp reads ({FORMAT_VERSION}); "
                                  "upgrade bitmtp")
        unknown, missing = sorted(set(raw) - fields), sorted(required - set(raw))
        if unknown:
            raise FormatError(f"unknown field(s) {unknown}; an adapter config has {sorted(fields)}")
        if missing:
            raise FormatError(f"missing field(s) {missing}")
        return AdapterConfig(**raw)
    except FormatError as exc:
        raise FormatError(f"{source}: {exc}") from None


def load_adapter(path: str | Path) -> tuple[AdapterConfig, dict[str, torch.Tensor]]:
    """Read and validate an adapter folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    cfg_path, tensor_path = path / CONFIG_FILE, path / TENSOR_FILE
    if not cfg_path.is_file() or not tensor_path.is_file():
        raise FormatError(f"{path}: not an adapter folder (needs {CONFIG_FILE} and {TENSOR_FILE})")
    try:
        raw = json.loads(cfg_path.read_bytes())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, a 5000-digit number
        raise FormatError(f"{cfg_path}: not valid JSON ({exc}); rewrite it or save the adapter again") from exc
    config = adapter_config_from_dict(raw, str(cfg_path))
    try:
        tensors = load_file(str(tensor_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise FormatError(f"{tensor_path}: cannot read safetensors file ({exc}); truncated or corrupt?") from exc
    check_tensors(config, tensors, source=str(tensor_path))
    return config, tensors
