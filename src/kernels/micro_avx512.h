// Internals shared by the AVX-512 micro-kernel translation units
// (micro_avx512.cc, micro_fused_avx512.cc, micro_avx512_bf16.cc): the
// register-blocked f32 GEMM building blocks and the functions one unit puts
// into another's table. Include only from units compiled with AVX-512 flags.
//
// A block is MR rows x NV vectors of 16 columns held in MR * NV zmm
// accumulators (6 x 4 = 24 or 8 x 2 = 16). Per step p the NV vectors of B's
// row p are loaded once and each A(i, p) is broadcast, so a 6 x 4 block does
// 24 FMAs per 4 vector loads + 6 broadcasts. Callers choose what happens to
// the accumulators afterwards (plain store, or a fused softmax epilogue), so
// the products of every kernel share one inner loop and one rounding order.
#ifndef RINGSPLASH_KERNELS_MICRO_AVX512_H_
#define RINGSPLASH_KERNELS_MICRO_AVX512_H_

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "src/kernels/micro.h"

namespace ringsplash::kernels::micro {

#define RINGSPLASH_INLINE inline __attribute__((always_inline))
// Loops over the accumulator arrays must be unrolled completely: an array
// indexed by a loop variable lives on the stack, and every block then pays a
// round trip of all its accumulators through memory.
#define RINGSPLASH_UNROLL _Pragma("GCC unroll 32")

// How A(i, p) = a[i * a_rs + p * a_cs] is walked.
enum class ALayout { kRowMajor, kColMajor, kGeneral };  // a_cs == 1 / a_rs == 1 / other

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

// Calls f(std::integral_constant<int, R>) with R == rows, 1 <= rows <= MR.
template <int MR, class F>
RINGSPLASH_INLINE void WithRows(int64_t rows, F&& f) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      WithRows<MR - 1>(rows, f);
      return;
    }
  }
  f(std::integral_constant<int, MR>());
}

// Splits m rows into ceil(m / MR) blocks of balanced height (64 rows: 9 x 6 +
// 2 x 5 rather than 10 x 6 + 4, so no block runs with few accumulators) and
// calls f(first_row, std::integral_constant<int, rows>) for each, in order.
template <int MR, class F>
RINGSPLASH_INLINE void ForEachRowBlock(int64_t m, F&& f) {
  const int64_t blocks = (m + MR - 1) / MR;
  if (blocks == 0) return;
  const int64_t base = m / blocks, taller = m % blocks;  // `taller` blocks get base + 1 rows
  int64_t i = 0;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t rows = base + (blk < taller ? 1 : 0);
    WithRows<MR>(rows, [&](auto r) { f(i, r); });
    i += rows;
  }
}

// The union [lo, hi) of the p ranges of rows [i0, i0 + rows) (empty rows
// ignored; lo == hi == 0 when all are empty); [0, k) without ranges.
inline void BlockRange(const KRanges& r, int64_t i0, int rows, int64_t k, int64_t* lo,
                       int64_t* hi) {
  if (r.lo == nullptr) {
    *lo = 0;
    *hi = k;
    return;
  }
  int64_t l = k, h = 0;
  for (int i = 0; i < rows; ++i) {
    if (r.hi[i0 + i] > r.lo[i0 + i]) {
      l = std::min<int64_t>(l, r.lo[i0 + i]);
      h = std::max<int64_t>(h, r.hi[i0 + i]);
    }
  }
  *lo = h > l ? l : 0;
  *hi = h > l ? h : 0;
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
  if (a_cs == 1) {
    GemmLayout<ALayout::kRowMajor>(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate,
                                   ranges);
  } else if (a_rs == 1) {
    GemmLayout<ALayout::kColMajor>(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate,
                                   ranges);
  } else {
    GemmLayout<ALayout::kGeneral>(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate,
                                  ranges);
  }
}

inline void GemmF32Avx512(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs,
                          int64_t a_cs, const float* b, int64_t ldb, float* c, int64_t ldc,
                          const float* row_scale, bool accumulate) {
  GemmF32RangesAvx512(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate, KRanges());
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

// Transposed-layout tile kernels (micro_fused_avx512.cc).
namespace avx512 {
bool TransposeF32(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst,
                  int64_t ldd);
void MaskBits(int64_t queries, int64_t keys, const uint8_t* bytes, int64_t ldb, uint16_t* bits,
              int64_t ldm, int32_t* key_lo, int32_t* key_hi, int32_t* query_lo, int32_t* query_hi);
void SoftmaxColumns(const TileArgs& t, float* row_max, float* row_sum, float* alpha);
void ForwardTile(const TileArgs& t, float* row_max, float* row_sum, float* alpha);
void BackwardTile(const BackwardTileArgs& b);
}  // namespace avx512

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_AVX512_H_
