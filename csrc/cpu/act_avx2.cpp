// SiLU(gate) * up for the fused layers, AVX2 path: four elements a step in double, each lane running
// exactly the operations of layers.cpp's scalar exp_d and SiLU (float -> double, the clamp, the
// round-to-integer by adding 1.5 * 2^52, the two-constant reduction, the degree-11 Horner polynomial,
// the exponent bits, 1 + e, the division, the rounding to float, the product with up) as separate
// IEEE operations (no FMA, -ffp-contract=off), so every value equals the scalar path's bit for bit.
// Why: the scalar loop did not vectorize (the extension's baseline is plain x86-64): SiLU was ~2 ms
// of a 25 ms SmolLM2 width-8 step. Called only after CPUID confirms AVX2.
//
// Reference: bitmtp.model.layers.silu (float64, rounded to float32)
// Test: tests/ops/test_fused_layers.py
#pragma GCC target("avx2")
#include <immintrin.h>

#include "layers.h"

namespace bitmtp_cpu {

namespace {

inline __m256d exp_d4(__m256d x) {
  // max/min with the constant first: a NaN x passes through, as the scalar clamp's comparisons do
  x = _mm256_min_pd(_mm256_set1_pd(709.0), _mm256_max_pd(_mm256_set1_pd(-708.0), x));
  const __m256d round = _mm256_set1_pd(6755399441055744.0);
  const __m256d t = _mm256_add_pd(_mm256_mul_pd(x, _mm256_set1_pd(1.4426950408889634)), round);
  const __m256d n = _mm256_sub_pd(t, round);
  const __m256i ni = _mm256_sub_epi64(_mm256_castpd_si256(t), _mm256_castpd_si256(round));
  const __m256d r = _mm256_sub_pd(_mm256_sub_pd(x, _mm256_mul_pd(n, _mm256_set1_pd(0.693147180369123816490))),
                                  _mm256_mul_pd(n, _mm256_set1_pd(1.90821492927058770002e-10)));
  __m256d p = _mm256_set1_pd(1.0 / 39916800.0);
  const double c[] = {1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0,
                      1.0 / 24.0,      1.0 / 6.0,      0.5,          1.0,          1.0};
  for (double ci : c) p = _mm256_add_pd(_mm256_mul_pd(p, r), _mm256_set1_pd(ci));
  const __m256i bits = _mm256_slli_epi64(_mm256_add_epi64(ni, _mm256_set1_epi64x(1023)), 52);
  return _mm256_mul_pd(p, _mm256_castsi256_pd(bits));
}

}  // namespace

int silu_mul_avx2(const float* g, const float* u, float* a, int n) {
  const __m256d one = _mm256_set1_pd(1.0);
  const __m256d sign = _mm256_set1_pd(-0.0);
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d gd = _mm256_cvtps_pd(_mm_loadu_ps(g + i));
    const __m256d e = exp_d4(_mm256_xor_pd(gd, sign));  // exp(-g)
    const __m128 silu = _mm256_cvtpd_ps(_mm256_div_pd(gd, _mm256_add_pd(one, e)));
    _mm_storeu_ps(a + i, _mm_mul_ps(silu, _mm_loadu_ps(u + i)));
  }
  return i;
}

}  // namespace bitmtp_cpu
