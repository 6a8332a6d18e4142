// Row-deterministic attention for CPU steps.
//
// Why: bitmtp's exactness invariants (speculative output == AR greedy output; KV rows equal a
// fresh prefill) need every row's result to be independent of the step's width M and of the
// segment length L it ran in. BLAS-backed matmuls change their summation order with the shapes,
// and in ternary models a 1-ulp difference can flip an int8 activation rounding downstream. Here
// each (row, head) is computed alone (attention_body.inc), visiting only the KV rows its mask
// allows, in increasing order, with a fixed 16-way partial-sum dot product: the result depends on
// the row's own inputs only, and is the same on every ISA path (vectors change only how many lanes
// run at once). The AVX2 / AVX-512 units run the same loop wider: SmolLM2's 8-row step (9 heads,
// ~70 KV rows) went from 0.24 to 0.17 ms per layer on the AVX-512 path.
//
// Reference: bitmtp.ops.reference.attention_reference
// Test: tests/ops/test_attention.py, tests/runtime/test_masked_rows.py
#include <math.h>
#include <stdint.h>

#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "attention.h"

namespace bitmtp_cpu {

#define ATTN_ROWS attention_rows_scalar
#include "attention_body.inc"
#undef ATTN_ROWS

void attention_rows(const AttentionArgs& a) {
  const int threads = a.threads > 0 ? a.threads : 1;
  std::vector<float> scratch_f(static_cast<size_t>(threads) * (a.L + a.D));
  std::vector<int> scratch_i(static_cast<size_t>(threads) * a.L);
  if (a.isa >= 2)
    attention_rows_avx512(a, scratch_f.data(), scratch_i.data());
  else if (a.isa == 1)
    attention_rows_avx2(a, scratch_f.data(), scratch_i.data());
  else
    attention_rows_scalar(a, scratch_f.data(), scratch_i.data());
}

}  // namespace bitmtp_cpu
