// AVX-512 VNNI path. Compiled for this ISA by the pragma below (never -march=native): the module
// only calls it after CPUID says avx512f/bw/vl/dq/vnni are present.
//
// One step covers 4 T2 words = 64 weights: the 4 words are broadcast to 16 lanes (lane 4j+s holds
// word j), shifted right by 2s and masked with 0x03030303, which yields the codes of k = 16j+4s ..
// 16j+4s+3 in lane 4j+s — exactly the int32 lane of a plain 64-byte activation load — and one
// vpdpbusd per token accumulates sum(c * x). Blocking over rows and tokens: w2a8_block.inc.
//
// Reference: bitmtp.ops.reference.w2a8_accumulate_reference, bitmtp.ops.reference.w2a8_linear_q_reference
// Test: tests/ops/backends/test_cpu_kernels.py
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")
#include <immintrin.h>

#include "w2a8_cpu.h"

namespace bitmtp_cpu {
namespace {

struct Isa {
  using Acc = __m512i;
  static constexpr int kStepWords = 4;
  static constexpr int kPartialSteps = 0;  // vpdpbusd accumulates int32 in one op
  static constexpr int kFaccLanes = 8;
  // 32 zmm: R*M <= 24 accumulators + R codes + 1 activation + 1 mask (3 decode constants on the
  // plain-layout path). R = 3 rather than 2 at M = 5..8: 11 loads per 24 vpdpbusd instead of 10 per
  // 16 and a third fewer block epilogues (M = 8: 1.35x -> 1.40x over the previous kernel).
  static constexpr int rows_for(int m) { return m <= 2 ? 8 : (m <= 4 ? 4 : 3); }

  // Into L2, not L1: the next row block (R rows, 13.8 KB at K = 6912, M = 1) is prefetched while this one
  // runs, and prefetches to L1 compete with the block's own loads for L1 fill buffers. M = 1 from memory,
  // BitNet-2B shapes, 2 threads, Intel Xeon 2-vCPU host (480 MiB L3), separate processes alternated:
  // 19.6 -> 22.6 GB/s (2560x6912) and 18.6 -> 23.2 GB/s (6912x2560); cache-resident M = 1 and M = 4, 8
  // unchanged within noise. (A prefetch two blocks ahead, or four interleaved row runs per thread, added
  // nothing on top.) The dense AVX-512 path prefetches into L2 for the same reason (dense_avx512.cpp).
  static inline void prefetch(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }

  static inline Acc zero() { return _mm512_setzero_si512(); }

