"""The row-per-invocation W2A8 shader for CPU Vulkan adapters (Mesa lavapipe, SwiftShader), generated.

Why a second W2A8 shader: a CPU Vulkan driver runs a workgroup's invocations as SIMD lanes of one
CPU thread, and a storage-buffer load whose address differs per lane (or that the driver cannot
prove uniform) becomes a per-lane loop with bounds checks. In ``w2a8.wgsl`` (one workgroup per
output row, lanes over K) every activation word is such a load: 64 per packed word at M = 16, which
was ~90 % of the shader's time on lavapipe (measured by replacing the loads with a register value:
2560 × 2560 at M = 16 went from 105 to 14 ms).

Here each invocation computes one output row for all M tokens, so all lanes read the same
activation word at the same time, and the activations come from a **uniform buffer**, which
lavapipe reads without the per-lane loop. Each packed T2 word is still loaded and decoded once for
all M ≤ 16 tokens. Measured on lavapipe (2 cores, 2560 × 2560, LLVM 15): M = 16 in 15 ms and
M = 1 in 4.1 ms, against 223 ms and 29 ms for ``w2a8.wgsl``.

The token loops are unrolled in the generated source (one module per token count): the same
shader with WGSL loops over an ``override`` token count ran 2× slower (32 vs 15 ms at M = 16).

Uniform bindings are at most 64 KiB (WebGPU's guaranteed ``maxUniformBufferBindingSize``), so the
activations ``x_q [K4, M]`` (token-minor, as ``act_quant.wgsl`` writes them) are bound as up to
:data:`MAX_WINDOWS` windows of :data:`WINDOW_BYTES` at consecutive offsets of the same buffer, each
covering :func:`window_words` T2 words of K; the shader walks each scale group window by window.
A step whose activations need more windows uses ``w2a8.wgsl``.

Same arithmetic as ``w2a8.wgsl``: exact int32 accumulators per scale group
(``Σ c·x_q − Σ x_q`` with codes ``c = w + 1``), then ``y = (Σ_g acc_g · scale_g) / s + bias`` in the
same order, so both shaders give the same bits.
"""

from __future__ import annotations

WINDOW_BYTES = 65536  # WebGPU guarantees maxUniformBufferBindingSize >= 64 KiB
MAX_WINDOWS = 4
WG = 64
ROWS = 2  # output rows per invocation (n and n + 64): each activation load serves both
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


def source(tokens: int, windows: int, rows: int | None = None) -> str:
    """WGSL of the ``linear`` and ``accumulate`` entry points for ``tokens`` tokens and ``windows``
    activation windows, ``rows`` output rows per invocation."""
    if not 1 <= tokens <= 16:
        raise ValueError(f"tokens: 1..16, got {tokens}")
    if not 1 <= windows <= MAX_WINDOWS:
        raise ValueError(f"windows: 1..{MAX_WINDOWS}, got {windows}")
    t, rr = tokens, rows or ROWS
    wj = window_words(t)
    vec4s = WINDOW_BYTES // 16
    out = [_HEADER.replace("ROWS_PER_LANE", f"{rr}u")]
    for c in range(windows):
        out.append(f"@group(0) @binding({WINDOW_BINDINGS[c]}) var<uniform> xw{c}: array<vec4<u32>, {vec4s}>;")
    out.append("")
    out.append("// exact accumulators of scale group g for rows n + 64 r (r < R), every token: index r * T + m")
    out.append(f"fn group_acc(n: u32, g: u32) -> array<i32, {t * rr}> {{")
    out += [f"  var a{r}_{m}: i32 = 0;" for r in range(rr) for m in range(t)]
    out += [f"  let row{r} = min(n + {WG * r}u, p.N - 1u) * p.Kw;" for r in range(rr)]
    out.append("  let j_lo = g * p.gw;")
    out.append("  let j_hi = j_lo + p.gw;")
    for c in range(windows):
        lo, hi = c * wj, (c + 1) * wj
        out.append(f"  // window {c}: T2 words [{lo}, {hi})")
        out.append(f"  for (var j = max(j_lo, {lo}u); j < min(j_hi, {hi}u); j++) {{")
        out += [f"    let word{r} = w[row{r} + j];" for r in range(rr)]
        out.append(f"    let v = (j - {lo}u) * {t}u;  // first vec4 of this word's activations in the window")
        for s in range(4):
            out += [f"    let c{r}_{s} = (word{r} >> {2 * s}u) & 0x03030303u;" for r in range(rr)]
            loaded = {}  # vec4 index → loaded: word (4j + s)·T + m of the window is vec4 v + (sT + m) / 4
            for m in range(t):
                i = s * t + m
                if i // 4 not in loaded:
                    loaded[i // 4] = f"x{s}_{i // 4}"
                    out.append(f"    let x{s}_{i // 4} = xw{c}[v + {i // 4}u];")
                for r in range(rr):
                    out.append(f"    a{r}_{m} += dot4I8Packed(c{r}_{s}, x{s}_{i // 4}[{i % 4}]);")
        out.append("  }")
    out.append(f"  return array<i32, {t * rr}>({', '.join(f'a{r}_{m}' for r in range(rr) for m in range(t))});")
    out.append("}")
    out.append("")
    out.append(_ENTRIES.replace("TOKENS", f"{t}u").replace("ROWS_PER_LANE", f"{rr}u"))
    return "\n".join(out)


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

_ENTRIES = """@compute @workgroup_size(64)
fn linear(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let n = (wid.x + wid.y * p.wg_x) * WG * ROWS_PER_LANE + tid;
  if (n >= p.N) { return; }  // no barriers in this shader
  var total: array<f32, TOKENS * ROWS_PER_LANE>;
  for (var g = 0u; g < p.n_groups; g++) {
    let acc = group_acc(n, g);
    for (var r = 0u; r < ROWS_PER_LANE; r++) {
      let srow = select(0u, n + WG * r + p.row_offset, p.scale_rows > 1u);
      let sc = scales[srow * p.n_groups + g];
      for (var m = 0u; m < TOKENS; m++) {
        total[r * TOKENS + m] += f32(acc[r * TOKENS + m] - xsum[m * p.n_groups + g]) * sc;
      }
    }
  }
  for (var r = 0u; r < ROWS_PER_LANE; r++) {
    let nr = n + WG * r;
    if (nr >= p.N) { break; }
    let full_n = nr + p.row_offset;
    for (var m = 0u; m < TOKENS; m++) {
      var out = total[r * TOKENS + m] / act_scale[m];
      if (p.has_bias != 0u) { out += bias[full_n]; }
      y[m * p.out_stride + full_n] = out;
    }
  }
}

@compute @workgroup_size(64)
fn accumulate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let n = (wid.x + wid.y * p.wg_x) * WG * ROWS_PER_LANE + tid;
  if (n >= p.N) { return; }
  for (var g = 0u; g < p.n_groups; g++) {
    let acc = group_acc(n, g);
    for (var r = 0u; r < ROWS_PER_LANE; r++) {
      let nr = n + WG * r;
      if (nr >= p.N) { break; }
      let full_n = nr + p.row_offset;
      for (var m = 0u; m < TOKENS; m++) {
        acc_out[(m * p.out_stride + full_n) * p.n_groups + g] = acc[r * TOKENS + m] - xsum[m * p.n_groups + g];
      }
    }
  }
}
"""
