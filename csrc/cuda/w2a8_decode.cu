// W2A8 decode kernel: widths M = 1..16 (one instantiation per M -- "M1", width specialization).
//
// Layout. A block is 4 warps (128 threads); each warp owns R consecutive output rows (R = 4 for
// M <= 4 -- 2 when N is too small for two blocks per SM -- else 2: enough rows to reuse every
// activation load R times, few enough to keep the RxM accumulators in registers). All 32 lanes of a warp split K. K is swept in chunks of 128 T2 words
// (2048 weights):
//
//   * the block stages the chunk's activations of all M tokens in shared memory (zero-filled past
//     K, so the K tail and any x_q alignment are handled once, here, and never again);
//   * every lane loads its packed words of the chunk for its R rows -- with VEC = 4 one 128-bit
//     load per row (lane l owns words 4l .. 4l+3 of the chunk), with VEC = 1 four coalesced 32-bit
//     loads (lane l owns words l, l+32, l+64, l+96) when rows are not 16-byte aligned -- and
//     prefetches the next chunk's words before the barrier so the loads overlap the compute;
//   * each word is decoded once in registers into four code/weight registers and applied to all M
//     tokens with __dp4a (4 dp4a per word, token and row).
//
// Exact groups. A "unit" is the VEC words one lane takes in one step (a step = 32 units, one per
// lane). A scale group of V units is reduced exactly, in int32, over a segment of `seg` lanes with
// xor shuffles, and only then scaled -- so the int32 accumulators (and the fp32 epilogue) never see a
// float partial sum of part of a group. The host (cuda_backend.py) picks:
//   * one group (per-tensor / per-row scales): seg = 32, flush once after the last step;
//   * V <= 32, V a power of two (e.g. G = 128 with VEC = 4: V = 2): seg = V, flush every step --
//     each step covers 32 / V whole groups, each on an aligned run of V lanes;
//   * V a multiple of 32: seg = 32, flush every V / 32 steps.
// Other group sizes go to the tiled kernel. The last group may be partial: lanes past the row's
// end contribute zeros (their words load as 0 and their activations are staged as 0).
//
// The -sum(x) fold: with few tokens (M < 2R) codes stay unsigned {0,1,2} and each lane keeps
// sum(x) per token (4 dp4a per word per token, shared by the R rows), subtracted before the group
// reduction; with more tokens it is cheaper to turn codes into signed weights once per word
// (t2_signed, shared by the M tokens). Both give exactly sum(c*x) - sum(x).
//
// Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
// Test: tests/ops/backends/test_cuda_kernels.py
#include "w2a8_common.cuh"

#define DEC_WARPS 4
#define DEC_THREADS (32 * DEC_WARPS)
#define DEC_CHUNK_WORDS 128  // one chunk = 32 lanes x 4 words; activations: M x 2 KiB of shared memory

// Shared-memory slot of activation word q (0..127) of a chunk. With VEC = 4, lane l reads words
// 4l + i: unswizzled, the 8 lanes of a quarter-warp (one LDS.128 phase) would hit 2 distinct 16-byte
// bank groups; xoring bits 3..4 of q into bits 0..1 spreads them over all 8. The VEC = 1 pattern
// (lane l reads word 32t + l) stays conflict-free: within a quarter-warp the xor term is constant.
__device__ __forceinline__ int dec_slot(int q) { return q ^ ((q >> 3) & 3); }

