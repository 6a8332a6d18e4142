// Dense multi-token GEMV (embedding-side projections, LM heads, non-ternary checkpoints), with
// float32 weights or weights kept in GGML's Q4_0 / Q4_1 / Q8_0 blocks or as bfloat16 / float16 rows (bitmtp/formats/ggml_blocks.py).
// Same contract as w2a8_cpu.h: plain declarations only (the ISA units include it under target
// pragmas).
//
// Reference: bitmtp.ops.reference.dense_linear_reference, bitmtp.formats.ggml_blocks.dequantize
// Test: tests/formats/test_ggml_blocks.py
#pragma once

#include <stdint.h>

namespace bitmtp_cpu {

// Weight storage of a dense projection. A block holds 32 consecutive weights of a row:
//   Q4_1: float16 d, float16 m, 16 bytes; weight j = d * q + m with q = byte[j % 16] >> (4 * (j >= 16)) & 15
//   Q8_0: float16 d, 32 int8; weight j = d * q[j]
//   Q4_0: float16 d, 16 bytes; weight j = d * (q - 8) with q as in Q4_1
//   BF16 / F16: 32 bfloat16 / IEEE half values, 64 bytes (a bf16 or f16 checkpoint's rows as they lie:
//   no scale); weight j = the value widened to float32, which is exact
// Each weight is rebuilt with exactly gguf-py's float32 operations (one multiply, then one add), so
// a packed row gives the very floats the float32 kernel would get from the dequantized tensor and
// the results are bit-identical to it on every ISA path.
enum DenseFormat { kDenseF32 = 0, kDenseQ4_1 = 1, kDenseQ8_0 = 2, kDenseQ4_0 = 3, kDenseBF16 = 4, kDenseF16 = 5 };
constexpr int kBlock = 32;
constexpr int block_bytes(int fmt) {
  return fmt == kDenseQ4_1 ? 20
         : fmt == kDenseQ8_0 ? 34
         : fmt == kDenseQ4_0 ? 18
         : (fmt == kDenseBF16 || fmt == kDenseF16) ? kBlock * 2
                                                   : kBlock * 4;
}

struct DenseArgs {
  const float* x;     // [M][K] contiguous
  int M;              // tokens in this call (any; blocked in chunks of <= 8)
  int K;
  const float* w;     // kDenseF32: [N][K] contiguous
  const float* bias;  // [N] or null
  float* y;           // [M][N]
  int N;
  int fmt = kDenseF32;
  const uint8_t* wb = nullptr;  // block formats: [N][K / 32] blocks (K a multiple of 32)
};

// The float32 value of an IEEE half (exact; block headers are converted once per block).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while (!(man & 0x400u));
    bits = sign | ((112u - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// The float32 value of a bfloat16 (exact: its bits are a float32's upper half).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

void dense_rows_scalar(const DenseArgs& a, int n0, int n1);
void dense_rows_avx2(const DenseArgs& a, int n0, int n1);
void dense_rows_avx512(const DenseArgs& a, int n0, int n1);

}  // namespace bitmtp_cpu
