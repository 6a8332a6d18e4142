// Masked multi-head attention with GQA over a KV segment, one workgroup per (row m, head h):
//   scores[l] = (q[m, h] . k[h / group, l]) * scale   where mask[m, l] != 0, else -inf
//   out[m, h] = softmax(scores) @ v[h / group, :L]
// The mask [M, L] carries the step's structure (AR causal, draft block-causal, verify), so one shader
// serves every replay state. Scores live in workgroup memory: L <= MAX_L. Masked KV rows are never
// read (neither K nor V), so whatever they hold cannot reach the output.
//
// Reference: bitmtp.ops.reference.attention_reference
// Test: tests/wgsl_fallback/test_attention.py, tests/runtime/test_masked_rows.py

struct Params { M: u32, heads: u32, kv_heads: u32, Dh: u32, S: u32, L: u32, scale: f32, _p: u32 }

const WG: u32 = 64u;
const MAX_L: u32 = 4096u;

@group(0) @binding(0) var<storage, read> q: array<f32>;        // [M, heads, Dh]
@group(0) @binding(1) var<storage, read> kc: array<f32>;       // [kv_heads, S, Dh]
@group(0) @binding(2) var<storage, read> vc: array<f32>;       // [kv_heads, S, Dh]
@group(0) @binding(3) var<storage, read> mask: array<u32>;     // [M, L]
@group(0) @binding(4) var<storage, read_write> out: array<f32>; // [M, heads, Dh]
@group(0) @binding(5) var<uniform> p: Params;

var<workgroup> scores: array<f32, MAX_L>;
var<workgroup> red: array<f32, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let m = wid.x;
  let h = wid.y;
  let kvh = h / (p.heads / p.kv_heads);
  let qb = (m * p.heads + h) * p.Dh;
  var best: f32 = -3.4e38;
  for (var l = tid; l < p.L; l += WG) {
    var sc: f32 = -3.4e38;
    if (mask[m * p.L + l] != 0u) {
      let kb = (kvh * p.S + l) * p.Dh;
      var dot: f32 = 0.0;
      for (var d = 0u; d < p.Dh; d++) { dot += q[qb + d] * kc[kb + d]; }
      sc = dot * p.scale;
    }
    scores[l] = sc;
    best = max(best, sc);
  }
  red[tid] = best;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (tid < stride) { red[tid] = max(red[tid], red[tid + stride]); }
    workgroupBarrier();
  }
  let mx = red[0];
  workgroupBarrier();
  var total: f32 = 0.0;
  for (var l = tid; l < p.L; l += WG) {
    var e: f32 = 0.0;
    if (mask[m * p.L + l] != 0u) { e = exp(scores[l] - mx); }
    scores[l] = e;
    total += e;
  }
  red[tid] = total;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (tid < stride) { red[tid] += red[tid + stride]; }
    workgroupBarrier();
  }
  // a row whose mask allows no KV row has total 0 (acc stays 0): output zeros, as every backend defines
  // it (bitmtp.ops.reference.attention_reference), not 0 * (1 / 0) = NaN. A row that sees a KV row has
  // total >= 1 (its max scores exp(0)), so its bits are unchanged.
  let inv = select(0.0, 1.0 / red[0], red[0] > 0.0);
  for (var d = tid; d < p.Dh; d += WG) {
    var acc: f32 = 0.0;
    for (var l = 0u; l < p.L; l++) {
      // Masked rows are skipped, never weighted by 0: their V may hold NaN/Inf (rejected drafts, an
      // earlier longer sequence), and 0 * NaN is NaN.
      if (mask[m * p.L + l] != 0u) { acc += scores[l] * vc[(kvh * p.S + l) * p.Dh + d]; }
    }
    out[qb + d] = acc * inv;
  }
}
