// W2A8 tiled kernel: prefill widths M >= 17, and any width whose scale-group size the decode
// kernel's lane segments cannot cover exactly (see w2a8_decode.cu).
//
// Layout. A block computes a 64 (tokens) x 64 (rows) output tile with 256 threads, each owning a
// 4 x 4 sub-tile (tokens ty + 16i, rows tx + 16j) in registers. K is swept group by group, and
// inside a group in tiles of 4 T2 words (64 weights):
//   * activations x_q[64, 64 bytes] and weights -- decoded once per tile into signed bytes c - 1, so
//     the -sum(x) fold is part of the product -- are staged in shared memory, rows padded to 17 int32
//     so the 16 lanes reading 16 different weight rows hit 16 different banks;
//   * each thread runs 16 x 16 __dp4a per tile (4 tokens x 4 rows x 16 packed int32 of K).
// Every thread accumulates all of K for its outputs itself, so groups are exact without any
// cross-thread reduction: at the end of each group the thread scales its int32 sums (and writes
// them when asked) and starts the next group from zero. Tiles are clipped to the group's words and
// activations past the group's end (or past K) are staged as zero, so a partial group or a K that
// is not a multiple of 16 needs nothing else.
//
// Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
// Test: tests/ops/backends/test_cuda_kernels.py
#include "w2a8_common.cuh"

#define TL_BM 64       // tokens per block tile
#define TL_BN 64       // output rows per block tile
#define TL_KW 4        // T2 words per K tile (64 weights)
#define TL_LD 17       // shared-memory row pitch in int32 (16 + 1 against bank conflicts)
#define TL_THREADS 256

__global__ void __launch_bounds__(TL_THREADS) w2a8_tiled_kernel(
    const i8* __restrict__ x,            // int8 [M, K], row-major
    const float* __restrict__ act_scale,  // float32 [M] (WRITE_OUT only)
    const u32* __restrict__ w,            // T2 words [N, KW]
    const float* __restrict__ scales,     // float32 [1 or N, NG] (WRITE_OUT only)
    const float* __restrict__ bias,       // float32 [N] (HAS_BIAS only)
    void* __restrict__ out,               // float32 or bf16 [M, N] (WRITE_OUT only)
    int* __restrict__ acc_out,            // int32 [M, N, NG] (WRITE_ACC only)
    int M, int N, int K, int KW, int NG,
    int GW,          // words per scale group (KW when NG == 1)
    int stride_sn,   // 0 when the scales are shared by all rows, else NG
    int flags) {
  __shared__ int xs[TL_BM * TL_LD];
  __shared__ int ws[TL_BN * TL_LD];

  const int tid = threadIdx.x;
  const int tx = tid & 15;  // output rows n0 + tx + 16j
  const int ty = tid >> 4;  // tokens m0 + ty + 16i
  const int m0 = blockIdx.y * TL_BM;
  const int n0 = blockIdx.x * TL_BN;
  const bool write_acc = (flags & W2A8_WRITE_ACC) != 0;
  const bool write_out = (flags & W2A8_WRITE_OUT) != 0;

  // Staging role: thread (srow, spart) loads word kt + spart of token m0 + srow and of weight row
  // n0 + srow. Out-of-range rows are clamped for the pointer and staged as zero.
  const int srow = tid >> 2;
  const int spart = tid & 3;
  const bool sx_ok = m0 + srow < M;
  const bool sw_ok = n0 + srow < N;
  const i8* x_row = x + (i64)min(m0 + srow, M - 1) * K;
  const u32* w_row = w + (i64)min(n0 + srow, N - 1) * KW;

  int acc[4][4];
  float y[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[i][j] = 0;
      y[i][j] = 0.0f;
    }
  }

  for (int g = 0; g < NG; ++g) {
    const int wlo = g * GW;
    const int whi = min(wlo + GW, KW);
    const int khi = min(16 * whi, K);  // group g ends at min((g+1)*G, K) = min(16*whi, K)
    for (int kt = wlo; kt < whi; kt += TL_KW) {
      const int j = kt + spart;
      int4 xv = make_int4(0, 0, 0, 0);
      if (sx_ok && j < whi) xv = load_x16(x_row, j, khi, flags);
      u32 wd = 0x55555555u;  // all codes 1 (weight 0) where there is no word
      if (sw_ok && j < whi) wd = __ldg(w_row + j);
      int* xd = xs + srow * TL_LD + 4 * spart;
      xd[0] = xv.x;
      xd[1] = xv.y;
      xd[2] = xv.z;
      xd[3] = xv.w;
      int* wdst = ws + srow * TL_LD + 4 * spart;
#pragma unroll
      for (int s = 0; s < 4; ++s) wdst[s] = t2_signed(t2_codes(wd, s));
      __syncthreads();

#pragma unroll
      for (int kk = 0; kk < 4 * TL_KW; ++kk) {
        int a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = xs[(ty + 16 * i) * TL_LD + kk];
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) b[jj] = ws[(tx + 16 * jj) * TL_LD + kk];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
          for (int jj = 0; jj < 4; ++jj) acc[i][jj] = __dp4a(a[i], b[jj], acc[i][jj]);
        }
      }
      __syncthreads();  // the next tile overwrites xs / ws
    }

    // Group g is complete in this thread's registers: exact int32 sums.
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int n = n0 + tx + 16 * jj;
      const float sc = (write_out && n < N) ? __ldg(scales + (i64)n * stride_sn + g) : 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = m0 + ty + 16 * i;
        if (m < M && n < N) {
          if (write_acc) acc_out[((i64)m * N + n) * NG + g] = acc[i][jj];
          if (write_out) y[i][jj] = fmaf((float)acc[i][jj], sc, y[i][jj]);
        }
        acc[i][jj] = 0;
      }
    }
  }

  if (!write_out) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty + 16 * i;
    if (m >= M) continue;
    const float s = __ldg(act_scale + m);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int n = n0 + tx + 16 * jj;
      if (n >= N) continue;
      float v = y[i][jj] / s;
      if (flags & W2A8_HAS_BIAS) v += __ldg(bias + n);
      w2a8_store(out, (i64)m * N + n, v, flags);
    }
  }
}
