"""The row-per-invocation dense linear for CPU Vulkan adapters (lavapipe), generated: the dense
counterpart of ``w2a8_rows.py`` (read its docstring first; the reasons are the same).

``dense.wgsl`` (ROWS rows per workgroup, lanes over K, a workgroup-memory reduction) was written for
GPUs. On lavapipe every one of its loads has a per-lane address, so each becomes a loop over the SIMD
lanes with a bounds check, and its token loop over a private array lives in memory: SmolLM2's LM head
(49152 × 576, float32) took 126 ms at M = 1 and 1.0 s at M = 16 there. This shader instead gives each
invocation :data:`ROWS` output rows (n, n + 64, …) for all M ≤ 16 tokens and walks K itself:

* **weights** are loaded one ``vec4`` per lane and step (four float32, or eight bf16 / f16 widened
  exactly in registers), so the per-lane storage-load loop is paid once per four or eight weights;
* **activations** come from uniform-buffer windows of a token-minor copy of ``x`` (``quads.wgsl``
  writes ``xt[j, m] = x[m, 4j .. 4j + 3]``), loaded once per subgroup and handed to every
  lane by ``subgroupBroadcast`` where the device has subgroups (``w2a8_rows``'s shared loads), else
  loaded by every lane;
* token and row loops are unrolled in the generated source (one module per token count and weight
  kind), with scalar accumulators.

Each output is ``Σ_units (w·x over the unit's 4 or 8 elements, in order)`` accumulated in float32 in
increasing k, then ``+ bias``: a different summation order from ``dense.wgsl``'s (both are compared
with a float64 reference, within 1e-5 of the largest output). Used where K is a multiple of the unit
and the activations fit :data:`MAX_WINDOWS` windows; otherwise ``dense.wgsl`` runs.
"""

from __future__ import annotations

from bitmtp.wgsl_fallback.w2a8_rows import WG, WINDOW_BYTES, check_share, shared_gathers, window_words

#: at most 8 windows + the params uniform: 9 of the 12 uniform buffers WebGPU guarantees per stage
MAX_WINDOWS = 8
#: output rows per invocation (each activation broadcast serves all of them)
ROWS = 4
#: binding of activation window 0, 1, …; weights 1, bias 2, y 3, params 4
WINDOW_BINDINGS = (0, 5, 6, 7, 8, 9, 10, 11)
#: weight elements per vec4 load: four float32, or eight 16-bit values packed in pairs
UNIT = {"f32": 4, "bf16": 8, "f16": 8}


def window_quads(tokens: int) -> int:
    """Quads of K (4 elements each) per activation window at ``tokens`` tokens: a quad holds one vec4 per
    token, 16·M bytes like a T2 word's activations, so as many as ``w2a8_rows.window_words``."""
    return window_words(tokens)


