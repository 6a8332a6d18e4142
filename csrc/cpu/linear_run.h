// The W2A8 and dense drivers shared by the pybind entry points (w2a8_module.cpp) and the fused
// decoder layers (layers.cpp): ISA choice, row splitting across threads, activation padding.
// They never touch the GIL: callers release it around them.
//
// Reference: bitmtp.ops.reference.w2a8_linear_q_reference, bitmtp.ops.reference.dense_linear_reference
// Test: tests/ops/backends/test_cpu_kernels.py, tests/formats/test_ggml_blocks.py
#pragma once

#include <stdint.h>

namespace bitmtp_cpu {

enum Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

bool has_avx2();
bool has_avx512_vnni();
int best_isa();
const char* isa_name(int isa);
// -1 -> best_isa(); throws std::invalid_argument when the CPU cannot run `isa`.
int resolve_isa(int isa);

// y[M][N] (and/or exact accumulators acc[M][N][NG]) of int8 activations x_q[M][K] against T2 words
// w[N][KW] with multiplicative scales; see w2a8_cpu.h for the contract.
void w2a8_run(const int8_t* x, int64_t M, int64_t K, const uint32_t* w, int64_t N, int64_t KW,
              const float* scales, int64_t scale_rows, int64_t NG, int64_t G, const float* act_scale,
              const float* bias, float* y, int32_t* acc, int isa, int threads);

// y[M][N] = x[M][K] . w[N][K]^T (+ bias), float32, row-independent summation order. `w` is float32
// [N][K] (fmt 0) or Q4_1 / Q8_0 / Q4_0 blocks [N][K / 32] (fmt 1 / 2 / 3, see dense_cpu.h).
void dense_run(const float* x, int64_t M, int64_t K, const void* w, int64_t N, const float* bias, float* y,
               int isa, int threads, int fmt = 0);

}  // namespace bitmtp_cpu
