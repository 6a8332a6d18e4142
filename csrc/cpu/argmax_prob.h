// Each logits row's argmax and its softmax probability, for choosing greedy tokens on CPU steps.
//
// Why: the step's epilogue was torch.softmax(logits).max(-1); at a 49152-token vocabulary torch runs
// those ops as OpenMP regions, whose workers then spin for a while on the same two cores the
// extension's own team (pool.h) needs for the next step: a SmolLM2 width-1 step went 8.4 -> 11.6 ms.
// Here they run on the extension's team.
//
// Definition, per row x[0..V): tok = the index of the first NaN if x holds one (prob = NaN), else the
// first index of the max m (the first of equal maxima, as torch.max); prob = 1 / T with
// T = sum_l e^(x_l - m). The row is cut into chunks of kArgmaxChunk values at fixed offsets; chunk c
// gives its max m_c and t_c = sum e^(x_l - m_c) in 16 lanes (lane i sums l = i, i + 16, ... of the
// chunk in increasing l from 0.f, the lanes then added in order to 0.f; vec_exp.inc's exponential);
// then T = sum over c in increasing order of t_c * e^(m_c - m) from 0.f, skipping chunks whose max is
// -inf. A row of -inf only, or holding +inf, has prob NaN (as torch's softmax). The bits depend only
// on the row: not on the ISA path, the thread count or the number of rows.
//
// Reference: bitmtp.ops.reference.argmax_prob_reference (float64 probabilities; tokens exactly)
// Test: tests/ops/test_argmax_prob.py
#pragma once

#include <stdint.h>

namespace bitmtp_cpu {

constexpr int64_t kArgmaxChunk = 4096;  // values per chunk: a thread's unit of work (16 KiB, in L1/L2)

// One chunk's summary: its max (NaN if it holds a NaN), the offset of its first max (or of its first
// NaN), and t_c (0 when its max is -inf).
struct ArgmaxChunk {
  float max;
  float total;
  int64_t first;
  int has_nan;
};

struct ArgmaxProbArgs {
  const float* logits;  // [M][V], rows contiguous
  int64_t M, V;
  int64_t* tok;         // [M]
  float* prob;          // [M]
  int threads;
  int isa;              // 0 scalar (baseline), 1 AVX2, 2 AVX-512: the same bits
};

void argmax_prob(const ArgmaxProbArgs& a);
void argmax_chunk_scalar(const float* x, int64_t n, ArgmaxChunk* out);
void argmax_chunk_avx2(const float* x, int64_t n, ArgmaxChunk* out);
void argmax_chunk_avx512(const float* x, int64_t n, ArgmaxChunk* out);

}  // namespace bitmtp_cpu
