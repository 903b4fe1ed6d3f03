// Building blocks of the fused transposed-layout tile kernels for AVX-512
// (micro.h TileArgs): S^T = K Q^T (or dP^T = V dO^T) is computed one register
// block (6 keys x 64 queries) at a time and handed, still in registers, to an
// epilogue that does the softmax work (or, StoredBlocks, the products are
// loaded from memory where tile GEMMs left them). The forward's epilogues
// live in micro/fused_avx512.cc, the backward's in micro/fused_bwd_avx512.h
// (instantiated by micro/fused_bwd_avx512.cc and, for stored products,
// micro/fused_bwd_stored_avx512.cc): separate files, so that the hundreds of
// unrolled block instantiations compile on two cores at once. Include only
// from AVX-512 translation units.
#ifndef RINGSPLASH_KERNELS_MICRO_FUSED_AVX512_H_
#define RINGSPLASH_KERNELS_MICRO_FUSED_AVX512_H_

#include <immintrin.h>

#include <cstdint>
#include <limits>

#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/common_avx512.h"
#include "src/kernels/micro/math_avx512.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro::avx512 {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();
using poly::kLog2e;

inline __mmask16 LaneMask(int64_t lanes) {
  return lanes >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << lanes) - 1u);
}

// Allowed lanes of key j for the 16 queries from i0 (a multiple of 16).
inline __mmask16 Allowed16(const TileArgs& t, int64_t j, int64_t i0) {
  return t.mask[j * t.ldm + i0 / 16];
}

// The exact step's shift for the new running max m_new of a strip: m_new,
// or 0 for a query with nothing allowed yet (m_new = -inf), whose P and
// alpha are then exp(-inf) = 0.
inline __m512 ExactShift(__m512 m_new) {
  const __mmask16 none = _mm512_cmp_ps_mask(m_new, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ);
  return _mm512_mask_blend_ps(none, m_new, _mm512_setzero_ps());
}

// The exact step's state update of the 16-query strip at i0 (SoftmaxColumnsFn),
// for its live lanes, from the old max, the new one and the strip's sums of P:
// alpha = exp(old_max - shift), row_sum = alpha row_sum + sum, row_max = m_new.
// Shared by the f32 exact step and the bf16 one, so both update alike.
inline void CommitExactStrip(int64_t i0, __mmask16 live, __m512 old_max, __m512 m_new, __m512 sum,
                             float* row_max, float* row_sum, float* alpha) {
  const __m512 a = Exp512(_mm512_sub_ps(old_max, ExactShift(m_new)));
  _mm512_mask_storeu_ps(alpha + i0, live, a);
  const __m512 l = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(live, row_sum + i0), sum);
  _mm512_mask_storeu_ps(row_sum + i0, live, l);
  _mm512_mask_storeu_ps(row_max + i0, live, m_new);
}

// Walks C[rows x mp] in register blocks (6 rows x 64 lanes, then narrower),
// has produce(acc, j0, first) fill each block (rows j0.., lanes first..) and
// hands it to epi.Apply(acc, j0, first) instead of storing it. With mask
// bits, only the span of 16-lane vectors of a block that holds an allowed
// pair is produced; the vectors outside it are handed to epi.Zero (outputs
// 0) — this is what keeps the diagonal of causal masks and the edges of
// sliding windows from costing full tiles.
template <class Produce, class Epilogue>
void BlockWalk(int64_t rows, int64_t mp, const uint16_t* bits, int64_t ldm, Epilogue& epi,
               Produce&& produce) {
  auto panel = [&]<int MR, int NV>(int64_t i0) {
    ForEachRowBlock<MR>(rows, [&](int64_t j0, auto r) {
      constexpr int R = decltype(r)::value;
      int v_lo = 0, v_hi = NV;
      if (bits != nullptr) {
        unsigned live = 0;
        RINGSPLASH_UNROLL
        for (int row = 0; row < R; ++row) {
          const uint16_t* w = bits + (j0 + row) * ldm + i0 / 16;
          RINGSPLASH_UNROLL
          for (int v = 0; v < NV; ++v) live |= w[v] != 0 ? 1u << v : 0u;
        }
        if (live == 0) {
          epi.Zero(j0, R, i0, NV);
          return;
        }
        v_lo = __builtin_ctz(live);
        v_hi = 32 - __builtin_clz(live);
        if (v_lo > 0) epi.Zero(j0, R, i0, v_lo);
        if (v_hi < NV) epi.Zero(j0, R, i0 + 16 * v_hi, NV - v_hi);
      }
      const int64_t first = i0 + 16 * v_lo;
      WithCount<NV>(v_hi - v_lo, [&](auto c) {
        constexpr int C = decltype(c)::value;
        __m512 acc[R][C];
        produce(acc, j0, first);
        epi.template Apply<R, C>(acc, j0, first);
      });
    });
  };
  int64_t i = 0;
  for (; i + 64 <= mp; i += 64) panel.template operator()<6, 4>(i);
  for (; i + 32 <= mp; i += 32) panel.template operator()<8, 2>(i);
  for (; i + 16 <= mp; i += 16) panel.template operator()<8, 1>(i);
}

