// A step's attention mask over KV rows [0, L), built on the device from the rows' positions (so the host
// uploads only tokens and positions). Row i may see KV row j when j <= reach_i, where reach_i is the
// row's own position for the first `causal` rows (prefill, AR, verify and the pending rows of a draft
// step) and the last row's position for the rest (a draft step's mask rows see history, the pending
// suffix and their whole block).
//
// Reference: bitmtp.runtime.graphs.causal_mask, bitmtp.decoding.drafters.MaskBlockDrafter.draft
// Test: tests/wgsl_fallback/test_mask.py

struct Params { M: u32, L: u32, causal: u32, _p: u32 }

@group(0) @binding(0) var<storage, read> pos: array<u32>;
@group(0) @binding(1) var<storage, read_write> mask: array<u32>;  // [M, L]
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.M * p.L) { return; }
  let m = i / p.L;
  let j = i % p.L;
  let reach = select(pos[p.M - 1u], pos[m], m < p.causal);
  mask[i] = select(0u, 1u, j <= reach);
}
