// AVX2 path (no VNNI assumed): maddubs (u8 codes x s8 activations -> pairwise int16; |2*-128*2|
// = 512 never saturates), summed in int16 over runs of steps, then madd with ones -> int32 lanes.
// One step covers 2 T2 words = 32 weights: lane 4j+s of an 8-lane register holds
// (word_j >> 2s) & 0x03030303, lined up with a plain 32-byte activation load (or lane 2s+j with x in
// the broadcast layout, see decode_bcast). Compiled for AVX2+FMA by the pragma; called only after CPUID
// confirms them. Blocking over rows and tokens: w2a8_block.inc.
//
// Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
// Test: tests/ops/backends/test_cpu_kernels.py
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "w2a8_cpu.h"

namespace bitmtp_cpu {
namespace {

struct Isa {
  using Acc = __m256i;
  static constexpr int kStepWords = 2;
  static constexpr int kFaccLanes = 4;
  // Broadcast layout (W2A8Args::x_bcast; x's int32 lanes transposed as 2x4 in every 32-byte chunk,
  // lane 2s + j holding bytes 16j + 4s .. + 3): the step's two words go to every qword with one
  // vpbroadcastq from memory (a load-port op) and one 64-bit variable shift by 2s per qword lines
  // up lane 2s + j = (word_j >> 2s) & 0x03030303 (word_1's bits shifted into word_0's dword sit
  // above bit 25 and are masked off). Decode drops from a load, a cross-lane permute, a shift and
  // an and to a broadcast load, a shift and an and. Unlike the AVX-512 broadcast decode the codes stay
  // unscaled (the int16 partial sums need |c| <= 2).
  static constexpr bool kBcast = true;
  // 16 ymm: R*M accumulators + R codes + 1 activation + 4 constants must stay <= 16.
  static constexpr int rows_for(int m) { return m <= 2 ? 4 : (m <= 4 ? 2 : 1); }

  static inline void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T0); }

  static inline Acc zero() { return _mm256_setzero_si256(); }

  static inline Acc decode_full(const uint32_t* wrow, int j) {
    const __m256i bcast = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    const __m128i w2 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wrow + j));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(_mm256_castsi128_si256(w2), bcast), shifts),
                    _mm256_set1_epi32(0x03030303));
  }

  static inline Acc decode_tail(const uint32_t* wrow, int j, int count) {
    const __m256i bcast = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
    // One word left in the group/row: the upper four lanes get code 0.
    const __m128i w1 = _mm_cvtsi32_si128(static_cast<int>(wrow[j]));
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(_mm256_castsi128_si256(w1), bcast), shifts),
                            _mm256_setr_epi32(0x03030303, 0x03030303, 0x03030303, 0x03030303, 0, 0, 0, 0));
  }

  static inline Acc decode_bcast(const uint32_t* wrow, int j) {
    long long w2;
    __builtin_memcpy(&w2, wrow + j, 8);
    return _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(w2), _mm256_setr_epi64x(0, 2, 4, 6)),
                            _mm256_set1_epi32(0x03030303));
  }

  static inline Acc decode_bcast_tail(const uint32_t* wrow, int j, int count) {
    (void)count;  // always 1 (kStepWords = 2): word_1 reads as 0, so its lanes get code 0
    const long long w1 = static_cast<long long>(wrow[j]);
    return _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(w1), _mm256_setr_epi64x(0, 2, 4, 6)),
                            _mm256_set1_epi32(0x03030303));
  }

  static inline Acc unscale(Acc acc) { return acc; }  // codes are not scaled in this layout

  // Lane 4j + s <- lane 2s + j: back to decode_full's order.
  static inline Acc unswizzle(Acc acc) {
    return _mm256_permutevar8x32_epi32(acc, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
  }

  template <int N>
  static inline void reduce_many(const Acc* v, int32_t* sums) {
    _Pragma("GCC unroll 32") for (int i = 0; i < N; ++i) sums[i] = reduce(v[i]);
  }

  static inline Acc load_x(const int8_t* p) {
    // No register pin here (unlike the AVX-512 path): with R = 1 (M >= 5) the compiler folds the
    // load into maddubs' memory operand, which frees the registers it otherwise spilled accumulators to.
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }

  static inline Acc dot(Acc acc, Acc codes, Acc x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), _mm256_set1_epi16(1)));
  }

  // int16 partial sums: maddubs then a 16-bit add (2 ops a step and token instead of 3), widened by
  // madd(., 1) once per run. Exact: an int16 lane gains c0*x0 + c1*x1 in [-512, 508] a step (codes
  // 0..2, x in [-128, 127]; maddubs never saturates there), so 64 steps stay in [-32768, 32512].
  static constexpr int kPartialSteps = 64;
  static inline Acc part_dot(Acc part, Acc codes, Acc x) {
    return _mm256_add_epi16(part, _mm256_maddubs_epi16(codes, x));
  }
  static inline Acc widen(Acc acc, Acc part) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(part, _mm256_set1_epi16(1)));
  }

  static inline int32_t reduce(Acc v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
  }

  // Many groups: fold -sum(x) into lane 0, add the 128-bit halves (exact int32), scale the four
  // partials in double (see the AVX-512 path).
  static inline void fold_scale(Acc acc, int32_t xsum, double scale, double* lanes) {
    const __m256i fix = _mm256_setr_epi32(xsum, 0, 0, 0, 0, 0, 0, 0);
    const __m256i fixed = _mm256_sub_epi32(acc, fix);
    const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(fixed), _mm256_extracti128_si256(fixed, 1));
    __m256d f = _mm256_loadu_pd(lanes);
    f = _mm256_fmadd_pd(_mm256_cvtepi32_pd(half), _mm256_set1_pd(scale), f);
    _mm256_storeu_pd(lanes, f);
  }
};

#include "w2a8_block.inc"

}  // namespace

void rows_avx2(const W2A8Args& a, int n0, int n1) { rows_blocked(a, n0, n1); }

}  // namespace bitmtp_cpu
