// Write a step's K or V rows src[M, kv_heads, Dh] into the cache [kv_heads, S, Dh] at the rows'
// positions (the device offset n of each row): in place, no copies of other rows.
//
// Reference: bitmtp.runtime.kv.KVStore.write
// Test: tests/wgsl_fallback/test_kv_write.py

struct Params { M: u32, kv_heads: u32, Dh: u32, S: u32 }

@group(0) @binding(0) var<storage, read> src: array<f32>;
@group(0) @binding(1) var<storage, read_write> cache: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.M * p.kv_heads * p.Dh) { return; }
  let d = i % p.Dh;
  let h = (i / p.Dh) % p.kv_heads;
  let m = i / (p.Dh * p.kv_heads);
  cache[(h * p.S + pos[m]) * p.Dh + d] = src[i];
}
