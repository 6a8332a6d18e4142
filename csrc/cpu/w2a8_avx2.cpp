// AVX2 path (no VNNI assumed): maddubs (u8 codes x s8 activations -> pairwise int16; |2*-128*2|
// = 512 never saturates) then madd with ones -> int32 lanes. One step covers 2 T2 words = 32
// weights: lane 4j+s of an 8-lane register holds (word_j >> 2s) & 0x03030303, lined up with a
// plain 32-byte activation load. Compiled for AVX2+FMA by the pragma; called only after CPUID
// confirms them.
#pragma GCC target("avx2,fma")
#include <immintrin.h>

#include "w2a8_cpu.h"

namespace bitmtp_cpu {
namespace {

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline double hsum_pd(__m256d v) {
  __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
  return _mm_cvtsd_f64(s);
}

template <int M>
void rows_m(const W2A8Args& a, int n0, int n1) {
  const __m256i bcast = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
  const __m256i mask3 = _mm256_set1_epi32(0x03030303);
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i first_lane = _mm256_setr_epi32(-1, 0, 0, 0, 0, 0, 0, 0);
  const bool single_group = a.NG == 1;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wrow = a.w + static_cast<int64_t>(n) * a.KW;
    const float* srow = a.scales ? a.scales + static_cast<int64_t>(n) * a.scale_row_stride : nullptr;
    __m256d facc[M];
    int32_t itot[M];
    for (int m = 0; m < M; ++m) {
      facc[m] = _mm256_setzero_pd();
      itot[m] = 0;
    }
    for (int g = 0; g < a.NG; ++g) {
      const int j0 = g * a.GW;
      const int j1 = (j0 + a.GW < a.KW) ? j0 + a.GW : a.KW;
      __m256i acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
      for (int j = j0; j < j1; j += 2) {
        __m128i w2;
        __m256i codes;
        if (j1 - j >= 2) {
          w2 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wrow + j));
          codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(_mm256_castsi128_si256(w2), bcast), shifts), mask3);
        } else {  // one word left in the group/row: upper four lanes get code 0
          w2 = _mm_cvtsi32_si128(static_cast<int>(wrow[j]));
          codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_permutevar8x32_epi32(_mm256_castsi128_si256(w2), bcast), shifts),
                                   _mm256_setr_epi32(0x03030303, 0x03030303, 0x03030303, 0x03030303, 0, 0, 0, 0));
        }
        const int8_t* xj = a.x + static_cast<int64_t>(j) * 16;
        for (int m = 0; m < M; ++m) {
          const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xj + m * a.x_stride));
          acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(_mm256_maddubs_epi16(codes, xv), ones16));
        }
      }
      if (a.acc || single_group) {
        for (int m = 0; m < M; ++m) {
          const int32_t exact = hsum_epi32(acc[m]) - a.xsum[m * a.NG + g];
          if (a.acc) a.acc[m * a.acc_stride_m + static_cast<int64_t>(n) * a.NG + g] = exact;
          itot[m] = exact;
        }
      } else {
        // Many groups: fold -sum(x) into lane 0, add the 128-bit halves (exact int32), scale the
        // four partials in double (see the AVX-512 path).
        const __m256d sc = _mm256_set1_pd(static_cast<double>(srow[g]));
        for (int m = 0; m < M; ++m) {
          const __m256i fixed = _mm256_sub_epi32(acc[m], _mm256_and_si256(_mm256_set1_epi32(a.xsum[m * a.NG + g]), first_lane));
          const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(fixed), _mm256_extracti128_si256(fixed, 1));
          facc[m] = _mm256_fmadd_pd(_mm256_cvtepi32_pd(half), sc, facc[m]);
        }
      }
    }
    if (a.y) {
      for (int m = 0; m < M; ++m) {
        double v = single_group ? static_cast<double>(itot[m]) * srow[0] : hsum_pd(facc[m]);
        v /= a.act_scale[m];
        if (a.bias) v += a.bias[n];
        a.y[m * a.y_stride + n] = static_cast<float>(v);
      }
    }
  }
}

using RowsFn = void (*)(const W2A8Args&, int, int);
const RowsFn kTable[kMaxWidth] = {rows_m<1>,  rows_m<2>,  rows_m<3>,  rows_m<4>,  rows_m<5>,  rows_m<6>,
                                  rows_m<7>,  rows_m<8>,  rows_m<9>,  rows_m<10>, rows_m<11>, rows_m<12>,
                                  rows_m<13>, rows_m<14>, rows_m<15>, rows_m<16>};

}  // namespace

void rows_avx2(const W2A8Args& a, int n0, int n1) { kTable[a.M - 1](a, n0, n1); }

}  // namespace bitmtp_cpu
