"""Fused decoder layers: all layers of one step in a single native call (CPU backend).

Why: on a CPU, a small model's step is dominated by per-op dispatch. SmolLM2-135M ran ~25 torch
ops per layer from Python: 34 ms per AR step, of which the projections were 15.5 ms. The native
``fused_layers`` (csrc/cpu/layers.cpp) runs RMSNorm → q/k/v → (q/k norm) → RoPE → KV write →
attention → (sub-norm) → o → residual → RMSNorm → gate/up → SiLU or ReLU² → (sub-norm) → down →
residual for every layer, calling the same dense / W2A8 / attention kernels as the per-op path.

Numerics: projections and attention are bit-identical to the per-op CPU path (same kernels, same
inputs); RMSNorm sums in double and SiLU/RoPE round in their own order, so the step's floats differ
from the per-op path within float32 rounding. Every operation is row-wise or uses the row-
independent kernels, so a row's result does not depend on the step's width — what lossless
speculative decoding needs (tests/ops/test_fused_layers.py checks both).

A :class:`FusedPlan` is built once per decoder from plain descriptions (:class:`FusedLayer`) and
holds a reference to every tensor its int64 table points at. ``BITMTP_FUSED=0`` turns the path
off (the per-op path runs instead); so does any backend other than ``cpu`` being requested, and any
registry override of a CPU op (benchmark gates inject slowed kernels that way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from operator import is_

import torch

from bitmtp.errors import BitMTPError
from bitmtp.ops import registry
from bitmtp.ops.head import NativeTail
from bitmtp.ops.ternary_linear import TernaryLinear
from bitmtp.ops.threads import kernel_threads

ENV_VAR = "BITMTP_FUSED"

# Field numbers of csrc/cpu/layers.h.
PROJ_FIELDS = 8  # kind, weight, bias, scales, scale_rows, group, K, N
NUM_PROJ = 4  # qkv, o, gate_up, down
NORM_FIELDS = 6  # in_norm, post_norm, q_norm, k_norm, attn_sub_norm, mlp_sub_norm
LAYER_FIELDS = NUM_PROJ * PROJ_FIELDS + NORM_FIELDS
LORA_FIELDS = 3  # A, B, rank
DENSE, TERNARY = 0, 1
#: projection kinds of dense weights kept in GGML blocks (csrc/cpu/layers.h ProjKind)
BLOCK_KINDS = {"q4_1": 2, "q8_0": 3, "q4_0": 4, "bf16": 5, "f16": 6}
PROJECTIONS = ("qkv", "o", "gate_up", "down")


class FusedUnsupported(BitMTPError):
    """The model (or this step) cannot take the fused path; the message says why."""


@dataclass(eq=False)
class TailCall:
    """A step's tail run inside :meth:`FusedPlan.run`, after the layers and in the same native call: ``spec``'s final
    norm and LM head (``ops.head.native_tail``) over rows ``rows`` of the step (int64 ``[m]``; None: every row in
    order), each row's argmax and probability into ``tok`` (int64 ``[m]``) and ``prob`` (float32 ``[m]``), the
    logits into ``logits`` (float32 ``[m, N]``; None: a scratch buffer of the call's). ``ops.head.norm_head_argmax``'s
    bits. ``ran``: set when it ran (the per-op path leaves it to the caller)."""

    spec: NativeTail
    rows: torch.Tensor | None
    m: int
    tok: torch.Tensor
    prob: torch.Tensor
    logits: torch.Tensor | None = None
    ran: bool = False

    def args(self, step_rows: int) -> tuple:
        """The native call's ``tail_*`` arguments, after checking the buffers they point into."""
        m, spec = self.m, self.spec
        tok, prob, logits, rows = self.tok, self.prob, self.logits, self.rows
        if tok.dtype != torch.int64 or prob.dtype != torch.float32 or tok.shape != (m,) or prob.shape != (m,) \
                or not (tok.is_contiguous() and prob.is_contiguous()):
            raise BitMTPError(f"tail: expected contiguous int64 / float32 [{m}] outputs, got {tok.dtype} "
                              f"{tuple(tok.shape)} / {prob.dtype} {tuple(prob.shape)}")
        if logits is not None and (logits.dtype != torch.float32 or logits.shape != (m, spec.n)
                                   or not logits.is_contiguous()):
            raise BitMTPError(f"tail: logits must be a contiguous float32 [{m}, {spec.n}] buffer, got {logits.dtype} "
                              f"{tuple(logits.shape)}")
        if rows is None:
            if m > step_rows:
                raise BitMTPError(f"tail: reads {m} rows of a step of {step_rows}")
        elif rows.dtype != torch.int64 or rows.shape != (m,) or not rows.is_contiguous():
            raise BitMTPError(f"tail: rows must be a contiguous int64 [{m}] tensor, got {rows.dtype} "
                              f"{tuple(rows.shape)}")
        return (spec.norm, spec.eps, spec.w, spec.n, spec.bias, spec.fmt, 0 if rows is None else rows.data_ptr(), m,
                0 if logits is None else logits.data_ptr(), tok.data_ptr(), prob.data_ptr())


@dataclass
class FusedLayer:
    """One decoder layer as the fused kernel sees it. Projections are :class:`TernaryLinear` or any
    module with a float32 ``weight [N, K]`` and optional ``bias`` (``DenseLinear``; its GGML
    ``blocks`` are read instead of the weight when present, and ``weight`` is then never touched);
    norms are float32 ``[n]`` tensors or None."""

    qkv: object
    o: object
    gate_up: object
    down: object
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_sub_norm: torch.Tensor | None = None
    mlp_sub_norm: torch.Tensor | None = None


@dataclass(frozen=True)
class Dims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    relu2: bool


def fused_enabled(device: torch.device, backend: str | None = None) -> tuple[bool, str]:
    """Whether the fused path may run for tensors on ``device`` with ``backend`` requested."""
    if os.environ.get(ENV_VAR, "").strip() == "0":
        return False, f"{ENV_VAR}=0"
    if device.type != "cpu":
        return False, f"the fused layers are a CPU path (device {device.type})"
    requested = registry.requested_backend(backend)
    if requested not in (None, "cpu"):
        return False, f"backend {requested!r} requested"
    ok, why = registry.availability("cpu", device)
    if not ok:
        return False, f"cpu backend unavailable: {why}"
    if registry.overridden("cpu"):
        return False, "a cpu op is overridden"
    return True, "native fused layers"


def _f32(name: str, t: torch.Tensor | None, shape: tuple[int, ...] | None = None) -> torch.Tensor | None:
    # no torch call where none is needed (detach, contiguous): each costs 10-30 µs a step with the caches cold
    # after the layers (bench/glue.py), and a step runs this four times
    if t is None:
        return None
    if t.requires_grad:
        t = t.detach()
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise FusedUnsupported(f"{name}: needs float32 CPU tensors, got {t.dtype} on {t.device}")
    if shape is not None and tuple(t.shape) != shape:
        raise FusedUnsupported(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    return t if t.is_contiguous() else t.contiguous()


class FusedPlan:
    """The native layer table of one decoder (see the module docstring)."""

    def __init__(self, layers: list[FusedLayer], dims: Dims):
        self.ext = registry.backend("cpu")._ext
        self.dims = dims
        self.keep: list[torch.Tensor] = []  # everything the table points at
        d = dims
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        shapes = {"qkv": (q + 2 * kv, d.hidden), "o": (d.hidden, q), "gate_up": (2 * d.inter, d.hidden),
                  "down": (d.hidden, d.inter)}
        rows = []
        for i, spec in enumerate(layers):
            row: list[int] = []
            for name in PROJECTIONS:
                row += self._projection(f"layers.{i}.{name}", getattr(spec, name), shapes[name])
            for name, n in (("in_norm", d.hidden), ("post_norm", d.hidden), ("q_norm", d.head_dim),
                            ("k_norm", d.head_dim), ("attn_sub_norm", q), ("mlp_sub_norm", d.inter)):
                row.append(self._ptr(_f32(f"layers.{i}.{name}", getattr(spec, name), (n,))))
            if (spec.q_norm is None) != (spec.k_norm is None):
                raise FusedUnsupported(f"layers.{i}: q_norm and k_norm must come together")
            rows.append(row)
        self.table = torch.tensor(rows, dtype=torch.int64).reshape(len(layers), LAYER_FIELDS)
        self.num_layers = len(layers)
        self._layer_ids: dict[tuple[int, ...], torch.Tensor] = {}  # per layer list: built once, not per step
        #: the last step's checked inputs and tail (:meth:`run`)
        self._memo: tuple | None = None
        self._tail_memo: tuple | None = None

    def _ptr(self, t: torch.Tensor | None) -> int:
        if t is None:
            return 0
        self.keep.append(t)
        return t.data_ptr()

    def _projection(self, name: str, mod, shape: tuple[int, int]) -> list[int]:
        n, k = shape
        if isinstance(mod, TernaryLinear):
            if (mod.out_features, mod.in_features) != shape:
                raise FusedUnsupported(f"{name}: expected {k}->{n}, got {mod.in_features}->{mod.out_features}")
            if mod.backend not in (None, "cpu"):
                raise FusedUnsupported(f"{name}: pinned to backend {mod.backend!r}")
            bias = None if mod.bias is None else mod.bias.detach().float().contiguous()
            w = mod.weight.contiguous()
            scales = _f32(f"{name}.scales", mod.scales)
            return [TERNARY, self._ptr(w), self._ptr(bias), self._ptr(scales), scales.shape[0], mod.group_size, k, n]
        # blocks first: a lazy GGUF weight (model.layers.LazyWeight) has no float tensor, and asking for
        # ``weight`` would dequantize the whole matrix just to be ignored
        blocks = getattr(mod, "blocks", None)
        if blocks is None and not isinstance(getattr(mod, "weight", None), torch.Tensor):
            raise FusedUnsupported(f"{name}: {type(mod).__name__} is neither ternary nor dense")
        if getattr(mod, "backend", None) not in (None, "cpu"):
            raise FusedUnsupported(f"{name}: pinned to backend {mod.backend!r}")
        bias = _f32(f"{name}.bias", getattr(mod, "bias", None), (n,))
        if blocks is not None:  # an exact encoding of the float32 weight: the same results from fewer bytes
            if tuple(blocks.shape) != shape or blocks.data.device.type != "cpu":
                raise FusedUnsupported(f"{name}: expected {shape} blocks on the CPU, got {tuple(blocks.shape)} on "
                                       f"{blocks.data.device}")
            return [BLOCK_KINDS[blocks.fmt], self._ptr(blocks.data), self._ptr(bias), 0, 1, k, k, n]
        w = _f32(f"{name}.weight", mod.weight, shape)
        return [DENSE, self._ptr(w), self._ptr(bias), 0, 1, k, k, n]

    def lora_table(self, deltas: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, list]:
        """The LoRA table of a mask block: ``deltas[(layer, projection)] = (A [r, K], B [N, r])``.
        Returns the int64 table and the tensors it points at (keep both alive together)."""
        table = torch.zeros(self.num_layers, NUM_PROJ, LORA_FIELDS, dtype=torch.int64)
        keep = []
        for (layer, proj), (a, b) in deltas.items():
            a, b = _f32(f"lora {layer}.{proj}.A", a), _f32(f"lora {layer}.{proj}.B", b)
            if a.shape[0] != b.shape[1]:
                raise FusedUnsupported(f"lora {layer}.{proj}: A has {a.shape[0]} rows but B {b.shape[1]} columns")
            keep += [a, b]
            table[layer, PROJECTIONS.index(proj)] = torch.tensor([a.data_ptr(), b.data_ptr(), a.shape[0]])
        return table, keep

    def run(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            mask: torch.Tensor, kv_k: list[torch.Tensor], kv_v: list[torch.Tensor], layers: list[int],
            *, attn_scale: float, lora: torch.Tensor | None = None, lora_first_row: int = 0,
            lora_scaling: float = 1.0, kv_table: torch.Tensor | None = None, overwrite: bool = False,
            tail: TailCall | None = None) -> torch.Tensor:
        """Run ``layers`` on ``x [M, hidden]`` (a new tensor is returned; ``x`` is not modified, unless
        ``overwrite``: a fresh tensor the caller gives up, which is then returned), writing each row's K/V at its
        position of ``kv_k/kv_v[layer]`` (``[kv_heads, S, head_dim]``). ``kv_table``: a cached
        :func:`kv_pointer_table` of those buffers. ``tail``: the step's final norm, LM head and choice too, in the
        same call (:class:`TailCall`; its ``ran`` is set)."""
        d = self.dims
        m = x.shape[0]
        given = x
        x = _f32("x", x, (m, d.hidden))
        if x is given and not overwrite:
            x = x.clone()
        # A step's other inputs are usually the same tensors as the previous step's (a runner's buffers, refilled in
        # place): their checks and pointers are kept with them (each torch call here costs 10-30 µs with the caches
        # cold after the previous step: bench/glue.py). The memo holds the tensors, so their ids are not reused.
        if kv_table is None:
            kv_table = kv_pointer_table(kv_k, kv_v, d)
        tensors = (positions, cos, sin, mask, kv_table, lora, kv_k[0])
        scalars = (m, lora_first_row, lora_scaling, attn_scale, tuple(layers))
        memo = self._memo
        if memo is None or memo[0] != scalars or not all(map(is_, memo[1], tensors)):
            memo = self._memo = (scalars, tensors, self._checked(m, positions, cos, sin, mask, kv_k, scalars[-1],
                                                                 attn_scale, lora, lora_first_row, lora_scaling,
                                                                 kv_table))
        tail_args = () if tail is None else self._tail_args(tail, m)
        isa = registry.backend("cpu")._isa()
        try:
            mid, kv_half, _ = memo[2]
            self.ext.fused_layers(x.data_ptr(), *mid, isa, kernel_threads(), kv_half, *tail_args)
        except ValueError as exc:  # the native argument checks (positions, dimensions)
            raise BitMTPError(str(exc)) from exc
        if tail is not None:
            tail.ran = True
        return x

    def _checked(self, m: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 kv_k: list[torch.Tensor], layers: tuple[int, ...], attn_scale: float, lora: torch.Tensor | None,
                 lora_first_row: int, lora_scaling: float, kv_table: torch.Tensor) -> tuple[tuple, bool, tuple]:
        """:meth:`run`'s checks of a step's inputs besides ``x``: the native call's arguments from ``M`` to
        ``relu2``, whether the K/V buffers hold float16, and the tensors those pointers point into (some converted
        here: kept with them)."""
        d = self.dims
        s = kv_k[0].shape[1]
        if kv_table.shape != (self.num_layers, 2):
            raise BitMTPError(f"kv: the native layers index K/V buffers by layer; expected {self.num_layers} layers' "
                              f"buffers, got {kv_table.shape[0]}")
        if tuple(mask.shape[:1]) != (m,) or mask.shape[1] > s:
            raise BitMTPError(f"mask: expected [{m}, L <= {s}], got {tuple(mask.shape)}")
        if mask.dtype not in (torch.bool, torch.uint8):
            raise BitMTPError(f"mask: expected a bool or uint8 tensor, got {mask.dtype}")
        mask_u8 = mask if mask.is_contiguous() else mask.contiguous()  # one byte a flag either way: its pointer
        pos = positions
        if pos.dtype != torch.int64 or not pos.is_contiguous():
            pos = pos.to(torch.int64).contiguous()
        cos, sin = _f32("cos", cos, (m, d.head_dim)), _f32("sin", sin, (m, d.head_dim))
        key = tuple(int(i) for i in layers)  # Python ints: checking them reads nothing back from a tensor
        ids = self._layer_ids.get(key)
        if ids is None:
            if any(not 0 <= i < self.num_layers for i in key):
                raise BitMTPError(f"layers: indices must be in [0, {self.num_layers}), got {list(key)}")
            ids = self._layer_ids[key] = torch.tensor(key, dtype=torch.int64)
        if lora is not None and tuple(lora.shape) != (self.num_layers, NUM_PROJ, LORA_FIELDS):
            raise BitMTPError("lora: not a LoRA table of this plan")
        mid = (m, d.hidden, d.heads, d.kv_heads, d.head_dim, d.inter, self.table.data_ptr(), kv_table.data_ptr(),
               0 if lora is None else lora.data_ptr(), lora_first_row, float(lora_scaling), ids.data_ptr(), ids.numel(),
               cos.data_ptr(), sin.data_ptr(), pos.data_ptr(), mask_u8.data_ptr(), s, mask.shape[1], float(d.eps),
               float(attn_scale), d.relu2)
        return mid, kv_k[0].dtype == torch.float16, (kv_table, mask_u8, pos, cos, sin, ids)

    def _tail_args(self, tail: TailCall, m: int) -> tuple:
        """``tail.args(m)``, kept with the tensors it checked while the next step's tail brings the same ones."""
        given = (tail.spec, tail.rows, tail.tok, tail.prob, tail.logits)
        memo = self._tail_memo
        if memo is None or memo[1] != (tail.m, m) or not all(map(is_, memo[0], given)):
            memo = self._tail_memo = (given, (tail.m, m), tail.args(m))
        return memo[2]


def kv_pointer_table(kv_k: list[torch.Tensor], kv_v: list[torch.Tensor], dims: Dims) -> torch.Tensor:
    """``int64 [layers, 2]`` of K/V buffer pointers, after checking each buffer's dtype and shape: all
    float32, or all float16 (the native layers store rows rounded to float16, as ``KVStore.write`` does)."""
    rows = []
    s = kv_k[0].shape[1]
    dtype = kv_k[0].dtype
    for i, (k, v) in enumerate(zip(kv_k, kv_v, strict=True)):
        for name, t in (("k", k), ("v", v)):
            if t.dtype not in (torch.float32, torch.float16) or t.device.type != "cpu" or not t.is_contiguous():
                raise FusedUnsupported(f"kv.{name}[{i}]: needs a contiguous float32 or float16 CPU buffer, "
                                       f"got {t.dtype}")
            if t.dtype != dtype:
                raise FusedUnsupported(f"kv.{name}[{i}]: {t.dtype}, but kv.k[0] is {dtype} (one dtype for all)")
            if tuple(t.shape) != (dims.kv_heads, s, dims.head_dim):
                raise FusedUnsupported(f"kv.{name}[{i}]: expected {(dims.kv_heads, s, dims.head_dim)}, "
                                       f"got {tuple(t.shape)}")
        rows.append([k.data_ptr(), v.data_ptr()])
    return torch.tensor(rows, dtype=torch.int64)
