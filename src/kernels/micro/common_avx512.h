// Internals shared by the AVX-512 micro-kernel translation units
// (micro/path_avx512.cc, micro/fused_avx512.cc, micro/fused_bwd_avx512.cc,
// micro/path_avx512_bf16.cc): the register-blocked f32 GEMM building blocks and
// the functions one unit puts into another's table. Include only from units
// compiled with AVX-512 flags.
//
// A block is MR rows x NV vectors of 16 columns held in MR * NV zmm
// accumulators (6 x 4 = 24 or 8 x 2 = 16). Per step p the NV vectors of B's
// row p are loaded once and each A(i, p) is broadcast, so a 6 x 4 block does
// 24 FMAs per 4 vector loads + 6 broadcasts. Callers choose what happens to
// the accumulators afterwards (plain store, or a fused softmax epilogue), so
// the products of every kernel share one inner loop and one rounding order.
#ifndef RINGSPLASH_KERNELS_MICRO_COMMON_AVX512_H_
#define RINGSPLASH_KERNELS_MICRO_COMMON_AVX512_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro {

template <int MR, int NV>
RINGSPLASH_INLINE void ZeroBlock(__m512 (&acc)[MR][NV]) {
  RINGSPLASH_UNROLL
  for (int i = 0; i < MR; ++i) {
    RINGSPLASH_UNROLL
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  }
}

// acc += A[MR x k] B[k x 16 NV].
template <int MR, int NV, ALayout L>
RINGSPLASH_INLINE void MultiplyBlock(int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                                     const float* b, int64_t ldb, __m512 (&acc)[MR][NV]) {
  if constexpr (L == ALayout::kRowMajor) {
    const float* ap[MR];
    RINGSPLASH_UNROLL
    for (int i = 0; i < MR; ++i) ap[i] = a + i * a_rs;
    for (int64_t p = 0; p < k; ++p) {
      __m512 bv[NV];
      RINGSPLASH_UNROLL
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + p * ldb + 16 * v);
      RINGSPLASH_UNROLL
      for (int i = 0; i < MR; ++i) {
        const __m512 ai = _mm512_set1_ps(ap[i][p]);
        RINGSPLASH_UNROLL
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
      }
    }
  } else {
    for (int64_t p = 0; p < k; ++p) {
      const float* ap = a + p * a_cs;
      __m512 bv[NV];
      RINGSPLASH_UNROLL
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + p * ldb + 16 * v);
      RINGSPLASH_UNROLL
      for (int i = 0; i < MR; ++i) {
        const __m512 ai = _mm512_set1_ps(L == ALayout::kColMajor ? ap[i] : ap[i * a_rs]);
        RINGSPLASH_UNROLL
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
      }
    }
  }
}

// The GEMMs of micro.h (GemmF32Fn, GemmF32RangesFn) for one layout of A.
template <ALayout L>
void GemmLayout(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                bool accumulate, KRanges ranges) {
  // One column panel (NV vectors) at a time so its B panel (k x 16 NV) stays
  // in L1 while the row blocks stream A.
  auto panel = [&]<int MR, int NV>(int64_t j) {
    ForEachRowBlock<MR>(m, [&](int64_t i0, auto rows) {
      constexpr int R = decltype(rows)::value;
      __m512 acc[R][NV];
      float* cb = c + i0 * ldc + j;
      RINGSPLASH_UNROLL
      for (int i = 0; i < R; ++i) {
        if (accumulate) {
          const __m512 r = _mm512_set1_ps(row_scale != nullptr ? row_scale[i0 + i] : 1.0f);
          RINGSPLASH_UNROLL
          for (int v = 0; v < NV; ++v) {
            acc[i][v] = _mm512_loadu_ps(cb + i * ldc + 16 * v);
            if (row_scale != nullptr) acc[i][v] = _mm512_mul_ps(acc[i][v], r);
          }
        } else {
          RINGSPLASH_UNROLL
          for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
        }
      }
      int64_t lo, hi;
      BlockRange(ranges, i0, R, k, &lo, &hi);
      MultiplyBlock<R, NV, L>(hi - lo, a + i0 * a_rs + lo * a_cs, a_rs, a_cs, b + lo * ldb + j, ldb,
                              acc);
      RINGSPLASH_UNROLL
      for (int i = 0; i < R; ++i) {
        RINGSPLASH_UNROLL
        for (int v = 0; v < NV; ++v) _mm512_storeu_ps(cb + i * ldc + 16 * v, acc[i][v]);
      }
    });
  };
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) panel.template operator()<6, 4>(j);
  for (; j + 32 <= n; j += 32) panel.template operator()<8, 2>(j);
  for (; j + 16 <= n; j += 16) panel.template operator()<8, 1>(j);
}