template <int M, int R, int VEC>
__global__ void __launch_bounds__(DEC_THREADS, 1) w2a8_decode_kernel(
    const i8* __restrict__ x,            // int8 [M, K], row-major
    const float* __restrict__ act_scale,  // float32 [M] (WRITE_OUT only)
    const u32* __restrict__ w,            // T2 words [N, KW]
    const float* __restrict__ scales,     // float32 [1 or N, NG] (WRITE_OUT only)
    const float* __restrict__ bias,       // float32 [N] (HAS_BIAS only)
    void* __restrict__ out,               // float32 or bf16 [M, N] (WRITE_OUT only)
    int* __restrict__ acc_out,            // int32 [M, N, NG] (WRITE_ACC only)
    int N, int K, int KW, int NG,
    int U,            // units per row: KW / VEC
    int V,            // units per scale group (NG > 1)
    int seg,          // lanes per group-reduction segment: a power of two, 1..32
    int flush_every,  // steps between group flushes (huge when NG == 1)
    int stride_sn,    // 0 when the scales are shared by all rows, else NG
    int flags) {
  static_assert(M >= 1 && M <= 16, "decode widths are 1..16");
  static_assert(R >= 1 && R <= 4, "rows per warp are 1..4");
  static_assert(VEC == 1 || VEC == 4, "VEC is 1 (32-bit loads) or 4 (128-bit loads)");
  constexpr bool kXsum = M < 2 * R;  // unsigned codes + sum(x), else signed weights (see above)

  __shared__ int4 xs[M * DEC_CHUNK_WORDS];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * DEC_WARPS + warp) * R;
  const bool write_acc = (flags & W2A8_WRITE_ACC) != 0;
  const bool write_out = (flags & W2A8_WRITE_OUT) != 0;
  const int nchunks = (KW + DEC_CHUNK_WORDS - 1) / DEC_CHUNK_WORDS;
  const int nsteps = (U + 31) >> 5;

  // Rows past N (last block) are clamped for loading and never written: no divergence around the
  // barriers and shuffles below, which every thread of the block must reach.
  const u32* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wrow[r] = w + (i64)min(row0 + r, N - 1) * KW;

  int acc[R][M];
  float y[R][M];
  int xsum[M];
#pragma unroll
  for (int m = 0; m < M; ++m) {
    xsum[m] = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[r][m] = 0;
      y[r][m] = 0.0f;
    }
  }

  // This lane's packed words of chunk c for every row; zero past the end of the row.
  auto load_chunk = [&](u32 (&dst)[R][4], int c) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (VEC == 4) {
        const int u = c * 32 + lane;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (u < U) v = __ldg(reinterpret_cast<const uint4*>(wrow[r]) + u);
        dst[r][0] = v.x;
        dst[r][1] = v.y;
        dst[r][2] = v.z;
        dst[r][3] = v.w;
      } else {
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const int j = c * DEC_CHUNK_WORDS + 32 * t + lane;
          dst[r][t] = j < KW ? __ldg(wrow[r] + j) : 0u;
        }
      }
    }
  };

  // One word per row (wd[r]) against activation slot `slot` of the chunk, for all M tokens.
  auto apply_word = [&](const u32 (&wd)[R], int slot) {
    int cd[R][4];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const u32 c = t2_codes(wd[r], s);
        cd[r][s] = kXsum ? (int)c : t2_signed(c);
      }
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const int4 xv = xs[m * DEC_CHUNK_WORDS + slot];
      if (kXsum) {
        xsum[m] = __dp4a(xv.x, 0x01010101, xsum[m]);
        xsum[m] = __dp4a(xv.y, 0x01010101, xsum[m]);
        xsum[m] = __dp4a(xv.z, 0x01010101, xsum[m]);
        xsum[m] = __dp4a(xv.w, 0x01010101, xsum[m]);
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[r][m] = __dp4a(cd[r][0], xv.x, acc[r][m]);
        acc[r][m] = __dp4a(cd[r][1], xv.y, acc[r][m]);
        acc[r][m] = __dp4a(cd[r][2], xv.z, acc[r][m]);
        acc[r][m] = __dp4a(cd[r][3], xv.w, acc[r][m]);
      }
    }
  };

  // After step s: if a group boundary falls here, reduce the group's accumulators exactly over each
  // segment, let the segment leader write / scale them, and start the next group from zero.
  auto end_step = [&](int s) {
    if ((s + 1) % flush_every != 0 && s != nsteps - 1) return;  // warp-uniform
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (kXsum) {
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] -= xsum[m];
        xsum[m] = 0;
      }
    }
    for (int o = 1; o < seg; o <<= 1) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] += __shfl_xor_sync(W2A8_FULL_MASK, acc[r][m], o);
      }
    }
    const int lead = lane & ~(seg - 1);
    const int unit = s * 32 + lead;  // the segment's first unit: names the group
    if (unit < U) {
      const int g = NG == 1 ? 0 : unit / V;
      // With seg == 32 every lane holds the same sums, so every lane keeps the same y and the final
      // cross-lane float reduction is skipped; otherwise only leaders accumulate y.
      const bool keep_y = write_out && (lane == lead || seg == 32);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int n = row0 + r;
        if (n < N) {
          if (keep_y) {
            const float sc = __ldg(scales + (i64)n * stride_sn + g);
#pragma unroll
            for (int m = 0; m < M; ++m) y[r][m] = fmaf((float)acc[r][m], sc, y[r][m]);
          }
          if (write_acc && lane == lead) {
#pragma unroll
            for (int m = 0; m < M; ++m) acc_out[((i64)m * N + n) * NG + g] = acc[r][m];
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) acc[r][m] = 0;
    }
  };

  u32 wc[R][4];
  u32 wn[R][4];
  load_chunk(wc, 0);
  for (int c = 0; c < nchunks; ++c) {
    if (c + 1 < nchunks) load_chunk(wn, c + 1);  // in flight while this chunk computes

    __syncthreads();  // every warp is done with the previous chunk's activations
    {
      const int j = c * DEC_CHUNK_WORDS + threadIdx.x;  // one activation word per thread and token
#pragma unroll
      for (int m = 0; m < M; ++m) {
        int4 v = make_int4(0, 0, 0, 0);
        if (j < KW) v = load_x16(x + (i64)m * K, j, K, flags);
        xs[m * DEC_CHUNK_WORDS + dec_slot(threadIdx.x)] = v;
      }
    }
    __syncthreads();

    if (VEC == 4) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u32 wd[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wd[r] = wc[r][i];
        apply_word(wd, dec_slot(4 * lane + i));
      }
      end_step(c);  // one step per chunk
    } else {
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int s = 4 * c + t;  // four steps per chunk
        if (s >= nsteps) break;   // warp-uniform
        u32 wd[R];
#pragma unroll
        for (int r = 0; r < R; ++r) wd[r] = wc[r][t];
        apply_word(wd, dec_slot(32 * t + lane));
        end_step(s);
      }
    }

