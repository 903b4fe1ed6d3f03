// AMX micro-kernels (compiled with -mamx-tile -mamx-bf16 on top of the
// AVX512_BF16 flags; called only after runtime detection, and tile
// instructions run only once Linux granted the tile-data permission:
// AmxTilesPermitted). The "amx" path is the avx512_bf16 table with GemmBf16
// on AMX tiles: the bf16 forward's score products K Q^T and, with P rounded
// to bf16 rows by its softmax step (SoftmaxBf16) and V packed as pairs
// (PackPairsBf16), its P V; the bf16 backward's S^T = K Q^T, dP^T = V dO^T
// and, from P^T and dS^T rounded to bf16 (GradOperandsBf16), dV, dK and dQ
// (flash_backward.cc). Everything else stays on the AVX-512 kernels.
//
// TDPBF16PS multiplies a 16 x 32 bf16 tile A (16 rows, 16 pairs) by a 16 x 16
// pair-interleaved tile B (16 pair rows x 16 columns x 2) into 16 x 16 f32 C,
// i.e. exactly micro.h's GemmBf16 layouts: A rows at stride lda elements, B
// pair rows at stride ldb * 2 elements. Like vdpbf16ps it multiplies bf16
// pairs exactly in f32 and rounds each f32 sum to nearest even (bf16
// subnormal inputs read as zero), so results differ from the vdpbf16ps kernel
// only in the order of the f32 sums.
//
// Tiles: C blocks of up to 2 x 2 tiles (32 x 32) in tmm0-3, A in tmm4-5, B in
// tmm6-7, every tile 16 rows x 64 bytes; k runs in steps of 16 pairs. Rows
// beyond the last multiple of 16 and pairs beyond the last multiple of 16
// (D not a multiple of 32) go to the vdpbf16ps kernel.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -W(maybe-)uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "src/kernels/micro_amx.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "src/kernels/cpu_features.h"
#include "src/kernels/micro.h"
#include "src/kernels/micro_avx512.h"
#include "src/kernels/micro_fused_avx512.h"
#include "src/kernels/micro_math_avx512.h"

