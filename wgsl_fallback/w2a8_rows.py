"""The row-per-invocation W2A8 shader for CPU Vulkan adapters (Mesa lavapipe, SwiftShader), generated.

Why a second W2A8 shader: a CPU Vulkan driver runs a workgroup's invocations as SIMD lanes of one
CPU thread, and a storage-buffer load whose address differs per lane (or that the driver cannot
prove uniform) becomes a per-lane loop with bounds checks. In ``w2a8.wgsl`` (one workgroup per
output row, lanes over K) every activation word is such a load: 64 per packed word at M = 16, which
was ~90 % of the shader's time on lavapipe (measured by replacing the loads with a register value:
2560 × 2560 at M = 16 went from 105 to 14 ms).

Here each invocation computes :data:`ROWS` output rows for all M tokens, so all lanes read the
same activation word at the same time, and the activations come from a **uniform buffer**, which
lavapipe reads without the per-lane loop. Each packed T2 word is still loaded and decoded once for
all M ≤ 16 tokens. On a CPU driver ``dot4I8Packed`` is emulated (byte extracts, 4 multiplies, 4
adds), so the default arithmetic (:data:`ARITH` ``"hi16"``, :func:`_hi16_body`) sums two products
per 32-bit multiply instead.

**Shared activation loads** (:data:`SHARE_ACTIVATIONS`, where the adapter has subgroups). lavapipe
treats a uniform-buffer offset as uniform only when it is a constant (``nir_src_is_always_uniform``);
an offset that depends on the word loop's counter is loaded as a per-lane gather (8 scalar loads and
a bounds select per 32-bit value) even though every lane asks for the same word. So instead of every
lane gathering all 4·M activation words of a T2 word, lane ℓ of a subgroup of S gathers words
ℓ, ℓ + S, … (⌈4M / S⌉ gathers, each bringing S different words), splits them for the arithmetic,
and ``subgroupBroadcast`` with a constant lane — an element extract and splat on a CPU driver —
hands each word to every lane. M = 16, 2560 × 2560 on lavapipe (S = 8), interleaved: 2.7–3.0 ms
against 3.9–4.7 ms with per-lane loads; M = 1 0.9–1.05 ms against 1.03–1.1 ms. Every lane of the
workgroup stays active through the word loop (a row past N computes a clamped row and skips its
stores), so every broadcast reads a live lane. The subgroup size S is measured once per device
(:attr:`Runner.subgroup_size <bitmtp.wgsl_fallback.runner.Runner.subgroup_size>`); without
subgroups, or with a size that varies between invocations, each lane loads for itself.

Where the time went on lavapipe before shared loads (Mesa 22.3; M = 16, 2560 × 2560): the loop with its
four weight-word loads and nothing else takes 2.1 ms (a storage-buffer load with a per-lane
address is a loop over the SIMD lanes with a bounds check each: ~35 cycles per word), the
arithmetic 1.4 ms more, the activation loads (a uniform-buffer load whose offset depends on the
loop counter is an 8-lane gather) 1.7 ms more. At M = 1 the weight loads are nearly all of it.
Binding the weights as an ``rgba32uint`` texture instead (``textureLoad`` fetches four words per
lane without the lane loop) measured M = 1 in 1.3 vs 2.7 ms and M = 16 in 6.9 vs 7.4 ms; not done
here (textures need their own upload, row chunking at 16384 and Kw % 4 == 0). Loading the weights as
``vec4<u32>`` storage words (one per-lane loop for four words, the body unrolled four times) was
measured with shared loads too: M = 1 0.83 vs 0.90 ms, M = 16 3.7 vs 3.1 ms (slower); not kept.

The token loops are unrolled in the generated source (one module per token count): the same
shader with WGSL loops over an ``override`` token count ran 2× slower (32 vs 15 ms at M = 16).

Uniform bindings are at most 64 KiB (WebGPU's guaranteed ``maxUniformBufferBindingSize``), so the
activations ``x_q [K4, M]`` (token-minor, as ``act_quant.wgsl`` writes them) are bound as up to
:data:`MAX_WINDOWS` windows of :data:`WINDOW_BYTES` at consecutive offsets of the same buffer, each
covering :func:`window_words` T2 words of K; the shader walks each scale group window by window.
A step whose activations need more windows uses ``w2a8.wgsl``.

Same results as ``w2a8.wgsl``: exact int32 accumulators per scale group (``Σ c·x_q − Σ x_q`` with
codes ``c = w + 1``), then ``y = (Σ_g acc_g · scale_g) / s + bias`` in the same order, so both
shaders give the same bits.
"""

