// pybind11 module bitmtp._cpu_w2a8: single-pass multi-token W2A8 linear for CPUs.
//
// Python passes raw data pointers (bitmtp/ops/backends/cpu_backend.py validates dtype, shape,
// contiguity and alignment first), so this extension needs no torch headers and builds against
// any torch. The ISA (AVX-512 VNNI, AVX2, scalar) is chosen at run time from CPUID; the module is
// compiled for the baseline x86-64 target and only the ISA translation units carry target pragmas.
//
// Reference: bitmtp.ops.reference.w2a8_linear_q_reference
// Reference: bitmtp.ops.reference.dense_linear_reference
// Reference: bitmtp.ops.reference.attention_reference
// Reference: bitmtp.model.decoder.Decoder.run_layers
// Reference: bitmtp.formats.gguf._Cursor.strings_python
// Reference: bitmtp.formats.gguf._tq2_0_t2_words_numpy
// Test: tests/ops/backends/test_cpu_kernels.py
// Test: tests/formats/test_ggml_blocks.py
// Test: tests/ops/test_attention.py
// Test: tests/ops/test_fused_layers.py
// Test: tests/formats/test_gguf.py
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>


#include "argmax_prob.h"
#include "attention.h"
#include "half.h"
#include "layers.h"
#include "linear_run.h"
#include "pool.h"

namespace py = pybind11;
using namespace bitmtp_cpu;

namespace {

py::dict cpu_features() {
  py::dict d;
  d["avx2"] = has_avx2();
  d["avx512_vnni"] = has_avx512_vnni();
  d["best"] = isa_name(best_isa());
  // the kernels' threads are the extension's own team (pool.h), not OpenMP
  d["openmp"] = false;
  d["threading"] = "bitmtp pool";
  const PoolStats ps = pool_stats();
  d["pool_workers"] = ps.workers;
  d["pool_regions"] = ps.regions;
  d["pool_wakeups"] = ps.wakeups;
  return d;
}

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);
}

// Shared by w2a8_linear and w2a8_accumulate: y and/or acc (linear_run.cpp).
void run(uintptr_t x_ptr, int64_t M, int64_t K, uintptr_t w_ptr, int64_t N, int64_t KW, uintptr_t scales_ptr,
         int64_t scale_rows, int64_t NG, int64_t G, uintptr_t act_scale_ptr, uintptr_t bias_ptr, uintptr_t y_ptr,
         uintptr_t acc_ptr, int isa, int threads) {
  py::gil_scoped_release release;
  w2a8_run(reinterpret_cast<const int8_t*>(x_ptr), M, K, reinterpret_cast<const uint32_t*>(w_ptr), N, KW,
           reinterpret_cast<const float*>(scales_ptr), scale_rows, NG, G, reinterpret_cast<const float*>(act_scale_ptr),
           reinterpret_cast<const float*>(bias_ptr), reinterpret_cast<float*>(y_ptr), reinterpret_cast<int32_t*>(acc_ptr),
           isa, threads);
}

// Per-token int8 quantization of float32 rows x[M][K] into x_q[M][K] and s[M] (layers.cpp).
void act_quant(uintptr_t x_ptr, int64_t M, int64_t K, uintptr_t q_ptr, uintptr_t s_ptr) {
  require(M >= 1 && K >= 1 && M * K <= INT32_MAX, "act_quant: needs 1 <= M, 1 <= K and M * K < 2^31");
  py::gil_scoped_release release;
  act_quant_rows(reinterpret_cast<const float*>(x_ptr), static_cast<int>(M), static_cast<int>(K),
                 reinterpret_cast<int8_t*>(q_ptr), reinterpret_cast<float*>(s_ptr));
}

