// Fused decoder layers: every layer of one decoder step in a single native call (layers.cpp).
//
// Python describes the model once as an int64 "layer table" (bitmtp/ops/fused_layers.py mirrors
// these field numbers) and each step passes the rows' activations, positions, RoPE rows and mask.
//
// Reference: bitmtp.model.decoder.Decoder.run_layers (its per-op loop, BITMTP_FUSED=0)
// Test: tests/ops/test_fused_layers.py
#pragma once

#include <stdint.h>

namespace bitmtp_cpu {

// Fields of one projection inside a layer-table row.
enum ProjField { kPKind, kPWeight, kPBias, kPScales, kPScaleRows, kPGroup, kPK, kPN, kProjFields };
// kProjQ4_1 / kProjQ8_0 / kProjQ4_0 / kProjBF16 / kProjF16: dense weights kept in GGML blocks or half rows (dense_cpu.h), `weight` points at them.
enum ProjKind { kDense = 0, kTernary = 1, kProjQ4_1 = 2, kProjQ8_0 = 3, kProjQ4_0 = 4, kProjBF16 = 5, kProjF16 = 6 };
// The projections of a layer, in table order (q/k/v and gate/up are fused, see bitmtp/model/fuse.py).
enum Proj { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3, kNumProj = 4 };
// Fields after the projections: the layer's norm weights (0 = absent).
enum LayerField { kInNorm = kNumProj * kProjFields, kPostNorm, kQNorm, kKNorm, kAttnSubNorm, kMlpSubNorm, kLayerFields };
// LoRA table: per layer and projection, A [rank][K], B [N][rank] (0 = no delta) and the rank.
enum LoraField { kLA, kLB, kLRank, kLoraFields };

struct FusedStep {
  float* x;                   // [M][hidden] residual stream, updated in place
  int M, hidden, heads, kv_heads, head_dim, inter;
  const int64_t* table;       // [num_layers][kLayerFields]
  const int64_t* kv;          // [num_layers][2]: K and V buffers, [kv_heads][S][head_dim], float32 or
                              // (kv_half) IEEE binary16
  bool kv_half = false;       // K/V rows are stored rounded to float16 (nearest even, as torch's .half())
  const int64_t* lora;        // [num_layers][kNumProj][kLoraFields], or null
  int lora_first_row;         // rows >= this get the LoRA deltas (the mask rows of a draft step)
  float lora_scaling;
  const int64_t* layer_ids;   // the layers to run, in order
  int num_layers_run;
  const float* cos;           // [M][head_dim]
  const float* sin;           // [M][head_dim]
  const int64_t* positions;   // [M]
  const uint8_t* mask;        // [M][L], 1 = may attend
  int S, L;
  float eps, attn_scale;
  bool relu2;                 // BitNet's squared ReLU instead of SiLU
  int isa, threads;
};

void fused_layers(const FusedStep& s);

// y[rows][n] = w * (x * rsqrt(mean(x^2) + eps)) per row (layers.cpp: the layers' own norm), bit-exact with
// bitmtp.ops.reference.rms_norm_reference (the mean of squares summed in double, rounded to float32). On the
// calling thread: ~1 us at n = 576, where the torch version's nine small ops cost ~20-120 us a step.
void rms_norm_f32(const float* x, int rows, int n, const float* w, float eps, float* y);

// Per-token absmax int8 quantization of x[rows][k] (layers.cpp), bit-exact with
// bitmtp.formats.quantize.quantize_activations: q[rows][k] and the scales s[rows]. On the calling thread:
// ~3 us at k = 2560 (what a torch-op version costs ~25 us and a libgomp region beside the team, ms).
void act_quant_rows(const float* x, int rows, int k, int8_t* q, float* s);

// a[i] = SiLU(g[i]) * u[i], SiLU evaluated in double and rounded to float32 (layers.cpp), on the given
// ISA path (kAvx2 and up: four lanes a step, the same values bit for bit).
void silu_mul(const float* g, const float* u, float* a, int n, int isa);
// silu_mul's AVX2 part (act_avx2.cpp): i below the returned count (the largest multiple of 4 <= n).
int silu_mul_avx2(const float* g, const float* u, float* a, int n);

}  // namespace bitmtp_cpu
