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
  const float* v;       // [KVH][S][D]
  const uint8_t* mask;  // [M][L], 1 = row may attend to that KV row
  float* out;           // [M][H][D]
  int M, H, KVH, D, S, L;
  float scale;
  int threads;
  int isa;              // 0 scalar (baseline), 1 AVX2, 2 AVX-512: the same bits, wider vectors
};

// Dispatches on a.isa (already checked against the CPU by the caller).
void attention_rows(const AttentionArgs& a);
void attention_rows_scalar(const AttentionArgs& a, float* scratch_f, int* scratch_i);
void attention_rows_avx2(const AttentionArgs& a, float* scratch_f, int* scratch_i);
void attention_rows_avx512(const AttentionArgs& a, float* scratch_f, int* scratch_i);

}  // namespace bitmtp_cpu
