// Row-deterministic attention for CPU steps.
//
// Why: bitmtp's exactness invariants (speculative output == AR greedy output; KV rows equal a
// fresh prefill) need every row's result to be independent of the step's width M and of the
// segment length L it ran in. BLAS-backed matmuls change their summation order with the shapes,
// and in ternary models a 1-ulp difference can flip an int8 activation rounding downstream. Here
// each (row, head) is computed alone, visiting only the KV rows its mask allows, in increasing
// order, with a fixed 16-way partial-sum dot product: the result depends on the row's own inputs
// only. Compiled for the baseline target (no ISA dispatch), so it is also identical across CPUs.
#include <cmath>
#include <cstdint>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention.h"

namespace bitmtp_cpu {

namespace {

constexpr int kLanes = 16;

// Dot product with 16 independent partial sums (each sequential over d), combined in a fixed
// order; GCC vectorizes the lane loop without reassociating anything.
inline float dot(const float* a, const float* b, int d) {
  float part[kLanes] = {0};
  int i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int j = 0; j < kLanes; ++j) part[j] += a[i + j] * b[i + j];
  for (int j = 0; i < d; ++i, ++j) part[j] += a[i] * b[i];
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += part[j];
  return s;
}

}  // namespace

void attention_rows(const AttentionArgs& a) {
  const int group = a.H / a.KVH;
  const int64_t pairs = static_cast<int64_t>(a.M) * a.H;
#pragma omp parallel num_threads(a.threads > 0 ? a.threads : 1)
  {
    std::vector<float> score(static_cast<size_t>(a.L));
    std::vector<int> idx(static_cast<size_t>(a.L));
    std::vector<float> acc(static_cast<size_t>(a.D));
#pragma omp for schedule(static)
    for (int64_t p = 0; p < pairs; ++p) {
      const int m = static_cast<int>(p / a.H), h = static_cast<int>(p % a.H);
      const int kvh = h / group;
      const float* q = a.q + (static_cast<int64_t>(m) * a.H + h) * a.D;
      const float* kbase = a.k + static_cast<int64_t>(kvh) * a.S * a.D;
      const float* vbase = a.v + static_cast<int64_t>(kvh) * a.S * a.D;
      const uint8_t* mrow = a.mask + static_cast<int64_t>(m) * a.L;
      int n = 0;
      float mx = -INFINITY;
      for (int l = 0; l < a.L; ++l) {
        if (!mrow[l]) continue;
        const float s = dot(q, kbase + static_cast<int64_t>(l) * a.D, a.D) * a.scale;
        idx[n] = l;
        score[n++] = s;
        mx = s > mx ? s : mx;
      }
      float* out = a.out + (static_cast<int64_t>(m) * a.H + h) * a.D;
      if (n == 0) {  // a fully masked row (never produced by the runtime): zeros, not NaN
        for (int d = 0; d < a.D; ++d) out[d] = 0.f;
        continue;
      }
      double total = 0.0;
      for (int i = 0; i < n; ++i) {
        score[i] = std::exp(score[i] - mx);
        total += score[i];
      }
      for (int d = 0; d < a.D; ++d) acc[d] = 0.f;
      for (int i = 0; i < n; ++i) {
        const float w = score[i];
        const float* vr = vbase + static_cast<int64_t>(idx[i]) * a.D;
        for (int d = 0; d < a.D; ++d) acc[d] += w * vr[d];
      }
      const float inv = static_cast<float>(1.0 / total);
      for (int d = 0; d < a.D; ++d) out[d] = acc[d] * inv;
    }
  }
}

}  // namespace bitmtp_cpu