namespace ringsplash::kernels::micro {
namespace {

constexpr int64_t kTile = 16;  // rows of a tile; also pairs (k) and columns (n) per tile

// One C block of RI x CJ tiles at rows i, columns j, over k2 pairs (a
// multiple of 16). Tile numbers are instruction immediates, hence the
// spelled-out cases.
template <int RI, int CJ>
void TileBlock(int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
               int64_t ldc, bool accumulate) {
  const int64_t sa = lda * 2, sb = ldb * 4, sc = ldc * 4;  // strides in bytes
  float* c1 = c + kTile * ldc;                             // second row of tiles
  if (accumulate) {
    _tile_loadd(0, c, sc);
    if constexpr (CJ == 2) _tile_loadd(1, c + kTile, sc);
    if constexpr (RI == 2) _tile_loadd(2, c1, sc);
    if constexpr (RI == 2 && CJ == 2) _tile_loadd(3, c1 + kTile, sc);
  } else {
    _tile_zero(0);
    if constexpr (CJ == 2) _tile_zero(1);
    if constexpr (RI == 2) _tile_zero(2);
    if constexpr (RI == 2 && CJ == 2) _tile_zero(3);
  }
  for (int64_t t = 0; t < k2; t += kTile) {
    _tile_loadd(4, a + 2 * t, sa);
    if constexpr (RI == 2) _tile_loadd(5, a + kTile * lda + 2 * t, sa);
    _tile_loadd(6, b + t * ldb * 2, sb);
    if constexpr (CJ == 2) _tile_loadd(7, b + (t * ldb + kTile) * 2, sb);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CJ == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RI == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RI == 2 && CJ == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, sc);
  if constexpr (CJ == 2) _tile_stored(1, c + kTile, sc);
  if constexpr (RI == 2) _tile_stored(2, c1, sc);
  if constexpr (RI == 2 && CJ == 2) _tile_stored(3, c1 + kTile, sc);
}

// C[m x n] (+)= A B with m, n and k2 multiples of 16. Row panels of 32
// outside: a panel of A (32 rows x k2 pairs, 8 KiB at k2 = 64) stays in L1
// while the column blocks stream B. Measured against column panels outside
// (B's panel kept instead): 8-12 % faster on the 128 x 128 x 64-pair
// products of D = 128 (BM_GemmBf16Scores, BM_GemmBf16Accumulate, two
// alternated runs), equal at 32 pairs; the attention benchmarks did not
// move beyond their noise.
void TileProducts(int64_t m, int64_t n, int64_t k2, const uint16_t* a, int64_t lda,
                  const uint16_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  // GCC 12's tile load and store intrinsics are asm without a "memory"
  // clobber, so nothing stops the compiler from moving them across
  // ordinary loads and stores of A, B and C once this is inlined somewhere:
  // compiler barriers on both sides keep them inside.
  asm volatile("" ::: "memory");
  ConfigureTiles();
  for (int64_t i = 0; i < m; i += 2 * kTile) {
    const bool two_rows = i + 2 * kTile <= m;
    const uint16_t* ai = a + i * lda;
    for (int64_t j = 0; j < n; j += 2 * kTile) {
      const bool two_cols = j + 2 * kTile <= n;
      const uint16_t* bj = b + 2 * j;  // column j of pair-interleaved B
      float* cij = c + i * ldc + j;
      if (two_rows && two_cols) {
        TileBlock<2, 2>(k2, ai, lda, bj, ldb, cij, ldc, accumulate);
      } else if (two_rows) {
        TileBlock<2, 1>(k2, ai, lda, bj, ldb, cij, ldc, accumulate);
      } else if (two_cols) {
        TileBlock<1, 2>(k2, ai, lda, bj, ldb, cij, ldc, accumulate);
      } else {
        TileBlock<1, 1>(k2, ai, lda, bj, ldb, cij, ldc, accumulate);
      }
    }
  }
  // Back to the initial tile state, so the thread's context switches save
  // no tile data and other AMX users in the process start from a clean slate.
  _tile_release();
  asm volatile("" ::: "memory");
}

// GemmBf16Fn on AMX where whole tiles fit, the vdpbf16ps kernel for the rest
// (and for row_scale, which AMX cannot apply to C) — and for everything if
// Linux refused the tile permission (same layouts, so same results up to the
// order of the f32 sums).
void GemmBf16Amx(int64_t m, int64_t n, int64_t k2, const uint16_t* a, int64_t lda,
                 const uint16_t* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                 bool accumulate) {
  const GemmBf16Fn vector_gemm = Avx512Bf16MicroKernels().gemm_bf16;
  const int64_t m16 = m / kTile * kTile, k16 = k2 / kTile * kTile;
  if (row_scale != nullptr || m16 == 0 || k16 == 0 || !AmxTilesPermitted()) {
    vector_gemm(m, n, k2, a, lda, b, ldb, c, ldc, row_scale, accumulate);
    return;
  }
  TileProducts(m16, n, k16, a, lda, b, ldb, c, ldc, accumulate);
  if (k16 < k2) {
    vector_gemm(m16, n, k2 - k16, a + 2 * k16, lda, b + k16 * ldb * 2, ldb, c, ldc, nullptr, true);
  }
  if (m16 < m) {
    vector_gemm(m - m16, n, k2, a + m16 * lda, lda, b, ldb, c + m16 * ldc, ldc, nullptr,
                accumulate);
  }
}

// Element order that turns [16 of row 2t | 16 of row 2t + 1] into their
// pairs.
alignas(64) constexpr uint16_t kInterleave[32] = {0,  16, 1,  17, 2,  18, 3,  19, 4,  20, 5,
                                                  21, 6,  22, 7,  23, 8,  24, 9,  25, 10, 26,
                                                  11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// The pair loop of both packers: both(r, c) gives [16 of row r | 16 of row
// r + 1] from column c as bf16 (zero past the last row); interleaved
// element by element into pair row r / 2, for rows up to RoundUp(rows, 32)
// and columns up to cols16.
template <class Both>
RINGSPLASH_INLINE void InterleavePairs(int64_t rows, int64_t cols16, uint16_t* dst, int64_t ldd,
                                       Both&& both) {
  const __m512i order = _mm512_load_si512(kInterleave);
  const int64_t padded = RoundUp(rows, 32);
  for (int64_t r = 0; r < padded; r += 2) {
    uint16_t* out = dst + (r / 2) * ldd * 2;
    for (int64_t c = 0; c < cols16; c += 16) {
      _mm512_storeu_si512(out + 2 * c, _mm512_permutexvar_epi16(order, both(r, c)));
    }
  }
}

// Pairs of rows (2t, 2t + 1), 16 columns at a time, both rounded to bf16.
void PackPairsBf16(int64_t rows, int64_t cols, const float* src, int64_t lds, uint16_t* dst,
                   int64_t ldd) {
  InterleavePairs(rows, cols, dst, ldd, [&](int64_t r, int64_t c) {
    const __m512 even = r < rows ? _mm512_loadu_ps(src + r * lds + c) : _mm512_setzero_ps();
    const __m512 odd =
        r + 1 < rows ? _mm512_loadu_ps(src + (r + 1) * lds + c) : _mm512_setzero_ps();
    return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));
  });
}

// PackPairsFromBf16Fn: the same from bf16 rows, the column tail loaded
// under a mask.
void PackPairsFromBf16(int64_t rows, int64_t cols, const uint16_t* src, int64_t lds, uint16_t* dst,
                       int64_t ldd) {
  InterleavePairs(rows, RoundUp(cols, 16), dst, ldd, [&](int64_t r, int64_t c) {
    const __mmask16 in = avx512::LaneMask(cols - c);
    const __m256i even =
        r < rows ? _mm256_maskz_loadu_epi16(in, src + r * lds + c) : _mm256_setzero_si256();
    const __m256i odd = r + 1 < rows ? _mm256_maskz_loadu_epi16(in, src + (r + 1) * lds + c)
                                     : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(even), odd, 1);
  });
}

