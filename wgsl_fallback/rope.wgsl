// RoPE in place on x[M, heads, Dh], rotate-half convention (transformers'):
//   x' = x * cos[pos] + rotate_half(x) * sin[pos],  rotate_half(x) = [-x[half:], x[:half]]
// cos/sin tables [positions, Dh] live on the device; positions [M] are the rows' absolute positions.
//
// Reference: bitmtp.model.layers.apply_rope
// Test: tests/wgsl_fallback/test_rope.py

struct Params { M: u32, heads: u32, Dh: u32, _p: u32 }

@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read> cos_t: array<f32>;
@group(0) @binding(2) var<storage, read> sin_t: array<f32>;
@group(0) @binding(3) var<storage, read> pos: array<u32>;
@group(0) @binding(4) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let half = p.Dh / 2u;
  let i = gid.x;
  if (i >= p.M * p.heads * half) { return; }
  let d = i % half;
  let row = i / half;            // m * heads + h
  let m = row / p.heads;
  let base = row * p.Dh;
  let t = pos[m] * p.Dh;
  let a = x[base + d];
  let b = x[base + d + half];
  x[base + d] = a * cos_t[t + d] - b * sin_t[t + d];
  x[base + d + half] = b * cos_t[t + d + half] + a * sin_t[t + d + half];
}
