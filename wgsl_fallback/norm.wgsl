// Row-wise RMSNorm, as transformers' Llama/Qwen3/BitNet RMSNorm: y = weight * (x * rsqrt(mean(x^2) + eps)).
// Rows of length D at stride D: whole hidden rows, BitNet's sub-norm rows, or Qwen3's per-head q/k rows
// (rows = M * heads, D = head_dim, weight shared by every head). One workgroup per row.
//
// Reference: bitmtp.ops.reference.rms_norm_reference
// Test: tests/wgsl_fallback/test_norm.py

struct Params { rows: u32, D: u32, eps: f32, _p: u32 }

const WG: u32 = 64u;

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> weight: array<f32>;   // [D]
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let r = wid.x + wid.y * 65535u;
  if (r >= p.rows) { return; }
  let base = r * p.D;
  var ss: f32 = 0.0;
  for (var d = tid; d < p.D; d += WG) { let v = x[base + d]; ss += v * v; }
  red[tid] = ss;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (tid < stride) { red[tid] += red[tid + stride]; }
    workgroupBarrier();
  }
  let inv = inverseSqrt(red[0] / f32(p.D) + p.eps);
  for (var d = tid; d < p.D; d += WG) { y[base + d] = weight[d] * (x[base + d] * inv); }
}
