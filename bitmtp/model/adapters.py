"""The modules behind MTP adapters: the mask block (mask embedding + gated LoRA) and draft heads.

An adapter file (``bitmtp/formats/adapters.py``) holds tensors; this module turns them into the
modules the decoder and the drafters run.

* :class:`MaskBlock` — a learned mask-token embedding and gated LoRA deltas. "Gated" means the
  delta is applied only to mask rows: the decoder adds it to the trailing ``mask_rows`` rows of a
  draft step and nowhere else, so the base model's next-token path (every pending row, every AR
  and verify step) is untouched and verification stays exact. The LoRA factors of the targets
  that the decoder runs as one fused projection (q/k/v → ``qkv``, gate/up → ``gate_up``) are
  fused the same way — ``A`` stacked, ``B`` block-diagonal — so a fused projection gets its whole
  delta from two small matmuls.
* :class:`DraftHeads` — the recurrent residual draft heads of the Divine design,
  ``s_k = RMSNorm(W_up · W_down · [s_(k−1) ‖ E(y_(t+k))] + s_(k−1))``, whose logits go through
  the base model's LM head.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from bitmtp.errors import BitMTPError
from bitmtp.formats.adapters import AdapterConfig, BaseShape, check_tensors
from bitmtp.model.layers import rms_norm
from bitmtp.ops import dense_linear

#: fused projection group -> the adapter targets it holds, in the decoder's output order
GROUPS = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}


def fuse_group_factors(group: str, targets: Any, lora_a: Any, lora_b: Any,
                       out_sizes: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The LoRA factors of a fused projection ``group``: ``A`` stacked over its present targets, ``B``
    block-diagonal (zero rows for absent targets), so the group's whole delta is two matmuls. None when no
    target of the group is adapted. ``lora_a(t)`` / ``lora_b(t)`` give target ``t``'s factors; built with
    differentiable ops (cat, pad), so the training view gets gradients through it."""
    members = GROUPS[group]
    present = [t for t in members if t in targets]
    if not present:
        return None
    a = torch.cat([lora_a(t) for t in present])
    total = sum(out_sizes)
    cols = []
    for t in present:
        lo = sum(out_sizes[: members.index(t)])
        b = lora_b(t)
        cols.append(torch.nn.functional.pad(b, (0, 0, lo, total - lo - b.shape[0])))
    return a, torch.cat(cols, dim=1)


def gated_lora(outputs: torch.Tensor, inputs: torch.Tensor, first_row: int, a: torch.Tensor, b: torch.Tensor,
               scaling: float, *, row_dim: int = 0, linear: Any = None, inplace: bool = True) -> torch.Tensor:
    """The gated LoRA: ``outputs`` rows ``[first_row, …)`` (along ``row_dim``) get ``scaling · (x Aᵀ) Bᵀ`` of
    the matching ``inputs`` rows; rows before ``first_row`` keep the base model's outputs exactly (the gate).

    The one definition the executors share: the torch decoder (``linear`` = ``ops.dense_linear``, in place, so
    on the cpu backend it is the fused native layers' LoRA kernel: tests/ops/test_fused_layers.py), and the
    training view (``linear`` None: autograd matmuls, ``inplace=False``, rows along dim 1). The Vulkan runtime
    mirrors it with its dense shader (tests/wgsl_fallback). Returns the updated outputs."""
    n = inputs.shape[row_dim] - first_row
    rows = inputs.narrow(row_dim, first_row, n)
    if linear is None:
        delta = (rows.to(a.dtype) @ a.T) @ b.T
    else:
        delta = linear(linear(rows.to(a.dtype), a), b)
    if scaling != 1.0:
        delta = delta * scaling
    delta = delta.to(outputs.dtype)
    if inplace:
        outputs.narrow(row_dim, first_row, n).add_(delta)
        return outputs
    return torch.cat([outputs.narrow(row_dim, 0, first_row), outputs.narrow(row_dim, first_row, n) + delta],
                     dim=row_dim)


def heads_step(down: torch.Tensor, up: torch.Tensor, norm: torch.Tensor, eps: float, state: torch.Tensor,
               token_embedding: torch.Tensor) -> torch.Tensor:
    """One draft head: ``s_k = RMSNorm(W_up · W_down · [s_(k−1) ‖ E(y)] + s_(k−1))`` (``[..., hidden]``).

    The one definition of the heads step: :meth:`DraftHeads.step` (inference) and the training view's
    ``HeadsParams.step`` call it; the Vulkan runtime mirrors it with W_down split into its state and
    embedding halves (tests/wgsl_fallback)."""
    z = torch.cat([state, token_embedding.to(state.dtype)], dim=-1)
    return rms_norm((z @ down.T) @ up.T + state, norm, eps)