from __future__ import annotations

WINDOW_BYTES = 65536  # WebGPU guarantees maxUniformBufferBindingSize >= 64 KiB
MAX_WINDOWS = 4
WG = 64
#: "hi16": two products per 32-bit multiply (see _hi16_body; M = 16 in 11.0 vs 13.6 ms, M = 1 2.9 vs
#: 2.8 ms on lavapipe, 2560 × 2560, 4 dispatches per sync); "dot4": dot4I8Packed per row
ARITH = "hi16"
#: output rows per invocation (n, n + 64, …): each activation load and split serves all of them.
#: M = 16, 2560 × 2560 on lavapipe, interleaved runs (token-outer order, unrolled epilogue): R = 3
#: 8.4 ms, 4 7.8, 5 7.5, 6 7.7; 4 divides the usual widths into whole 256-row workgroups
ROWS = 4
#: load each activation word once per subgroup and broadcast it (module docstring) where the device's
#: subgroup size allows (:func:`share_size`); False: every lane loads every word itself
SHARE_ACTIVATIONS = True
#: binding index of activation window 0, 1, 2, 3 (the others match w2a8.wgsl's layout)
WINDOW_BINDINGS = (0, 9, 10, 11)


def window_words(tokens: int) -> int:
    """T2 words of K per activation window at ``tokens`` tokens: each T2 word holds 4 activation words
    per token (16 bytes); a multiple of 16 words so every window offset is a multiple of 256 bytes
    (WebGPU's largest ``minUniformBufferOffsetAlignment``)."""
    return (WINDOW_BYTES // (16 * tokens)) // 16 * 16


def windows_needed(tokens: int, kw: int) -> int:
    """Activation windows a step of ``tokens`` tokens over ``kw`` T2 words per row binds."""
    return -(-kw // window_words(tokens))


def share_size(subgroup_size: int) -> int:
    """The subgroup size the shader shares activation loads over (its lanes ``0 .. S − 1`` each load
    every S-th word), or 0 for per-lane loads: sharing needs :data:`SHARE_ACTIVATIONS`, a power of two
    ≥ 4 (whole vec4s per round of loads) that divides the workgroup (:data:`WG`)."""
    s = int(subgroup_size)
    return s if SHARE_ACTIVATIONS and _shareable(s) else 0


def _shareable(s: int) -> bool:
    return 4 <= s <= WG and s & (s - 1) == 0


def check_share(share: int) -> None:
    """``ValueError`` unless ``share`` is 0 or a subgroup size loads can be shared over (a generator argument)."""
    if share and not _shareable(share):
        raise ValueError(f"share: 0 or a power of two in 4..{WG}, got {share}")


def shared_gathers(out: list[str], window: int, words: int, share: int) -> int:
    """Emit the loads of ``words`` consecutive 32-bit activation words (from vec4 ``v`` of window
    ``window``) spread over a subgroup of ``share`` lanes: ``xl{q}`` holds word ``q·share + lane``
    (clamped to the last word where ``words`` is not a multiple). Returns how many (``q`` values);
    ``subgroupBroadcast(xl{i // share}, i % share)`` is word i."""
    rounds = -(-words // share)
    for q in range(rounds):
        first = q * share
        idx = f"{first}u + lane" if first + share <= words else f"min({first}u + lane, {words - 1}u)"
        out.append(f"    let xi{q} = {idx};")
        out.append(f"    let xl{q} = xw{window}[v + (xi{q} >> 2u)][xi{q} & 3u];")
    return rounds


def source(tokens: int, windows: int, rows: int | None = None, arith: str | None = None, share: int = 0) -> str:
    """WGSL of the ``linear`` and ``accumulate`` entry points for ``tokens`` tokens and ``windows``
    activation windows, ``rows`` output rows per invocation; ``share``: the subgroup size activation
    loads are shared over (:func:`share_size`; 0 = each lane loads every activation word)."""
    if not 1 <= tokens <= 16:
        raise ValueError(f"tokens: 1..16, got {tokens}")
    if not 1 <= windows <= MAX_WINDOWS:
        raise ValueError(f"windows: 1..{MAX_WINDOWS}, got {windows}")
    t, rr, arith = tokens, rows or ROWS, arith or ARITH
    if arith not in ("dot4", "hi16"):
        raise ValueError(f"arith: dot4 or hi16, got {arith!r}")
    check_share(share)
    wj = window_words(t)
    vec4s = WINDOW_BYTES // 16
    out = [_HEADER]
    for c in range(windows):
        out.append(f"@group(0) @binding({WINDOW_BINDINGS[c]}) var<uniform> xw{c}: array<vec4<u32>, {vec4s}>;")
    out.append("")
    out.append("// exact accumulators of scale group g for rows n + 64 r (r < R), every token: index r * T + m")
    out.append(f"fn group_acc(n: u32, g: u32, lane: u32) -> array<i32, {t * rr}> {{")
    out += [f"  var a{r}_{m}: i32 = 0;" for r in range(rr) for m in range(t)]
    out += [f"  let row{r} = min(n + {WG * r}u, p.N - 1u) * p.Kw;" for r in range(rr)]
    if arith == "hi16":
        out += [f"  var cs{r}: u32 = 0u;  // Σ codes of row {r} over the group" for r in range(rr)]
    out.append("  let j_lo = g * p.gw;")
    out.append("  let j_hi = j_lo + p.gw;")
    for c in range(windows):
        lo, hi = c * wj, (c + 1) * wj
        out.append(f"  // window {c}: T2 words [{lo}, {hi})")
        out.append(f"  for (var j = max(j_lo, {lo}u); j < min(j_hi, {hi}u); j++) {{")
        out += [f"    let word{r} = w[row{r} + j];" for r in range(rr)]
        out.append(f"    let v = (j - {lo}u) * {t}u;  // first vec4 of this word's activations in the window")
        x = _SharedX(c, t, share, arith) if share else _LaneX(c, t)
        if arith == "hi16":
            _hi16_body(out, x, t, rr)
        else:
            _dot4_body(out, x, t, rr)
        out.append("  }")
    if arith == "hi16":  # Σ c·(x + 128) − 128·Σ c = Σ c·x
        out += [f"  a{r}_{m} -= i32(128u * cs{r});" for r in range(rr) for m in range(t)]
    out.append(f"  return array<i32, {t * rr}>({', '.join(f'a{r}_{m}' for r in range(rr) for m in range(t))});")
    out.append("}")
    out.append("")
    out.append(_entries(t, rr, bool(share)))
    return "\n".join(out)


class _LaneX:
    """Activation word i of a T2 word (i = slice·T + token; vec4 v + i / 4 of the window, component
    i % 4), loaded by every lane itself; ``split`` gives hi16's (ue, uo) halves of u = x + 128."""

    def __init__(self, c: int, t: int):
        self.c, self.t = c, t

    def prologue(self, out: list[str]) -> None:
        pass

    def raw(self, out: list[str], i: int) -> str:
        out.append(f"    let x_{i} = xw{self.c}[v + {i // 4}u][{i % 4}];")
        return f"x_{i}"

    def split(self, out: list[str], i: int) -> tuple[str, str]:
        out.append(f"    let u_{i} = xw{self.c}[v + {i // 4}u][{i % 4}] ^ 0x80808080u;")
        out.append(f"    let ue_{i} = u_{i} & 0x00FF00FFu;")
        out.append(f"    let uo_{i} = (u_{i} >> 8u) & 0x00FF00FFu;")
        return f"ue_{i}", f"uo_{i}"


class _SharedX(_LaneX):
    """The same words, loaded once per subgroup of ``s`` lanes: lane ℓ loads words ℓ, ℓ + s, … of the
    T2 word (clamped to the last, 4T − 1, where 4T is not a multiple of s), splits them for hi16, and
    ``subgroupBroadcast(·, i % s)`` gives word i to every lane."""

    def __init__(self, c: int, t: int, s: int, arith: str):
        super().__init__(c, t)
        self.s, self.arith = s, arith

    def prologue(self, out: list[str]) -> None:
        for q in range(shared_gathers(out, self.c, 4 * self.t, self.s)):
            if self.arith == "hi16":
                out.append(f"    let xu{q} = xl{q} ^ 0x80808080u;")
                out.append(f"    let xe{q} = xu{q} & 0x00FF00FFu;")
                out.append(f"    let xo{q} = (xu{q} >> 8u) & 0x00FF00FFu;")

    def raw(self, out: list[str], i: int) -> str:
        q, lane = divmod(i, self.s)
        out.append(f"    let x_{i} = subgroupBroadcast(xl{q}, {lane}u);")
        return f"x_{i}"

    def split(self, out: list[str], i: int) -> tuple[str, str]:
        q, lane = divmod(i, self.s)
        out.append(f"    let ue_{i} = subgroupBroadcast(xe{q}, {lane}u);")
        out.append(f"    let uo_{i} = subgroupBroadcast(xo{q}, {lane}u);")
        return f"ue_{i}", f"uo_{i}"


def _dot4_body(out: list[str], x: _LaneX, t: int, rr: int) -> None:
    """Per slice s: codes c = w + 1 of each row, then dot4I8Packed against each token's x word."""
    x.prologue(out)
    for s in range(4):
        out += [f"    let c{r}_{s} = (word{r} >> {2 * s}u) & 0x03030303u;" for r in range(rr)]
        for m in range(t):
            xv = x.raw(out, s * t + m)
            for r in range(rr):
                out.append(f"    a{r}_{m} += dot4I8Packed(c{r}_{s}, {xv});")


def _hi16_body(out: list[str], x: _LaneX, t: int, rr: int) -> None:
    """Two products per 32-bit multiply, summed in the high half: with u = x + 128 ∈ [0, 255] split
    as ue = u₀ | u₂<<16 and uo = u₁ | u₃<<16, and the codes as e = c₂ | c₀<<16, o = c₃ | c₁<<16,
    ``e·ue mod 2³²`` = c₂u₀ + (c₀u₀ + c₂u₂)·2¹⁶: the high half holds two products' sum. Per T2 word
    a high half sums 16 products (≤ 8160) over a low half of ≤ 8 × 510 (no carry), then is flushed
    into the int32 accumulators; Σ c·u − 128·Σ c = Σ c·x. Per token, slice and row: 2 multiplies
    and 2 adds (dot4I8Packed: 4 + 4, emulated on CPU drivers); the activation split is shared by
    the rows, the code split by the tokens.

    Token-outer order: the codes of all slices are split once per word, then each token runs its
    four slices into R fresh high-half sums that are flushed at once, so R sums are live instead of
    R·T (M = 16, 2560 × 2560, R = 3: 8.3 vs 8.8 ms; R = 4 then 7.5–7.8 ms)."""
    for r in range(rr):
        out.append(f"    cs{r} += countOneBits(word{r} & 0x55555555u) + 2u * countOneBits(word{r} & 0xAAAAAAAAu);")
    for s in range(4):
        for r in range(rr):
            out.append(f"    let cw{r}_{s} = (word{r} >> {2 * s}u) & 0x03030303u;")
            out.append(f"    let rt{r}_{s} = (cw{r}_{s} >> 16u) | (cw{r}_{s} << 16u);")
            out.append(f"    let e{r}_{s} = rt{r}_{s} & 0x00030003u;")
            out.append(f"    let o{r}_{s} = (rt{r}_{s} >> 8u) & 0x00030003u;")
    x.prologue(out)
    for m in range(t):
        out += [f"    var h{r}_{m}: u32 = 0u;" for r in range(rr)]
        for s in range(4):
            ue, uo = x.split(out, s * t + m)  # word (4j + s)·T + m of the window
            out += [f"    h{r}_{m} += e{r}_{s} * {ue} + o{r}_{s} * {uo};" for r in range(rr)]
        out += [f"    a{r}_{m} += i32(h{r}_{m} >> 16u);" for r in range(rr)]


_HEADER = """// Generated by bitmtp/wgsl_fallback/w2a8_rows.py (see its docstring): W2A8 linear, one output row per
// invocation, activations from uniform-buffer windows, token loops unrolled.

struct Params {
  M: u32, N: u32, Kw: u32, K4: u32, n_groups: u32, gw: u32, scale_rows: u32, has_bias: u32,
  out_stride: u32, row_offset: u32, wg_x: u32, _pad: u32,
}

const WG: u32 = 64u;

@group(0) @binding(1) var<storage, read> xsum: array<i32>;     // [M, n_groups]
@group(0) @binding(2) var<storage, read> w: array<u32>;        // [N, Kw]
@group(0) @binding(3) var<storage, read> act_scale: array<f32>; // [M]
@group(0) @binding(4) var<storage, read> scales: array<f32>;   // [scale_rows, n_groups]
@group(0) @binding(5) var<storage, read> bias: array<f32>;     // [N] (ignored unless has_bias)
@group(0) @binding(6) var<storage, read_write> y: array<f32>;  // [M, out_stride]
@group(0) @binding(7) var<storage, read_write> acc_out: array<i32>; // [M, N, n_groups]
@group(0) @binding(8) var<uniform> p: Params;"""


def _entries(t: int, rr: int, shared: bool) -> str:
    """The ``linear`` and ``accumulate`` entry points, their token and row loops unrolled like the
    accumulation's: with WGSL loops over ``array<f32, T·R>`` indexed by loop counters the epilogue
    cost ~3 ms per M = 16 dispatch on lavapipe (2560 × 256: 3.7 ms against 0.7 ms at M = 1), since a
    dynamically indexed private array lives in memory and is gathered lane by lane. ``shared``: lanes
    broadcast activation words to each other, so no lane leaves before the word loops are done (rows
    past N read clamped rows and scales and skip their stores)."""
    ids = [(r, m) for r in range(rr) for m in range(t)]
    lane_arg = ", @builtin(subgroup_invocation_id) lane: u32" if shared else ""
    head = [
        "@compute @workgroup_size(64)",
        "fn {name}(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32"
        + lane_arg + ") {{",
        f"  let n = (wid.x + wid.y * p.wg_x) * WG * {rr}u + tid;",
    ]
    if not shared:
        head.append("  if (n >= p.N) {{ return; }}  // no barriers or subgroup operations in this shader")
    call = f"    let acc = group_acc(n, g, {'lane' if shared else '0u'});"
    lin = [line.format(name="linear") for line in head]
    lin += [f"  var t{r}_{m}: f32 = 0.0;" for r, m in ids]
    lin.append("  for (var g = 0u; g < p.n_groups; g++) {")
    lin.append(call)
    lin += [f"    let xs{m} = xsum[{m}u * p.n_groups + g];" for m in range(t)]
    lin += [f"    let sc{r} = scales[select(0u, min(n + {WG * r}u, p.N - 1u) + p.row_offset, p.scale_rows > 1u)"
            f" * p.n_groups + g];" for r in range(rr)]
    lin += [f"    t{r}_{m} += f32(acc[{r * t + m}] - xs{m}) * sc{r};" for r, m in ids]
    lin.append("  }")
    lin += [f"  let as{m} = act_scale[{m}u];" for m in range(t)]
    lin.append("  let hb = p.has_bias != 0u;")
    for r in range(rr):
        if r or shared:
            lin.append(f"  if (n + {WG * r}u >= p.N) {{ return; }}")
        lin.append(f"  let n{r} = n + {WG * r}u + p.row_offset;")
        lin.append(f"  var b{r} = 0.0;")
        lin.append(f"  if (hb) {{ b{r} = bias[n{r}]; }}")
        for m in range(t):
            lin.append(f"  let o{r}_{m} = t{r}_{m} / as{m};")
            lin.append(f"  y[{m}u * p.out_stride + n{r}] = select(o{r}_{m}, o{r}_{m} + b{r}, hb);")
    lin.append("}")
    acc = [line.format(name="accumulate") for line in head]
    acc.append("  for (var g = 0u; g < p.n_groups; g++) {")
    acc.append(call)
    acc += [f"    let xs{m} = xsum[{m}u * p.n_groups + g];" for m in range(t)]
    for r in range(rr):  # stores under an if, no `continue`: every lane runs every group's word loop
        acc.append(f"    if (n + {WG * r}u < p.N) {{")
        acc.append(f"      let n{r} = n + {WG * r}u + p.row_offset;")
        acc += [f"      acc_out[({m}u * p.out_stride + n{r}) * p.n_groups + g] = acc[{r * t + m}] - xs{m};"
                for m in range(t)]
        acc.append("    }")
    acc.append("  }")
    acc.append("}")
    return "\n".join(lin + [""] + acc) + "\n"
