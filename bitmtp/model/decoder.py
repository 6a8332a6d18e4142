"""One decoder for every registered family (``bitmtp.model.families``): it executes the model's layer spec.

The decoder computes *steps*: M rows (tokens at absolute positions) against one KV store, writing
the rows' K/V in place at their positions and attending over a read window of the store under a
boolean mask. It never allocates KV and never copies KV rows; the runtime decides widths,
segments and masks. Every op is row-independent (per-token activation quantization, row-wise
norms, per-row attention), so a row's result does not depend on the other rows of the step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bitmtp.errors import BitMTPError
from bitmtp.formats.ggml_blocks import BlockWeight
from bitmtp.model.args import ModelArgs
from bitmtp.model.families import Activation, Norm, UnsupportedLayer
from bitmtp.model.fuse import fuse_rows
from bitmtp.model.layers import (
    BlockEmbedding,
    DenseLinear,
    LazyWeight,
    apply_rope,
    changes_tensors,
    gelu_tanh,
    relu2,
    rms_norm,
    rope_tables,
    silu,
)
from bitmtp.ops import TernaryLinear, attention
from bitmtp.ops import rms_norm as ops_rms_norm
from bitmtp.ops.fused_layers import (
    Dims,
    FusedLayer,
    FusedPlan,
    FusedUnsupported,
    TailCall,
    fused_enabled,
    kv_pointer_table,
)
from bitmtp.ops.head import NativeTail, choose_logits, native_tail, norm_head_argmax
from bitmtp.ops.registry import choice_state

log = logging.getLogger("bitmtp")

#: the ways a step can run (:attr:`Decoder.last_path`): the fused CPU layers, per op, and the fused GPU step
#: (``bitmtp.runtime.gpu_step``: the whole step, recorded by the graph pool's runner)
FUSED, PER_OP, GPU_STEP = "fused", "per-op", "gpu-step"


class Attention(nn.Module):
    """q/k/v run as one fused projection (``qkv_proj``, see model/fuse.py), then o_proj."""

    def __init__(self, args: ModelArgs, q, k, v, o):
        super().__init__()
        self.args = args
        self.qkv_proj, self.o_proj = fuse_rows([q, k, v]), o
        self.scale = args.head_dim**-0.5


class MLP(nn.Module):
    """gate/up run as one fused projection (``gate_up_proj``), then the activation and down_proj."""

    def __init__(self, args: ModelArgs, gate, up, down):
        super().__init__()
        self.args = args
        self.gate_up_proj, self.down_proj = fuse_rows([gate, up]), down


class Layer(nn.Module):
    """One decoder layer's projections and norms. ``norms`` holds a weight per :class:`~bitmtp.model.families.Norm`
    slot of the model's :class:`~bitmtp.model.families.LayerSpec` (every executor reads them by slot)."""

    def __init__(self, args: ModelArgs, attn: Attention, mlp: MLP, norms: dict[Norm, torch.Tensor]):
        super().__init__()
        self.attn, self.mlp = attn, mlp
        self.norms = nn.ParameterDict({n.value: nn.Parameter(t, requires_grad=False) for n, t in norms.items()})

    def norm(self, slot: Norm) -> torch.Tensor | None:
        """The weight of norm ``slot``, or None when this layer has no such norm."""
        return self.norms[slot.value] if slot.value in self.norms else None


#: the activations the torch executor (:meth:`Decoder.run_layers`, per op) implements
TORCH_ACTIVATIONS = {Activation.SILU: silu, Activation.RELU2: relu2, Activation.GELU_TANH: gelu_tanh}
#: the activations of the fused CPU layers (csrc/cpu/layers.cpp), as the native ``relu2`` flag
FUSED_ACTIVATIONS = {Activation.SILU: False, Activation.RELU2: True}
FUSED_NORMS = (Norm.ATTN_IN, Norm.Q, Norm.K, Norm.ATTN_SUB, Norm.MLP_IN, Norm.MLP_SUB)


