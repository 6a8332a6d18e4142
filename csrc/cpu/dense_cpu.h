// Dense float32 multi-token GEMV (embedding-side projections, LM heads, non-ternary checkpoints).
// Same contract as w2a8_cpu.h: plain declarations only (the ISA units include it under target
// pragmas).
#pragma once

#include <stdint.h>

namespace bitmtp_cpu {

struct DenseArgs {
  const float* x;     // [M][K] contiguous
  int M;              // tokens in this call (any; blocked in chunks of <= 8)
  int K;
  const float* w;     // [N][K] contiguous
  const float* bias;  // [N] or null
  float* y;           // [M][N]
  int N;
};

void dense_rows_scalar(const DenseArgs& a, int n0, int n1);
void dense_rows_avx2(const DenseArgs& a, int n0, int n1);
void dense_rows_avx512(const DenseArgs& a, int n0, int n1);

}  // namespace bitmtp_cpu
