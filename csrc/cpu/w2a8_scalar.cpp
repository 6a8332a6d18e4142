// Portable W2A8 path: plain C++, no intrinsics. Same arithmetic as the SIMD paths (exact int32
// accumulators per group, float epilogue in double).
//
// Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
// Test: tests/ops/backends/test_cpu_kernels.py
#include "w2a8_cpu.h"

namespace bitmtp_cpu {
namespace {

inline int32_t dot4(uint32_t codes, const int8_t* x) {
  return static_cast<int32_t>(codes & 0xFF) * x[0] + static_cast<int32_t>((codes >> 8) & 0xFF) * x[1] +
         static_cast<int32_t>((codes >> 16) & 0xFF) * x[2] + static_cast<int32_t>(codes >> 24) * x[3];
}

}  // namespace

void rows_scalar(const W2A8Args& a, int n0, int n1) {
  int32_t acc[kMaxWidth];
  double ysum[kMaxWidth];
  for (int n = n0; n < n1; ++n) {
    const uint32_t* wrow = a.w + static_cast<int64_t>(n) * a.KW;
    for (int m = 0; m < a.M; ++m) ysum[m] = 0.0;
    for (int g = 0; g < a.NG; ++g) {
      const int j0 = g * a.GW;
      const int j1 = (j0 + a.GW < a.KW) ? j0 + a.GW : a.KW;
      for (int m = 0; m < a.M; ++m) acc[m] = 0;
      for (int j = j0; j < j1; ++j) {
        const uint32_t word = wrow[j];  // loaded and decoded once, applied to all M tokens
        for (int s = 0; s < 4; ++s) {
          const uint32_t codes = (word >> (2 * s)) & 0x03030303u;
          const int64_t off = static_cast<int64_t>(j) * 16 + 4 * s;
          for (int m = 0; m < a.M; ++m) acc[m] += dot4(codes, a.x + m * a.x_stride + off);
        }
      }
      for (int m = 0; m < a.M; ++m) {
        const int32_t exact = acc[m] - a.xsum[m * a.NG + g];
        if (a.acc) a.acc[m * a.acc_stride_m + static_cast<int64_t>(n) * a.NG + g] = exact;
        if (a.y) ysum[m] += static_cast<double>(exact) * a.scales[static_cast<int64_t>(n) * a.scale_row_stride + g];
      }
    }
    if (a.y) {
      for (int m = 0; m < a.M; ++m) {
        double v = ysum[m] / a.act_scale[m];
        if (a.bias) v += a.bias[n];
        a.y[m * a.y_stride + n] = static_cast<float>(v);
      }
    }
  }
}

}  // namespace bitmtp_cpu