class MaskBlock(nn.Module):
    """Mask embedding + gated LoRA of a ``mask-block`` adapter, fused per projection group."""

    def __init__(self, config: AdapterConfig, tensors: dict[str, torch.Tensor], *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        if config.kind != "mask-block":
            raise BitMTPError(f"adapter kind: MaskBlock needs a mask-block adapter, got {config.kind!r}")
        self.config = config
        self.block_size = config.block_size
        base = config.base
        self.scaling = (config.lora_alpha / config.rank) if config.lora_alpha else 1.0
        self.mask_embedding = nn.Parameter(tensors["mask_embedding"].to(device, dtype), requires_grad=False)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for i in range(base.num_layers):
            for group, members in GROUPS.items():
                outs = [base.target_shape(t)[1] for t in members]
                fused = fuse_group_factors(group, config.targets, lambda t, i=i: tensors[f"layers.{i}.{t}.lora_A"],
                                           lambda t, i=i: tensors[f"layers.{i}.{t}.lora_B"], outs)
                if fused is not None:
                    self.a[(i, group)], self.b[(i, group)] = (f.to(device, dtype).contiguous() for f in fused)

    def delta(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor | None:
        """The LoRA delta of ``group`` in ``layer`` for mask rows ``x [R, in]`` (None: not a target)."""
        a = self.a.get((layer, group))
        if a is None:
            return None
        out = torch.zeros(x.shape[0], self.b[(layer, group)].shape[0], dtype=a.dtype, device=a.device)
        return gated_lora(out, x, 0, a, self.b[(layer, group)], self.scaling, linear=dense_linear)

    def apply(self, layer: int, group: str, inputs: torch.Tensor, outputs: torch.Tensor, first_row: int) -> None:
        """Add ``group``'s gated LoRA to ``outputs`` rows ``[first_row, M)`` in place (the decoder's mask rows);
        a group without targets is left alone."""
        a = self.a.get((layer, group))
        if a is not None:
            # through the dense-linear op: on the cpu backend the same kernel as the fused layers' LoRA
            gated_lora(outputs, inputs, first_row, a, self.b[(layer, group)], self.scaling, linear=dense_linear)


class DraftHeads(nn.Module):
    """Recurrent residual draft heads (one per drafted token after d_1), sharing the LM head."""

    def __init__(self, config: AdapterConfig, tensors: dict[str, torch.Tensor], *, eps: float = 1e-6,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        if config.kind != "heads":
            raise BitMTPError(f"adapter kind: DraftHeads needs a heads adapter, got {config.kind!r}")
        self.config = config
        self.block_size = config.block_size
        k = config.num_heads
        stack = lambda name: torch.stack([tensors[f"heads.{j}.{name}"] for j in range(k)]).to(device, dtype)  # noqa: E731
        self.down = nn.Parameter(stack("down"), requires_grad=False)  # [K, r, 2·hidden]
        self.up = nn.Parameter(stack("up"), requires_grad=False)  # [K, hidden, r]
        self.norm = nn.Parameter(stack("norm"), requires_grad=False)  # [K, hidden]
        self.eps = eps

    def step(self, k: int, state: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """Head k: ``s_k`` from ``s_(k−1)`` and the embedding of the token it follows (``[..., hidden]``)."""
        return heads_step(self.down[k], self.up[k], self.norm[k], self.eps, state, token_embedding)


def build_adapter(config: AdapterConfig, tensors: dict[str, torch.Tensor], args: Any, *,
                  dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> MaskBlock | DraftHeads:
    """Check that the adapter fits the model (``args``: its ModelArgs) and build its module."""
    config.check_base(args)
    check_tensors(config, tensors)
    if config.kind == "mask-block":
        return MaskBlock(config, tensors, dtype=dtype, device=device)
    return DraftHeads(config, tensors, eps=args.rms_norm_eps, dtype=dtype, device=device)


def init_adapter_tensors(config: AdapterConfig, *, seed: int = 0, zero_init_b: bool = True,
                         b_std: float = 0.02) -> dict[str, torch.Tensor]:
    """Fresh adapter tensors: the starting point of training, or a random adapter for tests.

    LoRA ``A`` and the heads' down projections are Kaiming-like (std 1/√in); LoRA ``B`` and the heads'
    up projections are zero (the adapter starts as a no-op delta, as LoRA does) unless
    ``zero_init_b=False``, which draws them with std ``b_std`` — a random adapter whose drafts
    differ from the base model's, the hard case for lossless verification.
    """
    g = torch.Generator().manual_seed(seed)
    base: BaseShape = config.base
    out: dict[str, torch.Tensor] = {}

    def normal(shape, std):
        return torch.randn(shape, generator=g) * std

    for name, shape in config.expected_shapes().items():
        if name == "mask_embedding":
            out[name] = normal(shape, 1.0 / math.sqrt(base.hidden_size) * 4)
        elif name.endswith(".norm"):
            out[name] = torch.ones(shape)
        elif name.endswith((".lora_A", ".down")):
            out[name] = normal(shape, 1.0 / math.sqrt(shape[1]))
        else:  # lora_B, up
            out[name] = torch.zeros(shape) if zero_init_b else normal(shape, b_std)
    return out


def base_fingerprint(decoder: Any) -> str:
    """A short hash of a decoder's shape and a sample of its weights (embedding rows, LM head rows,
    the first layer's fused q/k/v), stable across loads of the same checkpoint."""
    import hashlib

    h = hashlib.sha256()
    a = decoder.args
    h.update(repr((a.family, a.hidden_size, a.intermediate_size, a.num_layers, a.num_heads, a.num_kv_heads,
                   a.head_dim, a.vocab_size)).encode())
    # rows only (``DenseLinear.rows``, ``embed[:8]``): a GGUF model's lazy weights dequantize just those rows
    head = decoder.lm_head
    samples = [decoder.embed[:8], head.rows(slice(0, 8)) if hasattr(head, "rows") else head.weight[:8]]
    first = decoder.layers[0].attn.qkv_proj
    if hasattr(first, "rows"):  # a DenseLinear: the first 4096 weights are in its first ceil(4096 / K) rows
        samples.append(first.rows(slice(0, -(-4096 // first.in_features))).reshape(-1)[:4096])
    elif hasattr(first, "weight"):
        samples.append(first.weight.reshape(-1)[:4096])
    for t in samples:
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes() if t.is_floating_point()
                 else t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
