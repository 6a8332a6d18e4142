// W2A8 linear with 16-token register tiling: one workgroup per output row; every packed T2 word is
// loaded and decoded once for all M <= 16 tokens (dot4I8Packed against each token's packed int8 x).
//
// T2: word j of row n holds weights k = 16j + 4s + b at bits 8b + 2s, so (word >> 2s) & 0x03030303 is
// four code bytes c = w + 1 lined up with the int32 holding x_q[16j + 4s .. 16j + 4s + 3].
// Exact integers: acc_g = sum_{k in g} c * x_q - sum_{k in g} x_q   (the "-sum x" folds the code offset)
// Float epilogue:  y[m, n] = (sum_g acc_g * scale[n, g]) / s[m] + bias[n]
//
// Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
// Test: tests/wgsl_fallback/test_w2a8.py

struct Params {
  M: u32,           // tokens (1..16)
  N: u32,           // rows in this weight chunk
  Kw: u32,          // T2 words per row (K padded to 16, / 16)
  K4: u32,          // packed activation words per token (Kw * 4)
  n_groups: u32,    // scale groups per row
  gw: u32,          // T2 words per group (group size / 16)
  scale_rows: u32,  // 1 (shared) or the full N
  has_bias: u32,
  out_stride: u32,  // floats per output row (the full N)
  row_offset: u32,  // first row of this chunk in the full matrix
  wg_x: u32,        // workgroups along x (2-D grids for N > 65535)
  _pad: u32,
}

const WG: u32 = 64u;
const MT: u32 = 16u;
// The step's token count as a pipeline constant (one pipeline per width 1..16, like the CUDA kernels'
// width specialization): the token loops then have constant bounds, the compiler unrolls them and keeps
// the accumulators in registers. Must equal p.M.
override TOKENS: u32 = 16u;

@group(0) @binding(0) var<storage, read> xq: array<u32>;       // [K4, M] (token-minor)
@group(0) @binding(1) var<storage, read> xsum: array<i32>;     // [M, n_groups]
@group(0) @binding(2) var<storage, read> w: array<u32>;        // [N, Kw]
@group(0) @binding(3) var<storage, read> act_scale: array<f32>; // [M]
@group(0) @binding(4) var<storage, read> scales: array<f32>;   // [scale_rows, n_groups]
@group(0) @binding(5) var<storage, read> bias: array<f32>;     // [N] (ignored unless has_bias)
@group(0) @binding(6) var<storage, read_write> y: array<f32>;  // [M, out_stride]
@group(0) @binding(7) var<storage, read_write> acc_out: array<i32>; // [M, N, n_groups]
@group(0) @binding(8) var<uniform> p: Params;

var<workgroup> red: array<array<i32, MT>, WG>;

// Sum of this thread's words of group g, for every token; reduced across the workgroup into red[0].
// With the adapter's `subgroup` feature (SUBGROUP defined) the first stage is subgroupAdd: one shared
// store per subgroup instead of a log2(64)-step tree of barriers.
fn group_sums(n: u32, g: u32, tid: u32, lane: u32, sgs: u32) {
  var acc: array<i32, MT>;
  for (var m = 0u; m < TOKENS; m++) { acc[m] = 0; }
  let row = n * p.Kw;
  let end = (g + 1u) * p.gw;
  for (var j = g * p.gw + tid; j < end; j += WG) {
    let word = w[row + j];
    for (var s = 0u; s < 4u; s++) {
      let codes = (word >> (2u * s)) & 0x03030303u;
      let xi = (4u * j + s) * TOKENS;
      for (var m = 0u; m < TOKENS; m++) {
        acc[m] += dot4I8Packed(codes, xq[xi + m]);
      }
    }
  }
//#if SUBGROUP
  let sg = tid / sgs;
  for (var m = 0u; m < TOKENS; m++) {
    let total = subgroupAdd(acc[m]);
    if (lane == 0u) { red[sg][m] = total; }
  }
  workgroupBarrier();
  if (tid < p.M) {
    var total: i32 = red[0][tid];
    for (var k = 1u; k < WG / sgs; k++) { total += red[k][tid]; }
    red[0][tid] = total;
  }
  workgroupBarrier();
//#else
  for (var m = 0u; m < TOKENS; m++) { red[tid][m] = acc[m]; }
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (tid < stride) {
      for (var m = 0u; m < TOKENS; m++) { red[tid][m] += red[tid + stride][m]; }
    }
    workgroupBarrier();
  }
//#endif
}

@compute @workgroup_size(64)
fn linear(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32 /*SG_BUILTINS*/) {
  let n = wid.x + wid.y * p.wg_x;
  if (n >= p.N) { return; }  // uniform per workgroup
  let full_n = n + p.row_offset;
  let srow = select(0u, full_n, p.scale_rows > 1u);
  var total: f32 = 0.0;
  for (var g = 0u; g < p.n_groups; g++) {
    group_sums(n, g, tid, /*SG_ARGS*/);
    if (tid < p.M) {
      let exact = red[0][tid] - xsum[tid * p.n_groups + g];
      total += f32(exact) * scales[srow * p.n_groups + g];
    }
    workgroupBarrier();
  }
  if (tid < p.M) {
    var out = total / act_scale[tid];
    if (p.has_bias != 0u) { out += bias[full_n]; }
    y[tid * p.out_stride + full_n] = out;
  }
}

@compute @workgroup_size(64)
fn accumulate(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32 /*SG_BUILTINS*/) {
  let n = wid.x + wid.y * p.wg_x;
  if (n >= p.N) { return; }
  let full_n = n + p.row_offset;
  for (var g = 0u; g < p.n_groups; g++) {
    group_sums(n, g, tid, /*SG_ARGS*/);
    if (tid < p.M) {
      acc_out[(tid * p.out_stride + full_n) * p.n_groups + g] = red[0][tid] - xsum[tid * p.n_groups + g];
    }
    workgroupBarrier();
  }
}
