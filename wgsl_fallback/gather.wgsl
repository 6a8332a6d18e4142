// Embedding lookup on the device: out[m, :] = table[tokens[off + m], :] — the host uploads only token ids.
// A table split into row chunks (larger than one binding) is gathered chunk by chunk: each dispatch
// writes the rows whose token lies in [row_start, row_start + rows).

struct Params { M: u32, H: u32, off: u32, row_start: u32, rows: u32, _a: u32, _b: u32, _c: u32 }

@group(0) @binding(0) var<storage, read> table: array<f32>;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i >= p.M * p.H) { return; }
  let t = tokens[p.off + i / p.H];
  if (t < p.row_start || t >= p.row_start + p.rows) { return; }
  out[i] = table[(t - p.row_start) * p.H + i % p.H];
}
