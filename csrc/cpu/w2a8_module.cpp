// pybind11 module bitmtp._cpu_w2a8: single-pass multi-token W2A8 linear for CPUs.
//
// Python passes raw data pointers (bitmtp/ops/backends/cpu_backend.py validates dtype, shape,
// contiguity and alignment first), so this extension needs no torch headers and builds against
// any torch. The ISA (AVX-512 VNNI, AVX2, scalar) is chosen at run time from CPUID; the module is
// compiled for the baseline x86-64 target and only the ISA translation units carry target pragmas.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention.h"
#include "dense_cpu.h"
#include "w2a8_cpu.h"

namespace py = pybind11;
using namespace bitmtp_cpu;

namespace {

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
  return false;
#endif
}

bool has_avx512_vnni() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

int best_isa() { return has_avx512_vnni() ? kAvx512 : (has_avx2() ? kAvx2 : kScalar); }

const char* isa_name(int isa) { return isa == kAvx512 ? "avx512_vnni" : (isa == kAvx2 ? "avx2" : "scalar"); }

py::dict cpu_features() {
  py::dict d;
  d["avx2"] = has_avx2();
  d["avx512_vnni"] = has_avx512_vnni();
  d["best"] = isa_name(best_isa());
#ifdef _OPENMP
  d["openmp"] = true;
  d["max_threads"] = omp_get_max_threads();
#else
  d["openmp"] = false;
  d["max_threads"] = 1;
#endif
  return d;
}

// One contiguous row range per thread (a multiple of 8 rows): each thread streams one long run of
// memory that the kernels' software prefetch covers end to end. Handing out small blocks
// dynamically instead cost a DRAM stall at every block start (W2A8 M = 1, 6912x2560: ~250 us vs
// ~200 us); a fork-join stalls on a descheduled thread either way.
template <typename Fn>
void split_rows(int64_t N, int threads, Fn fn) {
#pragma omp parallel num_threads(threads)
  {
#ifdef _OPENMP
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
    const int64_t t = 0, nt = 1;
#endif
    const int64_t per = ((N + nt - 1) / nt + 7) / 8 * 8;
    const int64_t n0 = std::min<int64_t>(N, t * per), n1 = std::min<int64_t>(N, n0 + per);
    if (n0 < n1) fn(static_cast<int>(n0), static_cast<int>(n1));
  }
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

// Shared by w2a8_linear and w2a8_accumulate: y and/or acc. Tokens go in chunks of kMaxWidth; each
// chunk streams the weights once (rows split across threads), applying every word to all tokens.
void run(uintptr_t x_ptr, int64_t M, int64_t K, uintptr_t w_ptr, int64_t N, int64_t KW, uintptr_t scales_ptr,
         int64_t scale_rows, int64_t NG, int64_t G, uintptr_t act_scale_ptr, uintptr_t bias_ptr, uintptr_t y_ptr,
         uintptr_t acc_ptr, int isa, int threads) {
  require(M >= 1, "x_q: M must be >= 1, got " + std::to_string(M));
  require(K >= 1 && N >= 1, "weight: K and N must be >= 1");
  require(KW == (K + 15) / 16, "weight: " + std::to_string(KW) + " words per row do not match K=" + std::to_string(K));
  require(NG >= 1 && G >= 1 && (NG == 1 || G % 16 == 0) && NG == (K + G - 1) / G,
          "group_size: G=" + std::to_string(G) + " with " + std::to_string(NG) + " groups does not fit K=" +
              std::to_string(K));
  require(y_ptr || acc_ptr, "out: nothing to write");
  require(!y_ptr || (scales_ptr && act_scale_ptr), "scales/act_scale: required for the float output");
  require(scale_rows == 1 || scale_rows == N, "scales: rows must be 1 or N");
  require(x_ptr && w_ptr, "x_q/weight: null pointer");
  if (isa < 0) isa = best_isa();
  require(isa <= best_isa(), std::string("isa: ") + isa_name(isa) + " is not supported by this CPU (best: " +
                                 isa_name(best_isa()) + ")");
  require(isa >= kScalar && isa <= kAvx512, "isa: unknown value");

  const int8_t* x = reinterpret_cast<const int8_t*>(x_ptr);
  const int gw = NG == 1 ? static_cast<int>(KW) : static_cast<int>(G / 16);
  // Activation rows are copied zero-padded so every SIMD step may load 64 bytes from any word
  // offset without reading past the row: stride >= KW*16 + 48, a multiple of 64.
  const int64_t stride = ((KW * 16 + 48 + 63) / 64) * 64;
  std::vector<int8_t> xbuf(static_cast<size_t>(std::min<int64_t>(M, kMaxWidth) * stride + 64), 0);
  std::vector<int32_t> xsum(static_cast<size_t>(kMaxWidth * NG), 0);
  void (*rows)(const W2A8Args&, int, int) = isa == kAvx512 ? rows_avx512 : (isa == kAvx2 ? rows_avx2 : rows_scalar);
  if (threads <= 0) threads = 1;

  py::gil_scoped_release release;
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
    }
    W2A8Args a;
    a.x = xbuf.data();
    a.x_stride = stride;
    a.M = mc;
    a.xsum = xsum.data();
    a.w = reinterpret_cast<const uint32_t*>(w_ptr);
    a.KW = static_cast<int>(KW);
    a.NG = static_cast<int>(NG);
    a.GW = gw;
    a.scales = reinterpret_cast<const float*>(scales_ptr);
    a.scale_row_stride = scale_rows == 1 ? 0 : static_cast<int>(NG);
    a.act_scale = act_scale_ptr ? reinterpret_cast<const float*>(act_scale_ptr) + m0 : nullptr;
    a.bias = reinterpret_cast<const float*>(bias_ptr);
    a.y = y_ptr ? reinterpret_cast<float*>(y_ptr) + m0 * N : nullptr;
    a.y_stride = N;
    a.acc = acc_ptr ? reinterpret_cast<int32_t*>(acc_ptr) + m0 * N * NG : nullptr;
    a.acc_stride_m = N * NG;
    split_rows(N, threads, [&](int n0, int n1) { rows(a, n0, n1); });
  }
}

