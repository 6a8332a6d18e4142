// Embedding lookup on the device: out[m, :] = table[tokens[m], :] — the host uploads only token ids.

struct Params { M: u32, H: u32, _a: u32, _b: u32 }

@group(0) @binding(0) var<storage, read> table: array<f32>;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.M * p.H) { return; }
  out[i] = table[tokens[i / p.H] * p.H + i % p.H];
}
