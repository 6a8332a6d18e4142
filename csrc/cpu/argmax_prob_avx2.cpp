// argmax_prob, avx2 path (argmax_prob_body.inc). Called only after CPUID confirms the ISA.
//
// Reference: bitmtp.ops.reference.argmax_prob_reference
// Test: tests/ops/test_argmax_prob.py
#pragma GCC target("avx2")
#include <stdint.h>

#include "argmax_prob.h"

namespace bitmtp_cpu {

#define ARGMAX_VEC_BYTES 32  // the native vector
#define ARGMAX_CHUNK_FN argmax_chunk_avx2
#include "argmax_prob_body.inc"
#undef ARGMAX_CHUNK_FN
#undef ARGMAX_VEC_BYTES

}  // namespace bitmtp_cpu