@dataclass
class StepInputs:
    """One step's rows: token ids ``[M]``, absolute positions ``[M]`` and the attention mask
    ``[M, L]`` over KV rows ``[0, L)`` (True = may attend; L is the segment's read length).

    ``mask_rows``: how many trailing rows are mask rows of a mask-block draft step (a static count:
    it is part of the replay state), and ``mask_block`` the adapter module (``model.adapters.MaskBlock``)
    that drives them: their input is its mask embedding (their token ids are ignored) and only they
    get its gated LoRA deltas.

    ``slots``: the KV row each row writes (None: its position). Rows of a tree step share positions
    (mask blocks after several rows), so all but one of them write to scratch slots past the step's
    other rows; the mask decides who reads what. Positions still drive RoPE.

    ``rope``: the rows' RoPE ``(cos, sin)`` ``[M, head_dim]`` when the caller looked them up already (the batch's
    host inputs do, by numpy: ``runtime.batch_pass.HostInputs``); None: the decoder looks them up.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    mask: torch.Tensor
    mask_rows: int = 0
    mask_block: Any = None
    slots: torch.Tensor | None = None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None


class Decoder(nn.Module):
    """Embeddings, layers, final norm and LM head of one checkpoint."""

    def __init__(self, args: ModelArgs, embed: torch.Tensor | LazyWeight, layers: list[Layer], norm: torch.Tensor,
                 lm_head: DenseLinear, max_positions: int | None = None):
        """``embed``: the token embedding ``[vocab, hidden]``, a float tensor or a :class:`LazyWeight` (a GGUF
        file's blocks: :attr:`embed` then dequantizes only the rows looked up, see :class:`BlockEmbedding`)."""
        super().__init__()
        self.args = args
        self.spec = args.layer_spec
        self.spec.check("the torch decoder", TORCH_ACTIVATIONS, Norm)
        self._act = TORCH_ACTIVATIONS[self.spec.activation]
        self._embed_lazy: LazyWeight | None = None
        if isinstance(embed, LazyWeight):
            self._embed_lazy = embed
        else:
            self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = nn.Parameter(norm, requires_grad=False)
        self.lm_head = lm_head
        self.backend: str | None = None  # backend for attention (linear layers carry their own)
        n_pos = max_positions or args.max_position_embeddings
        cos, sin = rope_tables(args.head_dim, args.rope_theta, args.rope_scaling, n_pos)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._rope_host: tuple[int, Any, Any] | None = None
        self.rope_host()  # (made here, outside any decode loop: the loop's instrumented reads count .numpy())
        self._fused: FusedPlan | None = None
        self._fused_unsupported: str | None = None  # why this model cannot build a plan
        self._native_epoch = 0  # invalidate_native() calls so far
        #: why the last step did not use the fused CPU layers ("" when it did, None before any step)
        self.fused_reason: str | None = None
        #: the path the last step ran: ``"fused"`` or ``"per-op"`` (None before any step)
        self.last_path: str | None = None
        #: steps run on each path since this decoder was built (tests assert the path they meant)
        self.path_counts: dict[str, int] = {FUSED: 0, PER_OP: 0, GPU_STEP: 0}
        #: why the fused GPU step (``bitmtp.runtime.gpu_step``) does not run, or "" when it does
        self.gpu_step_reason = ""
        self._logged_reasons: set[str] = set()  # fallback reasons already logged (once each)

    def _pending_embed(self) -> LazyWeight | None:
        """The embedding's :class:`LazyWeight` while no float tensor is in place (adopting the shared tensor once
        the tied LM head has materialized it)."""
        lazy = self.__dict__.get("_embed_lazy")
        if lazy is None:
            return None
        if "embed" in self._parameters:  # an embedding was assigned
            self._embed_lazy = None
            return None
        if lazy.materialized is not None:
            self.materialize_embed()
            return None
        return lazy

    def materialize_embed(self) -> nn.Parameter:
        """The embedding as a float Parameter (dequantized once from its blocks if it was lazy, the same tensor
        as a tied LM head's weight); :attr:`embed` is that tensor from then on. Training, export to float and
        the Vulkan upload get here through any tensor use of :attr:`embed`."""
        lazy = self.__dict__.get("_embed_lazy")
        if lazy is not None and "embed" not in self._parameters:
            self._parameters["embed"] = lazy.materialize()
        self._embed_lazy = None
        return self._parameters["embed"]

    @property
    def embed_blocks(self) -> BlockWeight | None:
        """The embedding's GGML blocks while it is held lazily (None once a float tensor exists)."""
        lazy = self._pending_embed()
        return None if lazy is None else lazy.blocks

    def __getattr__(self, name: str) -> Any:
        if name == "embed":
            lazy = self._pending_embed()
            if lazy is not None:
                return BlockEmbedding(self, lazy)
        return super().__getattr__(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "embed":  # an assigned embedding replaces the lazy one
            self.__dict__["_embed_lazy"] = None
        super().__setattr__(name, value)

    def _apply(self, fn, recurse=True):
        self.invalidate_native()  # tensors move: the native table would dangle
        if self._pending_embed() is not None and changes_tensors(fn):
            self.materialize_embed()
        return super()._apply(fn, recurse)

    def invalidate_native(self) -> None:
        """Forget the native fused-layers plan: call after replacing modules or tensors in place (the
        plan points at the old ones); the next step rebuilds it."""
        self._fused, self._fused_unsupported, self.fused_reason = None, None, None
        self._native_epoch += 1  # the step tail's operands are taken again (_native_tail)

    def pack_dense_blocks(self) -> dict[str, int]:
        """Give every dense projection (and the LM head) a GGML block copy of its weight where one is
        lossless (:meth:`DenseLinear.pack_blocks`): GGUF Q4_0/Q4_1/Q8_0 checkpoints then stream their
        original bytes on the CPU, with bit-identical results. Returns :meth:`dense_summary`.
        ``BITMTP_DENSE_BLOCKS=0`` makes the loaders skip this."""
        for mod in self.modules():
            if isinstance(mod, DenseLinear):
                mod.pack_blocks()
        self.invalidate_native()
        return self.dense_summary()

    def dense_summary(self) -> dict:
        """The dense projections (LM head included): ``formats`` (how many read each block format, or
        ``"float"``), ``float_bytes`` (their weights as float tensors: stored, or made when asked for where
        lazy) and ``step_bytes`` (what a CPU step reads of them: the blocks where packed). Reads no weight."""
        dense = [m for m in self.modules() if isinstance(m, DenseLinear)]
        formats: dict[str, int] = {}
        for m in dense:
            key = m.blocks.fmt if m.blocks is not None else "float"
            formats[key] = formats.get(key, 0) + 1

        def float_bytes(m: DenseLinear) -> int:
            return m.out_features * m.in_features * torch.empty(0, dtype=m.dtype).element_size()

        step_bytes = sum(m.blocks.nbytes if m.blocks is not None else float_bytes(m) for m in dense)
        return {"formats": dict(sorted(formats.items())), "float_bytes": sum(float_bytes(m) for m in dense),
                "step_bytes": step_bytes}

    def parameter_count(self) -> int:
        """Weights the model holds, lazy ones included (``parameters()`` lists only tensors that exist: a GGUF
        model's block weights have no float tensor until a float path asks for one)."""
        n = sum(p.numel() for p in self.parameters())
        n += sum(m.out_features * m.in_features for m in self.modules() if isinstance(m, DenseLinear) and m.lazy)
        lazy = self._pending_embed()
        if lazy is not None and not any(m.lazy and m.blocks is lazy.blocks for m in self.modules()
                                        if isinstance(m, DenseLinear)):  # a tied head counted it already
            n += lazy.shape.numel()
        return n

    def drop_dense_blocks(self) -> None:
        """Forget every block copy made by :meth:`pack_dense_blocks` (the float32 kernels run again; lazy
        weights are dequantized for them)."""
        for mod in self.modules():
            if isinstance(mod, DenseLinear):
                mod.drop_blocks()
        self.invalidate_native()

    def fused_plan(self) -> FusedPlan | None:
        """The native fused-layers plan (``bitmtp.ops.fused_layers``) when this decoder can use it,
        else None with the reason in :attr:`fused_reason`. Checked per call for the switches
        (``BITMTP_FUSED``, requested backend, op overrides); the table itself is built once."""
        ok, why = fused_enabled(self.device, self.backend)
        if not ok:
            self.__dict__["fused_reason"] = why
            return None
        if self._fused is None and self._fused_unsupported is None:
            a = self.args
            try:
                self.spec.check("the fused CPU layers (csrc/cpu/layers.cpp)", FUSED_ACTIVATIONS, FUSED_NORMS)
                specs = [FusedLayer(ly.attn.qkv_proj, ly.attn.o_proj, ly.mlp.gate_up_proj, ly.mlp.down_proj,
                                    ly.norm(Norm.ATTN_IN), ly.norm(Norm.MLP_IN), ly.norm(Norm.Q), ly.norm(Norm.K),
                                    ly.norm(Norm.ATTN_SUB), ly.norm(Norm.MLP_SUB))
                         for ly in self.layers]
                dims = Dims(a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.intermediate_size,
                            a.rms_norm_eps, FUSED_ACTIVATIONS[self.spec.activation])
                self._fused = FusedPlan(specs, dims)
            except (FusedUnsupported, UnsupportedLayer) as exc:
                self._fused_unsupported = str(exc)
        # (past nn.Module.__setattr__'s parameter / module / buffer checks: this runs every step)
        self.__dict__["fused_reason"] = "" if self._fused is not None else self._fused_unsupported
        return self._fused

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self._pending_embed() is not None else self.embed.dtype

    @property
    def device(self) -> torch.device:
        lazy = self._pending_embed()
        return lazy.blocks.data.device if lazy is not None else self.embed.device

    @property
    def ternary(self) -> bool:
        """Whether every layer's projections are ternary (W2A8) rather than dense."""
        return all(isinstance(m, TernaryLinear) for layer in self.layers
                   for m in (layer.attn.qkv_proj, layer.attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj))

    def hidden_states(self, step: StepInputs, kv, *, norm: bool = True, tail: TailCall | None = None) -> torch.Tensor:
        """Run all layers for the step's rows, writing their K/V into ``kv`` in place. ``norm=False``: the last
        layer's outputs, before the final norm (what :meth:`choose` takes). ``tail``: run in the same native call as
        the layers where they are fused (:meth:`choose_step`)."""
        a = self.args
        m = step.tokens.shape[0]
        r = step.mask_rows
        if r:
            if step.mask_block is None:
                raise BitMTPError("mask_rows: this step has mask rows but no mask_block drives them")
            p = m - r
            x = torch.cat([self.embed[step.tokens[:p]], step.mask_block.mask_embedding.to(self.dtype).expand(r, -1)])
        else:
            x = self.embed[step.tokens]  # [M, hidden]
        # the final norm through ops (native on the CPU: one call instead of nine small torch ops a step)
        # x is a fresh tensor of this step's: the native layers may run on it in place
        hidden = self.run_layers(x, step, kv, range(len(self.layers)), overwrite=True, tail=tail)
        return ops_rms_norm(hidden, self.norm, a.rms_norm_eps) if norm else hidden

    def run_layers(self, x: torch.Tensor, step: StepInputs, kv, layers, *, overwrite: bool = False,
                   tail: TailCall | None = None) -> torch.Tensor:
        """Run decoder ``layers`` (indices, in order) on the step's rows ``x [M, hidden]`` — all of them
        for :meth:`hidden_states`; the CPU-offloaded tail when earlier layers ran on another device.
        ``overwrite``: ``x`` is the caller's to give up (the native layers run on it in place). ``tail``: the
        final norm, head and choice too, when the layers run fused (its ``ran`` says; else the caller runs it)."""
        a = self.args
        m = step.tokens.shape[0]
        r = step.mask_rows
        if step.rope is not None:
            cos, sin = step.rope
        else:
            cos, sin = self.rope_cos[step.positions], self.rope_sin[step.positions]
        if cos.dtype != x.dtype:  # (no call when they match: each costs 10-30 µs a step, bench/glue.py)
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        plan = self.fused_plan()
        if plan is not None:
            out, why = self._run_fused(plan, x, step, kv, layers, cos, sin, overwrite, tail)
            if out is not None:
                self._took(FUSED, "")
                return out
            self._took(PER_OP, why)
        else:
            self._took(PER_OP, self.fused_reason or "")
        for i in layers:
            layer = self.layers[i]
            at, mlp = layer.attn, layer.mlp
            adapt = self._gated_lora(step.mask_block, i, m - r) if r else None
            h = rms_norm(x, layer.norm(Norm.ATTN_IN), a.rms_norm_eps)
            qkv = at.qkv_proj(h)
            if adapt is not None:
                qkv = adapt("qkv", h, qkv)
            q, k, v = qkv.split((a.q_size, a.kv_size, a.kv_size), dim=-1)
            q = q.reshape(m, a.num_heads, a.head_dim)
            k = k.reshape(m, a.num_kv_heads, a.head_dim)
            v = v.reshape(m, a.num_kv_heads, a.head_dim)
            if layer.norm(Norm.Q) is not None:
                q = rms_norm(q, layer.norm(Norm.Q), a.rms_norm_eps)
            if layer.norm(Norm.K) is not None:
                k = rms_norm(k, layer.norm(Norm.K), a.rms_norm_eps)
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
            keys, values = kv.write(i, k, v, step.positions if step.slots is None else step.slots)
            out = attention(q, keys, values, step.mask, at.scale, backend=self.backend).reshape(m, a.q_size)
            if layer.norm(Norm.ATTN_SUB) is not None:
                out = rms_norm(out, layer.norm(Norm.ATTN_SUB), a.rms_norm_eps)
            o = at.o_proj(out)
            x = x + (o if adapt is None else adapt("o", out, o))
            h = rms_norm(x, layer.norm(Norm.MLP_IN), a.rms_norm_eps)
            gu = mlp.gate_up_proj(h)
            if adapt is not None:
                gu = adapt("gate_up", h, gu)
            g, u = gu.split(a.intermediate_size, dim=-1)
            act = self._act(g) * u
            if layer.norm(Norm.MLP_SUB) is not None:
                act = rms_norm(act, layer.norm(Norm.MLP_SUB), a.rms_norm_eps)
            y = mlp.down_proj(act)
            if adapt is not None:
                y = adapt("down", act, y)
            if layer.norm(Norm.MLP_OUT) is not None:
                y = rms_norm(y, layer.norm(Norm.MLP_OUT), a.rms_norm_eps)
            x = x + y
        return x

    def rope_host(self) -> tuple[Any, Any] | None:
        """The RoPE tables ``(cos, sin)`` as numpy arrays sharing their memory, when they are float32 CPU tensors
        (None otherwise): the CPU runners look a step's rows up by numpy (``runtime.graphs.HostCausal``,
        ``runtime.batch_pass.HostInputs``). Made again only when the tables moved."""
        buffers = self._buffers  # (not self.rope_cos: nn.Module's attribute lookup, ~20-40 µs a step cold)
        cos, sin = buffers["rope_cos"], buffers["rope_sin"]
        held = self.__dict__.get("_rope_host")
        if held is not None and held[0] is cos and held[1] is sin and held[2] == cos.data_ptr():
            return held[3]
        tables = None
        if cos.device.type == "cpu" and cos.dtype == torch.float32 and sin.dtype == torch.float32:
            tables = (cos.numpy(), sin.numpy())
        self.__dict__["_rope_host"] = (cos, sin, cos.data_ptr(), tables)
        return tables

    def _took(self, path: str, reason: str) -> None:
        """Record the path a step ran (:attr:`last_path`, :attr:`path_counts`, :attr:`fused_reason`); the
        per-op path is logged once per reason at debug level, so a fallback is never silent."""
        # plain attributes set past nn.Module.__setattr__'s parameter / module / buffer checks: this runs every step
        d = self.__dict__
        d["last_path"] = path
        self.path_counts[path] += 1
        d["fused_reason"] = reason
        if path == PER_OP and reason not in self._logged_reasons:
            self._logged_reasons.add(reason)
            log.debug("bitmtp: a step ran the per-op layers instead of the fused CPU layers: %s", reason)

    def _run_fused(self, plan: FusedPlan, x, step: StepInputs, kv, layers, cos, sin,
                   overwrite: bool = False, tail: TailCall | None = None) -> tuple[torch.Tensor | None, str]:
        """All ``layers`` in one native call: ``(hidden, "")``, or ``(None, why)`` when this KV store or
        mask block cannot take it (the caller runs the per-op path and records ``why``)."""
        try:
            table = getattr(kv, "_fused_kv_table", None)
            if table is None:  # the store's buffers never move (runtime/kv.py): build once per store
                table = kv._fused_kv_table = kv_pointer_table(kv.k, kv.v, plan.dims)
            if table.shape[0] != plan.num_layers:
                # a store for some of the layers only: the per-op path indexes it as it must
                return None, f"the KV store holds {table.shape[0]} of the {plan.num_layers} layers"
            lora, scaling, first = None, 1.0, 0
            if step.mask_rows:
                lora, scaling = self._fused_lora(plan, step.mask_block)
                first = step.tokens.shape[0] - step.mask_rows
        except FusedUnsupported as exc:
            return None, str(exc)
        except AttributeError as exc:  # a KV store without k/v buffer lists, a block without LoRA tables
            return None, f"{type(exc).__name__}: {exc}"
        # the native layers take the KV rows to write (positions only index RoPE, done above)
        at = step.positions if step.slots is None else step.slots
        return plan.run(x, at, cos, sin, step.mask, kv.k, kv.v, layers,
                        attn_scale=self.args.head_dim**-0.5, lora=lora, lora_first_row=first,
                        lora_scaling=scaling, kv_table=table, overwrite=overwrite, tail=tail), ""

    @staticmethod
    def _fused_lora(plan: FusedPlan, block) -> tuple[torch.Tensor, float]:
        """The mask block's LoRA table for ``plan``, cached on the block with the tensors it points at."""
        cached = getattr(block, "_fused_lora", None)
        if cached is None or cached[0] is not plan:
            table, keep = plan.lora_table({key: (block.a[key], block.b[key]) for key in block.a})
            cached = block._fused_lora = (plan, table, keep)
        return cached[1], block.scaling

    @staticmethod
    def _gated_lora(block, layer: int, first_mask_row: int):
        """The gate of the gated LoRA (``model.adapters.gated_lora``): add the mask block's delta to rows
        ``[first_mask_row, M)`` only (rows before it — the pending rows — keep the base model's exact outputs)."""

        def adapt(group: str, inputs: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
            block.apply(layer, group, inputs, outputs, first_mask_row)
            return outputs

        return adapt

    def choose(self, hidden: torch.Tensor, *, out: tuple[torch.Tensor, torch.Tensor] | None = None,
               logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tok, prob, logits)`` of rows ``hidden [M, hidden]`` taken before the final norm
        (``hidden_states(..., norm=False)``): the final norm, the LM head and each row's argmax and probability —
        one native call on the CPU (``ops.head.norm_head_argmax``), the bits of
        ``argmax_prob(self.logits(final norm))``. ``out`` / ``logits_out``: buffers to write into."""
        head = self.lm_head
        if isinstance(head, DenseLinear):
            weight, blocks = head.operands(hidden.device)
            return norm_head_argmax(hidden, self.norm, self.args.rms_norm_eps, weight, blocks=blocks, bias=head.bias,
                                    head_backend=head.backend, out=out, logits_out=logits_out)
        return choose_logits(self.logits(ops_rms_norm(hidden, self.norm, self.args.rms_norm_eps)), out=out,
                             logits_out=logits_out)

    def choose_step(self, step: StepInputs, kv, heads: list[int] | None = None, *,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None,
                    logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Run the step (:meth:`hidden_states`) and choose for its rows ``heads`` (row indices, ascending; None:
        every row): ``(tok, prob, logits)`` with the bits of ``choose(hidden_states(step, kv, norm=False)[heads])``.
        Where the layers run fused on the CPU and the tail would run in one native call (``ops.head.native_tail``),
        the tail runs inside the layers' call: the whole step is ONE crossing into native code, none of the
        Python and torch between two calls (~100-160 µs a SmolLM2 step: ``bench/glue.py``). ``logits`` is then
        ``logits_out`` — None when none was given (the call kept them in its own scratch)."""
        m = step.tokens.shape[0]
        if heads is not None and len(heads) == m and heads == list(range(m)):
            heads = None
        r = m if heads is None else len(heads)
        if out is None:
            out = (torch.empty(r, dtype=torch.long), torch.empty(r, dtype=torch.float32))
        rows = None if heads is None else torch.tensor(heads, dtype=torch.long)
        spec = self._native_tail() if r else None
        tail = None if spec is None else TailCall(spec, rows, r, out[0], out[1], logits_out)
        hidden = self.hidden_states(step, kv, norm=False, tail=tail)
        if tail is not None and tail.ran:
            return out[0], out[1], logits_out
        if rows is not None:
            hidden = hidden[rows.to(hidden.device)]
        return self.choose(hidden, out=out, logits_out=logits_out)

    def _native_tail(self) -> NativeTail | None:
        """The step tail's operands for the fused CPU layers' call (``ops.head.native_tail``), or None. Kept while the
        registry's choices, the head and norm modules and :meth:`invalidate_native`'s count stay the same: like the
        fused layers' table, it points at the tensors it was made from (and keeps them), so replacing the head's or the
        norm's tensors in place needs :meth:`invalidate_native` (what ``pack_dense_blocks`` and training do)."""
        head, norm = self._modules["lm_head"], self._parameters["norm"]
        key = (choice_state(), id(head), getattr(head, "backend", None), id(norm), self._native_epoch)
        held = self.__dict__.get("_tail_spec")
        if held is not None and held[0] == key and not torch.is_grad_enabled():
            return held[1]
        spec = None
        if isinstance(head, DenseLinear) and norm.device.type == "cpu":
            weight, blocks = head.operands(norm.device)
            spec = native_tail(norm, self.args.rms_norm_eps, weight, blocks=blocks, bias=head.bias,
                               head_backend=head.backend)
        # (the key holds ids: the spec keeps the head and the norm, so they are not reused while it is held)
        self.__dict__["_tail_spec"] = (key, spec, head, norm)
        return spec

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.lm_head(hidden)
        return out if out.dtype == torch.float32 else out.float()  # (no call when it is: bench/glue.py)

    def forward(self, step: StepInputs, kv) -> torch.Tensor:
        """Logits ``[M, vocab]`` (float32) of the step's rows."""
        return self.logits(self.hidden_states(step, kv))