  static inline Acc decode_full(const uint32_t* wrow, int j) {
    const __m512i bcast = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    const __m512i mask3 = _mm512_set1_epi32(0x03030303);
    const __m128i w4 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + j));
    return _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(bcast, _mm512_castsi128_si512(w4)), shifts),
                              mask3);
  }

  // Broadcast layout (W2A8Args::x_bcast): the 4 words go to every 128-bit chunk with one
  // vbroadcasti32x4 from memory (a load-port op) and chunk s keeps bits 2s, 2s+1 of each byte by a
  // mask, without shifting: lane 4s + j holds codes << 2s of k = 16j + 4s .. + 3, which x's transposed
  // chunks line up with. The codes (<= 2 << 6 = 128) stay valid u8 operands of vpdpbusd, and every
  // product in chunk s is a multiple of 4^s, so unscale's arithmetic shift is exact. Decode drops
  // from a permute, a shift and an and (two of them on the vector ALU ports that vpdpbusd needs)
  // to one and. Measured with the in-place dot below and R = 3 at M = 5..8 (30 BitNet-2B layers of
  // W2A8, one thread, AMD EPYC Zen 4, alternated with the previous kernel in one run): M = 8 306 ->
  // 207 ms (1.40x; the broadcast decode alone 1.10x, plus the in-place dot 1.35x), M = 16 1.42x,
  // M = 4 1.27x, M = 1 unchanged within noise (memory-bound).
  static constexpr bool kBcast = true;

  static inline __m512i bcast_masks() {
    return _mm512_setr_epi32(0x03030303, 0x03030303, 0x03030303, 0x03030303, 0x0C0C0C0C, 0x0C0C0C0C, 0x0C0C0C0C,
                             0x0C0C0C0C, 0x30303030, 0x30303030, 0x30303030, 0x30303030, static_cast<int>(0xC0C0C0C0),
                             static_cast<int>(0xC0C0C0C0), static_cast<int>(0xC0C0C0C0), static_cast<int>(0xC0C0C0C0));
  }

  static inline Acc decode_bcast(const uint32_t* wrow, int j) {
    return _mm512_and_si512(_mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wrow + j))),
                            bcast_masks());
  }

  static inline Acc decode_bcast_tail(const uint32_t* wrow, int j, int count) {
    // Absent words load as 0: their lanes get code 0.
    const __m128i w4 = _mm_maskz_loadu_epi32(static_cast<__mmask8>((1u << count) - 1u), wrow + j);
    return _mm512_and_si512(_mm512_broadcast_i32x4(w4), bcast_masks());
  }

  static inline Acc unscale(Acc acc) {
    return _mm512_srav_epi32(acc, _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6));
  }

  // Lane 4j + s <- lane 4s + j: the transpose back to decode_full's order.
  static inline Acc unswizzle(Acc acc) {
    return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), acc);
  }

  // sums[i] = sum of the lanes of v[i], i < N <= 32: transposing trees of 16 (45 ops for 16 vectors, vs
  // ~9 per vector for separate reductions). Integer adds, so the order does not matter.
  template <int N>
  static inline void reduce_many(const Acc* v, int32_t* sums) {
    static_assert(N >= 1 && N <= 32, "reduce_many: 1..32 vectors");
    if constexpr (N > 16) {
      reduce16<16>(v, sums);
      reduce16<N - 16>(v + 16, sums + 16);
    } else {
      reduce16<N>(v, sums);
    }
  }

  template <int N>
  static inline void reduce16(const Acc* v, int32_t* sums) {
    Acc x[16], t[8], u[4];
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) x[i] = i < N ? v[i] : _mm512_setzero_si512();
    // chunks of t[i]: [x2i, x2i, x2i+1, x2i+1] (two partials each)
    _Pragma("GCC unroll 8") for (int i = 0; i < 8; ++i) t[i] = _mm512_add_epi32(
        _mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_i32x4(x[2 * i], x[2 * i + 1], 0xEE));
    // chunks of u[i]: [x4i, x4i+1, x4i+2, x4i+3]
    _Pragma("GCC unroll 4") for (int i = 0; i < 4; ++i) u[i] = _mm512_add_epi32(
        _mm512_shuffle_i32x4(t[2 * i], t[2 * i + 1], 0x88), _mm512_shuffle_i32x4(t[2 * i], t[2 * i + 1], 0xDD));
    const __m512i v0 = _mm512_add_epi32(_mm512_unpacklo_epi32(u[0], u[1]), _mm512_unpackhi_epi32(u[0], u[1]));
    const __m512i v1 = _mm512_add_epi32(_mm512_unpacklo_epi32(u[2], u[3]), _mm512_unpackhi_epi32(u[2], u[3]));
    // lane 4c + i of w: the sum of x[4i + c]
    const __m512i w = _mm512_add_epi32(_mm512_unpacklo_epi64(v0, v1), _mm512_unpackhi_epi64(v0, v1));
    alignas(64) int32_t lanes[16];
    _mm512_store_si512(lanes, w);
    _Pragma("GCC unroll 16") for (int k = 0; k < N; ++k) sums[k] = lanes[4 * (k % 4) + k / 4];
  }

  static inline Acc decode_tail(const uint32_t* wrow, int j, int count) {
    const __m512i bcast = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6);
    const __m512i mask3 = _mm512_set1_epi32(0x03030303);
    // Group or row tail: never read past the row; lanes of absent words get code 0.
    const __m128i w4 = _mm_maskz_loadu_epi32(static_cast<__mmask8>((1u << count) - 1u), wrow + j);
    return _mm512_maskz_and_epi32(static_cast<__mmask16>((1u << (4 * count)) - 1u),
                                  _mm512_srlv_epi32(_mm512_permutexvar_epi32(bcast, _mm512_castsi128_si512(w4)), shifts),
                                  mask3);
  }

  // Rows are zero-padded. The empty asm pins the load in a register: otherwise GCC folds it into
  // every vpdpbusd as a memory operand and loads it once per row instead of once per step, which
  // made the kernel load-port bound (M = 8: 757 -> see docs/ARCHITECTURE.md for the measurement).
  static inline Acc load_x(const int8_t* p) {
    Acc v = _mm512_loadu_si512(p);
    __asm__("" : "+v"(v));
    return v;
  }

  // vpdpbusd in place through asm: with the intrinsic GCC 12 copied every accumulator through a
  // fresh register each step (2 moves per dot at M = 8) and spilled two of the 16 to the stack.
  static inline Acc dot(Acc acc, Acc codes, Acc x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(codes), "v"(x));
    return acc;
  }

  static inline int32_t reduce(Acc acc) { return _mm512_reduce_add_epi32(acc); }

  // Many groups: fold -sum(x) into lane 0 (exact), add the two 8-lane halves (exact int32) and
  // scale the 8 partials in double; far cheaper per group than a full reduction.
  static inline void fold_scale(Acc acc, int32_t xsum, double scale, double* lanes) {
    const __m512i fixed = _mm512_mask_sub_epi32(acc, 1, acc, _mm512_set1_epi32(xsum));
    const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(fixed), _mm512_extracti64x4_epi64(fixed, 1));
    __m512d f = _mm512_loadu_pd(lanes);
    f = _mm512_fmadd_pd(_mm512_cvtepi32_pd(half), _mm512_set1_pd(scale), f);
    _mm512_storeu_pd(lanes, f);
  }
};

#include "w2a8_block.inc"

}  // namespace

void rows_avx512(const W2A8Args& a, int n0, int n1) { rows_blocked(a, n0, n1); }

}  // namespace bitmtp_cpu
