// W2A8 CPU kernels: shared declarations.
//
// Layout contract (see bitmtp/formats/ternary.py): packed weights are T2 words, uint32[N][KW];
// weight k = 16j + 4s + b sits at bits 8b + 2s of word j, so (word >> 2s) & 0x03030303 holds the
// four codes (c = w + 1 in {0,1,2}) of k = 16j+4s .. 16j+4s+3, one per byte, lined up with the
// little-endian int32 of four consecutive int8 activations. Each kernel therefore computes
// sum(c * x) with unsigned-by-signed byte dot products (VNNI vpdpbusd, AVX2 maddubs) and folds the
// code offset by subtracting sum(x) per group.
//
// This header is included by the ISA-specific translation units, which are compiled with
// "#pragma GCC target" for their ISA: it must declare only plain data and functions, never define
// inline or template code (an inline function instantiated under an AVX-512 target could be the
// copy the linker keeps, and run on a CPU without AVX-512).
//
// Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
// Test: tests/ops/backends/test_cpu_kernels.py
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace bitmtp_cpu {

// Maximum tokens per pass over the weights; larger M is processed in chunks of this many rows.
constexpr int kMaxWidth = 16;

struct W2A8Args {
  const int8_t* x;          // activations, [M][x_stride] bytes, zero beyond K, x_stride % 64 == 0
  int64_t x_stride;         // bytes per activation row (>= KW * 16 rounded up to 64)
  int M;                    // tokens in this chunk, 1..kMaxWidth
  const int32_t* xsum;      // [M][NG]: sum of x over each scale group (the code-offset fold)
  const uint32_t* w;        // T2 words, [N][KW]
  int KW;                   // words per row
  int NG;                   // scale groups per row
  int GW;                   // group size in words (the last group may be shorter)
  const float* scales;      // [1 or N][NG], multiplicative weight scales (null when acc_out is set)
  int scale_row_stride;     // 0 (shared) or NG
  const float* act_scale;   // [M]: s with x ~= x_q / s
  const float* bias;        // [N] or null
  float* y;                 // [M][y_stride] float32 output, or null
  int64_t y_stride;
  int32_t* acc;             // [M][acc_stride_m] exact per-group accumulators [.., N, NG], or null
  int64_t acc_stride_m;
  // x in the ISA's broadcast layout: AVX-512 (w2a8_avx512.cpp): in every 64-byte chunk of a row the
  // sixteen int32 lanes are transposed as a 4x4 matrix (lane 4s + j holds bytes 16j + 4s .. + 3);
  // AVX2 (w2a8_avx2.cpp): in every 32-byte chunk the eight lanes as 2x4 (lane 2s + j holds them).
  bool x_bcast = false;
};

// Whether the AVX-512 path takes x in the broadcast layout for this shape: chunks must line up with
// every step, i.e. each scale group starts on a 4-word boundary, and a group's scaled lane sums
// (codes up to 2 << 6, see w2a8_avx512.cpp) must fit int32: 65536 words = 1M weights per group.
bool bcast_layout_fits(int NG, int GW);
// Transposes the int32 lanes of each 64-byte chunk of x[0, bytes) in place as 4x4 matrices
// (bytes % 64 == 0). Both are defined in linear_run.cpp, which sets W2A8Args::x_bcast.
void to_bcast_layout(int8_t* x, int64_t bytes);
// The AVX2 path's: each scale group starts on a 2-word step; lanes of each 32-byte chunk transposed as
// 2x4 (bytes % 32 == 0). Also in linear_run.cpp.
bool pair_layout_fits(int NG, int GW);
void to_pair_layout(int8_t* x, int64_t bytes);

// Each computes output rows [n0, n1) for all M tokens of the chunk.
void rows_scalar(const W2A8Args& a, int n0, int n1);
void rows_avx2(const W2A8Args& a, int n0, int n1);
void rows_avx512(const W2A8Args& a, int n0, int n1);

}  // namespace bitmtp_cpu
