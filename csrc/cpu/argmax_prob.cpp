// Each logits row's argmax and softmax probability on the extension's thread team (see argmax_prob.h
// for the definition and why). The baseline unit: the SSE2 chunk body, the split into chunks over the
// team and the merge of a row's chunks in order.
//
// Reference: bitmtp.ops.reference.argmax_prob_reference
// Test: tests/ops/test_argmax_prob.py
#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "pool.h"

#include "argmax_prob.h"

namespace bitmtp_cpu {

#define ARGMAX_VEC_BYTES 16  // the native vector of the x86-64 baseline: SSE2 xmm
#define ARGMAX_CHUNK_FN argmax_chunk_scalar
#include "argmax_prob_body.inc"
#undef ARGMAX_CHUNK_FN
#undef ARGMAX_VEC_BYTES

namespace {

using ChunkFn = void (*)(const float*, int64_t, ArgmaxChunk*);

// e^x of one value through the vector exponential (lane 0 of a broadcast): the bits of every lane
float exp1(float x) { return vec_exp(vfn{} + x)[0]; }

void merge_row(const ArgmaxChunk* parts, int64_t chunks, int64_t* tok, float* prob) {
  for (int64_t c = 0; c < chunks; ++c)
    if (parts[c].has_nan) {
      *tok = c * kArgmaxChunk + parts[c].first;
      *prob = __builtin_nanf("");
      return;
    }
  int64_t best = 0;
  for (int64_t c = 1; c < chunks; ++c)
    if (parts[c].max > parts[best].max) best = c;  // strictly: the first chunk holding the max wins
  const float m = parts[best].max;
  *tok = best * kArgmaxChunk + parts[best].first;
  if (m == -__builtin_inff()) {  // every value -inf: softmax is undefined (NaN, as torch's)
    *prob = __builtin_nanf("");
    return;
  }
  float T = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    if (parts[c].max == -__builtin_inff()) continue;  // weight exactly 0
    T += parts[c].total * exp1(parts[c].max - m);
  }
  *prob = 1.f / T;  // +inf in the row: T is NaN (inf - inf), and so is prob
}

}  // namespace

void argmax_prob(const ArgmaxProbArgs& a) {
  if (a.M <= 0) return;
  const ChunkFn fn = a.isa >= 2 ? argmax_chunk_avx512 : a.isa == 1 ? argmax_chunk_avx2 : argmax_chunk_scalar;
  const int64_t chunks = (a.V + kArgmaxChunk - 1) / kArgmaxChunk;
  const int64_t items = a.M * chunks;
  std::vector<ArgmaxChunk> parts(static_cast<size_t>(items));
  auto body = [&](int t, int nt) {
    const int64_t lo = items * t / nt, hi = items * (t + 1) / nt;
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t r = i / chunks, c = i % chunks;
      const int64_t start = c * kArgmaxChunk;
      const int64_t n = a.V - start < kArgmaxChunk ? a.V - start : kArgmaxChunk;
      fn(a.logits + r * a.V + start, n, &parts[static_cast<size_t>(i)]);
    }
  };
  const int threads = a.threads < 1 ? 1 : (a.threads > items ? static_cast<int>(items) : a.threads);
  if (threads == 1)
    body(0, 1);
  else
    parallel_for_threads(threads, body);
  for (int64_t r = 0; r < a.M; ++r) merge_row(parts.data() + r * chunks, chunks, a.tok + r, a.prob + r);
}

}  // namespace bitmtp_cpu
