// Drivers of the W2A8 and dense kernels (see linear_run.h). Moved out of w2a8_module.cpp so the
// fused decoder layers (layers.cpp) call exactly the code the per-op entry points call.
//
// Reference: bitmtp.ops.reference.w2a8_linear_q_reference, bitmtp.ops.reference.dense_linear_reference
// Test: tests/ops/backends/test_cpu_kernels.py, tests/formats/test_ggml_blocks.py
#include "linear_run.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dense_cpu.h"
#include "pool.h"
#include "w2a8_cpu.h"

namespace bitmtp_cpu {

bool has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool has_avx512_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

namespace {

// One contiguous row range per thread (a multiple of 8 rows): each thread streams one long run of
// memory that the kernels' software prefetch covers end to end. Handing out small blocks
// dynamically instead cost a DRAM stall at every block start (W2A8 M = 1, 6912x2560: ~250 us vs
// ~200 us); a fork-join stalls on a descheduled thread either way.
template <typename Fn>
void split_rows(int64_t N, int threads, Fn fn) {
  parallel_for_threads(threads, [&](int t, int nt) {
    const int64_t per = ((N + nt - 1) / nt + 7) / 8 * 8;
    const int64_t n0 = std::min<int64_t>(N, t * per), n1 = std::min<int64_t>(N, n0 + per);
    if (n0 < n1) fn(static_cast<int>(n0), static_cast<int>(n1));
  });
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

}  // namespace

bool bcast_layout_fits(int NG, int GW) { return (NG == 1 || GW % 4 == 0) && GW <= 65536; }

void to_bcast_layout(int8_t* x, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 64) {
    int32_t in[16], out[16];
    std::memcpy(in, x + c, 64);
    for (int l = 0; l < 16; ++l) out[l] = in[4 * (l % 4) + l / 4];
    std::memcpy(x + c, out, 64);
  }
}

bool pair_layout_fits(int NG, int GW) { return NG == 1 || GW % 2 == 0; }

void to_pair_layout(int8_t* x, int64_t bytes) {
  for (int64_t c = 0; c < bytes; c += 32) {
    int32_t in[8], out[8];
    std::memcpy(in, x + c, 32);
    for (int l = 0; l < 8; ++l) out[l] = in[4 * (l % 2) + l / 2];
    std::memcpy(x + c, out, 32);
  }
}

int best_isa() { return has_avx512_vnni() ? kAvx512 : (has_avx2() ? kAvx2 : kScalar); }

const char* isa_name(int isa) { return isa == kAvx512 ? "avx512_vnni" : (isa == kAvx2 ? "avx2" : "scalar"); }

int resolve_isa(int isa) {
  if (isa < 0) return best_isa();
  require(isa <= kAvx512, "isa: unknown value " + std::to_string(isa));
  require(isa <= best_isa(), std::string("isa: ") + isa_name(isa) + " is not supported by this CPU (best: " +
                                 isa_name(best_isa()) + ")");
  return isa;
}

// Tokens go in chunks of kMaxWidth; each chunk streams the weights once (rows split across
// threads), applying every word to all tokens.
void w2a8_run(const int8_t* x, int64_t M, int64_t K, const uint32_t* w, int64_t N, int64_t KW,
              const float* scales, int64_t scale_rows, int64_t NG, int64_t G, const float* act_scale,
              const float* bias, float* y, int32_t* acc, int isa, int threads) {
  require(M >= 1, "x_q: M must be >= 1, got " + std::to_string(M));
  require(K >= 1 && N >= 1, "weight: K and N must be >= 1");
  require(KW == (K + 15) / 16, "weight: " + std::to_string(KW) + " words per row do not match K=" + std::to_string(K));
  require(NG >= 1 && G >= 1 && (NG == 1 || G % 16 == 0) && NG == (K + G - 1) / G,
          "group_size: G=" + std::to_string(G) + " with " + std::to_string(NG) + " groups does not fit K=" +
              std::to_string(K));
  require(y || acc, "out: nothing to write");
  require(!y || (scales && act_scale), "scales/act_scale: required for the float output");
  require(scale_rows == 1 || scale_rows == N, "scales: rows must be 1 or N");
  require(x && w, "x_q/weight: null pointer");
  isa = resolve_isa(isa);

  const int gw = NG == 1 ? static_cast<int>(KW) : static_cast<int>(G / 16);
  // Activation rows are copied zero-padded so every SIMD step may load 64 bytes from any word
  // offset without reading past the row: stride >= KW*16 + 48, a multiple of 64.
  const int64_t stride = ((KW * 16 + 48 + 63) / 64) * 64;
  std::vector<int8_t> xbuf(static_cast<size_t>(std::min<int64_t>(M, kMaxWidth) * stride + 64), 0);
  std::vector<int32_t> xsum(static_cast<size_t>(kMaxWidth * NG), 0);
  void (*rows)(const W2A8Args&, int, int) = isa == kAvx512 ? rows_avx512 : (isa == kAvx2 ? rows_avx2 : rows_scalar);
  if (threads <= 0) threads = 1;
  // The AVX-512 decode takes x with each 64-byte chunk's lanes transposed (w2a8_avx512.cpp): one
  // transpose per activation row here saves a cross-lane permute and a shift per weight step; the
  // AVX2 decode likewise with 32-byte chunks (w2a8_avx2.cpp: a cross-lane permute and a load).
  const bool bcast = (isa == kAvx512 && bcast_layout_fits(static_cast<int>(NG), gw)) ||
                     (isa == kAvx2 && pair_layout_fits(static_cast<int>(NG), gw));

  for (int64_t m0 = 0; m0 < M; m0 += kMaxWidth) {
    const int mc = static_cast<int>(std::min<int64_t>(kMaxWidth, M - m0));
    for (int m = 0; m < mc; ++m) {
      const int8_t* src = x + (m0 + m) * K;
      int8_t* dst = xbuf.data() + m * stride;
      std::memcpy(dst, src, static_cast<size_t>(K));
      std::memset(dst + K, 0, static_cast<size_t>(stride - K));
      for (int64_t g = 0; g < NG; ++g) {
        const int64_t lo = g * G, hi = std::min<int64_t>(lo + G, K);
        int32_t s = 0;
        for (int64_t k = lo; k < hi; ++k) s += src[k];
        xsum[m * NG + g] = s;
      }
      if (bcast) (isa == kAvx512 ? to_bcast_layout : to_pair_layout)(dst, stride);
    }
    W2A8Args a;
    a.x = xbuf.data();
    a.x_stride = stride;
    a.M = mc;
    a.xsum = xsum.data();
    a.w = w;
    a.KW = static_cast<int>(KW);
    a.NG = static_cast<int>(NG);
    a.GW = gw;
    a.scales = scales;
    a.scale_row_stride = scale_rows == 1 ? 0 : static_cast<int>(NG);
    a.act_scale = act_scale ? act_scale + m0 : nullptr;
    a.bias = bias;
    a.y = y ? y + m0 * N : nullptr;
    a.y_stride = N;
    a.acc = acc ? acc + m0 * N * NG : nullptr;
    a.acc_stride_m = N * NG;
    a.x_bcast = bcast;
    split_rows(N, threads, [&](int n0, int n1) { rows(a, n0, n1); });
  }
}

// Dense linear (float32 or block-format weights), rows split across threads as one contiguous range
// each (the same streaming scheme as the W2A8 kernel).
void dense_run(const float* x, int64_t M, int64_t K, const void* w, int64_t N, const float* bias, float* y,
               int isa, int threads, int fmt) {
  require(M >= 1 && K >= 1 && N >= 1, "dense: M, K and N must be >= 1");
  require(x && w && y, "dense: null pointer");
  require(fmt >= kDenseF32 && fmt <= kDenseF16,
          "dense: unknown weight format " + std::to_string(fmt));
  require(fmt == kDenseF32 || K % kBlock == 0,
          "dense: block-format weights need K a multiple of 32, got K=" + std::to_string(K));
  isa = resolve_isa(isa);
  DenseArgs a{x, static_cast<int>(M), static_cast<int>(K), nullptr, bias, y, static_cast<int>(N)};
  a.fmt = fmt;
  if (fmt == kDenseF32)
    a.w = static_cast<const float*>(w);
  else
    a.wb = static_cast<const uint8_t*>(w);
  void (*rows)(const DenseArgs&, int, int) =
      isa == kAvx512 ? dense_rows_avx512 : (isa == kAvx2 ? dense_rows_avx2 : dense_rows_scalar);
  if (threads <= 0) threads = 1;
  split_rows(N, threads, [&](int n0, int n1) { rows(a, n0, n1); });
}

}  // namespace bitmtp_cpu