// Streaming-read probe: sums a buffer with `threads` threads. Benchmarks divide bytes by its time to
// get this machine's read bandwidth in the same run as the kernels they compare against it.
uint64_t stream_read(uintptr_t ptr, int64_t nbytes, int threads) {
  require(ptr != 0 && nbytes >= 8, "stream_read: needs a buffer of at least 8 bytes");
  const uint64_t* p = reinterpret_cast<const uint64_t*>(ptr);
  const int64_t n = nbytes / 8;
  uint64_t s = 0;
  py::gil_scoped_release release;
#pragma omp parallel for schedule(static) reduction(+ : s) num_threads(threads > 0 ? threads : 1)
  for (int64_t i = 0; i < n; ++i) s += p[i];
  return s;
}

// Dense float32 linear: y[M][N] = x[M][K] . w[N][K]^T (+ bias), rows split across threads as one
// contiguous range each (the same streaming scheme as the W2A8 kernel).
void dense(uintptr_t x_ptr, int64_t M, int64_t K, uintptr_t w_ptr, int64_t N, uintptr_t bias_ptr, uintptr_t y_ptr,
           int isa, int threads) {
  require(M >= 1 && K >= 1 && N >= 1, "dense: M, K and N must be >= 1");
  require(x_ptr && w_ptr && y_ptr, "dense: null pointer");
  if (isa < 0) isa = best_isa();
  require(isa <= best_isa(), std::string("isa: ") + isa_name(isa) + " is not supported by this CPU");
  DenseArgs a{reinterpret_cast<const float*>(x_ptr), static_cast<int>(M), static_cast<int>(K),
              reinterpret_cast<const float*>(w_ptr), reinterpret_cast<const float*>(bias_ptr),
              reinterpret_cast<float*>(y_ptr), static_cast<int>(N)};
  void (*rows)(const DenseArgs&, int, int) =
      isa == kAvx512 ? dense_rows_avx512 : (isa == kAvx2 ? dense_rows_avx2 : dense_rows_scalar);
  if (threads <= 0) threads = 1;
  py::gil_scoped_release release;
  split_rows(N, threads, [&](int n0, int n1) { rows(a, n0, n1); });
}

void attention(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t mask, uintptr_t out, int64_t M, int64_t H,
               int64_t KVH, int64_t D, int64_t S, int64_t L, double scale, int threads) {
  require(M >= 1 && H >= 1 && KVH >= 1 && D >= 1 && L >= 1 && S >= L, "attention: bad shape");
  require(H % KVH == 0, "attention: kv heads must divide heads");
  require(q && k && v && mask && out, "attention: null pointer");
  AttentionArgs a{reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(k),
                  reinterpret_cast<const float*>(v), reinterpret_cast<const uint8_t*>(mask),
                  reinterpret_cast<float*>(out), static_cast<int>(M), static_cast<int>(H), static_cast<int>(KVH),
                  static_cast<int>(D), static_cast<int>(S), static_cast<int>(L), static_cast<float>(scale), threads};
  py::gil_scoped_release release;
  attention_rows(a);
}

}  // namespace

PYBIND11_MODULE(_cpu_w2a8, m) {
  m.doc() = "bitmtp W2A8 CPU kernels (single-pass multi-token GEMV; AVX-512 VNNI / AVX2 / scalar)";
  m.def("cpu_features", &cpu_features, "ISA support detected from CPUID and the OpenMP thread count");
  m.def("best_isa", &best_isa, "0 = scalar, 1 = avx2, 2 = avx512_vnni");
  m.def("dense", &dense, py::arg("x_ptr"), py::arg("M"), py::arg("K"), py::arg("w_ptr"), py::arg("N"),
        py::arg("bias_ptr"), py::arg("y_ptr"), py::arg("isa"), py::arg("threads"),
        "Dense float32 multi-token GEMV with a row-independent summation order");
  m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("out"),
        py::arg("M"), py::arg("H"), py::arg("KVH"), py::arg("D"), py::arg("S"), py::arg("L"), py::arg("scale"),
        py::arg("threads"), "Row-deterministic masked attention on float32 buffers");
  m.def("stream_read", &stream_read, py::arg("ptr"), py::arg("nbytes"), py::arg("threads"),
        "Sum a buffer of uint64 with `threads` threads (a streaming-read bandwidth probe)");
  m.def("run", &run, py::arg("x_ptr"), py::arg("M"), py::arg("K"), py::arg("w_ptr"), py::arg("N"), py::arg("KW"),
        py::arg("scales_ptr"), py::arg("scale_rows"), py::arg("NG"), py::arg("G"), py::arg("act_scale_ptr"),
        py::arg("bias_ptr"), py::arg("y_ptr"), py::arg("acc_ptr"), py::arg("isa"), py::arg("threads"),
        "Run the kernel on raw pointers (validated by the Python wrapper). isa=-1 picks the best.");
}
