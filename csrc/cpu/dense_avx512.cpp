// Dense float32 GEMV, AVX-512F path (see dense_block.inc). Called only after CPUID confirms it.
//
// Reference: bitmtp.ops.reference.dense_linear_reference, bitmtp.formats.ggml_blocks.dequantize
// Test: tests/formats/test_ggml_blocks.py
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,f16c")
#include <immintrin.h>

#include <cstdlib>

#include "dense_cpu.h"

namespace bitmtp_cpu {
namespace {

struct DIsa {
  using Vec = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRegs = 32;  // zmm registers
  // dense_block_q decodes a row block's R rows before its FMAs and loads each activation vector once for
  // them (see there): 1.07-1.11x the per-row order at M = 8 and 15, AMD EPYC Zen 4.
  static constexpr bool kDecodeRowsFirst = true;
  static constexpr int rows_for(int m) { return m <= 2 ? 8 : (m <= 4 ? 4 : 3); }
  static inline Vec zero() { return _mm512_setzero_ps(); }
  static inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static inline Vec load_pinned(const float* p) {
    Vec v = _mm512_loadu_ps(p);
    __asm__("" : "+v"(v));  // one load shared by the R rows, not folded into every FMA
    return v;
  }
  static inline Vec load_tail(const float* p, int count) {
    return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1u), p);
  }
  static inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float reduce(Vec v) {
    // Fixed pairwise order: 16 -> 8 -> 4 -> 2 -> 1.
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 0x55));
    return _mm_cvtss_f32(q);
  }
  // A block's 32 weights as 2 vectors in k order, with gguf-py's float32 values: d * q + m. d * q is
  // exact (an 11-bit float16 times a 4-bit code), so one FMA rounds exactly as the multiply-then-add
  // does. Low nibbles are weights 0-15, high nibbles 16-31. The 16 values a code can take are made once
  // per block (one FMA over 0..15: lane j holds exactly fma(d, j, m)) and each weight is looked up by its
  // code with vpermps, which reads only an index's low 4 bits, so the low nibble needs no mask: per block
  // 1 FMA + 2 permutes instead of 2 int->float converts, a mask and 2 FMAs (the M = 1 GEMV is bound by these
  // instructions, not by bandwidth).
  static inline void q4_1(const uint8_t* blk, Vec* w) {
    int32_t dm;
    __builtin_memcpy(&dm, blk, 4);
    const __m128 hdr = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));  // lanes 0, 1: d, m (exact widenings)
    const Vec table = _mm512_fmadd_ps(_mm512_broadcastss_ps(hdr), codes16(), _mm512_broadcastss_ps(_mm_movehdup_ps(hdr)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
    w[0] = _mm512_permutexvar_ps(b, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  }
  // Q4_0: d * (q - 8), exact; the same lookup (lane j holds d * (j - 8)).
  static inline void q4_0(const uint8_t* blk, Vec* w) {
    uint16_t h;
    __builtin_memcpy(&h, blk, 2);
    const Vec table = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(h)), _mm512_sub_ps(codes16(), _mm512_set1_ps(8.0f)));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
    w[0] = _mm512_permutexvar_ps(b, table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  }
  // 0, 1, ..., 15 as floats (exact).
  static inline Vec codes16() {
    return _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f);
  }
  // Q8_0: d * q, exact.
  static inline void q8_0(const uint8_t* blk, Vec* w) {
    uint16_t h;
    __builtin_memcpy(&h, blk, 2);
    const Vec d = _mm512_set1_ps(_cvtsh_ss(h));
    w[0] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)))));
    w[1] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))));
  }
  // BF16: the 16-bit value moved to a float32's upper half (exact); F16: vcvtph2ps (exact).
  static inline void bf16(const uint8_t* blk, Vec* w) {
    for (int s = 0; s < 2; ++s)
      w[s] = _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * s))), 16));
  }
  static inline void f16(const uint8_t* blk, Vec* w) {
    for (int s = 0; s < 2; ++s) w[s] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32 * s)));
  }
  // Into L2 (T1), not L1: with T0 an LM head (128256 x 2560 float32, one thread, AMD EPYC Zen 4) ran
  // 1.2-1.4x slower at M = 1 and 1.7x slower at M = 8 (the prefetches of a row block evicted the
  // activations from L1 and queued behind its misses), alternated in one run.
  static inline void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
};

#include "dense_block.inc"

}  // namespace

void dense_rows_avx512(const DenseArgs& a, int n0, int n1) { dense_blocked(a, n0, n1); }

}  // namespace bitmtp_cpu