// r[jj] holds keys j0 + jj of 16 queries (from i0): transposed in registers
// and stored as rows i0 .. i0 + nq - 1 of P, 16 bf16 from key j0 each.
RINGSPLASH_INLINE void StoreTransposedBf16(__m512 (&r)[16], int64_t nq, uint16_t* p, int64_t ldpb,
                                           int64_t i0, int64_t j0) {
  Transpose16(r);  // r[c]: query i0 + c over keys j0 .. j0 + 15
  for (int64_t c = 0; c < nq; ++c) {
    const __m256i row = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(r[c]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + (i0 + c) * ldpb + j0), row);
  }
}

// A tile in the transposed layout (keys x queries: src[j * lds + i]) to
// bf16, 16 keys x 16 queries at a time, each value loaded once:
//   rows[j * ldr + i] for j < keys, i < RoundUp(queries, kVec) (zero from
//     queries), when rows is not null;
//   cols[i * ldc + j] for i < queries, j < RoundUp(keys, 32) (zero from
//     keys), transposed in registers, when cols is not null.
void TileToBf16(int64_t keys, int64_t queries, const float* src, int64_t lds, uint16_t* rows,
                int64_t ldr, uint16_t* cols, int64_t ldc) {
  const int64_t mp = RoundUp(queries, kVec);
  const int64_t padded = cols != nullptr ? RoundUp(keys, 32) : keys;
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const int64_t nq = std::min<int64_t>(16, queries - i0);
    const __mmask16 in = avx512::LaneMask(nq);
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
      __m512 r[16];
      RINGSPLASH_UNROLL
      for (int jj = 0; jj < 16; ++jj) {
        const int64_t j = j0 + jj;
        if (j >= keys) {
          r[jj] = _mm512_setzero_ps();
          continue;
        }
        r[jj] = _mm512_maskz_loadu_ps(in, src + j * lds + i0);
        if (rows != nullptr) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + j * ldr + i0),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(r[jj])));
        }
      }
      if (cols != nullptr) StoreTransposedBf16(r, nq, cols, ldc, i0, j0);
    }
  }
}

