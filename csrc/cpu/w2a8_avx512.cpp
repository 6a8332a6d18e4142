// AVX-512 VNNI path. Compiled for this ISA by the pragma below (never -march=native): the module
// only calls it after CPUID says avx512f/bw/vl/vnni are present.
//
// One step covers 4 T2 words = 64 weights: the 4 words are broadcast to 16 lanes (lane 4j+s holds
// word j), shifted right by 2s and masked with 0x03030303, which yields the codes of k = 16j+4s ..
// 16j+4s+3 in lane 4j+s — exactly the int32 lane of a plain 64-byte activation load. One
// vpdpbusd per token then accumulates sum(c * x) for that step. The decode (load, permute, shift,
// and) happens once per step and is shared by all M tokens: the weights stream once per call.
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")
#include <immintrin.h>

#include "w2a8_cpu.h"

namespace bitmtp_cpu {
namespace {

// Word mask for a partial step of `count` (1..4) words, expanded to the 16 lanes it feeds.
inline __mmask16 lane_mask(int count) { return static_cast<__mmask16>((1u << (4 * count)) - 1u); }

template <int M>
void rows_m(const W2A8Args& a, int n0, int n1) {
  const __m512i bcast = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
  const __m512i mask3 = _mm512_set1_epi32(0x03030303);
  const bool single_group = a.NG == 1;
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wrow = a.w + static_cast<int64_t>(n) * a.KW;
    const float* srow = a.scales ? a.scales + static_cast<int64_t>(n) * a.scale_row_stride : nullptr;
    __m512d facc[M];
    int32_t itot[M];
    for (int m = 0; m < M; ++m) {
      facc[m] = _mm512_setzero_pd();
      itot[m] = 0;
    }
    for (int g = 0; g < a.NG; ++g) {
      const int j0 = g * a.GW;
      const int j1 = (j0 + a.GW < a.KW) ? j0 + a.GW : a.KW;
      __m512i acc[M];
      for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
      for (int j = j0; j < j1; j += 4) {
        const int count = (j1 - j < 4) ? j1 - j : 4;
        __m128i w4;
        __m512i codes;
        if (count == 4) {
          w4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + j));
          codes = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(bcast, _mm512_castsi128_si512(w4)), shifts), mask3);
        } else {  // group or row tail: never read past the row, zero the codes of absent words
          w4 = _mm_maskz_loadu_epi32(static_cast<__mmask8>((1u << count) - 1u), wrow + j);
          codes = _mm512_maskz_and_epi32(lane_mask(count),
                                         _mm512_srlv_epi32(_mm512_permutexvar_epi32(bcast, _mm512_castsi128_si512(w4)), shifts),
                                         mask3);
        }
        const int8_t* xj = a.x + static_cast<int64_t>(j) * 16;
        for (int m = 0; m < M; ++m) {
          const __m512i xv = _mm512_loadu_si512(xj + m * a.x_stride);  // x rows are zero-padded to 64 B
          acc[m] = _mm512_dpbusd_epi32(acc[m], codes, xv);
        }
      }
      if (a.acc || single_group) {
        for (int m = 0; m < M; ++m) {
          const int32_t exact = _mm512_reduce_add_epi32(acc[m]) - a.xsum[m * a.NG + g];
          if (a.acc) a.acc[m * a.acc_stride_m + static_cast<int64_t>(n) * a.NG + g] = exact;
          itot[m] = exact;
        }
      } else {
        // Many groups: fold -sum(x) into lane 0 (exact), add the two 8-lane halves (exact int32),
        // and scale the 8 partials in double. 5 instructions per group and token instead of a
        // 16-lane reduction; double keeps the result within ~1e-16 of the exact epilogue.
        const __m512d sc = _mm512_set1_pd(static_cast<double>(srow[g]));
        for (int m = 0; m < M; ++m) {
          const __m512i fixed = _mm512_mask_sub_epi32(acc[m], 1, acc[m], _mm512_set1_epi32(a.xsum[m * a.NG + g]));
          const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(fixed), _mm512_extracti64x4_epi64(fixed, 1));
          facc[m] = _mm512_fmadd_pd(_mm512_cvtepi32_pd(half), sc, facc[m]);
        }
      }
    }
    if (a.y) {
      for (int m = 0; m < M; ++m) {
        double v = single_group ? static_cast<double>(itot[m]) * srow[0]
                                : _mm512_reduce_add_pd(facc[m]);
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

void rows_avx512(const W2A8Args& a, int n0, int n1) { kTable[a.M - 1](a, n0, n1); }

}  // namespace bitmtp_cpu