// W2A8 linear on float32 activations in one call: quantize x[M][K] (act_quant above, into this thread's
// buffer), then the kernel. What TernaryLinear calls on the cpu backend: the quantization as torch ops
// cost 3x the kernel at M = 1 (2560 x 6912), and their libgomp region fought the thread team.
void linear_f32(uintptr_t x_ptr, int64_t M, int64_t K, uintptr_t w_ptr, int64_t N, int64_t KW, uintptr_t scales_ptr,
                int64_t scale_rows, int64_t NG, int64_t G, uintptr_t bias_ptr, uintptr_t y_ptr, int isa, int threads) {
  require(M >= 1 && K >= 1 && M * K <= INT32_MAX, "linear_f32: needs 1 <= M, 1 <= K and M * K < 2^31");
  py::gil_scoped_release release;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> xs;
  xq.resize(static_cast<size_t>(M * K));
  xs.resize(static_cast<size_t>(M));
  act_quant_rows(reinterpret_cast<const float*>(x_ptr), static_cast<int>(M), static_cast<int>(K), xq.data(),
                 xs.data());
  w2a8_run(xq.data(), M, K, reinterpret_cast<const uint32_t*>(w_ptr), N, KW, reinterpret_cast<const float*>(scales_ptr),
           scale_rows, NG, G, xs.data(), reinterpret_cast<const float*>(bias_ptr), reinterpret_cast<float*>(y_ptr),
           nullptr, isa, threads);
}

// Streaming-read probe: sums a buffer with `threads` threads. Benchmarks divide bytes by its time to
// get this machine's read bandwidth in the same run as the kernels they compare against it.
uint64_t stream_read(uintptr_t ptr, int64_t nbytes, int threads) {
  require(ptr != 0 && nbytes >= 8, "stream_read: needs a buffer of at least 8 bytes");
  const uint64_t* p = reinterpret_cast<const uint64_t*>(ptr);
  const int64_t n = nbytes / 8;
  py::gil_scoped_release release;
  const int nt = threads > 0 ? threads : 1;
  std::vector<uint64_t> sums(static_cast<size_t>(nt) * 8, 0);  // one cache line per thread
  parallel_for_threads(nt, [&](int t, int n_t) {
    uint64_t s = 0;
    for (int64_t i = n * t / n_t; i < n * (t + 1) / n_t; ++i) s += p[i];
    sums[static_cast<size_t>(t) * 8] = s;
  });
  uint64_t s = 0;
  for (int t = 0; t < nt; ++t) s += sums[static_cast<size_t>(t) * 8];
  return s;
}

// Dense linear: y[M][N] = x[M][K] . w[N][K]^T (+ bias), float32 or block-format weights (linear_run.cpp).
void dense(uintptr_t x_ptr, int64_t M, int64_t K, uintptr_t w_ptr, int64_t N, uintptr_t bias_ptr, uintptr_t y_ptr,
           int isa, int threads, int fmt) {
  py::gil_scoped_release release;
  dense_run(reinterpret_cast<const float*>(x_ptr), M, K, reinterpret_cast<const void*>(w_ptr), N,
            reinterpret_cast<const float*>(bias_ptr), reinterpret_cast<float*>(y_ptr), isa, threads, fmt);
}

void attention(uintptr_t q, uintptr_t k, uintptr_t v, uintptr_t mask, uintptr_t out, int64_t M, int64_t H,
               int64_t KVH, int64_t D, int64_t S, int64_t L, double scale, int threads, int isa, bool kv_half) {
  require(M >= 1 && H >= 1 && KVH >= 1 && D >= 1 && L >= 1 && S >= L, "attention: bad shape");
  require(H % KVH == 0, "attention: kv heads must divide heads");
  require(q && k && v && mask && out, "attention: null pointer");
  AttentionArgs a{reinterpret_cast<const float*>(q), reinterpret_cast<const float*>(k),
                  reinterpret_cast<const float*>(v), reinterpret_cast<const uint8_t*>(mask),
                  reinterpret_cast<float*>(out), static_cast<int>(M), static_cast<int>(H), static_cast<int>(KVH),
                  static_cast<int>(D), static_cast<int>(S), static_cast<int>(L), static_cast<float>(scale), threads,
                  resolve_isa(isa), kv_half ? 1 : 0};
  py::gil_scoped_release release;
  attention_rows(a);
}

// Each row's argmax and softmax probability (argmax_prob.h) of M float32 rows of V logits.
void argmax_prob_entry(uintptr_t logits, int64_t M, int64_t V, uintptr_t tok, uintptr_t prob, int threads, int isa) {
  require(M >= 0 && V >= 1, "argmax_prob: bad shape");
  require(logits && tok && prob, "argmax_prob: null pointer");
  ArgmaxProbArgs a{reinterpret_cast<const float*>(logits), M, V, reinterpret_cast<int64_t*>(tok),
                   reinterpret_cast<float*>(prob), threads, resolve_isa(isa)};
  py::gil_scoped_release release;
  argmax_prob(a);
}

