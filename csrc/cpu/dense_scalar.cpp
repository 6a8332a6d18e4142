// Dense GEMV, portable path: one sequential sum per (row, token) — row-independent too. Block-format
// rows are decoded into a float32 row first (gguf-py's operations: d * q, then + m; bf16 / f16 widened).
//
// Reference: bitmtp.ops.reference.dense_linear_reference, bitmtp.formats.ggml_blocks.dequantize
// Test: tests/formats/test_ggml_blocks.py
#include <cstddef>
#include <vector>

#include "dense_cpu.h"

namespace bitmtp_cpu {

namespace {

void decode_row(const DenseArgs& a, int n, float* out) {
  const int blocks = a.K / kBlock, bb = block_bytes(a.fmt);
  const uint8_t* row = a.wb + static_cast<int64_t>(n) * blocks * bb;
  for (int b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + static_cast<int64_t>(b) * bb;
    float* o = out + b * kBlock;
    if (a.fmt == kDenseBF16 || a.fmt == kDenseF16) {
      for (int j = 0; j < kBlock; ++j) {
        uint16_t v;
        __builtin_memcpy(&v, blk + 2 * j, 2);
        o[j] = a.fmt == kDenseBF16 ? bf16_to_float(v) : half_to_float(v);
      }
      continue;
    }
    uint16_t h[2];
    __builtin_memcpy(h, blk, 4);
    const float d = half_to_float(h[0]);
    if (a.fmt == kDenseQ4_1) {
      const float m = half_to_float(h[1]);
      for (int j = 0; j < kBlock; ++j) {
        const int q = (blk[4 + (j & 15)] >> (j >= 16 ? 4 : 0)) & 15;
        o[j] = d * static_cast<float>(q) + m;
      }
    } else if (a.fmt == kDenseQ4_0) {
      for (int j = 0; j < kBlock; ++j) {
        const int q = (blk[2 + (j & 15)] >> (j >= 16 ? 4 : 0)) & 15;
        o[j] = d * static_cast<float>(q - 8);
      }
    } else {
      for (int j = 0; j < kBlock; ++j) o[j] = d * static_cast<float>(static_cast<int8_t>(blk[2 + j]));
    }
  }
}

}  // namespace

void dense_rows_scalar(const DenseArgs& a, int n0, int n1) {
  std::vector<float> decoded(a.fmt == kDenseF32 ? 0 : static_cast<size_t>(a.K));
  for (int n = n0; n < n1; ++n) {
    const float* w = decoded.data();
    if (a.fmt == kDenseF32)
      w = a.w + static_cast<int64_t>(n) * a.K;
    else
      decode_row(a, n, decoded.data());
    for (int m = 0; m < a.M; ++m) {
      const float* x = a.x + static_cast<int64_t>(m) * a.K;
      float s = 0.f;
      for (int k = 0; k < a.K; ++k) s += w[k] * x[k];
      if (a.bias) s += a.bias[n];
      a.y[static_cast<int64_t>(m) * a.N + n] = s;
    }
  }
}

}  // namespace bitmtp_cpu
