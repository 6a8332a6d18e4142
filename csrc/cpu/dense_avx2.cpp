// Dense float32 GEMV, AVX2+FMA path (see dense_block.inc). Called only after CPUID confirms it.
//
// Reference: bitmtp.ops.reference.dense_linear_reference, bitmtp.formats.ggml_blocks.dequantize
// Test: tests/formats/test_ggml_blocks.py
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "dense_cpu.h"

namespace bitmtp_cpu {
namespace {

struct DIsa {
  using Vec = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRegs = 16;  // ymm registers
  // Not here: with 16 registers the decode-first order of dense_block_q ran 0.86-0.95x the per-row
  // order at M = 3, 8 and 15 (AVX2 path on AMD EPYC Zen 4, one thread).
  static constexpr bool kDecodeRowsFirst = false;
  // 16 ymm: R*M accumulators + R weight vectors + 1 activation.
  static constexpr int rows_for(int m) { return m <= 2 ? 4 : (m <= 4 ? 2 : 1); }
  static inline Vec zero() { return _mm256_setzero_ps(); }
  static inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static inline Vec load_pinned(const float* p) {
    Vec v = _mm256_loadu_ps(p);
    __asm__("" : "+x"(v));
    return v;
  }
  static inline Vec load_tail(const float* p, int count) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), idx);
    return _mm256_maskload_ps(p, mask);
  }
  static inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float reduce(Vec v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 0x55));
    return _mm_cvtss_f32(q);
  }
  // A block's 32 weights as 4 vectors in k order, with gguf-py's float32 values: d * q + m. d * q is
  // exact (an 11-bit float16 times a 4-bit code), so one FMA rounds exactly as the multiply-then-add
  // does. Low nibbles are weights 0-15, high nibbles 16-31; each 8-byte half is widened once.
  static inline void q4_1(const uint8_t* blk, Vec* w) {
    int32_t dm;
    __builtin_memcpy(&dm, blk, 4);
    const __m128 hdr = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));  // lanes 0, 1: d, m (exact widenings)
    const Vec d = _mm256_broadcastss_ps(hdr), m = _mm256_broadcastss_ps(_mm_movehdup_ps(hdr));
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 4)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 12)));
    const __m256i nib = _mm256_set1_epi32(15);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b0, nib)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(b1, nib)), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), m);
  }
  // Q4_0: d * (q - 8), exact.
  static inline void q4_0(const uint8_t* blk, Vec* w) {
    uint16_t h;
    __builtin_memcpy(&h, blk, 2);
    const Vec d = _mm256_set1_ps(_cvtsh_ss(h));
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 10)));
    const __m256i nib = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
    w[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b0, nib), eight)));
    w[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b1, nib), eight)));
    w[2] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b0, 4), eight)));
    w[3] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(b1, 4), eight)));
  }
  // Q8_0: d * q, exact.
  static inline void q8_0(const uint8_t* blk, Vec* w) {
    uint16_t h;
    __builtin_memcpy(&h, blk, 2);
    const Vec d = _mm256_set1_ps(_cvtsh_ss(h));
    for (int s = 0; s < 4; ++s)
      w[s] = _mm256_mul_ps(
          d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * s)))));
  }
  // BF16: the 16-bit value moved to a float32's upper half (exact); F16: vcvtph2ps (exact).
  static inline void bf16(const uint8_t* blk, Vec* w) {
    for (int s = 0; s < 4; ++s)
      w[s] = _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * s))), 16));
  }
  static inline void f16(const uint8_t* blk, Vec* w) {
    for (int s = 0; s < 4; ++s) w[s] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * s)));
  }
  static inline void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }
};

#include "dense_block.inc"

}  // namespace

void dense_rows_avx2(const DenseArgs& a, int n0, int n1) { dense_blocked(a, n0, n1); }

}  // namespace bitmtp_cpu
