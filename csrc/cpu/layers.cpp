// Fused decoder layers for the CPU backend.
//
// Why: a SmolLM2-135M decode step ran ~25 torch ops per layer from Python (30 layers): 34 ms per
// AR step of which the projections were 15.5 ms; the rest was per-op dispatch. Here the whole
// layer stack runs in one call and the step costs the projections plus a little.
//
// Every operation is row-wise (RMSNorm, RoPE, activation quantization, the activation function)
// or uses the row-independent kernels (dense_run / w2a8_run: a fixed summation order per (row,
// token); attention_rows: each (row, head) alone), so a row's result never depends on the step's
// width — the invariant behind lossless speculative decoding. Elementwise work is single-threaded
// (a step has at most a few dozen rows); the projections and attention use `threads`.
//
// Numerics match the per-op path (bitmtp/model/layers.py) value for value: RMSNorm's mean of
// squares and SiLU are evaluated in double and rounded to float32 there and here, so their results
// do not depend on summation order or on the exp implementation; RoPE, residual adds and ReLU² are
// the same float32 operations (compiled with -std=c++17, GCC does not contract them into FMAs);
// projections, attention and activation quantization are the same kernels.
//
// Reference: bitmtp.model.decoder.Decoder.run_layers (its per-op loop, BITMTP_FUSED=0)
// Test: tests/ops/test_fused_layers.py
#include "layers.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "attention.h"
#include "half.h"
#include "dense_cpu.h"
#include "linear_run.h"
#include "pool.h"

namespace bitmtp_cpu {

// Per-token absmax int8 quantization, bit-exact with bitmtp.formats.quantize.quantize_activations:
// s = 127 / max(max|x|, 1e-5) and x_q = clamp(round_half_even(x * s), -128, 127), in float32.
void act_quant_rows(const float* x, int rows, int k, int8_t* q, float* s) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * k;
    float amax = 0.f;
    for (int i = 0; i < k; ++i) amax = std::max(amax, std::fabs(xr[i]));
    // torch evaluates `127.0 / t` as reciprocal(t) * 127: a quarter of the scales differ by an ulp
    // from a true division, so the reference's rounding is reproduced literally.
    const float sc = (1.0f / std::max(amax, 1e-5f)) * 127.0f;
    s[r] = sc;
    int8_t* qr = q + static_cast<int64_t>(r) * k;
    // Round half to even by the 1.5 * 2^23 trick (|x * sc| <= 128 here): plain adds that vectorize on
    // any x86-64, where nearbyintf is a libm call per element without SSE4.1 (~0.5 ms per BitNet-2B
    // layer at 15 rows).
    constexpr float kMagic = 12582912.0f;
    for (int i = 0; i < k; ++i) {
      const float v = (xr[i] * sc + kMagic) - kMagic;
      qr[i] = static_cast<int8_t>(std::min(127.f, std::max(-128.f, v)));
    }
  }
}

namespace {

template <typename T>
T* ptr(int64_t v) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(v));
}

// y = w * (x * rsqrt(mean(x^2) + eps)) per row of n (float32 statistics, as transformers' RMSNorm).
void rms_norm_rows(const float* x, int rows, int n, const float* w, float eps, float* y) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<int64_t>(r) * n;
    float* yr = y + static_cast<int64_t>(r) * n;
    // Squares of floats are exact in double and the sum's rounding error (~1e-16) vanishes when the
    // mean is rounded to float32, so eight independent partial sums (no serial add chain: 7 us per
    // 6912-wide row) give the value torch's float64 mean gives.
    double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) part[j] += static_cast<double>(xr[i + j]) * xr[i + j];
    for (; i < n; ++i) part[0] += static_cast<double>(xr[i]) * xr[i];
    const double ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
    for (int k = 0; k < n; ++k) yr[k] = w[k] * (xr[k] * inv);
  }
}

struct Work {
  std::vector<int8_t> xq;
  std::vector<float> xs, lora_t, lora_d;
};

