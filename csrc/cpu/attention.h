// Row-deterministic attention (see attention.cpp).
//
// Reference: bitmtp.ops.reference.attention_reference
// Test: tests/ops/test_attention.py, tests/runtime/test_masked_rows.py
#pragma once

#include <stdint.h>

namespace bitmtp_cpu {

struct AttentionArgs {
  const float* q;       // [M][H][D]
  const float* k;       // [KVH][S][D] (S = rows of the KV buffer; rows [0, L) are read)
  const float* v;       // [KVH][S][D]; with kv_half, both hold IEEE binary16 (read through uint16_t)
  const uint8_t* mask;  // [M][L], 1 = row may attend to that KV row
  float* out;           // [M][H][D]
  int M, H, KVH, D, S, L;
  float scale;
  int threads;
  int isa;              // 0 scalar (baseline), 1 AVX2, 2 AVX-512: the same bits, wider vectors
  int kv_half = 0;      // 1: K/V are float16, widened exactly on load (the bits of float32 K/V holding
                        // the same values): half the bytes a long KV store streams
  // Per query row, the first and last KV row its mask allows (lo > hi: none), from mask_row_bounds; null:
  // attention_rows finds them. Speed only: chunks and tiles outside every row's bounds are skipped without
  // reading the mask or writing -inf scores (a batch's rows each see their own range of a long store; SmolLM2
  // heads, 300 KV rows a row, 2 threads: 8 rows over 18k KV rows 475-580 -> 382-427 us a call, 16 rows over
  // 36k 1364-1396 -> 1022-1100 us). The fused layers find them once a step, not once a layer.
  const int32_t* row_lo = nullptr;
  const int32_t* row_hi = nullptr;
};

// lo[m] / hi[m]: the first and last nonzero byte of mask row m ([M][L]); lo = L, hi = -1 for an all-zero row.
void mask_row_bounds(const uint8_t* mask, int M, int L, int32_t* lo, int32_t* hi);

// Tiling of attention_body.inc (speed only: a pair's bits never depend on these).
constexpr int kAttnTile = 16;      // KV rows per transposed K tile: the vector lanes of the scores
constexpr int kAttnChunk = 128;    // KV rows per softmax chunk (fixes the bits: see attention_body.inc);
                                   // its V rows (32 KiB at head dim 64) stay in L1 for the PV loop
constexpr int kAttnMaxPairs = 64;  // (row, head) pairs computed together: bounds the scratch

// Floats of scratch one thread of attention_rows_* uses, and of the per-(pair, chunk) partials the
// threads share (attention.cpp; the caller allocates threads times the first plus the second, the
// ISA units carve it up the same way).
int64_t attention_scratch_floats(const AttentionArgs& a);
int64_t attention_partial_floats(const AttentionArgs& a);

// Dispatches on a.isa (already checked against the CPU by the caller).
void attention_rows(const AttentionArgs& a);
void attention_rows_scalar(const AttentionArgs& a, float* scratch);
void attention_rows_avx2(const AttentionArgs& a, float* scratch);
void attention_rows_avx512(const AttentionArgs& a, float* scratch);

}  // namespace bitmtp_cpu
