"""VRAM budget planner of the Vulkan runtime (``runtime="vulkan"``) with CPU offload (issue #8).

Target: small GPUs such as the RTX 3050 Laptop (4 GB, at most 3.9 GB usable) driven over Vulkan
through wgpu. :func:`plan_offload` decides, from a model's shape alone, what lives where:

* a fixed **device workspace** — the activation and scratch buffers of one ``m_max``-row step
  (formula in :func:`workspace_tensors`);
* the **LM head** (dense, plus the final norm) — on the device when it fits together with at least
  one decoder layer, else on the CPU;
* the **embeddings** — with the LM head: a tied model gathers the step's rows from the LM head's
  device copy, an untied one keeps its own table on the device (the host uploads token ids only);
  on the host when the LM head is on the CPU;
* the **decoder layers**, in order — each layer's weights plus its KV cache go on the device while
  they fit; the remaining tail runs on the CPU through the native CPU kernels (its KV lives on the
  host) and only the step's M hidden rows cross between the two.

It also records, per tensor kind, how many row chunks a tensor must be split into so that no
binding exceeds the device's maximum storage-buffer binding size (wgpu's
``max_storage_buffer_binding_size``; 128 MiB on Mesa lavapipe) — a 128k-vocabulary LM head is far
larger than that. :func:`check_device_limits` raises when a single row of a device tensor exceeds the
limit, because then no row split can help.

Only the standard library, :class:`~bitmtp.model.args.ModelArgs` and the family registry (a layer's
norm slots and their sizes, ``bitmtp.model.families``) are used: plans can be printed for models that
are not on this machine (the CLI's presets, ``bitmtp.cli_presets``), without torch work or downloads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import Any

from bitmtp.errors import BitMTPError
from bitmtp.formats.ternary import words_per_row
from bitmtp.model.args import ModelArgs
from bitmtp.model.families import get_family, norm_size

#: Usable VRAM of the target GPU (RTX 3050 Laptop, 4 GB): 3.9 GB.
DEFAULT_VRAM_BUDGET = int(3.9 * 10**9)
#: wgpu's max storage buffer binding size on Mesa lavapipe (the CI's software Vulkan).
LAVAPIPE_MAX_BINDING_BYTES = 128 * 2**20

MIB = 2**20
F32 = 4
I32 = 4

#: Projections of one decoder layer, in execution order: name -> (rows N, input features K) getter.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class OffloadError(BitMTPError, ValueError):
    """A plan cannot be made: bad arguments, or a budget or device limit the model cannot meet.

    ``plan`` is the plan that failed (``None`` when the arguments were rejected before planning).
    """

    def __init__(self, message: str, plan: OffloadPlan | None = None):
        super().__init__(message)
        self.plan = plan


# ---------------------------------------------------------------------------------------------------
# Tensors


@dataclass(frozen=True)
class TensorSpec:
    """One buffer: ``rows`` rows of ``row_bytes`` bytes each (a row is the unit a split keeps whole).

    For a layer tensor ``name`` is its kind (``"layer.q_proj"``, ``"layer.k_cache"``, ...) and stands
    for the same tensor in every layer.
    """

    name: str
    rows: int
    row_bytes: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def chunks(self, max_binding_bytes: int | None) -> int:
        """Number of row chunks of at most ``max_binding_bytes`` each (1 = no split needed).

        Raises:
            OffloadError: one row alone exceeds the limit (use :func:`check_device_limits` for a
                message that names the plan).
        """
        if max_binding_bytes is None or self.nbytes <= max_binding_bytes:
            return 1
        per_chunk = max_binding_bytes // self.row_bytes
        if per_chunk < 1:
            raise OffloadError(
                f"{self.name}: one row is {self.row_bytes} bytes, more than the device's binding limit of "
                f"{max_binding_bytes} bytes, so the tensor cannot be split by rows")
        return -(-self.rows // per_chunk)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "rows": self.rows, "row_bytes": self.row_bytes, "bytes": self.nbytes,
                "dtype": self.dtype, "shape": list(self.shape)}


def _projection_shapes(args: ModelArgs) -> dict[str, tuple[int, int]]:
    h, i = args.hidden_size, args.intermediate_size
    return {"q_proj": (args.q_size, h), "k_proj": (args.kv_size, h), "v_proj": (args.kv_size, h),
            "o_proj": (h, args.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def _dtype_name(nbytes: int) -> str:
    return {1: "int8", 2: "bf16", 4: "f32", 8: "f64"}.get(nbytes, f"{nbytes}B")


def layer_tensors(args: ModelArgs, *, capacity: int = 2048, m_max: int = 31, dense_dtype_bytes: int = 2,
                  kv_dtype_bytes: int = 2, ternary: bool = True, group_size: int | None = None) -> list[TensorSpec]:
    """The buffers of one decoder layer (identical for every layer).

    * projections q, k, v, o, gate, up, down (N × K each): ternary → T2 words
      ``int32[N, ceil(K/16)]`` (N × ceil(K/16) × 4 bytes) plus float32 scales — per tensor (4 bytes)
      by default, or ``[N, ceil(K/group_size)]`` when ``group_size`` is given (Bonsai: 128);
      dense → N × K × ``dense_dtype_bytes``;
    * biases where ``attention_bias`` / ``mlp_bias`` say so (float32 for ternary, dense dtype otherwise);
    * norms in float32, one per norm slot of the model's family (``Family.layer_norms``; named
      ``layer.norm.<slot>``), each of ``families.norm_size(slot, args)`` elements;
    * the KV cache: K and V, each ``[kv_heads, capacity + m_max, head_dim]`` × ``kv_dtype_bytes``
      (one row of a split = one KV head).
    """
    out: list[TensorSpec] = []
    bias_bytes = F32 if ternary else dense_dtype_bytes
    for name, (n, k) in _projection_shapes(args).items():
        if ternary:
            words = words_per_row(k)
            out.append(TensorSpec(f"layer.{name}", n, words * I32, "int32 (T2)", (n, words)))
            if group_size is None:
                out.append(TensorSpec(f"layer.{name}.scales", 1, F32, "f32", (1, 1)))
            else:
                groups = -(-k // group_size)
                out.append(TensorSpec(f"layer.{name}.scales", n, groups * F32, "f32", (n, groups)))
        else:
            out.append(TensorSpec(f"layer.{name}", n, k * dense_dtype_bytes, _dtype_name(dense_dtype_bytes), (n, k)))
        has_bias = args.mlp_bias if name in ("gate_proj", "up_proj", "down_proj") else args.attention_bias
        if has_bias:
            out.append(TensorSpec(f"layer.{name}.bias", 1, n * bias_bytes, _dtype_name(bias_bytes), (n,)))
    for slot in get_family(args.family).layer_norms:
        size = norm_size(slot, args)
        out.append(TensorSpec(f"layer.norm.{slot.value}", 1, size * F32, "f32", (size,)))
    rows = capacity + m_max
    for name in ("k_cache", "v_cache"):
        out.append(TensorSpec(f"layer.{name}", args.num_kv_heads, rows * args.head_dim * kv_dtype_bytes,
                              _dtype_name(kv_dtype_bytes), (args.num_kv_heads, rows, args.head_dim)))
    return out


def workspace_tensors(args: ModelArgs, *, capacity: int = 2048, m_max: int = 31) -> list[TensorSpec]:
    """The fixed device workspace of one step of up to ``m_max`` rows (all float32 unless noted).

    With M = m_max, S = capacity + m_max, h = hidden, q = heads × head_dim, kv = kv_heads × head_dim,
    I = intermediate, H = heads, V = vocab::

        hidden x + normed h      2 · M · h · 4
        int8 activations         M · max(h, q, I) · 1   + act scales M · 4
        qkv                      M · (q + 2·kv) · 4
        attention output         M · q · 4
        attention scores         H · M · S · 4
        attention mask           M · S · 4
        MLP gate|up, act         M · 2I · 4  +  M · I · 4
        RoPE cos/sin tables      2 · S · (head_dim / 2) · 4
        logits (LM head rows)    M · V · 4
        argmax outputs           M · (4 + 4)          (int32 token, f32 probability)
        static inputs            M · 3 · 4 + 4        (tokens, positions, row kinds; committed length n)

    The logits rows are reserved even when the LM head runs on the CPU (a conservative budget).
    """
    m, s, h = m_max, capacity + m_max, args.hidden_size
    q, kv, i, heads, v = args.q_size, args.kv_size, args.intermediate_size, args.num_heads, args.vocab_size
    widest = max(h, q, i)
    return [
        TensorSpec("ws.hidden", m, h * F32, "f32", (m, h)),
        TensorSpec("ws.normed", m, h * F32, "f32", (m, h)),
        TensorSpec("ws.act_q", m, widest, "int8", (m, widest)),
        TensorSpec("ws.act_scales", m, F32, "f32", (m,)),
        TensorSpec("ws.qkv", m, (q + 2 * kv) * F32, "f32", (m, q + 2 * kv)),
        TensorSpec("ws.attn_out", m, q * F32, "f32", (m, q)),
        TensorSpec("ws.scores", heads * m, s * F32, "f32", (heads, m, s)),
        TensorSpec("ws.mask", m, s * F32, "f32", (m, s)),
        TensorSpec("ws.gate_up", m, 2 * i * F32, "f32", (m, 2 * i)),
        TensorSpec("ws.mlp_act", m, i * F32, "f32", (m, i)),
        TensorSpec("ws.rope", 2 * s, (args.head_dim // 2) * F32, "f32", (2, s, args.head_dim // 2)),
        TensorSpec("ws.logits", m, v * F32, "f32", (m, v)),
        TensorSpec("ws.argmax", m, I32 + F32, "int32+f32", (m, 2)),
        TensorSpec("ws.inputs", 1, 3 * m * I32 + I32, "int32", (3 * m + 1,)),
    ]


def lm_head_tensors(args: ModelArgs, *, dense_dtype_bytes: int = 2) -> list[TensorSpec]:
    """The dense LM head ``[vocab, hidden]`` and the final norm (float32) that precedes it."""
    v, h = args.vocab_size, args.hidden_size
    return [TensorSpec("lm_head", v, h * dense_dtype_bytes, _dtype_name(dense_dtype_bytes), (v, h)),
            TensorSpec("final_norm", 1, h * F32, "f32", (h,))]


# ---------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class PlanEntry:
    """One component of the plan.

    ``device``: ``"gpu"`` (device memory), ``"cpu"`` (runs on the CPU, weights in host memory) or
    ``"host"`` (host memory, used by the host itself, e.g. the embedding lookup). ``chunks``: the
    largest number of row chunks any of the component's tensors is split into to respect the device's
    binding limit (1 = nothing split; always 1 off the device or without a limit; 0 = a row alone
    exceeds the limit, which :func:`plan_offload` turns into an error).
    """

    name: str
    device: str
    bytes: int
    chunks: int = 1
    notes: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "device": self.device, "bytes": self.bytes, "chunks": self.chunks,
                "notes": self.notes}


@dataclass
class OffloadPlan:
    """Where each part of a model lives under a VRAM budget (built by :func:`plan_offload`).

    ``entries``: workspace, lm_head (with the final norm), embeddings, then ``layer.0`` ..
    ``layer.{L-1}``. ``gpu_bytes``: total device bytes (workspace + LM head if on the device + the
    device layers). ``fits``: the whole model runs on the device (every layer and the LM head);
    ``False`` means a partial offload — a plan that cannot place even one layer is never returned
    (:func:`plan_offload` raises). ``tensors``: every tensor kind with its shape; ``chunks``: per tensor
    kind, the number of row chunks it needs under ``max_binding_bytes`` (0: one row exceeds the limit;
    only an error for tensors on the device).
    """

    args: ModelArgs
    budget: int
    entries: list[PlanEntry]
    gpu_layers: list[int]
    cpu_layers: list[int]
    gpu_bytes: int
    fits: bool
    capacity: int
    m_max: int
    ternary: bool
    dense_dtype_bytes: int
    kv_dtype_bytes: int
    max_binding_bytes: int | None
    tensors: list[TensorSpec] = field(default_factory=list)
    chunks: dict[str, int] = field(default_factory=dict)
    name: str | None = None

    @property
    def lm_head_on_gpu(self) -> bool:
        return self.entry("lm_head").device == "gpu"

    @property
    def layer_bytes(self) -> int:
        """Bytes of one decoder layer: weights, norms and its KV cache."""
        return sum(t.nbytes for t in self.tensors if t.name.startswith("layer."))

    @property
    def step_transfer_bytes(self) -> int:
        """Bytes of the step's hidden rows (m_max × hidden × float32) crossing host↔device once."""
        return self.m_max * self.args.hidden_size * F32

    def entry(self, name: str) -> PlanEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    def device_tensors(self) -> list[TensorSpec]:
        """The tensor kinds that are bound on the device under this plan."""
        out = [t for t in self.tensors if t.name.startswith("ws.")]
        if self.lm_head_on_gpu:
            out += [t for t in self.tensors if t.name in ("lm_head", "final_norm")]
        if self.gpu_layers:
            out += [t for t in self.tensors if t.name.startswith("layer.")]
        return out

    def summary(self) -> str:
        """``"N of L layers on the GPU, X MiB of Y MiB budget; K layers on the CPU move ..."``."""
        a, n_cpu = self.args, len(self.cpu_layers)
        head = (f"{len(self.gpu_layers)} of {a.num_layers} layers on the GPU, "
                f"{self.gpu_bytes / MIB:.1f} MiB of {self.budget / MIB:.1f} MiB budget")
        move = f"{self.m_max}×{a.hidden_size}×4 = {self.step_transfer_bytes} bytes per step"
        layers = f"{n_cpu} layer{'' if n_cpu == 1 else 's'} on the CPU"
        verb = "moves" if n_cpu == 1 else "move"
        if n_cpu and self.lm_head_on_gpu:
            tail = f"{layers} {verb} {move} each way"
        elif n_cpu:
            tail = f"{layers} {verb} {move} device→host (LM head on the CPU too)"
        elif not self.lm_head_on_gpu:
            tail = f"no layers on the CPU; the LM head on the CPU gets {move} device→host"
        else:
            tail = "no layers on the CPU"
        return f"{head}; {tail}"

    def _rows(self) -> list[tuple[str, str, int, str]]:
        rows = [(e.name, e.device, e.bytes, e.notes) for e in self.entries if not e.name.startswith("layer.")]
        layers = [e for e in self.entries if e.name.startswith("layer.")]
        start = 0
        while start < len(layers):  # group contiguous runs on the same device
            end = start
            while end + 1 < len(layers) and layers[end + 1].device == layers[start].device:
                end += 1
            run = layers[start:end + 1]
            label = f"layer {start}" if start == end else f"layers {start}-{end}"
            per = run[0].notes
            if len(run) > 1:
                per = f"{len(run)} × {run[0].bytes / MIB:.2f} MiB; " + per
            rows.append((label, run[0].device, sum(e.bytes for e in run), per))
            start = end + 1
        rows.append(("total on GPU", "gpu", self.gpu_bytes,
                     "fits entirely" if self.fits else "partial offload" if self.gpu_layers
                     else "does not fit: no decoder layer on the device"))
        return rows

    def table(self) -> str:
        """An aligned, human-readable table (component, where, MiB, notes) and the summary line."""
        a = self.args
        title = self.name or f"{a.family} model"
        limit = ("no binding limit" if self.max_binding_bytes is None
                 else f"binding limit {self.max_binding_bytes / MIB:.0f} MiB")
        header = (f"Offload plan for {title}: {a.num_layers} layers, hidden {a.hidden_size}, vocab {a.vocab_size}, "
                  f"{'ternary T2' if self.ternary else 'dense'} projections; capacity {self.capacity} + "
                  f"m_max {self.m_max}; budget {self.budget} bytes; {limit}")
        rows = [("component", "where", "MiB", "notes")]
        rows += [(c, w, f"{b / MIB:.1f}", n) for c, w, b, n in self._rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = [header]
        for i, (c, w, b, n) in enumerate(rows):
            lines.append(f"{c:<{widths[0]}}  {w:<{widths[1]}}  {b:>{widths[2]}}  {n}".rstrip())
            if i == 0:
                lines.append("-" * (sum(widths) + 6 + max(len(r[3]) for r in rows)))
        lines.append(self.summary())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable description of the plan."""
        return {
            "name": self.name, "args": self.args.to_dict(), "budget": self.budget, "gpu_bytes": self.gpu_bytes,
            "fits": self.fits, "gpu_layers": list(self.gpu_layers), "cpu_layers": list(self.cpu_layers),
            "lm_head_on_gpu": self.lm_head_on_gpu, "layer_bytes": self.layer_bytes,
            "step_transfer_bytes": self.step_transfer_bytes, "capacity": self.capacity, "m_max": self.m_max,
            "ternary": self.ternary, "dense_dtype_bytes": self.dense_dtype_bytes,
            "kv_dtype_bytes": self.kv_dtype_bytes, "max_binding_bytes": self.max_binding_bytes,
            "entries": [e.to_dict() for e in self.entries], "tensors": [t.to_dict() for t in self.tensors],
            "chunks": dict(self.chunks), "summary": self.summary(),
        }


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OffloadError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < low:
        raise OffloadError(f"{name}: must be >= {low}, got {value}")
    return value


def _safe_chunks(t: TensorSpec, limit: int | None) -> int:
    """Chunks of ``t`` under ``limit``; 0 when one row alone exceeds it (cannot be split)."""
    return 0 if limit is not None and t.row_bytes > limit else t.chunks(limit)


def _max_chunks(specs: list[TensorSpec], limit: int | None) -> int:
    return max((_safe_chunks(t, limit) for t in specs), default=1)


def _chunk_note(specs: list[TensorSpec], limit: int | None) -> str:
    split = [f"{t.name} ×{_safe_chunks(t, limit)}" for t in specs if _safe_chunks(t, limit) != 1]
    return f"; split by rows: {', '.join(split)}" if split else ""


def plan_offload(args: ModelArgs, budget_bytes: int = DEFAULT_VRAM_BUDGET, *, capacity: int = 2048, m_max: int = 31,
                 dense_dtype_bytes: int = 2, kv_dtype_bytes: int = 2, ternary: bool = True,
                 max_binding_bytes: int | None = None, force_cpu_layers: int | None = None,
                 group_size: int | None = None, name: str | None = None) -> OffloadPlan:
    """Place a model's parts on the device or the CPU under ``budget_bytes`` of VRAM.

    Order of placement: the workspace (:func:`workspace_tensors`) first; then the LM head + final norm
    (:func:`lm_head_tensors`) on the device if workspace + LM head + one layer fit, else on the CPU;
    the embeddings with the LM head (a tied model's are the LM head's device copy; on the host only when
    the LM head runs on the CPU); then layers 0, 1, ... (:func:`layer_tensors`, weights + KV cache) on
    the device while they fit. The remaining tail runs on the CPU with its KV cache on the host.
    ``force_cpu_layers=n`` puts (at least) the last n layers on the CPU. The device layers are always
    ``0 .. g-1`` and the plan is maximal: one more device layer would exceed the budget (unless forced).

    Args:
        args: the model's shape.
        budget_bytes: usable device memory in bytes (see :func:`parse_bytes`).
        capacity, m_max: KV store capacity and widest step, as in :class:`bitmtp.runtime.kv.KVStore`.
        dense_dtype_bytes: bytes per dense weight (LM head, embeddings, dense projections): 2 = bf16.
        kv_dtype_bytes: bytes per KV cache element.
        ternary: projections are T2 ternary (else dense, ``dense_dtype_bytes`` per weight).
        max_binding_bytes: the device's maximum storage-buffer binding size, for chunk counts.
        force_cpu_layers: run the last n layers on the CPU regardless of the budget (0 ≤ n < layers).
        group_size: per-group ternary scales with this group size (default: one scale per tensor).
        name: a label for the table (e.g. a preset name of ``bitmtp.cli_presets``).

    Raises:
        OffloadError (a BitMTPError): a non-int or non-positive budget, invalid capacity / m_max /
            dtype sizes / force_cpu_layers, or a budget too small for the workspace plus one layer
            (the message holds the failed plan's table and the minimum budget needed), or — with
            ``max_binding_bytes`` — a device tensor one row of which exceeds that limit.
    """
    if not isinstance(args, ModelArgs):
        raise OffloadError(f"args: expected a ModelArgs, got {type(args).__name__}")
    budget = _check_int("budget_bytes", budget_bytes, 1)
    capacity = _check_int("capacity", capacity, 1)
    m_max = _check_int("m_max", m_max, 1)
    _check_int("dense_dtype_bytes", dense_dtype_bytes, 1)
    _check_int("kv_dtype_bytes", kv_dtype_bytes, 1)
    if max_binding_bytes is not None:
        _check_int("max_binding_bytes", max_binding_bytes, 1)
    if group_size is not None:
        _check_int("group_size", group_size, 1)
    forced = 0
    if force_cpu_layers is not None:
        forced = _check_int("force_cpu_layers", force_cpu_layers, 0)
        if forced >= args.num_layers:
            raise OffloadError(f"force_cpu_layers: must be < num_layers={args.num_layers} (a plan keeps at least "
                               f"one layer on the device; use runtime='torch' for CPU-only), got {forced}")

    ws = workspace_tensors(args, capacity=capacity, m_max=m_max)
    head = lm_head_tensors(args, dense_dtype_bytes=dense_dtype_bytes)
    layer = layer_tensors(args, capacity=capacity, m_max=m_max, dense_dtype_bytes=dense_dtype_bytes,
                          kv_dtype_bytes=kv_dtype_bytes, ternary=ternary, group_size=group_size)
    ws_bytes = sum(t.nbytes for t in ws)
    head_bytes = sum(t.nbytes for t in head)
    layer_bytes = sum(t.nbytes for t in layer)
    kv_bytes = sum(t.nbytes for t in layer if t.name.endswith("_cache"))
    limit = max_binding_bytes

    h, v = args.hidden_size, args.vocab_size
    # the device gathers the step's embedding rows from its token ids (the host uploads only ids): a tied
    # model gathers from the LM head's copy, an untied one needs the table on the device as well
    emb_bytes = 0 if args.tie_word_embeddings else v * h * dense_dtype_bytes
    head_on_gpu = ws_bytes + head_bytes + emb_bytes + layer_bytes <= budget
    free = budget - ws_bytes - (head_bytes + emb_bytes if head_on_gpu else 0)
    n_gpu = max(0, min(args.num_layers - forced, free // layer_bytes))
    gpu_layers = list(range(n_gpu))
    cpu_layers = list(range(n_gpu, args.num_layers))

    dense = _dtype_name(dense_dtype_bytes)
    head_note = f"dense {v}×{h} {dense} + final norm; "
    if head_on_gpu:
        head_note += "device copy of the tied embeddings" if args.tie_word_embeddings else "on the device"
        head_note += _chunk_note(head, limit)
    else:
        head_note += "does not fit with a layer: CPU computes logits + argmax"
    if not head_on_gpu:
        emb_note = f"dense {v}×{h} {dense}, host memory (the LM head is on the CPU too)"
    elif args.tie_word_embeddings:
        emb_note = "tied: the device gathers the step's rows from the LM head's copy (the host uploads token ids)"
    else:
        emb_note = f"dense {v}×{h} {dense} on the device: the step's rows are gathered from the uploaded token ids"
    emb_device = "gpu" if head_on_gpu else "host"
    weights = layer_bytes - kv_bytes
    kind = "T2 ternary" if ternary else f"dense {dense}"
    entries = [
        PlanEntry("workspace", "gpu", ws_bytes, _max_chunks(ws, limit),
                  f"M={m_max}-row step buffers, scores over {capacity}+{m_max} rows, logits {m_max}×{v} f32"
                  + _chunk_note(ws, limit)),
        PlanEntry("lm_head", "gpu" if head_on_gpu else "cpu", head_bytes,
                  _max_chunks(head, limit) if head_on_gpu else 1, head_note),
        PlanEntry("embeddings", emb_device, emb_bytes if head_on_gpu else v * h * dense_dtype_bytes, 1, emb_note),
    ]
    for i in range(args.num_layers):
        on_gpu = i < n_gpu
        note = (f"{kind} weights {weights / MIB:.2f} MiB + KV {kv_bytes / MIB:.2f} MiB"
                + ("" if on_gpu else " (KV on the host)") + (_chunk_note(layer, limit) if on_gpu else ""))
        if not on_gpu and forced and i >= args.num_layers - forced:
            note += "; forced to the CPU"
        entries.append(PlanEntry(f"layer.{i}", "gpu" if on_gpu else "cpu", layer_bytes,
                                 _max_chunks(layer, limit) if on_gpu else 1, note))
    gpu_bytes = ws_bytes + (head_bytes + emb_bytes if head_on_gpu else 0) + n_gpu * layer_bytes
    tensors = ws + head + layer
    plan = OffloadPlan(
        args=args, budget=budget, entries=entries, gpu_layers=gpu_layers, cpu_layers=cpu_layers,
        gpu_bytes=gpu_bytes, fits=head_on_gpu and not cpu_layers, capacity=capacity, m_max=m_max,
        ternary=ternary, dense_dtype_bytes=dense_dtype_bytes, kv_dtype_bytes=kv_dtype_bytes,
        max_binding_bytes=limit, tensors=tensors, chunks={t.name: _safe_chunks(t, limit) for t in tensors}, name=name,
    )
    if n_gpu == 0:
        minimum = ws_bytes + layer_bytes
        raise OffloadError(
            f"budget_bytes: {budget} bytes ({budget / MIB:.1f} MiB) cannot hold the workspace "
            f"({ws_bytes} bytes) plus one decoder layer ({layer_bytes} bytes); the minimum budget is "
            f"{minimum} bytes ({minimum / MIB:.1f} MiB). The plan that failed:\n{plan.table()}", plan)
    if limit is not None:
        check_device_limits(plan, limit)
    return plan


def check_device_limits(plan: OffloadPlan, max_buffer_bytes: int) -> None:
    """Check that every tensor the plan binds on the device can be split into ≤ ``max_buffer_bytes`` chunks.

    Splits are by rows, so a tensor fails only when one of its rows alone is larger than the limit
    (e.g. a KV head slab at a huge capacity). Returns ``None`` when all is well.

    Raises:
        OffloadError: naming the first such tensor, with the plan's table.
    """
    limit = _check_int("max_buffer_bytes", max_buffer_bytes, 1)
    for t in plan.device_tensors():
        if t.row_bytes > limit:
            raise OffloadError(
                f"{t.name}: one row of shape {list(t.shape)} ({t.dtype}) is {t.row_bytes} bytes, more than the "
                f"device's buffer limit of {limit} bytes, so it cannot be split by rows. The plan:\n{plan.table()}",
                plan)


# ---------------------------------------------------------------------------------------------------
# Byte strings

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int) -> int:
    """Parse a byte count: ``"3.9GB"`` (decimal units), ``"4GiB"`` / ``"512MiB"`` (binary units),
    ``"3900000000"`` or an int. Units are case-insensitive; K/M/G/T alone mean KB/MB/GB/TB.

    Raises:
        OffloadError: not a non-negative number with a known unit, or not a whole number of bytes.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise OffloadError(f"bytes: must be >= 0, got {text}")
        return text
    if not isinstance(text, str):
        raise OffloadError(f"bytes: expected a string like '3.9GB' or '4GiB', got {type(text).__name__} {text!r}")
    match = _BYTES_RE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise OffloadError(f"bytes: cannot parse {text!r}; expected e.g. '3.9GB', '4GiB', '512MiB' or '3900000000'")
    try:
        value = Decimal(match.group(1)) * _UNITS[unit]
    except InvalidOperation as e:  # pragma: no cover - the regex admits only valid decimals
        raise OffloadError(f"bytes: cannot parse {text!r}") from e
    if value != value.to_integral_value():
        raise OffloadError(f"bytes: {text!r} is {value} bytes, not a whole number of bytes")
    return int(value)


__all__ = [
    "DEFAULT_VRAM_BUDGET",
    "LAVAPIPE_MAX_BINDING_BYTES",
    "OffloadError",
    "OffloadPlan",
    "PlanEntry",
    "TensorSpec",
    "check_device_limits",
    "layer_tensors",
    "lm_head_tensors",
    "parse_bytes",
    "plan_offload",
    "workspace_tensors",
]
