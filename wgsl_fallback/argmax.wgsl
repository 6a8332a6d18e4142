// Greedy pick per row of logits [M, V]: the argmax (lowest index among ties, as torch.argmax) and its
// softmax probability 1 / sum_v exp(logit_v - max) — what the decoding policies need, so a step reads
// back 2 * W numbers instead of M * V logits. One workgroup per row. Results go to one u32 buffer
// out[2W] (ids at [off + m], the probability's bits at [W + off + m]) so a step's outputs are one read.
//
// Reference: bitmtp.decoding.drafters._argmax_prob
// Test: tests/wgsl_fallback/test_argmax.py

struct Params { M: u32, V: u32, off: u32, W: u32 }

const WG: u32 = 64u;

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> out: array<u32>;    // [2W]
@group(0) @binding(2) var<uniform> p: Params;

var<workgroup> rv: array<f32, WG>;
var<workgroup> ri: array<u32, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let m = wid.x;
  if (m >= p.M) { return; }
  let base = m * p.V;
  var bv: f32 = -3.4e38;
  var bi: u32 = 0xFFFFFFFFu;
  for (var v = tid; v < p.V; v += WG) {
    let x = logits[base + v];
    if (x > bv) { bv = x; bi = v; }  // v increases per thread: the first max wins
  }
  rv[tid] = bv;
  ri[tid] = bi;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (tid < stride) {
      let ov = rv[tid + stride];
      let oi = ri[tid + stride];
      if (ov > rv[tid] || (ov == rv[tid] && oi < ri[tid])) { rv[tid] = ov; ri[tid] = oi; }
    }
    workgroupBarrier();
  }
  let mx = rv[0];
  // an all-NaN (or all below -3.4e38) row found no max: id 0, as torch.argmax's NaN rows never give an
  // id outside the vocabulary (its probability is NaN, so the policies never call it confident)
  let arg = select(ri[0], 0u, ri[0] == 0xFFFFFFFFu);
  workgroupBarrier();
  var total: f32 = 0.0;
  for (var v = tid; v < p.V; v += WG) { total += exp(logits[base + v] - mx); }
  rv[tid] = total;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (tid < stride) { rv[tid] += rv[tid + stride]; }
    workgroupBarrier();
  }
  if (tid == 0u) {
    out[p.off + m] = arg;
    out[p.W + p.off + m] = bitcast<u32>(1.0 / rv[0]);
  }
}
