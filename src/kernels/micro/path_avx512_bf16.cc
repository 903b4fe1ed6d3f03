// AVX512_BF16 micro-kernels (compiled with -mavx512bf16 on top of the AVX-512
// flags; called only after runtime detection). vdpbf16ps multiplies pairs of
// bf16 and accumulates both products into one f32 lane, so one instruction
// covers two steps of p: A's pair (2t, 2t+1) is broadcast as a 32-bit word and
// B is stored pair-interleaved (micro.h). Blocking as in micro/path_avx512.cc.
// Besides the GEMM, the bf16 operands of the products that round P and dS to
// bf16 (the forward's P V, the backward's dV, dK, dQ): pair packers,
// SoftmaxBf16 and GradOperandsBf16. The amx table (micro/path_amx.cc) keeps all of
// them and runs only GemmBf16 on tiles.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -Wmaybe-uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "src/kernels/micro/common_avx512.h"
#include "src/kernels/micro/fused_avx512.h"
#include "src/kernels/micro/math_avx512.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro {
namespace {

template <int MR, int NV>
inline void GemmBf16Block(int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b,
                          int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                          bool accumulate) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i) {
    if (accumulate) {
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_loadu_ps(c + i * ldc + 16 * v);
      if (row_scale != nullptr) {
        const __m512 r = _mm512_set1_ps(row_scale[i]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_mul_ps(acc[i][v], r);
      }
    } else {
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
    }
  }
  for (int64_t t = 0; t < k2; ++t) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) {
      bv[v] = (__m512bh)_mm512_loadu_si512(b + (t * ldb + 16 * v) * 2);
    }
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * t, sizeof(pair));
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], ai, bv[v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
  }
}

template <int R, int NV>
inline void GemmBf16Tail(int64_t rem, int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b,
                         int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                         bool accumulate) {
  if constexpr (R > 1) {
    if (rem == R - 1) {
      GemmBf16Block<R - 1, NV>(k2, a, lda, b, ldb, c, ldc, row_scale, accumulate);
    } else {
      GemmBf16Tail<R - 1, NV>(rem, k2, a, lda, b, ldb, c, ldc, row_scale, accumulate);
    }
  }
}

template <int MR, int NV>
void GemmBf16Panel(int64_t m, int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b,
                   int64_t ldb, float* c, int64_t ldc, const float* row_scale, bool accumulate) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) {
    GemmBf16Block<MR, NV>(k2, a + i * lda, lda, b, ldb, c + i * ldc, ldc,
                          row_scale != nullptr ? row_scale + i : nullptr, accumulate);
  }
  if (i < m) {
    GemmBf16Tail<MR, NV>(m - i, k2, a + i * lda, lda, b, ldb, c + i * ldc, ldc,
                         row_scale != nullptr ? row_scale + i : nullptr, accumulate);
  }
}

