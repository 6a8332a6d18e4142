// AVX-512 VNNI path. Compiled for this ISA by the pragma below (never -march=native): the module
// only calls it after CPUID says avx512f/bw/vl/dq/vnni are present.
//
// One step covers 4 T2 words = 64 weights: the 4 words are broadcast to 16 lanes (lane 4j+s holds
// word j), shifted right by 2s and masked with 0x03030303, which yields the codes of k = 16j+4s ..
// 16j+4s+3 in lane 4j+s — exactly the int32 lane of a plain 64-byte activation load — and one
// vpdpbusd per token accumulates sum(c * x). Blocking over rows and tokens: w2a8_block.inc.
//
// Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
// Test: tests/ops/backends/test_cpu_kernels.py
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")
#include <immintrin.h>

#include "w2a8_cpu.h"

namespace bitmtp_cpu {
namespace {

struct Isa {
  using Acc = __m512i;
  static constexpr int kStepWords = 4;
  static constexpr int kFaccLanes = 8;
  // 32 zmm: R*M <= 16 accumulators + R codes + 1 activation + 3 decode constants.
  static constexpr int rows_for(int m) { return m <= 2 ? 8 : (m <= 4 ? 4 : 2); }

  static inline void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }

  static inline Acc zero() { return _mm512_setzero_si512(); }

  static inline Acc decode_full(const uint32_t* wrow, int j) {
    const __m512i bcast = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    const __m512i mask3 = _mm512_set1_epi32(0x03030303);
    const __m128i w4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + j));
    return _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(bcast, _mm512_castsi128_si512(w4)), shifts),
                              mask3);
  }

  static inline Acc decode_tail(const uint32_t* wrow, int j, int count) {
    const __m512i bcast = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    const __m512i mask3 = _mm512_set1_epi32(0x03030303);
    // Group or row tail: never read past the row; lanes of absent words get code 0.
    const __m128i w4 = _mm_maskz_loadu_epi32(static_cast<__mmask8>((1u << count) - 1u), wrow + j);
    return _mm512_maskz_and_epi32(static_cast<__mmask16>((1u << (4 * count)) - 1u),
                                  _mm512_srlv_epi32(_mm512_permutexvar_epi32(bcast, _mm512_castsi128_si512(w4)), shifts),
                                  mask3);
  }

  // Rows are zero-padded. The empty asm pins the load in a register: otherwise GCC folds it into
  // every vpdpbusd as a memory operand and loads it once per row instead of once per step, which
  // made the kernel load-port bound (M = 8: 757 -> see docs/ARCHITECTURE.md for the measurement).
  static inline Acc load_x(const int8_t* p) {
    Acc v = _mm512_loadu_si512(p);
    __asm__("" : "+v"(v));
    return v;
  }

  static inline Acc dot(Acc acc, Acc codes, Acc x) { return _mm512_dpbusd_epi32(acc, codes, x); }

  static inline int32_t reduce(Acc acc) { return _mm512_reduce_add_epi32(acc); }

  // Many groups: fold -sum(x) into lane 0 (exact), add the two 8-lane halves (exact int32) and
  // scale the 8 partials in double; far cheaper per group than a full reduction.
  static inline void fold_scale(Acc acc, int32_t xsum, double scale, double* lanes) {
    const __m512i fixed = _mm512_mask_sub_epi32(acc, 1, acc, _mm512_set1_epi32(xsum));
    const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(fixed), _mm512_extracti64x4_epi64(fixed, 1));
    __m512d f = _mm512_loadu_pd(lanes);
    f = _mm512_fmadd_pd(_mm512_cvtepi32_pd(half), _mm512_set1_pd(scale), f);
    _mm512_storeu_pd(lanes, f);
  }
};

#include "w2a8_block.inc"

}  // namespace

void rows_avx512(const W2A8Args& a, int n0, int n1) { rows_blocked(a, n0, n1); }

}  // namespace bitmtp_cpu
