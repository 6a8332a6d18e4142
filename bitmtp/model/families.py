"""The family registry: what a model family is, in one place, and the layer spec every executor runs.

A :class:`Family` says how a checkpoint of that family is named and what its decoder layer computes:
the transformers ``model_type`` / architecture names, the GGUF ``general.architecture``, llama.cpp's
tensor names, whether llama.cpp permutes the q/k rows (its RoPE pairs neighbours), the layer's norms
(:class:`Norm` slots) and its activations (:class:`Activation`). The loaders, the GGUF reader and
writer, the VRAM planner and every executor read it; nothing else branches on a family name.

A :class:`LayerSpec` is what one decoder layer computes — an activation and a set of norm slots, a
frozen value made once per model (:func:`layer_spec`). The executors (the torch decoder, the fused
CPU layers, the Vulkan device model, the training view) each execute it and say what they support
with :meth:`LayerSpec.check`, which raises :class:`UnsupportedLayer` at load for anything they do not
implement — so an activation added here alone is refused by an executor without it, never run as
something else.

Adding a family is one :func:`register_family` call (``tests/model/test_families.py`` registers a test-only
family with GELU and an extra norm after the MLP and runs it) plus kernels in the executors that
support its features. This module is the only reader of ``ModelArgs.hidden_act``
(``tests/model/test_families.py`` checks that).
"""

from __future__ import annotations

import enum
import re
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bitmtp.errors import BitMTPError, FormatError


class Activation(str, enum.Enum):
    """The MLP's gate activation (``act(gate) * up``); the value is the transformers ``hidden_act``."""

    SILU = "silu"
    RELU2 = "relu2"  # BitNet's squared ReLU
    GELU_TANH = "gelu_pytorch_tanh"  # GELU, tanh approximation (Gemma's)


class Norm(str, enum.Enum):
    """The RMSNorm slots of a decoder layer, in the order a layer applies them.

    ``ATTN_IN`` / ``MLP_IN`` are in every family (transformers' ``input_layernorm`` /
    ``post_attention_layernorm``); the others are optional per family.
    """

    ATTN_IN = "attn_in"  # before q/k/v (hidden)
    Q = "q"  # per head on q, after the projection (head_dim; Qwen3)
    K = "k"  # per head on k (head_dim; Qwen3)
    ATTN_SUB = "attn_sub"  # on the attention output, before o_proj (q_size; BitNet)
    MLP_IN = "mlp_in"  # before gate/up (hidden)
    MLP_SUB = "mlp_sub"  # on act(gate)·up, before down_proj (intermediate; BitNet)
    MLP_OUT = "mlp_out"  # on the MLP's output, before the residual add (hidden; Gemma 2/3's post_feedforward_layernorm)


#: per-layer tensor names of each norm slot: transformers' (under ``model.layers.{i}.``), llama.cpp's (``blk.{i}.``)
NORM_NAMES: dict[Norm, tuple[str, str]] = {
    Norm.ATTN_IN: ("input_layernorm.weight", "attn_norm.weight"),
    Norm.Q: ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    Norm.K: ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    Norm.ATTN_SUB: ("self_attn.attn_sub_norm.weight", "attn_sub_norm.weight"),
    Norm.MLP_IN: ("post_attention_layernorm.weight", "ffn_norm.weight"),
    Norm.MLP_SUB: ("mlp.ffn_sub_norm.weight", "ffn_sub_norm.weight"),
    Norm.MLP_OUT: ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
}
#: the projections of every family: transformers' name prefix → llama.cpp's
PROJECTIONS: dict[str, str] = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
#: tensors outside the layers: transformers' name → llama.cpp's
GLOBAL_NAMES: dict[str, str] = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
REQUIRED_NORMS = frozenset({Norm.ATTN_IN, Norm.MLP_IN})
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_GG_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