void GemmBf16(int64_t m, int64_t n, int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b,
              int64_t ldb, float* c, int64_t ldc, const float* row_scale, bool accumulate) {
  int64_t j = 0;
  // b + j * 2: column j of a pair-interleaved B starts 2 j elements into each row.
  for (; j + 64 <= n; j += 64) {
    GemmBf16Panel<6, 4>(m, k2, a, lda, b + 2 * j, ldb, c + j, ldc, row_scale, accumulate);
  }
  for (; j + 32 <= n; j += 32) {
    GemmBf16Panel<8, 2>(m, k2, a, lda, b + 2 * j, ldb, c + j, ldc, row_scale, accumulate);
  }
  for (; j + 16 <= n; j += 16) {
    GemmBf16Panel<8, 1>(m, k2, a, lda, b + 2 * j, ldb, c + j, ldc, row_scale, accumulate);
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

// r[jj] holds keys j0 + jj of 16 queries (from i0): stored as rows i0 ..
// i0 + nq - 1 of P, 16 bf16 from key j0 each. Rounded first, two keys to a
// vector, and interleaved into 32-bit pairs (key 2t, key 2t + 1) per query,
// so the transpose moves 8 vectors of pairs, not 16 of floats: 48
// instructions in place of Transpose16's 64 and 16 conversions, with the
// same bits (the same round-to-nearest-even conversion of each value).
RINGSPLASH_INLINE void StoreTransposedBf16(__m512 (&r)[16], int64_t nq, uint16_t* p, int64_t ldpb,
                                           int64_t i0, int64_t j0) {
  const __m512i order = _mm512_load_si512(kInterleave);
  __m512i x[8];  // x[t] 32-bit lane q: keys 2t and 2t + 1 of query q
  RINGSPLASH_UNROLL
  for (int t = 0; t < 8; ++t) {
    x[t] = _mm512_permutexvar_epi16(
        order, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(r[2 * t + 1], r[2 * t])));
  }
  // Within each 128-bit lane L (queries 4L .. 4L + 3): quad[h][k] lane L
  // holds pairs t = 4h .. 4h + 3 of query 4L + k.
  __m512i quad[2][4];
  RINGSPLASH_UNROLL
  for (int h = 0; h < 2; ++h) {
    const __m512i* y = x + 4 * h;
    const __m512i a0 = _mm512_unpacklo_epi32(y[0], y[1]), a1 = _mm512_unpackhi_epi32(y[0], y[1]);
    const __m512i a2 = _mm512_unpacklo_epi32(y[2], y[3]), a3 = _mm512_unpackhi_epi32(y[2], y[3]);
    quad[h][0] = _mm512_unpacklo_epi64(a0, a2);
    quad[h][1] = _mm512_unpackhi_epi64(a0, a2);
    quad[h][2] = _mm512_unpacklo_epi64(a1, a3);
    quad[h][3] = _mm512_unpackhi_epi64(a1, a3);
  }
  // Lanes L of both halves side by side: one query's 16 keys per 256 bits.
  const __m512i lanes01 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
  const __m512i lanes23 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
  auto store = [&](int64_t c, __m256i row) RINGSPLASH_INLINE_LAMBDA {
    if (c < nq) _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + (i0 + c) * ldpb + j0), row);
  };
  RINGSPLASH_UNROLL
  for (int k = 0; k < 4; ++k) {
    const __m512i v01 = _mm512_permutex2var_epi64(quad[0][k], lanes01, quad[1][k]);
    const __m512i v23 = _mm512_permutex2var_epi64(quad[0][k], lanes23, quad[1][k]);
    store(k, _mm512_castsi512_si256(v01));
    store(4 + k, _mm512_extracti64x4_epi64(v01, 1));
    store(8 + k, _mm512_castsi512_si256(v23));
    store(12 + k, _mm512_extracti64x4_epi64(v23, 1));
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

// P^T of the 16-query strip at i0 (nq live queries) against the per-query
// exponent shift `shift` (a max times log2 e): P^T = 2^(x c2 - shift) with
// c2 = scale log2 e (Exp2Raw512, as in the fused f32 tile), masked keys
// zero, computed 16 keys x 16 queries in registers and written transposed
// as bf16 rows (keys up to RoundUp(keys, 32), zero past them). Returns the
// strip's sums, lane-wise.
RINGSPLASH_INLINE __m512 StripToBf16(const TileArgs& t, int64_t i0, int64_t nq, __m512 c2,
                                     __m512 shift, uint16_t* p, int64_t ldpb) {
  using avx512::Allowed16;
  const int64_t padded = RoundUp(t.keys, 32);
  __m512 sum = _mm512_setzero_ps();
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
      if (t.mask != nullptr) v = _mm512_maskz_mov_ps(Allowed16(t, j, i0), v);
      sum = _mm512_add_ps(sum, v);
      r[jj] = v;
    }
    StoreTransposedBf16(r, nq, p, ldpb, i0, j0);
  }
  return sum;
}