// A step's tail in one call: RMSNorm of the rows (as the rms_norm entry), the dense LM head on them (as the dense
// entry, into `logits`) and each row's argmax and probability (as the argmax_prob entry). The same three functions
// in the same order as the three entries, so the same bits; one crossing from Python instead of three (each ~20-50
// µs of Python and torch around it with the caches cold after the layers: bench/glue.py).
void norm_head_argmax(uintptr_t x, int64_t M, int64_t K, uintptr_t norm_w, float eps, uintptr_t normed, uintptr_t w,
                      int64_t N, uintptr_t bias, int fmt, uintptr_t logits, uintptr_t tok, uintptr_t prob, int isa,
                      int threads) {
  require(M >= 1 && K >= 1 && N >= 1 && M <= INT32_MAX && K <= INT32_MAX, "norm_head_argmax: bad shape");
  require(x && norm_w && normed && w && logits && tok && prob, "norm_head_argmax: null pointer");
  py::gil_scoped_release release;
  rms_norm_f32(reinterpret_cast<const float*>(x), static_cast<int>(M), static_cast<int>(K),
               reinterpret_cast<const float*>(norm_w), eps, reinterpret_cast<float*>(normed));
  dense_run(reinterpret_cast<const float*>(normed), M, K, reinterpret_cast<const void*>(w), N,
            reinterpret_cast<const float*>(bias), reinterpret_cast<float*>(logits), isa, threads, fmt);
  ArgmaxProbArgs a{reinterpret_cast<const float*>(logits), M, N, reinterpret_cast<int64_t*>(tok),
                   reinterpret_cast<float*>(prob), threads, resolve_isa(isa)};
  argmax_prob(a);
}

// A CPU step's mask and RoPE rows (bitmtp/ops/step_inputs.py, the numpy reference beside it): row i may attend to
// KV rows [lo[i], hi[i]] of the first L (lo null: from 0), and its cos / sin rows are rows positions[i] of the
// [table_rows][head_dim] tables. One call for the four numpy calls a step took (~60-100 µs with the caches cold
// after the layers: bench/glue.py).
void step_inputs(uintptr_t positions, uintptr_t lo, uintptr_t hi, int64_t M, int64_t L, uintptr_t mask,
                 uintptr_t cos_table, uintptr_t sin_table, int64_t table_rows, int64_t head_dim, uintptr_t cos,
                 uintptr_t sin) {
  require(positions && hi && mask && cos_table && sin_table && cos && sin && M >= 0 && L >= 0 && head_dim >= 1,
          "step_inputs: bad arguments");
  const int64_t* pos = reinterpret_cast<const int64_t*>(positions);
  const int64_t* lo_p = reinterpret_cast<const int64_t*>(lo);
  const int64_t* hi_p = reinterpret_cast<const int64_t*>(hi);
  for (int64_t i = 0; i < M; ++i)
    if (pos[i] < 0 || pos[i] >= table_rows)
      throw py::value_error("step_inputs: position " + std::to_string(pos[i]) + " is outside the RoPE tables' " +
                            std::to_string(table_rows) + " rows");
  uint8_t* mk = reinterpret_cast<uint8_t*>(mask);
  const float* ct = reinterpret_cast<const float*>(cos_table);
  const float* st = reinterpret_cast<const float*>(sin_table);
  float* c = reinterpret_cast<float*>(cos);
  float* s = reinterpret_cast<float*>(sin);
  for (int64_t i = 0; i < M; ++i) {
    const int64_t a = lo_p ? lo_p[i] : 0, b = hi_p[i];
    uint8_t* row = mk + i * L;
    for (int64_t j = 0; j < L; ++j) row[j] = static_cast<uint8_t>(j >= a && j <= b);
    std::memcpy(c + i * head_dim, ct + pos[i] * head_dim, sizeof(float) * head_dim);
    std::memcpy(s + i * head_dim, st + pos[i] * head_dim, sizeof(float) * head_dim);
  }
}

// n float32 values rounded to float16 bits the way the fused layers store K/V (half.h); for tests.
void round_to_half(uintptr_t src, uintptr_t dst, int64_t n) {
  require(src && dst && n >= 0, "round_to_half: bad arguments");
  const float* s = reinterpret_cast<const float*>(src);
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(s[i]);
}