class UnsupportedLayer(BitMTPError):
    """An executor was asked to run a layer feature it does not implement; the message names both."""


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer computes: its activation and the norm slots present (besides the always
    present ATTN_IN and MLP_IN). Executors branch on these enums only."""

    activation: Activation
    norms: frozenset[Norm]

    def has(self, norm: Norm) -> bool:
        return norm in self.norms

    def check(self, executor: str, activations: Iterable[Activation], norms: Iterable[Norm]) -> None:
        """Raise :class:`UnsupportedLayer` naming ``executor`` and the feature unless every feature of this
        spec is among the ``activations`` and ``norms`` the executor implements."""
        acts = frozenset(activations)
        if self.activation not in acts:
            raise UnsupportedLayer(
                f"{executor}: this model's activation {self.activation.value!r} is not implemented there "
                f"(it runs {', '.join(sorted(a.value for a in acts))}); run the model on the torch path "
                "(runtime='torch', the default) instead")
        missing = sorted(n.value for n in self.norms - frozenset(norms))
        if missing:
            raise UnsupportedLayer(
                f"{executor}: this model's layers have norm(s) {', '.join(missing)} that are not implemented there; "
                "run the model on the torch path (runtime='torch', the default) instead")


@dataclass(frozen=True)
class Family:
    """One model family (see the module docstring). ``activations``: the ``hidden_act`` values it accepts,
    the first being its default when a config names none."""

    name: str
    hf_model_types: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    gguf_arch: str
    activations: tuple[Activation, ...]
    norms: frozenset[Norm] = field(default_factory=frozenset)  # optional slots, besides ATTN_IN and MLP_IN
    permute_qk: bool = False  # llama.cpp stores q/k rows permuted within each head
    description: str = ""

    def __post_init__(self) -> None:
        if not self.activations:
            raise BitMTPError(f"family {self.name!r}: give at least one activation")
        if REQUIRED_NORMS & self.norms:
            raise BitMTPError(f"family {self.name!r}: norms lists the optional slots only "
                              f"({', '.join(n.value for n in REQUIRED_NORMS)} are always present)")

    @property
    def layer_norms(self) -> tuple[Norm, ...]:
        """Every norm slot of a layer of this family, in :class:`Norm` order."""
        return tuple(n for n in Norm if n in REQUIRED_NORMS or n in self.norms)

    def activation(self, hidden_act: Any) -> Activation:
        """The :class:`Activation` of a ``hidden_act`` value (None: the family's default); FormatError when
        this family does not run it."""
        if hidden_act is None:
            return self.activations[0]
        allowed = ", ".join(repr(a.value) for a in self.activations)
        try:
            act = Activation(hidden_act)
        except ValueError:
            raise FormatError(f"hidden_act: {self.name} models run {allowed}, got {hidden_act!r}") from None
        if act not in self.activations:
            raise FormatError(f"hidden_act: {self.name} models run {allowed}, got {hidden_act!r}")
        return act

    def gguf_name(self, hf_name: str) -> str:
        """llama.cpp's name of a transformers tensor name of this family (``model.layers.3.mlp.up_proj.weight``
        → ``blk.3.ffn_up.weight``); FormatError for a name this family has no GGUF name for."""
        if hf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[hf_name]
        m = _HF_LAYER.fullmatch(hf_name)
        if m:
            gg = self._layer_names().get(m.group(2))
            if gg is not None:
                return f"blk.{m.group(1)}.{gg}"
        raise FormatError(f"tensor {hf_name!r}: no GGUF name for it in a {self.name} model")

    def hf_name(self, gguf_tensor_name: str) -> str | None:
        """The transformers name of a llama.cpp tensor name, or None when it is not a tensor of this family."""
        for hf, gg in GLOBAL_NAMES.items():
            if gg == gguf_tensor_name:
                return hf
        m = _GG_LAYER.fullmatch(gguf_tensor_name)
        if m:
            back = {gg: hf for hf, gg in self._layer_names().items()}
            hf = back.get(m.group(2))
            if hf is not None:
                return f"model.layers.{m.group(1)}.{hf}"
        return None

    def _layer_names(self) -> dict[str, str]:
        names = {NORM_NAMES[n][0]: NORM_NAMES[n][1] for n in self.layer_norms}
        for hf, gg in PROJECTIONS.items():
            names[f"{hf}.weight"] = f"{gg}.weight"
            names[f"{hf}.bias"] = f"{gg}.bias"
        return names

    def qk_permute_heads(self, args: Any, hf_name: str) -> int | None:
        """Heads to (un)permute for llama.cpp's RoPE layout when writing/reading ``hf_name``, else None."""
        if not self.permute_qk:
            return None
        if ".self_attn.q_proj." in hf_name:
            return args.num_heads
        if ".self_attn.k_proj." in hf_name:
            return args.num_kv_heads
        return None


