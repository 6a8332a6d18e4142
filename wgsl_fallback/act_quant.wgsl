// Per-token absmax int8 quantization (the A8 of W2A8), as bitmtp.formats.quantize_activations:
//   s = 127 / max(max|x|, 1e-5);  x_q = clamp(round_half_even(x * s), -128, 127)
// x_q is packed four int8 to a u32 (K padded with zeros to K4 * 4), stored token-minor: word i of token m
// at xq[i * M + m], so the W2A8 kernel's 16-token tile reads one word position of all tokens from one
// cache line. Plus each scale group's sum of x_q (the W2A8 kernel's "-sum x" term). One workgroup per token.
//
// Reference: bitmtp.ops.reference.act_quant_reference
// Test: tests/wgsl_fallback/test_act_quant.py

struct Params { M: u32, K: u32, K4: u32, group: u32, n_groups: u32, _a: u32, _b: u32, _c: u32 }

const WG: u32 = 64u;

@group(0) @binding(0) var<storage, read> x: array<f32>;            // [M, K]
@group(0) @binding(1) var<storage, read_write> xq: array<u32>;     // [K4, M]
@group(0) @binding(2) var<storage, read_write> s_out: array<f32>;  // [M]
@group(0) @binding(3) var<storage, read_write> xsum: array<i32>;   // [M, n_groups]
@group(0) @binding(4) var<uniform> p: Params;

var<workgroup> red: array<f32, WG>;

fn q(v: f32, s: f32) -> i32 {
  return i32(clamp(round(v * s), -128.0, 127.0));
}

// 1 / a correctly rounded, for a positive float: 2^48 / significand by restoring division in u32
// (remainder < 2^25), then rounded to nearest. A subnormal a, or one
// whose reciprocal would be subnormal (a >= 2^126), takes the plain division (never an activation's
// absmax: it is clamped to >= 1e-5 and finite activations that large overflow the model anyway).
fn recip_rn(a: f32) -> f32 {
  let bits = bitcast<u32>(a);
  let e = (bits >> 23u) & 0xFFu;
  if (e == 0u || e > 252u) { return 1.0 / a; }
  let m = (bits & 0x7FFFFFu) | 0x800000u;  // a = m * 2^(e - 150), 2^23 <= m < 2^24
  if (m == 0x800000u) { return bitcast<f32>((254u - e) << 23u); }  // a power of two: 2^(127 - (e - 127))
  var rem: u32 = 1u;
  var quo: u32 = 0u;
  for (var i = 0u; i < 48u; i++) {  // quo = floor(2^48 / m), 2^24 < quo < 2^25
    rem = rem << 1u;
    quo = quo << 1u;
    if (rem >= m) { rem -= m; quo |= 1u; }
  }
  // 1/a = (quo + rem/m) * 2^(102 - e): 24 significant bits, then the round bit quo & 1. No ties: m is not a
  // power of two, so m * quo != 2^48 and rem != 0 — a set round bit always rounds up
  var mant = quo >> 1u;
  if ((quo & 1u) == 1u) { mant += 1u; }
  var biased = 253u - e;
  if (mant == 0x1000000u) { mant = 0x800000u; biased += 1u; }
  return bitcast<f32>((biased << 23u) | (mant & 0x7FFFFFu));
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let m = wid.x;
  if (m >= p.M) { return; }
  let base = m * p.K;
  var amax: f32 = 0.0;
  for (var k = tid; k < p.K; k += WG) { amax = max(amax, abs(x[base + k])); }
  red[tid] = amax;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (tid < stride) { red[tid] = max(red[tid], red[tid + stride]); }
    workgroupBarrier();
  }
  // torch evaluates 127 / a as reciprocal(a) * 127 (Tensor.__rtruediv__), each step rounded. WGSL allows
  // 2.5 ulp for a division, and NVIDIA's Vulkan driver is an ulp off where lavapipe is not (seen on an H200),
  // so the reciprocal is computed exactly in integers (recip_rn); the multiplication is correctly rounded.
  let a = max(red[0], 1e-5);
  let s = recip_rn(a) * 127.0;
  if (tid == 0u) { s_out[m] = s; }
  for (var i = tid; i < p.K4; i += WG) {
    var word: u32 = 0u;
    for (var b = 0u; b < 4u; b++) {
      let k = 4u * i + b;
      if (k < p.K) { word |= (u32(q(x[base + k], s)) & 0xFFu) << (8u * b); }
    }
    xq[i * p.M + m] = word;
  }
  for (var g = tid; g < p.n_groups; g += WG) {
    var total: i32 = 0;
    let hi = min((g + 1u) * p.group, p.K);
    for (var k = g * p.group; k < hi; k++) { total += q(x[base + k], s); }
    xsum[m * p.n_groups + g] = total;
  }
}