// a = SiLU(g) * u over n floats on one ISA path (-1: the best), as the fused layers compute it; for tests.
void silu_mul_entry(uintptr_t g, uintptr_t u, uintptr_t a, int64_t n, int isa) {
  require(g && u && a && n >= 0 && n <= INT32_MAX, "silu_mul: bad arguments");
  silu_mul(reinterpret_cast<const float*>(g), reinterpret_cast<const float*>(u), reinterpret_cast<float*>(a),
           static_cast<int>(n), resolve_isa(isa));
}

// A GGUF string array read from a buffer (the file's memory map): `count` elements of (uint64 length,
// UTF-8 bytes) starting at byte `pos` of the buffer's first `size` bytes. Returns (list of str, end
// offset); ValueError at the first element that runs past `size` or is not UTF-8 (the Python reader,
// bitmtp/formats/gguf.py, then re-reads the array to name the element). SmolLM2's 49k tokens + 49k
// merges: ~10 ms here against ~60 ms for the tight Python loop — a part of every CLI start.
py::tuple gguf_strings(py::buffer buf, int64_t pos, int64_t count, int64_t size, bool big_endian) {
  py::buffer_info info = buf.request();
  const int64_t have = static_cast<int64_t>(info.size) * static_cast<int64_t>(info.itemsize);
  require(size >= 0 && size <= have && pos >= 0 && pos <= size && count >= 0, "gguf_strings: bad arguments");
  const char* base = static_cast<const char*>(info.ptr);
  py::list out(count);
  for (int64_t i = 0; i < count; ++i) {
    if (size - pos < 8) throw py::value_error("gguf_strings: element " + std::to_string(i) + " length past the end");
    uint64_t n;
    std::memcpy(&n, base + pos, 8);
    if (big_endian) n = __builtin_bswap64(n);
    pos += 8;
    if (n > static_cast<uint64_t>(size - pos))
      throw py::value_error("gguf_strings: element " + std::to_string(i) + " runs past the end");
    PyObject* str = PyUnicode_DecodeUTF8(base + pos, static_cast<Py_ssize_t>(n), "strict");
    if (!str) {
      PyErr_Clear();
      throw py::value_error("gguf_strings: element " + std::to_string(i) + " is not UTF-8");
    }
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), str);  // steals the reference
    pos += static_cast<int64_t>(n);
  }
  return py::make_tuple(out, pos);
}

// TQ2_0 rows -> T2 words (bitmtp/formats/ternary.py): `n` rows of `k` weights (k a multiple of 256), each row
// k/256 blocks of 66 bytes (64 bytes of 2-bit codes, byte 32h + j holding weights 128h + 32s + j at bits 2s,
// then a float16 scale), into n x k/16 uint32 words (weight 16w + 4s + b at bit 8b + 2s of word w). Codes
// are copied as they are (both formats store w + 1); the caller checks them. BitNet-2B's 2.1 G weights: the
// vectorized numpy version took ~9.5 s of the model's load.
void tq2_0_to_t2(uintptr_t src, int64_t n, int64_t k, uintptr_t dst, int threads) {
  require(src && dst && n >= 1 && k >= 256 && k % 256 == 0, "tq2_0_to_t2: bad arguments");
  const uint8_t* in = reinterpret_cast<const uint8_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  const int64_t nb = k / 256;
  parallel_for_threads(threads, [&](int t, int nt) {
  for (int64_t r = n * t / nt; r < n * (t + 1) / nt; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* qs = in + (r * nb + b) * 66;
      uint8_t codes[256];
      for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 4; ++s)
          for (int j = 0; j < 32; ++j) codes[128 * h + 32 * s + j] = (qs[32 * h + j] >> (2 * s)) & 3;
      uint32_t* w = out + r * (k / 16) + b * 16;
      for (int word = 0; word < 16; ++word) {
        const uint8_t* c = codes + 16 * word;
        uint32_t v = 0;
        for (int i = 0; i < 16; ++i) v |= static_cast<uint32_t>(c[i]) << (8 * (i % 4) + 2 * (i / 4));
        w[word] = v;
      }
    }
  }
  });
}