#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int i = 0; i < 4; ++i) wc[r][i] = wn[r][i];
    }
  }

  if (!write_out) return;
  if (seg < 32) {
    // Leaders hold y for their own groups: butterfly-sum them. Float addition is commutative, so
    // every lane ends with the bitwise-same sum (deterministic: graph replays match eager runs).
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int o = 16; o >= 1; o >>= 1) y[r][m] += __shfl_xor_sync(W2A8_FULL_MASK, y[r][m], o);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = row0 + r;
    if (n >= N) continue;
    const float b = (flags & W2A8_HAS_BIAS) ? __ldg(bias + n) : 0.0f;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (lane == ((r * M + m) & 31)) {  // spread the RxM stores over the lanes
        float v = y[r][m] / __ldg(act_scale + m);
        if (flags & W2A8_HAS_BIAS) v += b;
        w2a8_store(out, (i64)m * N + n, v, flags);
      }
    }
  }
}

// nvcc builds (.ci/nvcc_check.sh) instantiate every kernel so ptxas reports registers and spills
// for each; NVRTC (CuPy) instantiates only the one it is asked for through a name expression.
#ifndef __CUDACC_RTC__
#define W2A8_DECODE_INSTANTIATE(M_, R_, VEC_)                                                        \
  template __global__ void w2a8_decode_kernel<M_, R_, VEC_>(                                        \
      const i8* __restrict__, const float* __restrict__, const u32* __restrict__,                   \
      const float* __restrict__, const float* __restrict__, void* __restrict__, int* __restrict__, \
      int, int, int, int, int, int, int, int, int, int);
#define W2A8_DECODE_BOTH(M_, R_) W2A8_DECODE_INSTANTIATE(M_, R_, 1) W2A8_DECODE_INSTANTIATE(M_, R_, 4)
// Rows per warp as cuda_backend.rows_per_warp() chooses them (widths 1..4: 4, or 2 on small N).
W2A8_DECODE_BOTH(1, 4)
W2A8_DECODE_BOTH(2, 4)
W2A8_DECODE_BOTH(3, 4)
W2A8_DECODE_BOTH(4, 4)
W2A8_DECODE_BOTH(1, 2)
W2A8_DECODE_BOTH(2, 2)
W2A8_DECODE_BOTH(3, 2)
W2A8_DECODE_BOTH(4, 2)
W2A8_DECODE_BOTH(5, 2)
W2A8_DECODE_BOTH(6, 2)
W2A8_DECODE_BOTH(7, 2)
W2A8_DECODE_BOTH(8, 2)
W2A8_DECODE_BOTH(9, 2)
W2A8_DECODE_BOTH(10, 2)
W2A8_DECODE_BOTH(11, 2)
W2A8_DECODE_BOTH(12, 2)
W2A8_DECODE_BOTH(13, 2)
W2A8_DECODE_BOTH(14, 2)
W2A8_DECODE_BOTH(15, 2)
W2A8_DECODE_BOTH(16, 2)
#endif
