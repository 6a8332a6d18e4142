// Element-wise ops of a decoder layer: residual add, the gated MLP activations on a fused gate/up buffer
// gu[M, 2I] (gate = gu[:, :I], up = gu[:, I:]): SiLU-gate (Llama/Qwen3) and relu^2 (BitNet); column
// slices of a fused q|k|v output; and adding a delta into rows at an offset (gated LoRA on mask rows).
//
// Reference: bitmtp.model.layers.silu, bitmtp.model.decoder.Decoder.run_layers
// Test: tests/wgsl_fallback/test_elementwise.py

struct Params { n: u32, I: u32, C: u32, c0: u32 }

@group(0) @binding(0) var<storage, read> a: array<f32>;
@group(0) @binding(1) var<storage, read> b: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn add(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x + gid.y * 65535u * 64u;
  if (i >= p.n) { return; }
  y[i] = a[i] + b[i];
}

@compute @workgroup_size(64)
fn silu_mul(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x + gid.y * 65535u * 64u;
  if (i >= p.n) { return; }
  let m = i / p.I;
  let j = i % p.I;
  let g = a[m * 2u * p.I + j];
  let u = a[m * 2u * p.I + p.I + j];
  y[i] = g / (1.0 + exp(-g)) * u;
}

@compute @workgroup_size(64)
fn relu2_mul(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x + gid.y * 65535u * 64u;
  if (i >= p.n) { return; }
  let m = i / p.I;
  let j = i % p.I;
  let g = max(a[m * 2u * p.I + j], 0.0);
  let u = a[m * 2u * p.I + p.I + j];
  y[i] = g * g * u;
}

// y[m, j] = a[m, c0 + j] for a[M, C], y[M, I]
@compute @workgroup_size(64)
fn cols(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x + gid.y * 65535u * 64u;
  if (i >= p.n) { return; }
  let m = i / p.I;
  let j = i % p.I;
  y[i] = a[m * p.C + p.c0 + j];
}

// y[c0 + i] += a[i] for i < n (c0: an element offset = first row * row length)
@compute @workgroup_size(64)
fn add_into(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x + gid.y * 65535u * 64u;
  if (i >= p.n) { return; }
  y[p.c0 + i] = y[p.c0 + i] + a[i];
}
