// Dense float32 linear y = x @ W^T (+ bias) with 16-token register tiling: one workgroup per output row,
// each weight element loaded once for all M <= 16 tokens. Used for the LM head and dense checkpoints.

struct Params { M: u32, N: u32, K: u32, has_bias: u32, out_stride: u32, row_offset: u32, wg_x: u32, _p: u32 }

const WG: u32 = 64u;
const MT: u32 = 16u;

@group(0) @binding(0) var<storage, read> x: array<f32>;        // [M, K]
@group(0) @binding(1) var<storage, read> w: array<f32>;        // [N, K] (this chunk's rows)
@group(0) @binding(2) var<storage, read> bias: array<f32>;     // [full N]
@group(0) @binding(3) var<storage, read_write> y: array<f32>;  // [M, out_stride]
@group(0) @binding(4) var<uniform> p: Params;

var<workgroup> red: array<array<f32, MT>, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let n = wid.x + wid.y * p.wg_x;
  if (n >= p.N) { return; }
  var acc: array<f32, MT>;
  for (var m = 0u; m < MT; m++) { acc[m] = 0.0; }
  let row = n * p.K;
  for (var k = tid; k < p.K; k += WG) {
    let wk = w[row + k];
    for (var m = 0u; m < p.M; m++) { acc[m] += wk * x[m * p.K + k]; }
  }
  for (var m = 0u; m < MT; m++) { red[tid][m] = acc[m]; }
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (tid < stride) {
      for (var m = 0u; m < p.M; m++) { red[tid][m] += red[tid + stride][m]; }
    }
    workgroupBarrier();
  }
  if (tid < p.M) {
    let full_n = n + p.row_offset;
    var out = red[0][tid];
    if (p.has_bias != 0u) { out += bias[full_n]; }
    y[tid * p.out_stride + full_n] = out;
  }
}