inline void GemmF32RangesAvx512(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs,
                                int64_t a_cs, const float* b, int64_t ldb, float* c, int64_t ldc,
                                const float* row_scale, bool accumulate, KRanges ranges) {
  WithLayout(a_rs, a_cs, [&](auto layout) {
    GemmLayout<decltype(layout)::value>(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale,
                                        accumulate, ranges);
  });
}

inline void GemmF32Avx512(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs,
                          int64_t a_cs, const float* b, int64_t ldb, float* c, int64_t ldc,
                          const float* row_scale, bool accumulate) {
  GemmF32RangesAvx512(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate, KRanges());
}

// In-register transpose of 16 rows of 16 lanes: afterwards r[c] holds what
// was lane c of r[0..15]. Unpack pairs of rows, then pairs of 64-bit pairs,
// then two rounds of 128-bit lane shuffles.
RINGSPLASH_INLINE void Transpose16(__m512 (&r)[16]) {
  __m512 t[16];
  RINGSPLASH_UNROLL
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  RINGSPLASH_UNROLL
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  RINGSPLASH_UNROLL
  for (int h = 0; h < 2; ++h) {
    RINGSPLASH_UNROLL
    for (int i = 0; i < 4; ++i) {
      t[8 * h + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0x88);
      t[8 * h + 4 + i] = _mm512_shuffle_f32x4(r[8 * h + i], r[8 * h + 4 + i], 0xdd);
    }
  }
  RINGSPLASH_UNROLL
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}

// Running NaN/Inf check over loaded f32 vectors (the copies and transposes
// that pack inputs): the max of |bits| reaches the infinity pattern
// (exponent all ones) iff some value was a NaN or an infinity.
class NonFiniteCheck {
 public:
  RINGSPLASH_INLINE void Add(__m512i bits) {
    worst_ = _mm512_max_epi32(worst_, _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)));
  }
  RINGSPLASH_INLINE void Add(__m512 v) { Add(_mm512_castps_si512(v)); }
  bool Any() const { return _mm512_reduce_max_epi32(worst_) >= 0x7F800000; }

 private:
  __m512i worst_ = _mm512_setzero_si512();
};

// Transposed-layout tile kernels (micro/fused_avx512.cc; BackwardTile in
// micro/fused_bwd_avx512.cc).
namespace avx512 {
bool TransposeF32(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst,
                  int64_t ldd);
void MaskBits(int64_t queries, int64_t keys, const uint8_t* bytes, int64_t ldb, uint16_t* bits,
              int64_t ldm, int32_t* key_lo, int32_t* key_hi, int32_t* query_lo, int32_t* query_hi);
void SoftmaxColumns(const TileArgs& t, float* row_max, float* row_sum, float* alpha);
void ForwardTile(const TileArgs& t, float* row_max, float* row_sum, float* alpha);
void BackwardTile(const BackwardTileArgs& b);
void BackwardTileStored(const BackwardTileArgs& b);  // micro/fused_bwd_stored_avx512.cc
bool DecodeStep(const DecodeArgs& a);                // decode/step_avx512.cc
}  // namespace avx512

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_COMMON_AVX512_H_