_LOCK = threading.Lock()
_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add a family (BitMTPError when its name, an HF name or its GGUF architecture is taken). Returns it."""
    with _LOCK:
        for other in _FAMILIES.values():
            clash = ({other.name} & {family.name} or set(other.hf_model_types) & set(family.hf_model_types)
                     or set(other.hf_architectures) & set(family.hf_architectures)
                     or {other.gguf_arch} & {family.gguf_arch})
            if clash:
                raise BitMTPError(f"register_family: {family.name!r} clashes with the registered family "
                                  f"{other.name!r} on {sorted(clash)}; unregister it first or pick other names")
        _FAMILIES[family.name] = family
    return family


def unregister_family(name: str) -> None:
    """Remove a family registered with :func:`register_family` (tests use this in their teardown)."""
    with _LOCK:
        _FAMILIES.pop(name, None)


def family_names() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def get_family(name: Any) -> Family:
    """The registered family called ``name``; FormatError listing the supported ones otherwise."""
    fam = _FAMILIES.get(name) if isinstance(name, str) else None
    if fam is None:
        raise FormatError(f"family: unknown architecture {name!r}; supported: {', '.join(_FAMILIES)}")
    return fam


def family_of_config(model_type: Any, architectures: Any) -> Family | None:
    """The family a transformers config names: by ``model_type``, else by an ``architectures`` entry."""
    for fam in _FAMILIES.values():
        if isinstance(model_type, str) and (model_type == fam.name or model_type in fam.hf_model_types):
            return fam
    for fam in _FAMILIES.values():
        if isinstance(architectures, list) and any(a in fam.hf_architectures for a in architectures
                                                   if isinstance(a, str)):
            return fam
    return None


def family_of_gguf_arch(arch: Any) -> Family | None:
    return next((f for f in _FAMILIES.values() if f.gguf_arch == arch), None)


def supported_architectures() -> tuple[str, ...]:
    return tuple(a for f in _FAMILIES.values() for a in f.hf_architectures)


def supported_gguf_archs() -> tuple[str, ...]:
    return tuple(f.gguf_arch for f in _FAMILIES.values())


def check_hidden_act(args: Any) -> str:
    """Resolve and validate ``args.hidden_act`` for ``args.family`` (None → the family's default); returns
    the ``hidden_act`` string to keep. Called by ``ModelArgs`` when it is made."""
    return get_family(args.family).activation(args.hidden_act).value


def hidden_act_of_config(cfg: dict[str, Any]) -> Any:
    """The ``hidden_act`` a transformers config dict names (None when absent: the family's default)."""
    return cfg.get("hidden_act") or None


def layer_spec(args: Any) -> LayerSpec:
    """The :class:`LayerSpec` of a model with ``args`` (``ModelArgs``)."""
    fam = get_family(args.family)
    return LayerSpec(fam.activation(args.hidden_act), fam.norms)


def norm_size(norm: Norm, args: Any) -> int:
    """The length of a norm slot's weight vector for a model with ``args``."""
    return {Norm.ATTN_IN: args.hidden_size, Norm.MLP_IN: args.hidden_size, Norm.MLP_OUT: args.hidden_size,
            Norm.Q: args.head_dim, Norm.K: args.head_dim, Norm.ATTN_SUB: args.q_size,
            Norm.MLP_SUB: args.intermediate_size}[norm]


LLAMA = register_family(Family(
    "llama", ("llama",), ("LlamaForCausalLM",), "llama", (Activation.SILU, Activation.RELU2), permute_qk=True,
    description="Llama 2/3, SmolLM2 (incl. llama3 RoPE scaling)"))
QWEN3 = register_family(Family(
    "qwen3", ("qwen3",), ("Qwen3ForCausalLM",), "qwen3", (Activation.SILU, Activation.RELU2),
    frozenset({Norm.Q, Norm.K}),
    description="Qwen3, Ternary-Bonsai: RMSNorm per head on q and k"))
BITNET = register_family(Family(
    "bitnet", ("bitnet",), ("BitNetForCausalLM",), "bitnet", (Activation.RELU2, Activation.SILU),
    frozenset({Norm.ATTN_SUB, Norm.MLP_SUB}),
    description="BitNet b1.58: sub-norms before o_proj and down_proj, squared-ReLU MLP"))

__all__ = ["Activation", "Norm", "LayerSpec", "Family", "UnsupportedLayer", "register_family", "unregister_family",
           "get_family", "family_names", "family_of_config", "family_of_gguf_arch", "layer_spec", "norm_size",
           "check_hidden_act", "hidden_act_of_config", "NORM_NAMES", "PROJECTIONS", "GLOBAL_NAMES",
           "supported_architectures", "supported_gguf_archs", "LLAMA", "QWEN3", "BITNET"]