// A step's tail after its layers, inside the same call (fused_layers_entry's tail_* arguments): the final RMSNorm
// of rows `rows` of x (all M in order when null), the dense LM head on them into `logits` (a scratch buffer when
// null) and each row's argmax and probability. The norm_head_argmax entry's three functions in its order on the
// same rows, so its bits (the norm is row by row). Saves a step the Python and torch between the layers' call and
// the tail's (~100-160 µs of a SmolLM2 step with the caches cold after the layers: bench/glue.py).
struct StepTail {
  const float* norm = nullptr;
  float eps = 0;
  const void* w = nullptr;
  int64_t n = 0;
  const float* bias = nullptr;
  int fmt = 0;
  const int64_t* rows = nullptr;
  int64_t m = 0;
  float* logits = nullptr;
  int64_t* tok = nullptr;
  float* prob = nullptr;
};

void run_tail(const StepTail& t, const float* x, int hidden, int isa, int threads) {
  // buffers kept by the calling thread from step to step (a fresh [M, vocab] scratch is ~200 KB of new pages a step)
  thread_local std::vector<float> normed, scratch;
  normed.resize(static_cast<size_t>(t.m) * hidden);
  for (int64_t i = 0; i < t.m; ++i) {
    const int64_t row = t.rows ? t.rows[i] : i;
    rms_norm_f32(x + row * hidden, 1, hidden, t.norm, t.eps, normed.data() + i * hidden);
  }
  float* logits = t.logits;
  if (!logits) {
    scratch.resize(static_cast<size_t>(t.m) * t.n);
    logits = scratch.data();
  }
  dense_run(normed.data(), t.m, hidden, t.w, t.n, t.bias, logits, isa, threads, t.fmt);
  ArgmaxProbArgs a{logits, t.m, t.n, t.tok, t.prob, threads, resolve_isa(isa)};
  argmax_prob(a);
}

// Every layer of one decoder step (layers.cpp), then, when tail_w is set, the step's tail (StepTail); pointers
// validated by bitmtp/ops/fused_layers.py.
void fused_layers_entry(uintptr_t x, int M, int hidden, int heads, int kv_heads, int head_dim, int inter,
                        uintptr_t table, uintptr_t kv, uintptr_t lora, int lora_first_row, double lora_scaling,
                        uintptr_t layer_ids, int num_layers_run, uintptr_t cos, uintptr_t sin, uintptr_t positions,
                        uintptr_t mask, int S, int L, double eps, double attn_scale, bool relu2, int isa, int threads,
                        bool kv_half, uintptr_t tail_norm, double tail_eps, uintptr_t tail_w, int64_t tail_n,
                        uintptr_t tail_bias, int tail_fmt, uintptr_t tail_rows, int64_t tail_m, uintptr_t tail_logits,
                        uintptr_t tail_tok, uintptr_t tail_prob) {
  require(x && table && kv && layer_ids && cos && sin && positions && mask, "fused layers: null pointer");
  StepTail tail;
  if (tail_w) {
    require(tail_norm && tail_tok && tail_prob && tail_n >= 1 && tail_m >= 0 && tail_m <= INT32_MAX,
            "fused layers: bad tail");
    tail = StepTail{reinterpret_cast<const float*>(tail_norm), static_cast<float>(tail_eps),
                    reinterpret_cast<const void*>(tail_w), tail_n, reinterpret_cast<const float*>(tail_bias),
                    tail_fmt, reinterpret_cast<const int64_t*>(tail_rows), tail_m,
                    reinterpret_cast<float*>(tail_logits), reinterpret_cast<int64_t*>(tail_tok),
                    reinterpret_cast<float*>(tail_prob)};
    require(tail.rows || tail_m <= M, "fused layers: the tail reads more rows than the step has");
    for (int64_t i = 0; tail.rows && i < tail_m; ++i)
      require(tail.rows[i] >= 0 && tail.rows[i] < M, "fused layers: a tail row index is out of range");
  }
  FusedStep s;
  s.x = reinterpret_cast<float*>(x);
  s.M = M;
  s.hidden = hidden;
  s.heads = heads;
  s.kv_heads = kv_heads;
  s.head_dim = head_dim;
  s.inter = inter;
  s.table = reinterpret_cast<const int64_t*>(table);
  s.kv = reinterpret_cast<const int64_t*>(kv);
  s.lora = reinterpret_cast<const int64_t*>(lora);
  s.lora_first_row = lora_first_row;
  s.lora_scaling = static_cast<float>(lora_scaling);
  s.layer_ids = reinterpret_cast<const int64_t*>(layer_ids);
  s.num_layers_run = num_layers_run;
  s.cos = reinterpret_cast<const float*>(cos);
  s.sin = reinterpret_cast<const float*>(sin);
  s.positions = reinterpret_cast<const int64_t*>(positions);
  s.mask = reinterpret_cast<const uint8_t*>(mask);
  s.S = S;
  s.L = L;
  s.eps = static_cast<float>(eps);
  s.attn_scale = static_cast<float>(attn_scale);
  s.relu2 = relu2;
  s.isa = resolve_isa(isa);
  s.threads = threads > 0 ? threads : 1;
  s.kv_half = kv_half;
  py::gil_scoped_release release;
  fused_layers(s);
  if (tail.w && tail.m) run_tail(tail, s.x, hidden, s.isa, s.threads);
}

}  // namespace