// BlockWalk over the products C = A[rows x k] B[k x mp] (A row-major with
// leading dimension lda, B with ldb), computed block by block in registers.
template <class Epilogue>
void Blocks(int64_t rows, int64_t mp, int64_t k, const float* a, int64_t lda, const float* b,
            int64_t ldb, const uint16_t* bits, int64_t ldm, Epilogue& epi) {
  BlockWalk(rows, mp, bits, ldm, epi,
            [&]<int R, int C>(__m512(&acc)[R][C], int64_t j0, int64_t first) {
              ZeroBlock(acc);
              MultiplyBlock<R, C, ALayout::kRowMajor>(k, a + j0 * lda, lda, 1, b + first, ldb, acc);
            });
}

// BlockWalk over products already stored in c (ldc): what a bf16 GEMM
// (GemmBf16Fn: vdpbf16ps, AMX tiles) leaves for the same epilogues. An epilogue may
// overwrite the block it was handed (it has been loaded).
template <class Epilogue>
void StoredBlocks(int64_t rows, int64_t mp, const float* c, int64_t ldc, const uint16_t* bits,
                  int64_t ldm, Epilogue& epi) {
  BlockWalk(rows, mp, bits, ldm, epi,
            [&]<int R, int C>(__m512(&acc)[R][C], int64_t j0, int64_t first) {
              RINGSPLASH_UNROLL
              for (int r = 0; r < R; ++r) {
                RINGSPLASH_UNROLL
                for (int v = 0; v < C; ++v) {
                  acc[r][v] = _mm512_loadu_ps(c + (j0 + r) * ldc + first + 16 * v);
                }
              }
            });
}

// Stores zeros over rows [j0, j0 + rows) x `vectors` vectors from lane i0.
inline void ZeroVectors(float* out, int64_t ld, int64_t j0, int rows, int64_t i0, int vectors) {
  for (int r = 0; r < rows; ++r) {
    for (int v = 0; v < vectors; ++v) {
      _mm512_storeu_ps(out + (j0 + r) * ld + i0 + 16 * v, _mm512_setzero_ps());
    }
  }
}

// Shifted base-2 exponent x * log2 e - shift2 of a raw product: one FMA
// without a soft cap; with one, tanh(s * scale / cap) is also returned in
// *th (the backward needs 1 - th^2).
template <bool kCapped>
struct ExponentOp {
  __m512 c2;       // scale * log2 e                 (no cap)
  __m512 in, out;  // scale / cap and cap * log2 e  (cap)
  explicit ExponentOp(const TileArgs& t)
      : c2(_mm512_set1_ps(t.scale * kLog2e)),
        in(_mm512_set1_ps(kCapped ? t.scale / t.softcap : 0.0f)),
        out(_mm512_set1_ps(t.softcap * kLog2e)) {}
  RINGSPLASH_INLINE __m512 operator()(__m512 s, __m512 shift2, __m512* th) const {
    if constexpr (kCapped) {
      *th = Tanh512(_mm512_mul_ps(s, in));
      return _mm512_fmsub_ps(*th, out, shift2);
    } else {
      (void)th;
      return _mm512_fmsub_ps(s, c2, shift2);
    }
  }
};

}  // namespace ringsplash::kernels::micro::avx512

#endif  // RINGSPLASH_KERNELS_MICRO_FUSED_AVX512_H_
