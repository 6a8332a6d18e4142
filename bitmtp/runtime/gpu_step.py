"""The GPU step in few launches (DESIGN.md, "The GPU step: a launch budget"): embedding, every decoder layer,
the final norm and the LM head with argmax / probability / runner-up, as the fused Triton kernels of
``bitmtp.triton_kernels.layers`` — 9 launches a layer and 5 a step where the per-op path launched ~90 a layer.

Opt-in (``BITMTP_GPU_STEP=fused``) until a GPU run has verified it (``bench/gpu_check.sh``): then the
graph pool's decode and verify steps of width ≤ 16 run :meth:`GpuStepPlan.step` (inside a CUDA graph on a
GPU; through Triton's interpreter on CPU tensors with ``TRITON_INTERPRET=1``, for tests). Steps it does not
cover (wider steps, the heads drafter's, the top2 runner-up row) and models it does not cover (MLP-output norms,
other activations, head sizes that are not powers of two) run the per-op path, with the reason in
``decoder.gpu_step_reason``. Sampled steps and steps that keep their logits run the layers fused and end in the
head's logits (one launch), then choose with the sampler's torch ops.

Every launch goes through one counting :class:`Launcher`; the only launch outside it is the step's attention
mask (built by the caller's mask function, one torch op): ``tests/runtime/test_gpu_step.py`` counts every op a
step dispatches and fails above the budget.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch

from bitmtp.model.layers import DenseLinear
from bitmtp.ops.ternary_linear import TernaryLinear

#: the opt-in switch and its value
ENV_VAR, ENABLED = "BITMTP_GPU_STEP", "fused"
#: the launch budget: kernels a layer, and a step's own (embedding, final norm, head, argmax / probabilities)
LAYER_BUDGET, STEP_BUDGET = 10, 6
#: the widest step the fused kernels take (``bitmtp.triton_kernels.layers.ROWS``; wider steps run per op)
ROWS = 16


class Unsupported(Exception):
    """The model or step is not one the fused GPU step covers (the message says what)."""


class Launcher:
    """Runs and counts every kernel launch of a step (``launch(name, kernel, grid, *args, **kwargs)``)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def __call__(self, name: str, kernel: Any, grid: tuple, *args: Any, **kwargs: Any) -> None:
        self.counts[name] += 1
        kernel[grid](*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def reset(self) -> None:
        self.counts.clear()


def enabled(device: torch.device) -> tuple[bool, str]:
    """Whether steps on ``device`` take the fused GPU step, and why not."""
    if os.environ.get(ENV_VAR, "") != ENABLED:
        return False, f"opt in with {ENV_VAR}={ENABLED} (not yet verified on a GPU)"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:  # the W2A8 kernels' int8 tl.dot needs int8 tensor cores
            return False, (f"int8 tensor cores need an Ampere (sm_80) or later GPU; this one is sm_{major}{minor}: "
                           "steps run per op")
        return True, ""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return True, "Triton interpreter"
    return False, f"the fused GPU step runs on CUDA devices (or the Triton interpreter), not {device.type}"


def _projection(mod: Any, what: str) -> tuple[str, Any]:
    """``("ternary", module)`` or ``("dense", module)`` — the two kinds of projection the fused kernels take."""
    if isinstance(mod, TernaryLinear):
        if mod.bias is not None:
            raise Unsupported(f"{what}: a ternary projection with a bias")
        return "ternary", mod
    if isinstance(mod, DenseLinear):
        if mod.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise Unsupported(f"{what}: a {mod.weight.dtype} dense weight")
        return "dense", mod
    raise Unsupported(f"{what}: a {type(mod).__name__} projection (the fused GPU step takes ternary and dense ones)")


def _splits(units: int, k: int, sms: int) -> int:
    """K-slices so that units × slices fills the SMs about twice (each slice at least 256 wide)."""
    want = max(1, -(-2 * sms // max(units, 1)))
    return max(1, min(want, k // 256))


class GpuStepPlan:
    """A decoder's weights and scratch laid out for the fused kernels, for one KV store."""

    def __init__(self, decoder: Any, kv: Any):
        from bitmtp.model.families import Activation, Norm
        from bitmtp.triton_kernels import layers as kernels

        self.kernels = kernels
        a = decoder.args
        spec = decoder.spec
        acts = {Activation.RELU2: "relu2", Activation.SILU: "silu"}
        if spec.activation not in acts:
            raise Unsupported(f"activation {spec.activation!r} (the fused GPU step has relu2 and silu)")
        self.activation = acts[spec.activation]
        if a.head_dim % 2 or a.head_dim & (a.head_dim - 1) or a.head_dim < 16:
            raise Unsupported(f"head_dim {a.head_dim} (the fused attention takes powers of two >= 16)")
        self.layers = []
        for i, layer in enumerate(decoder.layers):
            if layer.norm(Norm.MLP_OUT) is not None:
                raise Unsupported(f"layer {i}: a {Norm.MLP_OUT.value} norm")
            qn, kn = layer.norm(Norm.Q), layer.norm(Norm.K)
            if (qn is None) != (kn is None):
                raise Unsupported(f"layer {i}: a {(Norm.Q if kn is None else Norm.K).value} norm without the other")
            self.layers.append({
                "qk_norm": None if qn is None else (qn, kn, a.rms_norm_eps),
                "qkv": _projection(layer.attn.qkv_proj, f"layer {i} qkv"),
                "o": _projection(layer.attn.o_proj, f"layer {i} o"),
                "gate_up": _projection(layer.mlp.gate_up_proj, f"layer {i} gate_up"),
                "down": _projection(layer.mlp.down_proj, f"layer {i} down"),
                "attn_in": layer.norm(Norm.ATTN_IN), "mlp_in": layer.norm(Norm.MLP_IN),
                "attn_sub": layer.norm(Norm.ATTN_SUB), "mlp_sub": layer.norm(Norm.MLP_SUB),
            })
        self.args, self.eps = a, a.rms_norm_eps
        dev = decoder.device
        self.device = dev
        embed = decoder.embed
        self.embed = embed.materialize() if hasattr(embed, "materialize") and not isinstance(embed, torch.Tensor) \
            else embed
        self.norm = decoder.norm
        self.head = decoder.lm_head.weight
        self.cos, self.sin = decoder.rope_cos, decoder.rope_sin
        self.kv = kv
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 2
        rows = kernels.ROWS
        f32 = dict(dtype=torch.float32, device=dev)
        h, q_size, inter = a.hidden_size, a.num_heads * a.head_dim, a.intermediate_size
        max_k = max(h, q_size, inter)
        self.x = torch.zeros(rows, h, **f32)  # the residual stream
        self.hn = torch.zeros(rows, h, **f32)  # the final norm's rows
        self.xq = torch.zeros(rows, max_k, dtype=torch.int8, device=dev)
        self.xs = torch.ones(rows, **f32)
        self.q = torch.zeros(rows, q_size, **f32)
        self.act = torch.zeros(rows, inter, **f32)
        self.hf = torch.zeros(rows, max_k, **f32)  # float rows into a dense projection
        self.t = torch.zeros(rows, 16, **f32)  # the mask rows' gated-LoRA down-projection (grown to the rank)
        self.seconds = torch.zeros(rows, dtype=torch.long, device=dev)
        max_n, max_ng, max_units, max_parts = 1, 1, 1, 0
        self.splits: list[dict[str, int]] = []
        heads = a.num_heads + 2 * a.num_kv_heads
        for ly in self.layers:
            sp = {}
            for name in ("qkv", "o", "gate_up", "down"):
                kind, mod = ly[name]
                n, k = mod.weight.shape
                if kind == "ternary":
                    k = mod.in_features
                    max_ng = max(max_ng, mod.scales.shape[1])
                epi = {"qkv": "qkv", "o": "residual", "gate_up": "glu", "down": "residual"}[name]
                units = kernels.w2a8_units(n, epi, inter=inter, heads=heads)
                sp[name] = _splits(units, k, sms)
                max_n, max_units = max(max_n, n), max(max_units, units)
                max_parts = max(max_parts, sp[name] * rows * n if kind == "dense" else 0)
            self.splits.append(sp)
        # int32 partials (ternary) and per-unit counters: zero, and left zero by every launch; float partials (dense)
        self.acc = torch.zeros(rows, max_n, max_ng, dtype=torch.int32, device=dev)
        self.parts = torch.zeros(max(max_parts, 1), **f32)
        self.counter = torch.zeros(max_units, dtype=torch.int32, device=dev)
        self.attn_parts = kernels.attention_scratch(a.num_kv_heads, a.num_heads, a.head_dim, kv.rows, dev)
        self.nsplit_max = -(-kv.rows // kernels.ATTN_SPLIT)
        self.head_parts = kernels.head_scratch(self.head.shape[0], dev)
        self.scale = a.head_dim ** -0.5
        self._logits: torch.Tensor | None = None

    def logits_rows(self, m: int) -> torch.Tensor:
        """A float32 ``[m, V]`` view of the plan's logits buffer (made on first use: 16 rows of the vocabulary)."""
        if self._logits is None:
            self._logits = torch.zeros(self.kernels.ROWS, self.head.shape[0], dtype=torch.float32, device=self.device)
        return self._logits[:m]

    def _xq(self, k: int) -> torch.Tensor:
        return self.xq[:, :k] if k == self.xq.shape[1] else self.xq.view(-1)[: self.xq.shape[0] * k].view(-1, k)

    def _input(self, launch: Launcher, x: torch.Tensor, norm: torch.Tensor | None, kind: str, k: int, m: int,
               lora: Any = None) -> None:
        """Rows ``x`` (after ``norm``) made ready for a ``kind`` projection: int8 rows and scales, or float rows
        (and the mask rows' LoRA down-projection)."""
        if kind == "ternary":
            self.kernels.norm_quant(launch, x, norm, self.eps, m=m, q=self._xq(k), s=self.xs, lora=lora)
        else:
            self.kernels.norm_quant(launch, x, norm, self.eps, m=m, f=self.hf[:, :k], lora=lora)

    def _lora(self, block: Any, layer: int, group: str, first: int) -> tuple[Any, Any]:
        """(down, up) LoRA arguments of ``group`` in ``layer`` for the kernels (None, None: not a target)."""
        if block is None or (layer, group) not in block.a:
            return None, None
        return ((block.a[(layer, group)], self.t, first),
                (block.b[(layer, group)], self.t, first, block.scaling))

    def _project(self, launch: Launcher, proj: tuple[str, Any], splits: int, k: int, m: int, **kw: Any) -> None:
        kind, mod = proj
        if kind == "ternary":
            self.kernels.w2a8_fused(launch, self._xq(k), self.xs, mod.weight, mod.scales, k, mod.group_size,
                                    self.acc, self.counter, m=m, splits=splits, **kw)
        else:
            src = kw.pop("src", None)
            self.kernels.dense_fused(launch, self.hf if src is None else src, mod.weight, mod.bias, self.parts,
                                     self.counter, m=m, splits=splits, **kw)

    def step(self, launch: Launcher, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             mask: torch.Tensor, out_token: torch.Tensor | None, out_prob: torch.Tensor | None, *, m: int,
             mask_rows: int = 0, block: Any = None, logits: torch.Tensor | None = None) -> None:
        """One step over ``m ≤ 16`` rows: ``tokens / positions / slots`` (int64, ≥ m long), ``mask [m, L]`` (bool);
        writes the rows' K/V into the store and their argmax / probability into ``out_token / out_prob`` (and
        every row's runner-up into :attr:`seconds`) when ``out_token`` is given, and, given ``logits`` (float32
        ``[≥ m, V]``), the rows' logits there for the caller to choose from (a sampler, kept logits). The last
        ``mask_rows`` rows are mask
        rows of the mask-block adapter ``block`` (a ``bitmtp.model.adapters.MaskBlock``): its mask embedding and
        gated LoRA."""
        kn, a = self.kernels, self.args
        first = m - mask_rows
        if mask_rows:
            self._check_block(block)
        kn.embed_rows(launch, tokens, self.embed, self.x, m=m, first_mask_row=first,
                      mask_embedding=block.mask_embedding if mask_rows else None)
        block = block if mask_rows else None
        h, q_size, inter = a.hidden_size, a.num_heads * a.head_dim, a.intermediate_size
        mask_u8 = mask.view(torch.uint8)
        for i, ly in enumerate(self.layers):
            sp = self.splits[i]
            down, up = self._lora(block, i, "qkv", first)
            self._input(launch, self.x, ly["attn_in"], ly["qkv"][0], h, m, down)
            self._project(launch, ly["qkv"], sp["qkv"], h, m, epilogue="qkv", out=self.q, lora=up,
                          qkv=(positions, slots, self.cos, self.sin, self.kv.k[i], self.kv.v[i], a.num_heads,
                               a.num_kv_heads, a.head_dim), qk_norm=ly["qk_norm"])
            dense_o = ly["o"][0] == "dense"
            down, up = self._lora(block, i, "o", first)
            kn.attention_split(launch, self.q.view(-1, a.num_heads, a.head_dim), self.kv.k[i], self.kv.v[i], mask_u8,
                               self.scale, self.attn_parts, m=m, nsplit_max=self.nsplit_max, sub_norm=ly["attn_sub"],
                               eps=self.eps, q_out=None if dense_o else self._xq(q_size),
                               s_out=None if dense_o else self.xs, f_out=self.hf[:, :q_size] if dense_o else None,
                               lora=down)
            self._project(launch, ly["o"], sp["o"], q_size, m, epilogue="residual", out=self.x, lora=up)
            down, up = self._lora(block, i, "gate_up", first)
            self._input(launch, self.x, ly["mlp_in"], ly["gate_up"][0], h, m, down)
            self._project(launch, ly["gate_up"], sp["gate_up"], h, m, epilogue="glu", out=self.act, inter=inter,
                          activation=self.activation, lora=up)
            down, up = self._lora(block, i, "down", first)
            if ly["down"][0] == "dense" and ly["mlp_sub"] is None:  # float rows as they are
                if down is not None:  # the mask rows' LoRA down-projection still needs a pass over the rows
                    kn.norm_quant(launch, self.act, None, self.eps, m=m, lora=down)
                self._project(launch, ly["down"], sp["down"], inter, m, epilogue="residual", out=self.x, src=self.act,
                              lora=up)
            else:
                self._input(launch, self.act, ly["mlp_sub"], ly["down"][0], inter, m, down)
                self._project(launch, ly["down"], sp["down"], inter, m, epilogue="residual", out=self.x, lora=up)
        kn.norm_quant(launch, self.x, self.norm, self.eps, m=m, f=self.hn)
        if out_token is not None:
            kn.head_argmax(launch, self.hn, self.head, self.head_parts, out_token, out_prob, self.seconds, m=m)
        if logits is not None:  # a batch of greedy and sampled rows asks for both
            kn.head_logits(launch, self.hn, self.head, logits, m=m)

    def _check_block(self, block: Any) -> None:
        """The LoRA ranks must fit the plan's ``t`` buffer (made for the largest group rank seen)."""
        rank = max((b.shape[1] for b in block.b.values()), default=1)
        if rank > self.t.shape[1]:
            self.t = torch.zeros(self.t.shape[0], 1 << (rank - 1).bit_length(), dtype=torch.float32,
                                 device=self.device)


def planned_bytes(args: Any, *, m: int, length: int, head_bytes: int, kv_bytes: int = 2, sms: int = 132,
                  scale_bytes: int = 4) -> dict[str, int]:
    """The memory traffic one fused step of ``m`` rows over ``length`` KV rows plans, for a ternary model of
    ``args`` on a GPU with ``sms`` SMs, from the kernels' own loads and stores:

    * ``weights``: every packed T2 word once (split-K slices are disjoint) and the scales; ``head``: the LM head
      once; ``kv``: each KV row read once per KV head (one split-KV program serves its group's heads and rows)
      plus the step's rows written;
    * ``scratch``: the bytes of the buffers kernels hand each other (residual rows, int8 rows, int32 partials,
      attention and head partials) — a few MB that stay in L2; counted once, as the most they add to HBM traffic;
    * ``on_chip``: the traffic to those buffers (loads, stores and atomics; L2), reported, not counted.

    ``roofline`` = weights + head + KV read: what a step must read. ``tests/runtime/test_gpu_step.py`` holds
    ``hbm`` (weights + head + KV + scratch) to ≤ 1.05× of it at BitNet-2B shapes."""
    rows = 16
    h, q, inter, kvh, d, layers = (args.hidden_size, args.num_heads * args.head_dim, args.intermediate_size,
                                   args.num_kv_heads, args.head_dim, args.num_layers)
    kv_size = kvh * d
    heads = args.num_heads + 2 * kvh
    # (N, K, units along N) of qkv, o, gate_up, down as w2a8_fused lays them out
    shapes = [(q + 2 * kv_size, h, heads), (h, q, -(-h // 64)), (2 * inter, h, -(-inter // 64)),
              (h, inter, -(-h // 64))]
    weights = layers * sum(n * (-(-k // 16)) * 4 + scale_bytes for n, k, _ in shapes)
    kv_read = layers * 2 * kvh * length * d * kv_bytes
    kv_write = layers * 2 * m * kv_size * kv_bytes
    nsplit = -(-length // 256)
    r = 1 << (rows * (args.num_heads // kvh) - 1).bit_length()
    nvb = -(-args.vocab_size // 128)
    scratch = (rows * h * 4 * 2 + rows * max(h, q, inter) + rows * 4 + rows * q * 4 + rows * inter * 4
               + rows * max(n for n, _, _ in shapes) * 4 + max(u for _, _, u in shapes) * 4
               + kvh * -(-(args.max_position_embeddings or length) // 256) * r * (d + 2) * 4 + rows * nvb * 5 * 4)
    on_chip = 0
    for k in (h, h, inter):  # norm_quant: read float rows, write int8 rows and scales
        on_chip += m * k * 4 + rows * k + rows * 4
    for n, k, units in shapes:  # each slice reads its int8 rows; partials added atomically, read, cleared
        splits = _splits(units, k, sms)
        on_chip += units * splits * m * -(-k // splits) + splits * m * n * 4 * 2 + 2 * m * n * 4 + m * n * 4
    on_chip += 2 * kvh * nsplit * r * (d + 2) * 4 + rows * q + m * q * 4  # attention partials, quantized rows
    on_chip = layers * on_chip + rows * h * 4 * 3 + m * h * 4 + 2 * rows * nvb * 5 * 4
    roofline = weights + head_bytes + kv_read
    return {"weights": weights, "head": head_bytes, "kv": kv_read + kv_write, "scratch": scratch,
            "hbm": weights + head_bytes + kv_read + kv_write + scratch, "on_chip": on_chip, "roofline": roofline}


def plan_for(decoder: Any, kv: Any) -> GpuStepPlan | None:
    """The decoder's fused GPU step plan for ``kv`` (built once per store), or None — with the reason in
    ``decoder.gpu_step_reason`` — when it is off or does not cover this model."""
    ok, why = enabled(decoder.device)
    if not ok:
        if decoder.gpu_step_reason != why:  # (every step asks: no nn.Module.__setattr__ when nothing changed)
            decoder.gpu_step_reason = why
        return None
    cached = getattr(kv, "_gpu_step_plan", None)
    if cached is not None and cached[0] is decoder:
        if decoder.gpu_step_reason != cached[2]:
            decoder.gpu_step_reason = cached[2]
        return cached[1]
    try:
        plan, reason = GpuStepPlan(decoder, kv), ""
    except Unsupported as exc:
        plan, reason = None, str(exc)
    kv._gpu_step_plan = (decoder, plan, reason)
    decoder.gpu_step_reason = reason
    return plan


__all__ = ["ENABLED", "ENV_VAR", "LAYER_BUDGET", "STEP_BUDGET", "ROWS", "GpuStepPlan", "Launcher", "Unsupported",
           "enabled", "plan_for", "planned_bytes"]
