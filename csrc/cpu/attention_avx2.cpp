// Attention, avx2 path (attention_body.inc). Called only after CPUID confirms the ISA.
//
// Reference: bitmtp.ops.reference.attention_reference
// Test: tests/ops/test_attention.py, tests/runtime/test_masked_rows.py
#pragma GCC target("avx2,fma")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pool.h"

#include "attention.h"

namespace bitmtp_cpu {

#define ATTN_VEC_BYTES 32  // the native vector: ymm
#define ATTN_ROWS attention_rows_avx2
#include "attention_body.inc"
#undef ATTN_ROWS
#undef ATTN_VEC_BYTES

}  // namespace bitmtp_cpu
