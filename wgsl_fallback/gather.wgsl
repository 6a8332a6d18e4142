// Embedding lookup on the device: out[m, :] = table[tokens[off + m], :] — the host uploads only token ids.
// A table split into row chunks (larger than one binding) is gathered chunk by chunk: each dispatch
// writes the rows whose token lies in [row_start, row_start + rows).
//
// Reference: bitmtp.model.decoder.Decoder.hidden_states (its embedding lookup)
// Test: tests/wgsl_fallback/test_gather.py

struct Params { M: u32, H: u32, off: u32, row_start: u32, rows: u32, _a: u32, _b: u32, _c: u32 }

//#if BF16
@group(0) @binding(0) var<storage, read> table: array<u32>;  // bf16 pairs, rows of K2 words
fn value(r: u32, k: u32) -> f32 {
  let word = table[r * ((p.H + 1u) / 2u) + k / 2u];
  return bitcast<f32>(select(word << 16u, word & 0xFFFF0000u, (k & 1u) == 1u));
}
//#else
//#if F16
@group(0) @binding(0) var<storage, read> table: array<u32>;  // f16 pairs
fn value(r: u32, k: u32) -> f32 { return unpack2x16float(table[r * ((p.H + 1u) / 2u) + k / 2u])[k & 1u]; }
//#else
@group(0) @binding(0) var<storage, read> table: array<f32>;
fn value(r: u32, k: u32) -> f32 { return table[r * p.H + k]; }
//#endif
//#endif
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.M * p.H) { return; }
  let t = tokens[p.off + i / p.H];
  if (t < p.row_start || t >= p.row_start + p.rows) { return; }
  out[i] = value(t - p.row_start, i % p.H);
}