// The lazy step of ForwardTileFn on stored products, in one pass
// (StripToBf16 against each query's reference max m_i). If a query's sum
// exceeds kLazySumLimit or is not finite (an exponent past 128 gives +inf)
// the step is abandoned, as the fused f32 tile's is: false, with row_sum and
// alpha untouched (they are committed last) and t.pt intact, for the exact
// step to redo P. The terms are positive, so a sum within the limit bounds
// each of them too: no test of each term's exponent is needed (one costs
// ~8 % of the step, docs/perf/XEON_HOST.md).
bool LazyStepBf16(const TileArgs& t, float* row_max, float* row_sum, float* alpha, uint16_t* p,
                  int64_t ldpb) {
  using avx512::LaneMask;
  const int64_t mp = RoundUp(t.queries, kVec);
  const __m512 neg_inf = _mm512_set1_ps(avx512::kNegInf);
  const __m512 c2 = _mm512_set1_ps(t.scale * avx512::kLog2e);
  float* sums = t.scratch;  // [mp], committed once every query passed
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    const int64_t nq = std::min<int64_t>(16, t.queries - i0);
    const __m512 m = _mm512_maskz_loadu_ps(live, row_max + i0);
    // A query without a finite reference yet (first tile, or masked so far).
    if (_mm512_mask_cmp_ps_mask(live, m, neg_inf, _CMP_EQ_OQ) != 0) return false;
    const __m512 shift = _mm512_mul_ps(m, _mm512_set1_ps(avx512::kLog2e));
    const __m512 sum = StripToBf16(t, i0, nq, c2, shift, p, ldpb);
    // An ordered compare: a NaN sum fails it too.
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

// The exact step of SoftmaxBf16Fn without a soft cap, in two passes over
// each 16-query strip (keys x 64 bytes, in L1 between them): the largest
// allowed logit of each query, then StripToBf16 against the new running max
// m_new = max(row_max, that logit), every exponent <= 0. A query with no
// allowed key so far keeps row_max = -inf with P, its sum and alpha zero,
// as in the f32 exact step (ExpStrip), whose exp of x - m_new this computes
// as 2^(x log2 e - m_new log2 e), as the lazy step does. It replaces that
// step's f32 P stored in place and TileToBf16's pass to round and transpose
// it. False (nothing committed, t.pt intact) if a strip's largest logit is
// +inf or NaN (a product past f32's range) or a sum overflows: the f32 step
// then gives what it always gave. (A NaN logit that max_ps drops from the
// max gives P ~ 2^-125 here, as in the lazy step, where the f32 step gives
// ~e^-86: both negligible.)
bool ExactStepBf16(const TileArgs& t, float* row_max, float* row_sum, float* alpha, uint16_t* p,
                   int64_t ldpb) {
  using avx512::Allowed16;
  using avx512::LaneMask;
  const int64_t mp = RoundUp(t.queries, kVec);
  const __m512 neg_inf = _mm512_set1_ps(avx512::kNegInf);
  const __m512 log2e = _mm512_set1_ps(avx512::kLog2e);
  const __m512 scale = _mm512_set1_ps(t.scale);
  const __m512 c2 = _mm512_set1_ps(t.scale * avx512::kLog2e);
  float* sums = t.scratch;         // [mp]
  float* maxima = t.scratch + mp;  // [mp] m_new
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    const int64_t nq = std::min<int64_t>(16, t.queries - i0);
    __m512 vmax = neg_inf;
    for (int64_t j = 0; j < t.keys; ++j) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(t.pt + j * t.ldp + i0), scale);
      if (t.mask != nullptr) x = _mm512_mask_blend_ps(Allowed16(t, j, i0), neg_inf, x);
      vmax = _mm512_max_ps(vmax, x);
    }
    // max_ps returns its second operand when one is NaN, so a NaN logit may
    // be dropped from vmax (and with it the max before it).
    if (_mm512_mask_cmp_ps_mask(live, vmax, _mm512_set1_ps(-avx512::kNegInf), _CMP_LT_OQ) != live) {
      return false;
    }
    const __m512 old_max = _mm512_mask_loadu_ps(neg_inf, live, row_max + i0);
    const __m512 m_new = _mm512_max_ps(old_max, vmax);
    const __m512 sum =
        StripToBf16(t, i0, nq, c2, _mm512_mul_ps(avx512::ExactShift(m_new), log2e), p, ldpb);
    // Terms <= 1 (exponents <= 0 up to rounding) unless a dropped NaN left
    // m_new too low: an overflowing sum fails then.
    if (_mm512_mask_cmp_ps_mask(live, sum, _mm512_set1_ps(kLazySumLimit), _CMP_LE_OQ) != live) {
      return false;
    }
    _mm512_store_ps(sums + i0, sum);
    _mm512_store_ps(maxima + i0, m_new);
  }
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    const __m512 old_max = _mm512_mask_loadu_ps(neg_inf, live, row_max + i0);
    avx512::CommitExactStrip(i0, live, old_max, _mm512_load_ps(maxima + i0),
                             _mm512_load_ps(sums + i0), row_max, row_sum, alpha);
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

// SoftmaxBf16Fn: without a soft cap the lazy step where it applies, else
// ExactStepBf16; with one (or a logit past f32's range), the exact AVX-512
// step in place and its P^T transposed to bf16 rows.
void SoftmaxBf16(const TileArgs& t, float* row_max, float* row_sum, float* alpha, uint16_t* p,
                 int64_t ldpb) {
  if (t.softcap == 0.0f && (LazyStepBf16(t, row_max, row_sum, alpha, p, ldpb) ||
                            ExactStepBf16(t, row_max, row_sum, alpha, p, ldpb))) {
    return;
  }
  avx512::SoftmaxColumns(t, row_max, row_sum, alpha);
  TileToBf16(t.keys, t.queries, t.pt, t.ldp, nullptr, 0, p, ldpb);
}

}  // namespace

const MicroKernels& Avx512Bf16MicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t = Avx512MicroKernels();
    t.name = "avx512_bf16";
    t.gemm_bf16 = GemmBf16;
    t.pack_pairs_bf16 = PackPairsBf16;
    t.pack_pairs_from_bf16 = PackPairsFromBf16;
    t.softmax_bf16 = SoftmaxBf16;
    t.grad_operands_bf16 = GradOperandsBf16;
    return t;
  }();
  return table;
}

}  // namespace ringsplash::kernels::micro
