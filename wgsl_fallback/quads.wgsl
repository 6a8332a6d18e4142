// x f32[M, K] → token-minor quads xt[j, m] = x[m, 4j .. 4j + 3] (K % 4 == 0), the activation layout of the
// rows dense shader (dense_rows.py): one K range of every token is one contiguous, window-able range.
//
// Reference: bitmtp.ops.reference.dense_linear_reference (of the dense op whose activations it lays out)
// Test: tests/wgsl_fallback/test_quads.py

struct Params { M: u32, K: u32, quads: u32, wg_x: u32 }

@group(0) @binding(0) var<storage, read> x: array<f32>;              // [M, K]
@group(0) @binding(1) var<storage, read_write> xt: array<vec4<f32>>; // [quads, M] (+ window padding)
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
  let i = (wid.x + wid.y * p.wg_x) * 64u + tid;
  if (i >= p.quads * p.M) { return; }
  let at = (i % p.M) * p.K + 4u * (i / p.M);  // token i % M, quad i / M
  xt[i] = vec4<f32>(x[at], x[at + 1u], x[at + 2u], x[at + 3u]);
}