// y[M][N] = projection(x[M][K]) (+ the LoRA delta on rows >= first), per the table fields `p`.
void project(const int64_t* p, const int64_t* lora, const FusedStep& s, const float* x, float* y, Work& w) {
  const int64_t K = p[kPK], N = p[kPN];
  if (p[kPKind] == kDense || (p[kPKind] >= kProjQ4_1 && p[kPKind] <= kProjF16)) {
    const int fmt = p[kPKind] == kDense      ? kDenseF32
                    : p[kPKind] == kProjQ4_1 ? kDenseQ4_1
                    : p[kPKind] == kProjQ8_0 ? kDenseQ8_0
                    : p[kPKind] == kProjQ4_0 ? kDenseQ4_0
                    : p[kPKind] == kProjBF16 ? kDenseBF16
                                             : kDenseF16;
    dense_run(x, s.M, K, ptr<const void>(p[kPWeight]), N, ptr<const float>(p[kPBias]), y, s.isa, s.threads, fmt);
  } else if (p[kPKind] == kTernary) {
    w.xq.resize(static_cast<size_t>(s.M * K));
    w.xs.resize(static_cast<size_t>(s.M));
    act_quant_rows(x, s.M, static_cast<int>(K), w.xq.data(), w.xs.data());
    const int64_t G = p[kPGroup];
    w2a8_run(w.xq.data(), s.M, K, ptr<const uint32_t>(p[kPWeight]), N, (K + 15) / 16, ptr<const float>(p[kPScales]),
             p[kPScaleRows], (K + G - 1) / G, G, w.xs.data(), ptr<const float>(p[kPBias]), y, nullptr, s.isa,
             s.threads);
  } else {
    throw std::invalid_argument("fused layers: unknown projection kind " + std::to_string(p[kPKind]));
  }
  if (lora == nullptr || lora[kLA] == 0 || s.lora_first_row >= s.M) return;
  // Gated LoRA: (x A^T) B^T * scaling added to the mask rows only (bitmtp/model/adapters.py).
  const int first = s.lora_first_row, R = s.M - first;
  const int64_t rank = lora[kLRank];
  w.lora_t.resize(static_cast<size_t>(R * rank));
  w.lora_d.resize(static_cast<size_t>(R * N));
  dense_run(x + first * K, R, K, ptr<const float>(lora[kLA]), rank, nullptr, w.lora_t.data(), s.isa, s.threads);
  dense_run(w.lora_t.data(), R, rank, ptr<const float>(lora[kLB]), N, nullptr, w.lora_d.data(), s.isa, s.threads);
  float* yr = y + first * N;
  if (s.lora_scaling != 1.0f)
    for (int64_t i = 0; i < R * N; ++i) yr[i] += w.lora_d[i] * s.lora_scaling;
  else
    for (int64_t i = 0; i < R * N; ++i) yr[i] += w.lora_d[i];
}

