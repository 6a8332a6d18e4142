"""``ModelArgs``: the shape and numerics of a decoder, read from a Hugging Face config.

Every field is checked for type and range when a ``ModelArgs`` is made (from a ``config.json``, a live
transformers config, a GGUF file's metadata or ``bitmtp.model_args``): a wrong-typed or out-of-range value
raises a FormatError naming the field and what it should be, never a ValueError from ``int()`` later and
never a model that loads with silently wrong numerics (a ``"false"`` string read as True, a NaN epsilon).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any

from bitmtp.errors import FormatError
from bitmtp.model import families

ROPE_TYPES = ("default", "llama3")
#: sizes index int32 buffers in the kernels
MAX_SIZE = 2**31 - 1
_POSITIVE_INTS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "max_position_embeddings")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


def _type(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(value: Any, name: str, minimum: int = 1, maximum: int = MAX_SIZE) -> int:
    """``value`` as an int in ``[minimum, maximum]``, else FormatError naming ``name`` (bools are not ints)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise FormatError(f"{name}: expected an integer, got {_type(value)}; write it as a JSON number")
    if not minimum <= value <= maximum:
        raise FormatError(f"{name}: must be in [{minimum}, {maximum}], got {value}")
    return int(value)


def check_real(value: Any, name: str) -> float:
    """``value`` as a finite positive float, else FormatError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise FormatError(f"{name}: expected a number, got {_type(value)}; write it as a JSON number")
    if not math.isfinite(value) or value <= 0:
        raise FormatError(f"{name}: must be finite and positive, got {value}")
    return float(value)


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise FormatError(f"{name}: expected true or false, got {_type(value)}")
    return value


def check_rope_scaling(scaling: Any, name: str = "rope_scaling") -> dict[str, Any] | None:
    """A validated copy of a RoPE scaling dict (None for no scaling); ``rope_type`` is filled in."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise FormatError(f"{name}: expected an object such as {{\"rope_type\": \"llama3\", \"factor\": 8.0, ...}} "
                          f"or null, got {_type(scaling)}")
    out = dict(scaling)
    rope_type = out.setdefault("rope_type", out.get("type", "default"))
    if not isinstance(rope_type, str) or rope_type not in ROPE_TYPES:
        raise FormatError(f"{name}: rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "llama3":
        if "factor" not in out:
            raise FormatError(f"{name}: llama3 scaling needs a 'factor'")
        out["factor"] = check_real(out["factor"], f"{name}.factor")
        low = out["low_freq_factor"] = check_real(out.get("low_freq_factor", 1.0), f"{name}.low_freq_factor")
        high = out["high_freq_factor"] = check_real(out.get("high_freq_factor", 4.0), f"{name}.high_freq_factor")
        if high <= low:
            raise FormatError(f"{name}: high_freq_factor ({high}) must exceed low_freq_factor ({low})")
        out["original_max_position_embeddings"] = check_int(out.get("original_max_position_embeddings", 8192),
                                                            f"{name}.original_max_position_embeddings")
    return out


@dataclass
class ModelArgs:
    """Everything the decoder needs to know about a checkpoint.

    ``family`` names an entry of the family registry (``bitmtp.model.families``: llama, qwen3, bitnet,
    and any registered later), which says what its layers compute (:attr:`layer_spec`); the MLP
    activation (None: the family's default) is resolved and checked there too.
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str | None = None  # read through the family registry only (layer_spec)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        families.get_family(self.family)  # FormatError naming the supported families
        for name in _POSITIVE_INTS:
            setattr(self, name, check_int(getattr(self, name), name))
        if self.num_heads % self.num_kv_heads:
            raise FormatError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise FormatError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        self.rms_norm_eps = check_real(self.rms_norm_eps, "rms_norm_eps")
        self.rope_theta = check_real(self.rope_theta, "rope_theta")
        self.rope_scaling = check_rope_scaling(self.rope_scaling)
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "default":
            self.rope_scaling = None
        for name in _BOOLS:
            check_bool(getattr(self, name), name)
        self.hidden_act = families.check_hidden_act(self)
        top = self.vocab_size - 1
        if self.bos_token_id is not None:
            check_int(self.bos_token_id, "bos_token_id", 0, top)
        if not isinstance(self.eos_token_id, list):
            raise FormatError(f"eos_token_id: expected a list of token ids, got {_type(self.eos_token_id)}")
        for e in self.eos_token_id:
            check_int(e, "eos_token_id", 0, top)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_spec(self) -> families.LayerSpec:
        """What each decoder layer computes (activation, norm slots), from the family registry."""
        return families.layer_spec(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "config") -> ModelArgs:
        """Build from a transformers config object or a ``config.json`` dict (v4 or v5 layout).

        Raises FormatError naming ``source`` and the config field for a missing, wrong-typed or
        out-of-range value (names as the config spells them: ``num_attention_heads``, not ``num_heads``).
        """
        cfg = config.to_dict() if hasattr(config, "to_dict") and not isinstance(config, dict) else config
        if not isinstance(cfg, dict):
            raise FormatError(f"{source}: expected a JSON object of model hyperparameters (as transformers' "
                              f"save_pretrained writes), got {type(cfg).__name__}")
        try:
            return cls._from_dict(cfg, source)
        except FormatError as exc:
            msg = str(exc)
            raise FormatError(msg if msg.startswith(f"{source}:") else f"{source}: {msg}") from None

    @classmethod
    def _from_dict(cls, cfg: dict[str, Any], source: str) -> ModelArgs:
        family = cfg.get("model_type")
        if family is not None and not isinstance(family, str):
            raise FormatError(f"model_type: expected a string such as 'llama', got {_type(family)}")
        archs = cfg.get("architectures") or []
        if not isinstance(archs, list):
            raise FormatError(f"architectures: expected a list of class names, got {_type(archs)}")
        fam = families.family_of_config(family, archs)
        if fam is None:
            raise FormatError(
                f"{source}: unknown architecture (model_type={cfg.get('model_type')!r}, "
                f"architectures={cfg.get('architectures')}); supported: "
                f"{', '.join(families.supported_architectures())}"
            )
        family = fam.name
        missing = object()

        def get(key: str, check, default: Any = missing) -> Any:
            value = cfg.get(key)
            if value is None:
                if default is missing:
                    raise FormatError(f"{source}: missing field {key!r}")
                return default
            return check(value, key)

        heads = get("num_attention_heads", check_int)
        hidden = get("hidden_size", check_int)
        head_dim = get("head_dim", check_int, None) or hidden // heads
        rope = cfg.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise FormatError(f"rope_parameters: expected an object, got {_type(rope)}")
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        scaling = check_rope_scaling(scaling, "rope_scaling" if cfg.get("rope_scaling") is not None
                                     else "rope_parameters")
        if scaling is not None and scaling["rope_type"] == "default":
            scaling = None
        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else list(eos) if isinstance(eos, (list, tuple)) else [eos]
        return cls(
            family=family,
            vocab_size=get("vocab_size", check_int),
            hidden_size=hidden,
            num_layers=get("num_hidden_layers", check_int),
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", check_int, heads),
            head_dim=head_dim,
            intermediate_size=get("intermediate_size", check_int),
            rms_norm_eps=get("rms_norm_eps", check_real, 1e-6),
            rope_theta=check_real(theta, "rope_theta"),
            rope_scaling=scaling,
            max_position_embeddings=get("max_position_embeddings", check_int, 4096),
            tie_word_embeddings=get("tie_word_embeddings", check_bool, False),
            attention_bias=get("attention_bias", check_bool, False),
            mlp_bias=get("mlp_bias", check_bool, False),
            hidden_act=families.hidden_act_of_config(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
        )
