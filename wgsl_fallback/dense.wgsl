// Dense linear y = x @ W^T (+ bias) with 16-token register tiling: ROWS output rows per workgroup, each
// weight element loaded once for all M <= 16 tokens; float32 math. Used for the LM head and dense
// checkpoints. Weights are float32, or (BF16 / F16 defined) 16-bit pairs packed in u32 words — half the
// device memory of a bf16/f16 checkpoint's dense tensors, widened exactly to f32 in registers.
//
// Reference: bitmtp.ops.reference.dense_linear_reference
// Test: tests/wgsl_fallback/test_dense.py

struct Params { M: u32, N: u32, K: u32, has_bias: u32, out_stride: u32, row_offset: u32, wg_x: u32, K2: u32 }

const WG: u32 = 64u;
const MT: u32 = 16u;
// ROWS output rows per workgroup, WG / ROWS threads each: a small-K projection (SmolLM2's K = 576) gives a
// thread only a few elements, so one row per workgroup paid a workgroup's fixed cost per row. Tokens are a
// pipeline constant (TOKENS = M) so the token loops unroll.
const ROWS: u32 = 4u;
const TPR: u32 = WG / ROWS;
override TOKENS: u32 = 16u;

@group(0) @binding(0) var<storage, read> x: array<f32>;        // [M, K]
//#if BF16
@group(0) @binding(1) var<storage, read> w: array<u32>;        // [N, K2] bf16 pairs (this chunk's rows)
fn weight(i: u32, k: u32) -> f32 {
  let word = w[i * p.K2 + k / 2u];
  return bitcast<f32>(select(word << 16u, word & 0xFFFF0000u, (k & 1u) == 1u));
}
//#else
//#if F16
@group(0) @binding(1) var<storage, read> w: array<u32>;        // [N, K2] f16 pairs
fn weight(i: u32, k: u32) -> f32 { return unpack2x16float(w[i * p.K2 + k / 2u])[k & 1u]; }
//#else
@group(0) @binding(1) var<storage, read> w: array<f32>;        // [N, K] (this chunk's rows)
fn weight(i: u32, k: u32) -> f32 { return w[i * p.K + k]; }
//#endif
//#endif
@group(0) @binding(2) var<storage, read> bias: array<f32>;     // [full N]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;  // [M, out_stride]
@group(0) @binding(4) var<uniform> p: Params;

var<workgroup> red: array<array<f32, MT>, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let n = (wid.x + wid.y * p.wg_x) * ROWS + tid / TPR;
  let lane = tid % TPR;
  let live = n < p.N;  // no early return: every thread takes part in the barriers
  var acc: array<f32, MT>;
  for (var m = 0u; m < TOKENS; m++) { acc[m] = 0.0; }
  if (live) {
    for (var k = lane; k < p.K; k += TPR) {
      let wk = weight(n, k);
      for (var m = 0u; m < TOKENS; m++) { acc[m] += wk * x[m * p.K + k]; }
    }
  }
  for (var m = 0u; m < TOKENS; m++) { red[tid][m] = acc[m]; }
  workgroupBarrier();
  for (var stride = TPR / 2u; stride > 0u; stride >>= 1u) {
    if (lane < stride) {
      for (var m = 0u; m < TOKENS; m++) { red[tid][m] += red[tid + stride][m]; }
    }
    workgroupBarrier();
  }
  if (live) {
    let full_n = n + p.row_offset;
    for (var m = lane; m < TOKENS; m += TPR) {  // TPR may be fewer than the tokens
      var out = red[tid - lane][m];
      if (p.has_bias != 0u) { out += bias[full_n]; }
      y[m * p.out_stride + full_n] = out;
    }
  }
}