// exp(x) in double to ~1e-14 relative: x = n·ln2 + r (Cody–Waite, |r| <= ln2/2), a degree-11 Taylor
// polynomial in r, times 2^n from the exponent bits. Why not std::exp: SiLU in double (see the
// header comment) called libm once per element, 0.46 ms per layer at 15 rows (14 ms of a SmolLM2
// draft step); this loop vectorizes. Its error is far below float32's half ulp (6e-8), so SiLU
// rounds to the same float as torch's float64 silu except in ~1e-7 of cases at a rounding tie.
inline double exp_d(double x) {
  x = x < -708.0 ? -708.0 : (x > 709.0 ? 709.0 : x);
  // n = nearbyint(x·log2 e) by adding and subtracting 1.5·2^52 (ties to even, as nearbyint in the default
  // rounding mode; |x·log2 e| < 1024 here): the same n, but plain adds that vectorize. nearbyint itself
  // is a libm call per element on the extension's baseline x86-64 target (no SSE4.1 roundpd): SiLU took
  // 2.6 ms of a 25 ms SmolLM2 width-8 step that way. The integer n comes from the sum's low mantissa bits.
  constexpr double kRound = 6755399441055744.0;
  const double t = x * 1.4426950408889634 + kRound;
  const double n = t - kRound;
  int64_t tb, kb;
  std::memcpy(&tb, &t, sizeof tb);
  const double round_const = kRound;
  std::memcpy(&kb, &round_const, sizeof kb);
  const int64_t ni = tb - kb;
  const double r = (x - n * 0.693147180369123816490) - n * 1.90821492927058770002e-10;
  double p = 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  const int64_t bits = (ni + 1023) << 52;
  double scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// x[heads][D] rotated by this row's cos/sin (rotate-half convention, halves duplicated).
void rope_heads(float* x, int heads, int D, const float* cos, const float* sin, float* tmp) {
  const int half = D / 2;
  for (int h = 0; h < heads; ++h) {
    float* xh = x + static_cast<int64_t>(h) * D;
    for (int i = 0; i < half; ++i) tmp[i] = -xh[half + i];
    for (int i = half; i < D; ++i) tmp[i] = xh[i - half];
    for (int i = 0; i < D; ++i) xh[i] = xh[i] * cos[i] + tmp[i] * sin[i];
  }
}

// Row g of the K (or V) buffer at position pos: D floats, stored as float32 or rounded to float16.
void store_kv_row(int64_t buf, bool half, int64_t at, const float* src, int D) {
  if (half) {
    uint16_t* dst = ptr<uint16_t>(buf) + at;
    for (int i = 0; i < D; ++i) dst[i] = f32_to_f16(src[i]);
  } else {
    std::memcpy(ptr<float>(buf) + at, src, sizeof(float) * D);
  }
}

}  // namespace

void silu_mul(const float* g, const float* u, float* a, int n, int isa) {
  // SiLU in double, rounded to float: the same value as bitmtp.model.layers.silu
  int i = isa >= kAvx2 ? silu_mul_avx2(g, u, a, n) : 0;
  for (; i < n; ++i) {
    const double gd = g[i];
    a[i] = static_cast<float>(gd / (1.0 + exp_d(-gd))) * u[i];
  }
}

