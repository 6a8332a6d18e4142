"""``ModelArgs``: the shape and numerics of a decoder, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bitmtp.errors import FormatError

#: Supported families and the transformers ``model_type`` / architectures that map to them.
FAMILIES = {"llama": "llama", "qwen3": "qwen3", "bitnet": "bitnet"}
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "BitNetForCausalLM": "bitnet"}


@dataclass
class ModelArgs:
    """Everything the decoder needs to know about a checkpoint.

    Families: ``llama`` (SmolLM2, Llama-3 incl. llama3 RoPE scaling), ``qwen3`` (q/k RMSNorm per
    head; Ternary-Bonsai) and ``bitnet`` (BitNet b1.58: ``attn_sub_norm`` before o_proj,
    ``ffn_sub_norm`` before down_proj, relu² MLP).
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
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise FormatError(f"family: unknown architecture {self.family!r}; supported: {', '.join(FAMILIES)}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size"):
            if int(getattr(self, name)) <= 0:
                raise FormatError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise FormatError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise FormatError(f"head_dim: RoPE needs an even head_dim, got {self.head_dim}")
        if self.hidden_act not in ("silu", "relu2"):
            raise FormatError(f"hidden_act: supported are 'silu' and 'relu2', got {self.hidden_act!r}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type", "default") not in ("default", "llama3"):
            raise FormatError(f"rope_scaling: type {self.rope_scaling.get('rope_type')!r} is not supported "
                              "(supported: default, llama3)")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_hf_config(cls, config: Any, source: str = "config") -> ModelArgs:
        """Build from a transformers config object or a ``config.json`` dict (v4 or v5 layout)."""
        cfg = config if isinstance(config, dict) else config.to_dict()
        family = cfg.get("model_type")
        if family not in FAMILIES:
            archs = cfg.get("architectures") or []
            family = next((_ARCHITECTURES[a] for a in archs if a in _ARCHITECTURES), family)
        if family not in FAMILIES:
            raise FormatError(
                f"{source}: unknown architecture (model_type={cfg.get('model_type')!r}, "
                f"architectures={cfg.get('architectures')}); supported: {', '.join(_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise FormatError(f"{source}: missing field {key!r}")
            return cfg[key]

        heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = cfg.get("head_dim") or hidden // heads
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.get("type", "default"))
            if scaling["rope_type"] == "default":
                scaling = None
        eos = cfg.get("eos_token_id")
        eos_list = [] if eos is None else ([int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)])
        act = cfg.get("hidden_act", "relu2" if family == "bitnet" else "silu")
        return cls(
            family=family,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=act,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos_list,
        )
