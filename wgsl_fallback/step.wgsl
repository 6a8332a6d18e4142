// The decode loop's device-side bookkeeping (bitmtp/runtime/verify_prep.py, on wgpu buffers):
// `prepare`: verify tokens = the draft's last D ids, positions = (last pending position) + 1 + [0, D);
// `resolve`: after a verify step, a = 1 + the longest prefix where d_(i+1) == v_i; the next draft step
// (width W) gets token v_a and positions (position of d_1) + a + [0, W). Nothing travels to the host.
//
// Reference: bitmtp.runtime.verify_prep.prepare_verify, bitmtp.runtime.verify_prep.resolve_verify
// Test: tests/wgsl_fallback/test_step.py

struct Params { D: u32, src_off: u32, W: u32, last_pos_index: u32 }

@group(0) @binding(0) var<storage, read> src_out: array<u32>;      // a runner's outputs [2 * W_src]
@group(0) @binding(1) var<storage, read> src_pos: array<u32>;      // that runner's positions
@group(0) @binding(2) var<storage, read> src_tok: array<u32>;      // that runner's tokens
@group(0) @binding(3) var<storage, read_write> dst_tok: array<u32>;
@group(0) @binding(4) var<storage, read_write> dst_pos: array<u32>;
@group(0) @binding(5) var<uniform> p: Params;

@compute @workgroup_size(64)
fn prepare(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.D) { return; }
  dst_tok[i] = src_out[p.src_off + i];
  dst_pos[i] = src_pos[p.last_pos_index] + 1u + i;
}

@compute @workgroup_size(64)
fn resolve(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.W) { return; }
  var a: u32 = 1u;
  for (var k = 1u; k < p.D; k++) {
    if (src_tok[k] != src_out[k - 1u]) { break; }
    a = a + 1u;
  }
  if (i == 0u) { dst_tok[0] = src_out[a - 1u]; }
  dst_pos[i] = src_pos[0] + a + i;
}