void fused_layers(const FusedStep& s) {
  const int M = s.M, Hd = s.hidden, D = s.head_dim;
  const int qs = s.heads * D, kvs = s.kv_heads * D, I = s.inter;
  if (M < 1 || Hd < 1 || D < 1 || s.heads < 1 || s.kv_heads < 1 || s.heads % s.kv_heads)
    throw std::invalid_argument("fused layers: bad step dimensions");
  if (s.L < 1 || s.S < s.L) throw std::invalid_argument("fused layers: mask length must be in [1, S]");
  for (int m = 0; m < M; ++m)
    if (s.positions[m] < 0 || s.positions[m] >= s.S) throw std::invalid_argument("fused layers: position out of the KV store");
  std::vector<float> h(static_cast<size_t>(M) * Hd), qkv(static_cast<size_t>(M) * (qs + 2 * kvs));
  std::vector<float> q(static_cast<size_t>(M) * qs), att(static_cast<size_t>(M) * qs), o(static_cast<size_t>(M) * Hd);
  std::vector<float> gu(static_cast<size_t>(M) * 2 * I), act(static_cast<size_t>(M) * I), tmp(static_cast<size_t>(D));
  Work w;
  // the mask is the step's, the same for every layer: its rows' bounds once (attention skips what lies outside)
  std::vector<int32_t> bounds(static_cast<size_t>(M) * 2);
  mask_row_bounds(s.mask, M, s.L, bounds.data(), bounds.data() + M);
  for (int li = 0; li < s.num_layers_run; ++li) {
    const int64_t layer = s.layer_ids[li];
    const int64_t* t = s.table + layer * kLayerFields;
    const int64_t* lora = s.lora ? s.lora + layer * kNumProj * kLoraFields : nullptr;
    auto lora_of = [&](int proj) { return lora ? lora + proj * kLoraFields : nullptr; };
    const int64_t kbuf = s.kv[layer * 2], vbuf = s.kv[layer * 2 + 1];

    // attention block
    rms_norm_rows(s.x, M, Hd, ptr<const float>(t[kInNorm]), s.eps, h.data());
    project(t + kQkv * kProjFields, lora_of(kQkv), s, h.data(), qkv.data(), w);
    for (int m = 0; m < M; ++m) {
      float* row = qkv.data() + static_cast<int64_t>(m) * (qs + 2 * kvs);
      float* qr = q.data() + static_cast<int64_t>(m) * qs;
      float* kr = row + qs;
      const float* vr = row + qs + kvs;
      if (t[kQNorm]) {
        rms_norm_rows(row, s.heads, D, ptr<const float>(t[kQNorm]), s.eps, qr);
        rms_norm_rows(kr, s.kv_heads, D, ptr<const float>(t[kKNorm]), s.eps, kr);
      } else {
        std::memcpy(qr, row, sizeof(float) * qs);
      }
      const float* c = s.cos + static_cast<int64_t>(m) * D;
      const float* sn = s.sin + static_cast<int64_t>(m) * D;
      rope_heads(qr, s.heads, D, c, sn, tmp.data());
      rope_heads(kr, s.kv_heads, D, c, sn, tmp.data());
      const int64_t pos = s.positions[m];
      for (int g = 0; g < s.kv_heads; ++g) {
        const int64_t at = (static_cast<int64_t>(g) * s.S + pos) * D;
        store_kv_row(kbuf, s.kv_half, at, kr + static_cast<int64_t>(g) * D, D);
        store_kv_row(vbuf, s.kv_half, at, vr + static_cast<int64_t>(g) * D, D);
      }
    }
    AttentionArgs aa{q.data(), ptr<const float>(kbuf), ptr<const float>(vbuf), s.mask, att.data(), M, s.heads,
                     s.kv_heads, D, s.S, s.L, s.attn_scale, s.threads, s.isa, s.kv_half ? 1 : 0,
                     bounds.data(), bounds.data() + M};
    attention_rows(aa);
    if (t[kAttnSubNorm]) rms_norm_rows(att.data(), M, qs, ptr<const float>(t[kAttnSubNorm]), s.eps, att.data());
    project(t + kO * kProjFields, lora_of(kO), s, att.data(), o.data(), w);
    for (int64_t i = 0; i < static_cast<int64_t>(M) * Hd; ++i) s.x[i] += o[i];

    // MLP block
    rms_norm_rows(s.x, M, Hd, ptr<const float>(t[kPostNorm]), s.eps, h.data());
    project(t + kGateUp * kProjFields, lora_of(kGateUp), s, h.data(), gu.data(), w);
    // Elementwise, so how rows are split over threads cannot change a value. The rows go over the
    // threads from 4 rows on (one fork-join, a few us, against ~1 ns an element of SiLU in double on
    // AVX2: 18 us a SmolLM2 layer at width 8).
    const int act_threads = M >= 4 ? s.threads : 1;
    parallel_for_threads(act_threads, [&](int th, int nth) {
      for (int m = M * th / nth; m < M * (th + 1) / nth; ++m) {
        const float* g = gu.data() + static_cast<int64_t>(m) * 2 * I;
        const float* u = g + I;
        float* a = act.data() + static_cast<int64_t>(m) * I;
        if (s.relu2) {
          for (int i = 0; i < I; ++i) {
            const float r = g[i] > 0.f ? g[i] : 0.f;
            a[i] = (r * r) * u[i];
          }
        } else {
          silu_mul(g, u, a, I, s.isa);
        }
      }
    });
    if (t[kMlpSubNorm]) rms_norm_rows(act.data(), M, I, ptr<const float>(t[kMlpSubNorm]), s.eps, act.data());
    project(t + kDown * kProjFields, lora_of(kDown), s, act.data(), o.data(), w);
    for (int64_t i = 0; i < static_cast<int64_t>(M) * Hd; ++i) s.x[i] += o[i];
  }
}

void rms_norm_f32(const float* x, int rows, int n, const float* w, float eps, float* y) {
  rms_norm_rows(x, rows, n, w, eps, y);
}

}  // namespace bitmtp_cpu