// The lazy step of ForwardTileFn on stored products, in one pass: P is
// computed (Exp2Raw512, as in the fused f32 tile) 16 keys x 16 queries in
// registers and written transposed as bf16 rows, while the largest exponent
// x * log2 e - m_i * log2 e of each query is tracked. If one exceeds
// log2(kLazySumLimit / keys) (so the query's sum could pass the limit) the
// step is abandoned: false, with row_sum and alpha untouched (they are
// committed last) and t.pt intact, for the exact step to redo P.
bool LazyStepBf16(const TileArgs& t, float* row_max, float* row_sum, float* alpha, uint16_t* p,
                  int64_t ldpb) {
  using avx512::Allowed16;
  using avx512::LaneMask;
  const int64_t mp = RoundUp(t.queries, kVec);
  const __m512 neg_inf = _mm512_set1_ps(avx512::kNegInf);
  const __m512 c2 = _mm512_set1_ps(t.scale * avx512::kLog2e);
  const __m512 bound =
      _mm512_set1_ps(std::log2(kLazySumLimit / static_cast<float>(std::max<int64_t>(t.keys, 1))));
  const int64_t padded = RoundUp(t.keys, 32);
  float* sums = t.scratch;  // [mp], committed once every query passed
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    const int64_t nq = std::min<int64_t>(16, t.queries - i0);
    const __m512 m = _mm512_maskz_loadu_ps(live, row_max + i0);
    // A query without a finite reference yet (first tile, or masked so far).
    if (_mm512_mask_cmp_ps_mask(live, m, neg_inf, _CMP_EQ_OQ) != 0) return false;
    const __m512 shift = _mm512_mul_ps(m, _mm512_set1_ps(avx512::kLog2e));
    __m512 sum = _mm512_setzero_ps(), emax = neg_inf;
    for (int64_t j0 = 0; j0 < padded; j0 += 16) {
      __m512 r[16];
      RINGSPLASH_UNROLL
      for (int jj = 0; jj < 16; ++jj) {
        const int64_t j = j0 + jj;
        if (j >= t.keys) {
          r[jj] = _mm512_setzero_ps();
          continue;
        }
        const __m512 e = _mm512_fmsub_ps(_mm512_loadu_ps(t.pt + j * t.ldp + i0), c2, shift);
        __m512 v = Exp2Raw512(e);
        if (t.mask != nullptr) {
          const __mmask16 allowed = Allowed16(t, j, i0);
          emax = _mm512_max_ps(emax, _mm512_mask_blend_ps(allowed, neg_inf, e));
          v = _mm512_maskz_mov_ps(allowed, v);
        } else {
          emax = _mm512_max_ps(emax, e);
        }
        sum = _mm512_add_ps(sum, v);
        r[jj] = v;
      }
      StoreTransposedBf16(r, nq, p, ldpb, i0, j0);
    }
    // Ordered compares: a NaN (from inf - inf in K Q^T) fails them too, as
    // max_ps may drop a NaN exponent from emax.
    if (_mm512_mask_cmp_ps_mask(live, emax, bound, _CMP_LE_OQ) != live) return false;
    if (_mm512_mask_cmp_ps_mask(live, sum, _mm512_set1_ps(kLazySumLimit), _CMP_LE_OQ) != live) {
      return false;
    }
    _mm512_store_ps(sums + i0, sum);
  }
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    _mm512_mask_storeu_ps(
        row_sum + i0, live,
        _mm512_add_ps(_mm512_maskz_loadu_ps(live, row_sum + i0), _mm512_load_ps(sums + i0)));
    _mm512_mask_storeu_ps(alpha + i0, live, _mm512_set1_ps(1.0f));
  }
  return true;
}

// GradOperandsBf16Fn: P^T as rows, dS^T as rows and transposed.
void GradOperandsBf16(int64_t keys, int64_t queries, const float* pt, const float* ds, int64_t ldp,
                      uint16_t* pt_rows, uint16_t* ds_rows, int64_t ldr, uint16_t* ds_cols,
                      int64_t ldc) {
  if (pt_rows != nullptr) TileToBf16(keys, queries, pt, ldp, pt_rows, ldr, nullptr, 0);
  TileToBf16(keys, queries, ds, ldp, ds_rows, ldr, ds_cols, ldc);
}

// SoftmaxBf16Fn: the lazy step where it applies (no soft cap), else the
// exact AVX-512 step in place and its P^T transposed to bf16 rows.
void SoftmaxBf16(const TileArgs& t, float* row_max, float* row_sum, float* alpha, uint16_t* p,
                 int64_t ldpb) {
  if (t.softcap == 0.0f && LazyStepBf16(t, row_max, row_sum, alpha, p, ldpb)) return;
  avx512::SoftmaxColumns(t, row_max, row_sum, alpha);
  TileToBf16(t.keys, t.queries, t.pt, t.ldp, nullptr, 0, p, ldpb);
}

}  // namespace

const MicroKernels& AmxMicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t = Avx512Bf16MicroKernels();
    t.name = "amx";
    t.gemm_bf16 = GemmBf16Amx;
    t.pack_pairs_bf16 = PackPairsBf16;
    t.pack_pairs_from_bf16 = PackPairsFromBf16;
    t.softmax_bf16 = SoftmaxBf16;
    t.grad_operands_bf16 = GradOperandsBf16;
    return t;
  }();
  return table;
}

}  // namespace ringsplash::kernels::micro
