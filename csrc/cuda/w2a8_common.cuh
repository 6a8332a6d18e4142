// Shared definitions of the CUDA W2A8 kernels (w2a8_decode.cu, w2a8_tiled.cu).
//
// The sources are compiled two ways: by nvcc (`.ci/nvcc_check.sh`, register/spill statistics) and
// at run time by NVRTC through CuPy (`bitmtp/ops/backends/cuda_backend.py`, which pastes this header
// in place of its #include so CuPy's kernel cache sees the whole text). NVRTC has no host standard
// library, so nothing here includes a system header: fixed-width types are our own typedefs and
// bf16 rounding is done on the bit pattern instead of through <cuda_bf16.h>. The sources are kept
// ASCII-only, so no encoding question arises between a file, CuPy and NVRTC.
//
// Contract (bitmtp.ops.reference):
//   acc[m, n, g] = sum_{k in g} (c[n,k] - 1) * x_q[m,k]      (exact int32)
//   y[m, n]      = sum_g acc[m, n, g] * scale[n or 0, g] / act_scale[m] (+ bias[n])
// with T2 codes c in {0, 1, 2}: weight k = 16j + 4s + b sits at bits 8b + 2s of word j, so
// (word >> 2s) & 0x03030303 holds the codes of k = 16j+4s .. 16j+4s+3 in bytes 0..3, lined up with
// the little-endian int32 of x_q[16j+4s .. 16j+4s+3] -- one __dp4a operand pair.
//
// Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
// Test: tests/ops/backends/test_cuda_kernels.py
#ifndef BITMTP_W2A8_COMMON_CUH
#define BITMTP_W2A8_COMMON_CUH

typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

// Run-time switches of both kernels (the `flags` argument). Keep in sync with cuda_backend.py.
#define W2A8_HAS_BIAS 1   // add bias[n] (float32) after the epilogue
#define W2A8_WRITE_ACC 2  // write the exact per-group accumulators int32[M, N, NG]
#define W2A8_WRITE_OUT 4  // write y[M, N] (float32, or bf16 with W2A8_OUT_BF16)
#define W2A8_OUT_BF16 8   // y is stored as bf16, rounded to nearest-even
#define W2A8_X_VEC16 16   // K % 16 == 0 and x_q is 16-byte aligned: activations load as int4

#define W2A8_FULL_MASK 0xffffffffu

// Four code bytes (0, 1, 2) of the weights k = 16j+4s .. 16j+4s+3 of T2 word j.
__device__ __forceinline__ u32 t2_codes(u32 word, int s) { return (word >> (2 * s)) & 0x03030303u; }

// Code bytes c in {0, 1, 2} -> signed weight bytes c - 1 in {-1, 0, 1}. Adding 0x7F to a byte of at
// most 2 never carries into the next byte (0x7F..0x81), and flipping bit 7 maps 0x7F/0x80/0x81 to
// 0xFF/0x00/0x01. Two instructions for four weights, and the -sum(x) fold is then built into dp4a.
__device__ __forceinline__ int t2_signed(u32 codes) { return (int)((codes + 0x7F7F7F7Fu) ^ 0x80808080u); }

// float32 -> bf16 bits, round to nearest even (what torch's .to(torch.bfloat16) does); NaN -> 0x7FC0
// with the sign kept, like c10::BFloat16.
__device__ __forceinline__ u16 f32_to_bf16_rne(float f) {
  u32 bits = __float_as_uint(f);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu) != 0u) {
    return (u16)(((bits >> 16) & 0x8000u) | 0x7FC0u);
  }
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return (u16)(bits >> 16);
}

// Store one output element in the dtype the flags name.
__device__ __forceinline__ void w2a8_store(void* out, i64 idx, float y, int flags) {
  if (flags & W2A8_OUT_BF16) {
    reinterpret_cast<u16*>(out)[idx] = f32_to_bf16_rne(y);
  } else {
    reinterpret_cast<float*>(out)[idx] = y;
  }
}

// The 16 activations x_row[16j .. 16j+16) as four little-endian int32; bytes at k >= k_end read as
// zero and are never loaded (x_q has exactly K columns: reading past K could leave the allocation).
// With W2A8_X_VEC16 the caller guarantees 16j + 16 <= k_end and 16-byte alignment: one int4 load.
__device__ __forceinline__ int4 load_x16(const i8* __restrict__ x_row, int j, int k_end, int flags) {
  if (flags & W2A8_X_VEC16) {
    return __ldg(reinterpret_cast<const int4*>(x_row + 16 * (i64)j));
  }
  int v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 word = 0u;
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const int k = 16 * j + 4 * i + b;
      if (k < k_end) word |= (u32)(u8)__ldg(x_row + k) << (8 * b);
    }
    v[i] = (int)word;
  }
  return make_int4(v[0], v[1], v[2], v[3]);
}

#endif  // BITMTP_W2A8_COMMON_CUH
