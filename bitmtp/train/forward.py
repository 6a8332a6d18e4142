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
from bitmtp.model.adapters import GROUPS, fuse_group_factors, gated_lora, heads_step
from bitmtp.model.decoder import Decoder
from bitmtp.model.families import Activation, Norm
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

    def factors(self, layer: int, group: str, out_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused ``(A, B)`` of a projection group (``model.adapters.fuse_group_factors``, differentiable);
        None when none of its targets is adapted."""
        return fuse_group_factors(group, self.config.targets,
                                  lambda t: self.lora[_key(f"layers.{layer}.{t}.lora_A")],
                                  lambda t: self.lora[_key(f"layers.{layer}.{t}.lora_B")], out_sizes)

    def apply(self, layer: int, group: str, inputs: torch.Tensor, outputs: torch.Tensor,
              first_row: int) -> torch.Tensor:
        """``outputs [B, L, out]`` with the gated LoRA (``model.adapters.gated_lora``) on rows ``[first_row, L)``."""
        fused = self.factors(layer, group, self._sizes(group))
        if fused is None:
            return outputs
        return gated_lora(outputs, inputs, first_row, *fused, self.scaling, row_dim=1, inplace=False)

    def _sizes(self, group: str) -> list[int]:
        base = self.config.base
        return [base.target_shape(t)[1] for t in GROUPS[group]]

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
        """Head k (``model.adapters.heads_step``, the inference heads' own definition)."""
        return heads_step(self.down[k], self.up[k], self.norm[k], self.eps, state, emb)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for j in range(self.config.num_heads):
            out[f"heads.{j}.down"] = self.down[j].detach().cpu().clone()
            out[f"heads.{j}.up"] = self.up[j].detach().cpu().clone()
            out[f"heads.{j}.norm"] = self.norm[j].detach().cpu().clone()
        return out


class ViewLayer(nn.Module):
    """One layer of a :class:`TrainView`: projections ``qkv``, ``o``, ``gate_up``, ``down`` and the norm weights
    as buffers ``norm_<slot>`` (:meth:`norm`; the ``full`` mode makes them parameters)."""

    def norm(self, slot: Norm) -> torch.Tensor | None:
        return getattr(self, norm_attr(slot), None)


def norm_attr(slot: Norm) -> str:
    """The attribute of a :class:`ViewLayer` holding norm ``slot``."""
    return f"norm_{slot.value}"


#: the activations the training view implements (autograd-friendly float versions of the decoder's)
TRAIN_ACTIVATIONS = {Activation.SILU: F.silu, Activation.RELU2: lambda g: torch.relu(g).square(),
                     Activation.GELU_TANH: lambda g: F.gelu(g, approximate="tanh")}


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
        self.spec = a.layer_spec
        self.spec.check("the training view (bitmtp.train.forward)", TRAIN_ACTIVATIONS, Norm)
        self._act = TRAIN_ACTIVATIONS[self.spec.activation]
        self.layers = nn.ModuleList()
        for layer in decoder.layers:
            at, mlp = layer.attn, layer.mlp
            m = ViewLayer()
            m.qkv, m.o = make(at.qkv_proj), make(at.o_proj)
            m.gate_up, m.down = make(mlp.gate_up_proj), make(mlp.down_proj)
            for slot in Norm:
                t = layer.norm(slot)
                if t is not None:
                    m.register_buffer(norm_attr(slot), t.detach().to(dtype), persistent=False)
            self.layers.append(m)
        self.requires_grad_(False)

    def hidden(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
               lora: MaskBlockParams | None = None, gate_from: int | None = None) -> torch.Tensor:
        """Final hidden states ``[B, L, hidden]`` of input embeddings ``x [B, L, hidden]``.

        ``mask [B or 1, L, L]`` (True = may attend); ``lora`` is added to rows ``[gate_from, L)`` only.
        """
        rope = self._rope_tables(positions, x.dtype)
        adapt = self._adapter(lora, gate_from)
        for i, m in enumerate(self.layers):
            q, k, v = self._qkv(i, m, x, rope, adapt)
            x = self._attend_and_mlp(i, m, x, q, k, v, mask[:, None], adapt)
        return rms_norm(x, self.norm, self.args.rms_norm_eps)

    def hidden_gated(self, x_seq: torch.Tensor, x_blocks: torch.Tensor, positions: torch.Tensor,
                     mask: torch.Tensor, lora: MaskBlockParams | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`hidden` of ``cat([x_seq, x_blocks], 1)`` with ``lora`` gated to the block rows, as
        ``(sequence rows, block rows)`` — computed in two streams: the sequence rows see no adapter and
        no block row (the gate and the layout), so they run without autograd, and only the block rows,
        attending to the sequence rows' keys and values, are differentiated. Same values as the joint
        pass up to float summation order; the backward skips the sequence rows (~1.5× a step with 256
        sequence rows and ~270 block rows on the CPU)."""
        t_len = x_seq.shape[1]
        rope_s = self._rope_tables(positions[:t_len], x_seq.dtype)
        rope_b = self._rope_tables(positions[t_len:], x_blocks.dtype)
        mask_s, mask_b = mask[:, None, :t_len, :t_len], mask[:, None, t_len:, :]
        adapt = self._adapter(lora, 0)
        plain = self._adapter(None, None)
        xs, xb = x_seq, x_blocks
        for i, m in enumerate(self.layers):
            with torch.no_grad():  # the layer's sequence keys/values (for the blocks) and its next input
                qs, ks, vs = self._qkv(i, m, xs, rope_s, plain)
                xs_next = self._attend_and_mlp(i, m, xs, qs, ks, vs, mask_s, plain)
            qb, kb, vb = self._qkv(i, m, xb, rope_b, adapt)
            xb = self._attend_and_mlp(i, m, xb, qb, torch.cat([ks, kb], 2), torch.cat([vs, vb], 2), mask_b, adapt)
            xs = xs_next
        eps = self.args.rms_norm_eps
        return rms_norm(xs, self.norm, eps), rms_norm(xb, self.norm, eps)

    def _rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.rope_cos[positions].to(dtype)[None, :, None, :],
                self.rope_sin[positions].to(dtype)[None, :, None, :])

    @staticmethod
    def _adapter(lora: MaskBlockParams | None, gate_from: int | None):
        def adapt(i, group, inp, out):
            return out if lora is None else lora.apply(i, group, inp, out, gate_from)
        return adapt

    def _qkv(self, i: int, m: ViewLayer, x: torch.Tensor, rope, adapt
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer ``i``'s queries, keys and values of rows ``x [B, L, hidden]`` (``[B, heads, L, hd]``, RoPE'd)."""
        a = self.args
        bsz, length, _ = x.shape
        eps = a.rms_norm_eps
        h = rms_norm(x, m.norm(Norm.ATTN_IN), eps)
        qkv = adapt(i, "qkv", h, m.qkv(h))
        q, k, v = qkv.split((a.q_size, a.kv_size, a.kv_size), dim=-1)
        q = q.reshape(bsz, length, a.num_heads, a.head_dim)
        k = k.reshape(bsz, length, a.num_kv_heads, a.head_dim)
        v = v.reshape(bsz, length, a.num_kv_heads, a.head_dim)
        if m.norm(Norm.Q) is not None:
            q = rms_norm(q, m.norm(Norm.Q), eps)
        if m.norm(Norm.K) is not None:
            k = rms_norm(k, m.norm(Norm.K), eps)
        q = _rope(q, *rope)
        k = _rope(k, *rope)
        return tuple(t.transpose(1, 2) for t in (q, k, v))  # [B, heads, L, hd]

    def _attend_and_mlp(self, i: int, m: ViewLayer, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor, attn_mask: torch.Tensor, adapt) -> torch.Tensor:
        """The rest of layer ``i`` for rows ``x`` whose queries are ``q``, over keys/values ``k``, ``v``
        (``attn_mask [B or 1, 1, rows, keys]``)."""
        a = self.args
        bsz, length, _ = x.shape
        eps = a.rms_norm_eps
        rep = a.num_heads // a.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1 / math.sqrt(a.head_dim))
        out = out.transpose(1, 2).reshape(bsz, length, a.q_size)
        if m.norm(Norm.ATTN_SUB) is not None:
            out = rms_norm(out, m.norm(Norm.ATTN_SUB), eps)
        x = x + adapt(i, "o", out, m.o(out))
        h = rms_norm(x, m.norm(Norm.MLP_IN), eps)
        gu = adapt(i, "gate_up", h, m.gate_up(h))
        g, u = gu.split(a.intermediate_size, dim=-1)
        act = self._act(g) * u
        if m.norm(Norm.MLP_SUB) is not None:
            act = rms_norm(act, m.norm(Norm.MLP_SUB), eps)
        y = adapt(i, "down", act, m.down(act))
        if m.norm(Norm.MLP_OUT) is not None:
            y = rms_norm(y, m.norm(Norm.MLP_OUT), eps)
        return x + y

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin
