"""The ``full`` training mode: a joint NTP + MTP fine-tune of every base weight.

Meant for GPU users (it trains the whole model: weights, Adam moments and activations of every
layer); it runs on a CPU for small models and tests.

* **Latent weights.** Dense projections, embeddings, norms and the LM head train as they are (a
  tied LM head stays tied). A ternary projection trains a float *latent* matrix whose forward is
  its absmean ternarization at the projection's own scale layout (per tensor, row or group) with a
  straight-through estimator — BitNet b1.58's quantization-aware rule. The latent starts at
  ``q · a / f`` per scale region (``f`` = the region's fraction of non-zero codes), whose absmean
  ternarization is exactly the checkpoint's codes ``q`` and scales ``a``: step 0 is the base model.
* **Mask rows** get the learned mask embedding and no LoRA: the whole network learns both tasks
  (ungated), so the result is a new base plus a ``mask-block`` adapter without LoRA targets.
* **Objective** (DESIGN.md "Training"): next-token cross-entropy over the sequence rows plus
  Σ_k γ^k · CE at block position k, on the packed layout of ``bitmtp.train.masks``. With
  self-distillation the block targets are the current model's own greedy predictions of the
  sequence (detached); the NTP term always uses the corpus tokens.
* **Write-back.** :func:`write_back` re-ternarizes each latent into the decoder's modules (packed
  T2 + scales) and copies the dense tensors, so the trained decoder runs on every backend; the
  trainer then writes one GGUF file holding the new base and its adapter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bitmtp.errors import BitMTPError
from bitmtp.formats.quantize import absmean_ternarize, dequantize_ternary
from bitmtp.formats.ternary import pack_t2
from bitmtp.model.decoder import Decoder
from bitmtp.model.families import Norm
from bitmtp.model.fuse import Stacked
from bitmtp.model.layers import DenseLinear
from bitmtp.ops import TernaryLinear
from bitmtp.train.forward import TrainView, fake_quant_ste, norm_attr
from bitmtp.train.losses import weighted_block_ce
from bitmtp.train.masks import packed_layout


def scale_layout(module: TernaryLinear) -> tuple[str, int | None]:
    """``(granularity, group_size)`` of a ternary projection's scales, for ``absmean_ternarize``."""
    s = module.scales
    if s.numel() == 1:
        return "tensor", None
    if s.shape[1] == 1:
        return "row", None
    return "group", module.group_size


def ternary_ste(latent: torch.Tensor, granularity: str, group_size: int | None) -> torch.Tensor:
    """Absmean-ternarized ``latent`` in the forward pass, identity gradient in the backward pass."""
    q, a = absmean_ternarize(latent, granularity, group_size)
    wq = dequantize_ternary(q, a, group_size, latent.dtype)
    return latent + (wq - latent).detach()


def initial_latent(module: TernaryLinear, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q · a / f`` per scale region: its absmean ternarization is the module's own ``(q, a)`` (up to
    the float32 rounding of the mean)."""
    from bitmtp.formats.scales import expand_scales

    gran, group = scale_layout(module)
    w0 = module.dequantized_weight(torch.float64)  # q · a
    n, k = w0.shape
    _, a_f = absmean_ternarize(w0, gran, group)  # mean |q · a| = a · f per region
    g = module.group_size
    a = expand_scales(module.scales.double(), n, k, g)
    return (w0 * a / expand_scales(a_f.double(), n, k, g)).to(dtype)


class _LatentProjection(nn.Module):
    """A trainable projection: latent weight (ternary: STE-ternarized in forward) and bias."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.parts = None
        if isinstance(module, Stacked):
            self.parts = nn.ModuleList(_LatentProjection(p) for p in module.parts)
            return
        if isinstance(module, TernaryLinear):
            self.layout = scale_layout(module)
            self.weight = nn.Parameter(initial_latent(module))
            self.quantize_input = True
        elif isinstance(module, DenseLinear):
            self.layout = None
            self.weight = nn.Parameter(module.weight.detach().float().clone())
            self.quantize_input = False
        else:
            raise BitMTPError(f"full training: cannot train a projection of type {type(module).__name__}")
        self.bias = None if module.bias is None else nn.Parameter(module.bias.detach().float().clone())

    def effective_weight(self) -> torch.Tensor:
        return self.weight if self.layout is None else ternary_ste(self.weight, *self.layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        if self.quantize_input:
            x = fake_quant_ste(x)
        return F.linear(x.to(self.weight.dtype), self.effective_weight(), self.bias)


class FullParams(nn.Module):
    """Everything the ``full`` mode trains: a :class:`TrainView` whose tensors are parameters
    (projections as :class:`_LatentProjection`) and the mask embedding."""

    def __init__(self, decoder: Decoder, mask_embedding: torch.Tensor):
        super().__init__()
        # projections are built trainable directly (no frozen float copies made and thrown away)
        view = TrainView(decoder, torch.float32, projection=_LatentProjection)
        self.tied = decoder.lm_head.weight.data_ptr() == decoder.embed.data_ptr()
        embed = nn.Parameter(view.embed.clone())
        del view.embed
        view.embed = embed
        norm = nn.Parameter(view.norm.clone())
        del view.norm
        view.norm = norm
        if self.tied:
            view.lm_head.weight = embed  # one tensor for both, as in the checkpoint
        for m in view.layers:
            for slot in Norm:
                t = m.norm(slot)
                if t is not None:
                    delattr(m, norm_attr(slot))
                    setattr(m, norm_attr(slot), nn.Parameter(t.clone()))
        view.requires_grad_(True)
        self.view = view
        self.mask_embedding = nn.Parameter(mask_embedding.detach().float().clone())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The adapter's tensors (a mask-block adapter without LoRA targets)."""
        return {"mask_embedding": self.mask_embedding.detach().cpu().clone()}


def full_loss(view: TrainView, params: FullParams, tokens: torch.Tensor, anchors: list[int], block_size: int,
              gamma: float, self_distill: bool, widths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """NTP cross-entropy over the sequence rows + the discounted block loss; per-position accuracy
    (``widths``: mask rows per anchor's block, default D − 1)."""
    bsz, t_len = tokens.shape
    lay = packed_layout(t_len, anchors, block_size, device=tokens.device, widths=widths)
    emb = view.embed[tokens]
    x = torch.cat([emb, params.mask_embedding.to(emb.dtype).expand(bsz, lay.block_k.numel(), -1)], dim=1)
    hidden = view.hidden(x, lay.positions, lay.mask[None])
    seq_logits = view.logits(hidden[:, :t_len])
    ntp = F.cross_entropy(seq_logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    logits = view.logits(hidden[:, t_len:])
    if self_distill:
        targets = seq_logits.detach().argmax(-1)[:, lay.block_targets - 1]
    else:
        targets = tokens[:, lay.block_targets]
    mtp, acc = weighted_block_ce(logits, targets, lay.block_k, block_size, gamma, n_blocks=len(anchors))
    return ntp + mtp, acc


def _write_projection(trained: _LatentProjection, module: nn.Module) -> nn.Module:
    if trained.parts is not None:
        return Stacked([_write_projection(t, m) for t, m in zip(trained.parts, module.parts, strict=True)])
    bias = None if trained.bias is None else trained.bias.detach().to(module.bias.dtype).clone()
    if isinstance(module, TernaryLinear):
        gran, group = trained.layout
        q, a = absmean_ternarize(trained.weight.detach(), gran, group)
        dev = module.weight.device
        return TernaryLinear(module.in_features, module.out_features, pack_t2(q.cpu()).to(dev), a.to(dev),
                             group_size=group, bias=None if bias is None else bias.float(), backend=module.backend)
    return DenseLinear(trained.weight.detach().to(module.weight.dtype).clone(), bias, backend=module.backend)


@torch.no_grad()
def write_back(params: FullParams, decoder: Decoder) -> None:
    """Put the trained weights into ``decoder`` (ternary latents re-ternarized and packed)."""
    view = params.view
    dt = decoder.dtype
    decoder.embed.data = view.embed.detach().to(dt).clone()
    decoder.norm.data = view.norm.detach().to(decoder.norm.dtype).clone()
    if params.tied:
        decoder.lm_head.weight = decoder.embed
    else:
        decoder.lm_head = _write_projection(view.lm_head, decoder.lm_head)
    for m, layer in zip(view.layers, decoder.layers, strict=True):
        layer.attn.qkv_proj = _write_projection(m.qkv, layer.attn.qkv_proj)
        layer.attn.o_proj = _write_projection(m.o, layer.attn.o_proj)
        layer.mlp.gate_up_proj = _write_projection(m.gate_up, layer.mlp.gate_up_proj)
        layer.mlp.down_proj = _write_projection(m.down, layer.mlp.down_proj)
        for slot in Norm:
            t, target = m.norm(slot), layer.norm(slot)
            if t is not None:
                target.data = t.detach().to(target.dtype).clone()
    decoder.invalidate_native()