def windows_needed(tokens: int, k: int) -> int:
    """Activation windows a step of ``tokens`` tokens over ``k`` input features binds."""
    quads = -(-k // 4)
    return -(-quads // window_quads(tokens))


def usable(tokens: int, k: int, kind: str) -> bool:
    """Whether this shader runs ``tokens`` × ``k`` with ``kind`` weights (else ``dense.wgsl`` does)."""
    return 1 <= tokens <= 16 and k % UNIT[kind] == 0 and windows_needed(tokens, k) <= MAX_WINDOWS


def source(tokens: int, windows: int, kind: str, rows: int | None = None, share: int = 0) -> str:
    """WGSL of the ``main`` entry point for ``tokens`` tokens, ``windows`` activation windows, ``kind``
    weights (f32 / bf16 / f16), ``rows`` output rows per invocation; ``share``: the subgroup size
    activation loads are shared over (``w2a8_rows.share_size``; 0 = each lane loads its own)."""
    if not 1 <= tokens <= 16:
        raise ValueError(f"tokens: 1..16, got {tokens}")
    if not 1 <= windows <= MAX_WINDOWS:
        raise ValueError(f"windows: 1..{MAX_WINDOWS}, got {windows}")
    if kind not in UNIT:
        raise ValueError(f"kind: one of {sorted(UNIT)}, got {kind!r}")
    check_share(share)
    t, rr, unit = tokens, rows or ROWS, UNIT[kind]
    qpu = unit // 4  # quads per unit
    wq = window_quads(t)
    wtype = "vec4<f32>" if kind == "f32" else "vec4<u32>"
    out = [_HEADER.replace("WTYPE", wtype)]
    for c in range(windows):
        out.append(f"@group(0) @binding({WINDOW_BINDINGS[c]}) var<uniform> xw{c}: array<vec4<f32>, "
                   f"{WINDOW_BYTES // 16}>;")
    out.append("")
    lane_arg = ", @builtin(subgroup_invocation_id) lane: u32" if share else ""
    out.append("@compute @workgroup_size(64)")
    out.append("fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32"
               f"{lane_arg}) {{")
    out.append(f"  let n = (wid.x + wid.y * p.wg_x) * WG * {rr}u + tid;")
    if not share:
        out.append("  if (n >= p.N) { return; }  // no barriers or subgroup operations in this shader")
    out += [f"  let row{r} = min(n + {WG * r}u, p.N - 1u) * p.units;" for r in range(rr)]
    out += [f"  var a{r}_{m}: f32 = 0.0;" for r in range(rr) for m in range(t)]
    for c in range(windows):
        lo, hi = c * wq // qpu, (c + 1) * wq // qpu  # units of this window
        out.append(f"  // window {c}: units [{lo}, {hi}) of K")
        out.append(f"  for (var j = {lo}u; j < min(p.units, {hi}u); j++) {{")
        out.append(f"    let v = (j - {lo}u) * {qpu * t}u;  // first vec4 of this unit's activations in the window")
        for r in range(rr):
            out.append(f"    let wv{r} = w[row{r} + j];")
            _widen(out, r, kind)
        xs = _x_words(out, c, t, qpu, share)
        for m in range(t):
            for r in range(rr):
                dot = " + ".join(f"w{r}_{e} * {xs[m][e]}" for e in range(unit))  # left to right
                out.append(f"    a{r}_{m} += {dot};")
        out.append("  }")
    out.append("  let hb = p.has_bias != 0u;")
    for r in range(rr):
        out.append(f"  if (n + {WG * r}u >= p.N) {{ return; }}")
        out.append(f"  let n{r} = n + {WG * r}u + p.row_offset;")
        out.append(f"  var b{r} = 0.0;")
        out.append(f"  if (hb) {{ b{r} = bias[n{r}]; }}")
        out += [f"  y[{m}u * p.out_stride + n{r}] = a{r}_{m} + b{r};" for m in range(t)]
    out.append("}")
    return "\n".join(out) + "\n"


def _widen(out: list[str], r: int, kind: str) -> None:
    """The unit's weights of row slot ``r`` as float32 scalars ``w{r}_{e}`` (16-bit pairs: element 2i in
    the low half of word i, as ``DenseWeight`` packs them)."""
    if kind == "f32":
        out += [f"    let w{r}_{e} = wv{r}[{e}];" for e in range(4)]
        return
    for i in range(4):
        if kind == "bf16":
            out.append(f"    let w{r}_{2 * i} = bitcast<f32>(wv{r}[{i}] << 16u);")
            out.append(f"    let w{r}_{2 * i + 1} = bitcast<f32>(wv{r}[{i}] & 0xFFFF0000u);")
        else:
            out.append(f"    let h{r}_{i} = unpack2x16float(wv{r}[{i}]);")
            out.append(f"    let w{r}_{2 * i} = h{r}_{i}.x;")
            out.append(f"    let w{r}_{2 * i + 1} = h{r}_{i}.y;")


def _x_words(out: list[str], c: int, t: int, qpu: int, share: int) -> list[list[str]]:
    """Names of x[m, e] for the unit's elements e, per token m. Word i of the unit's 4·T·qpu: quad
    i // (4T), token (i // 4) % T, component i % 4 (vec4 ``v + i / 4`` of window ``c``)."""
    words = 4 * t * qpu
    names = [[""] * (4 * qpu) for _ in range(t)]
    if share:
        shared_gathers(out, c, words, share)
    for i in range(words):
        quad, m, comp = i // (4 * t), (i // 4) % t, i % 4
        name = f"x{m}_{4 * quad + comp}"
        if share:
            q, lane = divmod(i, share)
            out.append(f"    let {name} = subgroupBroadcast(xl{q}, {lane}u);")
        else:
            out.append(f"    let {name} = xw{c}[v + {i // 4}u][{comp}];")
        names[m][4 * quad + comp] = name
    return names


_HEADER = """// Generated by bitmtp/wgsl_fallback/dense_rows.py (see its docstring): dense linear, one output row per
// invocation and row slot, activations from uniform-buffer windows, token loops unrolled.

struct Params { M: u32, N: u32, units: u32, has_bias: u32, out_stride: u32, row_offset: u32, wg_x: u32, _pad: u32 }

const WG: u32 = 64u;

@group(0) @binding(1) var<storage, read> w: array<WTYPE>;    // [N, units] (this chunk's rows)
@group(0) @binding(2) var<storage, read> bias: array<f32>;      // [full N] (ignored unless has_bias)
@group(0) @binding(3) var<storage, read_write> y: array<f32>;   // [M, out_stride]
@group(0) @binding(4) var<uniform> p: Params;"""
