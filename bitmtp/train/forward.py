"""A differentiable, full-sequence view of a :class:`~bitmtp.model.decoder.Decoder` for training.

Inference runs steps against a KV store through the backend kernels, which have no autograd. For
training, each projection of the frozen base is held as a float matrix (dense weights as they are;
ternary ones dequantized, ``(c − 1)·scale``) and run with ``F.linear``; ternary layers quantize
their inputs per token to int8 exactly as the W2A8 kernels do, with a straight-through estimator
so gradients flow to the adapter parameters of earlier layers. The math is the decoder's — same
norms, RoPE tables, fused q/k/v and gate/up, sub-norms, q/k norms — so what is trained here is
what runs at inference (tests compare this forward's logits with the engine's).

The trainable parts are :class:`MaskBlockParams` (mask embedding + per-target LoRA, applied to
the block rows only — the gate) and :class:`HeadsParams` (Divine draft heads).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from bitmtp.formats.adapters import AdapterConfig
from bitmtp.model.adapters import GROUPS
from bitmtp.model.decoder import Decoder
from bitmtp.model.fuse import Stacked
from bitmtp.model.layers import DenseLinear, rms_norm
from bitmtp.ops import TernaryLinear


def fake_quant_ste(x: torch.Tensor) -> torch.Tensor:
    """Per-token absmax int8 quantize-dequantize (the kernels' A8 rule), identity gradient."""
    s = 127.0 / x.detach().abs().amax(-1, keepdim=True).clamp_min(1e-5)
    q = torch.round(x.detach() * s).clamp(-128, 127) / s
    return x + (q - x.detach())


class FrozenProjection(nn.Module):
    """A projection of the base as a float matrix; ternary ones fake-quantize their input. A projection
    the decoder could not fuse (``fuse.Stacked``: parts of different kinds) runs its parts and
    concatenates, as the decoder does."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.parts = None
        if isinstance(module, Stacked):
            self.parts = nn.ModuleList(FrozenProjection(p, dtype) for p in module.parts)
            return
        if isinstance(module, TernaryLinear):
            w, b, self.quantize_input = module.dequantized_weight(dtype), module.bias, True
        elif isinstance(module, DenseLinear):
            w, b, self.quantize_input = module.weight, module.bias, False
        else:
            raise TypeError(f"training: cannot view {type(module).__name__} as a projection")
        self.register_buffer("weight", w.detach().to(dtype), persistent=False)
        self.register_buffer("bias", None if b is None else b.detach().to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        if self.quantize_input:
            x = fake_quant_ste(x)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class MaskBlockParams(nn.Module):
    """Trainable mask-block adapter: the mask embedding and, per layer and target, LoRA A/B."""

    def __init__(self, config: AdapterConfig, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.config = config
        self.scaling = (config.lora_alpha / config.rank) if config.lora_alpha else 1.0
        self.mask_embedding = nn.Parameter(tensors["mask_embedding"].clone().float())
        self.lora = nn.ParameterDict({_key(k): nn.Parameter(v.clone().float())
                                      for k, v in tensors.items() if k != "mask_embedding"})

    def delta(self, layer: int, group: str, x: torch.Tensor, out_sizes: list[int]) -> torch.Tensor | None:
        """LoRA delta of a fused group for rows ``x [..., in]`` (zeros for absent targets)."""
        members = GROUPS[group]
        if not any(t in self.config.targets for t in members):
            return None
        parts = []
        for t, size in zip(members, out_sizes, strict=True):
            if t in self.config.targets:
                a, b = self.lora[_key(f"layers.{layer}.{t}.lora_A")], self.lora[_key(f"layers.{layer}.{t}.lora_B")]
                parts.append((x @ a.T) @ b.T * self.scaling)
            else:
                parts.append(x.new_zeros(*x.shape[:-1], size))
        return torch.cat(parts, dim=-1)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"mask_embedding": self.mask_embedding.detach().cpu().clone()}
        out.update({_name(k): v.detach().cpu().clone() for k, v in self.lora.items()})
        return out


class HeadsParams(nn.Module):
    """Trainable Divine draft heads: ``s_k = RMSNorm(up·down·[s ‖ E(y)] + s)``."""

    def __init__(self, config: AdapterConfig, tensors: dict[str, torch.Tensor], eps: float):
        super().__init__()
        self.config, self.eps = config, eps
        k = config.num_heads
        self.down = nn.ParameterList([nn.Parameter(tensors[f"heads.{j}.down"].clone().float()) for j in range(k)])
        self.up = nn.ParameterList([nn.Parameter(tensors[f"heads.{j}.up"].clone().float()) for j in range(k)])
        self.norm = nn.ParameterList([nn.Parameter(tensors[f"heads.{j}.norm"].clone().float()) for j in range(k)])

    def step(self, k: int, state: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        z = torch.cat([state, emb.to(state.dtype)], dim=-1)
        return rms_norm((z @ self.down[k].T) @ self.up[k].T + state, self.norm[k], self.eps)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for j in range(self.config.num_heads):
            out[f"heads.{j}.down"] = self.down[j].detach().cpu().clone()
            out[f"heads.{j}.up"] = self.up[j].detach().cpu().clone()
            out[f"heads.{j}.norm"] = self.norm[j].detach().cpu().clone()
        return out


def _key(name: str) -> str:
    return name.replace(".", "__")


def _name(key: str) -> str:
    return key.replace("__", ".")


class TrainView(nn.Module):
    """The frozen base as float matrices, computing full sequences under an arbitrary mask."""

    def __init__(self, decoder: Decoder, dtype: torch.dtype = torch.float32, projection=None):
        """``projection(module)`` builds each projection's training module (default: a frozen
        :class:`FrozenProjection`; the ``full`` mode passes its trainable latent projection)."""
        super().__init__()
        make = projection or (lambda module: FrozenProjection(module, dtype))
        self.args = a = decoder.args
        self.dtype = dtype
        self.register_buffer("embed", decoder.embed.detach().to(dtype), persistent=False)
        self.register_buffer("norm", decoder.norm.detach().to(dtype), persistent=False)
        self.register_buffer("rope_cos", decoder.rope_cos, persistent=False)
        self.register_buffer("rope_sin", decoder.rope_sin, persistent=False)
        self.lm_head = make(decoder.lm_head)
        self.layers = nn.ModuleList()
        for layer in decoder.layers:
            at, mlp = layer.attn, layer.mlp
            m = nn.Module()
            m.qkv, m.o = make(at.qkv_proj), make(at.o_proj)
            m.gate_up, m.down = make(mlp.gate_up_proj), make(mlp.down_proj)
            for name, t in (("in_norm", layer.in_norm), ("post_norm", layer.post_norm), ("q_norm", at.q_norm),
                            ("k_norm", at.k_norm), ("attn_sub_norm", at.sub_norm), ("mlp_sub_norm", mlp.sub_norm)):
                m.register_buffer(name, None if t is None else t.detach().to(dtype), persistent=False)
            self.layers.append(m)
        self.sizes = {"qkv": [a.q_size, a.kv_size, a.kv_size], "o": [a.hidden_size],
                      "gate_up": [a.intermediate_size, a.intermediate_size], "down": [a.hidden_size]}
        self.requires_grad_(False)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               lora: MaskBlockParams | None = None, gate_from: int | None = None) -> torch.Tensor:
        """Final hidden states ``[B, L, hidden]`` of input embeddings ``x [B, L, hidden]``.

        ``mask [B or 1, L, L]`` (True = may attend); ``lora`` is added to rows ``[gate_from, L)`` only.
        """
        a = self.args
        bsz, length, _ = x.shape
        cos = self.rope_cos[positions].to(x.dtype)[None, :, None, :]
        sin = self.rope_sin[positions].to(x.dtype)[None, :, None, :]
        attn_mask = mask[:, None]  # [B, 1, L, L]
        rep = a.num_heads // a.num_kv_heads
        eps = a.rms_norm_eps

        def adapt(i, group, inp, out):
            if lora is None:
                return out
            d = lora.delta(i, group, inp[:, gate_from:], self.sizes[group])
            if d is None:
                return out
            return torch.cat([out[:, :gate_from], out[:, gate_from:] + d.to(out.dtype)], dim=1)

        for i, m in enumerate(self.layers):
            h = rms_norm(x, m.in_norm, eps)
            qkv = adapt(i, "qkv", h, m.qkv(h))
            q, k, v = qkv.split((a.q_size, a.kv_size, a.kv_size), dim=-1)
            q = q.reshape(bsz, length, a.num_heads, a.head_dim)
            k = k.reshape(bsz, length, a.num_kv_heads, a.head_dim)
            v = v.reshape(bsz, length, a.num_kv_heads, a.head_dim)
            if m.q_norm is not None:
                q, k = rms_norm(q, m.q_norm, eps), rms_norm(k, m.k_norm, eps)
            q = _rope(q, cos, sin)
            k = _rope(k, cos, sin)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, hd]
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1 / math.sqrt(a.head_dim))
            out = out.transpose(1, 2).reshape(bsz, length, a.q_size)
            if m.attn_sub_norm is not None:
                out = rms_norm(out, m.attn_sub_norm, eps)
            x = x + adapt(i, "o", out, m.o(out))
            h = rms_norm(x, m.post_norm, eps)
            gu = adapt(i, "gate_up", h, m.gate_up(h))
            g, u = gu.split(a.intermediate_size, dim=-1)
            act = torch.relu(g).square() if a.hidden_act == "relu2" else F.silu(g)
            act = act * u
            if m.mlp_sub_norm is not None:
                act = rms_norm(act, m.mlp_sub_norm, eps)
            x = x + adapt(i, "down", act, m.down(act))
        return rms_norm(x, self.norm, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
