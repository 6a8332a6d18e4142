// Dense float32 GEMV, portable path: one sequential sum per (row, token) — row-independent too.
#include "dense_cpu.h"

namespace bitmtp_cpu {

void dense_rows_scalar(const DenseArgs& a, int n0, int n1) {
  for (int n = n0; n < n1; ++n) {
    const float* w = a.w + static_cast<int64_t>(n) * a.K;
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