PYBIND11_MODULE(_cpu_w2a8, m) {
  m.doc() = "bitmtp W2A8 CPU kernels (single-pass multi-token GEMV; AVX-512 VNNI / AVX2 / scalar)";
  // the attention's summation structure, which the decode planner lays scratch KV rows out by
  // (bitmtp.ops.linear reads these: the planner never carries a hand-copied constant)
  m.attr("ATTENTION_LANES") = kAttnTile;
  m.attr("ATTENTION_CHUNK") = kAttnChunk;
  m.def("cpu_features", &cpu_features, "ISA support detected from CPUID and the thread team's counters (pool.h)");
  m.def("best_isa", &best_isa, "0 = scalar, 1 = avx2, 2 = avx512_vnni");
  m.def("dense", &dense, py::arg("x_ptr"), py::arg("M"), py::arg("K"), py::arg("w_ptr"), py::arg("N"),
        py::arg("bias_ptr"), py::arg("y_ptr"), py::arg("isa"), py::arg("threads"), py::arg("fmt") = 0,
        "Dense multi-token GEMV with a row-independent summation order; fmt: 0 float32, 1 Q4_1, 2 Q8_0, 3 Q4_0 blocks, 4 bfloat16 rows, 5 float16 rows");
  m.def("attention", &attention, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("out"),
        py::arg("M"), py::arg("H"), py::arg("KVH"), py::arg("D"), py::arg("S"), py::arg("L"), py::arg("scale"),
        py::arg("threads"), py::arg("isa") = -1, py::arg("kv_half") = false,
        "Row-deterministic masked attention on float32 q/out and float32 (or, kv_half, float16) K/V buffers "
        "(the same bits on every ISA path; float16 K/V give the bits of float32 K/V holding the same values)");
  m.def("fused_layers", &fused_layers_entry, py::arg("x"), py::arg("M"), py::arg("hidden"), py::arg("heads"),
        py::arg("kv_heads"), py::arg("head_dim"), py::arg("inter"), py::arg("table"), py::arg("kv"), py::arg("lora"),
        py::arg("lora_first_row"), py::arg("lora_scaling"), py::arg("layer_ids"), py::arg("num_layers_run"),
        py::arg("cos"), py::arg("sin"), py::arg("positions"), py::arg("mask"), py::arg("S"), py::arg("L"),
        py::arg("eps"), py::arg("attn_scale"), py::arg("relu2"), py::arg("isa"), py::arg("threads"),
        py::arg("kv_half") = false, py::arg("tail_norm") = 0, py::arg("tail_eps") = 0.0, py::arg("tail_w") = 0,
        py::arg("tail_n") = 0, py::arg("tail_bias") = 0, py::arg("tail_fmt") = 0, py::arg("tail_rows") = 0,
        py::arg("tail_m") = 0, py::arg("tail_logits") = 0, py::arg("tail_tok") = 0, py::arg("tail_prob") = 0,
        "Run decoder layers of one step in place on x (see csrc/cpu/layers.h for the table layout); with tail_w, "
        "then the final norm, LM head and argmax of rows tail_rows (norm_head_argmax's bits)");
  m.def("argmax_prob", &argmax_prob_entry, py::arg("logits"), py::arg("M"), py::arg("V"), py::arg("tok"),
        py::arg("prob"), py::arg("threads"), py::arg("isa") = -1,
        "Each float32 logits row's first argmax (int64) and softmax probability (float32), the same bits on "
        "every ISA path and thread count (csrc/cpu/argmax_prob.h)");
  m.def("norm_head_argmax", &norm_head_argmax, py::arg("x"), py::arg("M"), py::arg("K"), py::arg("norm_w"),
        py::arg("eps"), py::arg("normed"), py::arg("w"), py::arg("N"), py::arg("bias"), py::arg("fmt"),
        py::arg("logits"), py::arg("tok"), py::arg("prob"), py::arg("isa"), py::arg("threads"),
        "RMSNorm, the dense LM head and argmax_prob in one call (the rms_norm, dense and argmax_prob entries' bits)");
  m.def("step_inputs", &step_inputs, py::arg("positions"), py::arg("lo"), py::arg("hi"), py::arg("M"), py::arg("L"),
        py::arg("mask"), py::arg("cos_table"), py::arg("sin_table"), py::arg("table_rows"), py::arg("head_dim"),
        py::arg("cos"), py::arg("sin"),
        "A step's mask (row i sees KV rows lo[i]..hi[i] of L; lo 0: from 0) and its RoPE rows (table rows "
        "positions[i]) into the given buffers");
  m.def("round_to_half", &round_to_half, py::arg("src"), py::arg("dst"), py::arg("n"),
        "float32 -> float16 bits as the fused layers store K/V (round to nearest even); for tests");
  m.def("silu_mul", &silu_mul_entry, py::arg("g"), py::arg("u"), py::arg("a"), py::arg("n"), py::arg("isa") = -1,
        "a = SiLU(g) * u (float32 pointers, n values) on one ISA path, as the fused layers compute it; for tests");
  m.def("gguf_strings", &gguf_strings, py::arg("buffer"), py::arg("pos"), py::arg("count"), py::arg("size"),
        py::arg("big_endian"), "A GGUF string array from a buffer: (list of str, end offset); ValueError if bad");
  m.def("tq2_0_to_t2", &tq2_0_to_t2, py::arg("src"), py::arg("n"), py::arg("k"), py::arg("dst"), py::arg("threads"),
        "TQ2_0 rows (n x k/256 blocks of 66 bytes) -> T2 words (n x k/16 uint32), codes copied as they are");
  m.def("stream_read", &stream_read, py::arg("ptr"), py::arg("nbytes"), py::arg("threads"),
        "Sum a buffer of uint64 with `threads` threads (a streaming-read bandwidth probe)");
  m.def("rms_norm", [](int64_t x, int rows, int n, int64_t w, float eps, int64_t y) {
          py::gil_scoped_release release;
          rms_norm_f32(reinterpret_cast<const float*>(static_cast<uintptr_t>(x)), rows, n,
                       reinterpret_cast<const float*>(static_cast<uintptr_t>(w)), eps,
                       reinterpret_cast<float*>(static_cast<uintptr_t>(y)));
        }, py::arg("x_ptr"), py::arg("rows"), py::arg("n"), py::arg("w_ptr"), py::arg("eps"), py::arg("y_ptr"),
        "RMSNorm of float32 rows as the fused layers compute it (bit-exact with the torch reference)");
  m.def("act_quant", &act_quant, py::arg("x_ptr"), py::arg("M"), py::arg("K"), py::arg("q_ptr"), py::arg("s_ptr"),
        "Per-token absmax int8 quantization of float32 rows (bit-exact with the torch reference)");
  m.def("linear_f32", &linear_f32, py::arg("x_ptr"), py::arg("M"), py::arg("K"), py::arg("w_ptr"), py::arg("N"),
        py::arg("KW"), py::arg("scales_ptr"), py::arg("scale_rows"), py::arg("NG"), py::arg("G"), py::arg("bias_ptr"),
        py::arg("y_ptr"), py::arg("isa"), py::arg("threads"),
        "W2A8 linear on float32 activations: act_quant then the kernel, in one call (GIL released)");
  m.def("run", &run, py::arg("x_ptr"), py::arg("M"), py::arg("K"), py::arg("w_ptr"), py::arg("N"), py::arg("KW"),
        py::arg("scales_ptr"), py::arg("scale_rows"), py::arg("NG"), py::arg("G"), py::arg("act_scale_ptr"),
        py::arg("bias_ptr"), py::arg("y_ptr"), py::arg("acc_ptr"), py::arg("isa"), py::arg("threads"),
        "Run the kernel on raw pointers (validated by the Python wrapper). isa=-1 picks the best.");
}
