// Row-deterministic attention for CPU steps.
//
// Why: bitmtp's exactness invariants (speculative output == AR greedy output; KV rows equal a
// fresh prefill) need every row's result to be independent of the step's width M and of the
// segment length L it ran in. BLAS-backed matmuls change their summation order with the shapes,
// and in ternary models a 1-ulp difference can flip an int8 activation rounding downstream. Here
// every (row, head) pair runs one fixed operation sequence (attention_body.inc) over the KV rows
// its mask allows, in increasing order, with a fixed 16-way partial-sum dot product: the result
// depends on the pair's own inputs only, and is the same on every ISA path (vectors change only how
// many lanes run at once).
//
// Speed: what a step's pairs share is the K/V streaming. All pairs of one KV head (every query row
// and every head of the GQA group) are computed together, K and V read once per tile for all of
// them, scores vectorised across 16 KV rows of a transposed K tile (no horizontal sums), PV across
// the head dimension with several pairs' accumulators in registers. The softmax runs per chunk of
// kAttnChunk KV rows (its own max, exponentials, total and PV, merged afterwards in chunk order), so
// the threads split a long KV store's rows between them instead of splitting the 3 pairs of a
// decode step (which read K/V twice and left a thread idle), and the exponential is the kernel's
// own vectorised vec_exp (vec_exp.inc) instead of the C library's scalar expf (a third of the time before).
// SmolLM2-135M shapes (9 heads, 3 KV heads, head dim 64), AVX-512, 1 thread, per layer: width 1 over
// 1024 KV rows (L2-resident) 178 -> 127 us, over 4096 rows (6.3 MB, from memory) 1.5-2.1 -> 1.1-1.3 ms
// (the machine's one-core read bandwidth, ~5.5 GB/s); width 16 over 1024 rows 4.4 -> 1.4 ms.
//
// Reference: bitmtp.ops.reference.attention_reference
// Test: tests/ops/test_attention.py, tests/runtime/test_masked_rows.py
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <memory>

#include "pool.h"

#include "attention.h"

namespace bitmtp_cpu {

#define ATTN_VEC_BYTES 16  // the native vector of the x86-64 baseline: SSE2 xmm
#define ATTN_ROWS attention_rows_scalar
#include "attention_body.inc"
#undef ATTN_ROWS
#undef ATTN_VEC_BYTES

int64_t attention_scratch_floats(const AttentionArgs& a) {
  // one chunk's scores of kAttnMaxPairs pairs, one transposed K tile, one row of zeros (the
  // stand-in for KV rows nobody may read); float16 K/V: one tile's K rows and one chunk's V rows
  // widened to float32
  const int64_t half = a.kv_half ? static_cast<int64_t>(kAttnTile + kAttnChunk) * a.D : 0;
  return static_cast<int64_t>(kAttnMaxPairs) * kAttnChunk + static_cast<int64_t>(kAttnTile + 1) * a.D + half;
}

int64_t attention_partial_floats(const AttentionArgs& a) {
  // per (pair, chunk): max, total, seen flag, D accumulators
  const int64_t chunks = (static_cast<int64_t>(a.L) + kAttnChunk - 1) / kAttnChunk;
  return static_cast<int64_t>(a.M) * a.H * chunks * (3 + a.D);
}

void mask_row_bounds(const uint8_t* mask, int M, int L, int32_t* lo, int32_t* hi) {
  for (int m = 0; m < M; ++m) {
    const uint8_t* r = mask + static_cast<int64_t>(m) * L;
    int a = 0, b = L - 1;
    // whole 8-byte words of zeros first (a batch's row is zeros outside its sequence's range)
    for (uint64_t w; a + 8 <= L && (memcpy(&w, r + a, 8), w == 0);) a += 8;
    while (a < L && !r[a]) ++a;
    for (uint64_t w; b - 7 > a && (memcpy(&w, r + b - 7, 8), w == 0);) b -= 8;
    while (b >= a && !r[b]) --b;
    lo[m] = a;
    hi[m] = a < L ? b : -1;
  }
}

void attention_rows(const AttentionArgs& args) {
  AttentionArgs a = args;
  std::unique_ptr<int32_t[]> bounds;
  if (a.row_lo == nullptr || a.row_hi == nullptr) {
    bounds.reset(new int32_t[static_cast<size_t>(a.M) * 2]);
    mask_row_bounds(a.mask, a.M, a.L, bounds.get(), bounds.get() + a.M);
    a.row_lo = bounds.get();
    a.row_hi = bounds.get() + a.M;
  }
  const int threads = a.threads > 0 ? a.threads : 1;
  // not zero-filled: every float is written before it is read
  std::unique_ptr<float[]> scratch(
      new float[static_cast<size_t>(threads) * attention_scratch_floats(a) + attention_partial_floats(a)]);
  if (a.isa >= 2)
    attention_rows_avx512(a, scratch.get());
  else if (a.isa == 1)
    attention_rows_avx2(a, scratch.get());
  else
    attention_rows_scalar(a, scratch.get());
}

}  // namespace bitmtp_cpu
