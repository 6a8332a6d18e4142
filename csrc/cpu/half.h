// float32 -> float16 rounding shared by the fused layers' K/V writes (layers.cpp) and its test hook: the
// rounding of torch's .to(torch.float16) (nearest even) that the per-op path's KVStore.write applies.
//
// Reference: bitmtp.runtime.kv.KVStore.write
// Test: tests/ops/test_attention_depth.py (every rounding boundary, subnormals, overflow, NaN)
#pragma once

#include <stdint.h>

#include <cstring>

namespace bitmtp_cpu {

// float32 -> IEEE binary16 bits, rounded to nearest even (the rounding torch's .to(float16) does, so
// the fused path stores exactly the K/V halves the per-op path's KVStore.write stores): overflow to
// Inf, NaN stays a (quiet) NaN, results below 2^-14 become subnormals. After F. Giesen's
// float_to_half_fast3_rtne.
inline uint16_t f32_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint32_t o;
  if (u >= (127u + 16u) << 23) {  // |f| >= 65536 (or Inf/NaN): all exponent bits set
    o = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (u < 113u << 23) {  // the half is subnormal or zero: let float addition round the bits
    const uint32_t magic_u = 126u << 23;  // 0.5f: its ulp is the half subnormals' step, 2^-24
    float magic, v;
    std::memcpy(&magic, &magic_u, sizeof magic);
    std::memcpy(&v, &u, sizeof v);
    v += magic;
    std::memcpy(&o, &v, sizeof o);
    o -= magic_u;
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += (static_cast<uint32_t>(15 - 127) << 23) + 0xfffu + mant_odd;  // rebias, round half to even
    o = u >> 13;
  }
  return static_cast<uint16_t>(o | (sign >> 16));
}

}  // namespace bitmtp_cpu
