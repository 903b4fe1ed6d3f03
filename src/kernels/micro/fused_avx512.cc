// Fused forward tile kernels for AVX-512 (building blocks and the block
// loop in micro/fused_avx512.h), with the Q^T transpose and the mask bits.
//
// Forward (lazy rescaling): once a query has a finite reference max m_i (its
// running max after an exact step), the next tiles need no max pass at all:
// P^T = 2^(x * log2 e - m_i * log2 e) is evaluated straight from the
// accumulators (one FMA gives the shifted exponent), stored, and summed per
// lane. Only if some query's tile sum exceeds kLazySumLimit (a logit more
// than ~14 above m_i: rare after the first tile) or is not finite is the tile
// recomputed with the exact two-pass step, which then also raises m_i. The
// first tile of every query takes the exact step.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -W(maybe-)uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "src/kernels/micro/fused_avx512.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/common_avx512.h"
#include "src/kernels/micro/math_avx512.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro::avx512 {
namespace {

// Natural logit of the raw product (scale, then the soft cap). The cap is a
// compile-time switch (WithSwitches, as in the lazy step and the AVX2
// kernels), so an uncapped tile carries no tanh code.
template <bool kCapped>
struct LogitOp {
  __m512 scale, cap, inv_cap;
  explicit LogitOp(const TileArgs& t)
      : scale(_mm512_set1_ps(t.scale)),
        cap(_mm512_set1_ps(t.softcap)),
        inv_cap(_mm512_set1_ps(kCapped ? 1.0f / t.softcap : 0.0f)) {}
  RINGSPLASH_INLINE __m512 operator()(__m512 s) const {
    const __m512 x = _mm512_mul_ps(s, scale);
    if constexpr (!kCapped) return x;
    return _mm512_mul_ps(cap, Tanh512(_mm512_mul_ps(x, inv_cap)));
  }
};

// --- Forward --------------------------------------------------------------------

// Lazy step: P^T = 2^(x2 - m2) from the registers, per-lane sums into `sums`.
template <bool kMasked, bool kCapped>
struct LazyForwardEpilogue {
  const TileArgs& t;
  const float* m2;  // [mp] row_max * log2 e
  float* sums;      // [mp]
  ExponentOp<kCapped> exponent;

  void Zero(int64_t j0, int rows, int64_t i0, int vectors) {
    ZeroVectors(t.pt, t.ldp, j0, rows, i0, vectors);
  }

  template <int R, int NV>
  RINGSPLASH_INLINE void Apply(__m512 (&acc)[R][NV], int64_t j0, int64_t i0) {
    RINGSPLASH_UNROLL
    for (int v = 0; v < NV; ++v) {
      const int64_t col = i0 + 16 * v;
      const __m512 shift = _mm512_load_ps(m2 + col);
      __m512 sum = _mm512_setzero_ps();
      RINGSPLASH_UNROLL
      for (int r = 0; r < R; ++r) {
        __m512 th;
        __m512 p = Exp2Raw512(exponent(acc[r][v], shift, &th));
        if constexpr (kMasked) {
          p = _mm512_maskz_mov_ps(Allowed16(t, j0 + r, col), p);
        }
        _mm512_storeu_ps(t.pt + (j0 + r) * t.ldp + col, p);
        sum = _mm512_add_ps(sum, p);
      }
      _mm512_store_ps(sums + col, _mm512_add_ps(_mm512_load_ps(sums + col), sum));
    }
  }
};

template <bool kMasked, bool kCapped>
void LazyScores(const TileArgs& t, int64_t mp) {
  LazyForwardEpilogue<kMasked, kCapped> epi{t, t.scratch, t.scratch + mp, ExponentOp<kCapped>(t)};
  Blocks(t.keys, mp, t.d, t.k, t.ldk, t.qt, t.ldq, t.mask, t.ldm, epi);
}

// Tries the lazy step; false (nothing committed) if a query needs the exact one.
bool TryLazyStep(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  const int64_t mp = RoundUp(t.queries, kVec);
  float* m2 = t.scratch;
  float* sums = t.scratch + mp;
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    const __m512 m = _mm512_maskz_loadu_ps(live, row_max + i0);
    // A query without a finite reference yet (first tile, or masked so far).
    if (_mm512_mask_cmp_ps_mask(live, m, _mm512_set1_ps(kNegInf), _CMP_EQ_OQ) != 0) return false;
    _mm512_store_ps(m2 + i0, _mm512_mul_ps(m, _mm512_set1_ps(kLog2e)));
    _mm512_store_ps(sums + i0, _mm512_setzero_ps());
  }
  WithSwitches(t, [&](auto capped, auto masked) {
    LazyScores<decltype(masked)::value, decltype(capped)::value>(t, mp);
  });
  // Every live lane's sum must be <= the limit (a NaN or inf fails too).
  const __m512 limit = _mm512_set1_ps(kLazySumLimit);
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    const __mmask16 ok =
        _mm512_mask_cmp_ps_mask(live, _mm512_load_ps(sums + i0), limit, _CMP_LE_OQ);
    if (ok != live) return false;
  }
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    const __m512 l =
        _mm512_add_ps(_mm512_maskz_loadu_ps(live, row_sum + i0), _mm512_load_ps(sums + i0));
    _mm512_mask_storeu_ps(row_sum + i0, live, l);
    _mm512_mask_storeu_ps(alpha + i0, live, _mm512_set1_ps(1.0f));
  }
  return true;
}

// Exact step, first pass: logits stored (-inf where masked or skipped), the
// max of each lane kept in lane_max.
template <bool kMasked, bool kCapped>
struct ExactForwardEpilogue {
  const TileArgs& t;
  float* lane_max;  // [mp]
  LogitOp<kCapped> logit;

  void Zero(int64_t j0, int rows, int64_t i0, int vectors) {
    for (int r = 0; r < rows; ++r) {
      for (int v = 0; v < vectors; ++v) {
        _mm512_storeu_ps(t.pt + (j0 + r) * t.ldp + i0 + 16 * v, _mm512_set1_ps(kNegInf));
      }
    }
  }
  template <int R, int NV>
  RINGSPLASH_INLINE void Apply(__m512 (&acc)[R][NV], int64_t j0, int64_t i0) {
    RINGSPLASH_UNROLL
    for (int v = 0; v < NV; ++v) {
      const int64_t col = i0 + 16 * v;
      __m512 vmax = _mm512_load_ps(lane_max + col);
      RINGSPLASH_UNROLL
      for (int r = 0; r < R; ++r) {
        __m512 x = logit(acc[r][v]);
        if constexpr (kMasked) {
          x = _mm512_mask_blend_ps(Allowed16(t, j0 + r, col), _mm512_set1_ps(kNegInf), x);
        }
        _mm512_storeu_ps(t.pt + (j0 + r) * t.ldp + col, x);
        vmax = _mm512_max_ps(vmax, x);
      }
      _mm512_store_ps(lane_max + col, vmax);
    }
  }
};

// Exact step, second pass over the logits of the 16-query strip at i0 whose
// tile max is vmax: P^T = exp(x - shift), then the state update.
void ExpStrip(const TileArgs& t, int64_t i0, __m512 vmax, float* row_max, float* row_sum,
              float* alpha) {
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const __mmask16 live = LaneMask(t.queries - i0);
  const __m512 old_max = _mm512_mask_loadu_ps(neg_inf, live, row_max + i0);
  const __m512 m_new = _mm512_max_ps(old_max, vmax);
  const __m512 shift = ExactShift(m_new);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < t.keys; ++j) {
    float* s = t.pt + j * t.ldp + i0;
    const __m512 p = Exp512(_mm512_sub_ps(_mm512_loadu_ps(s), shift));
    _mm512_storeu_ps(s, p);
    sum = _mm512_add_ps(sum, p);
  }
  CommitExactStrip(i0, live, old_max, m_new, sum, row_max, row_sum, alpha);
}

}  // namespace

// 16 x 16 blocks transposed in registers (Transpose16). The loaded rows are
// also checked for NaN/Inf (NonFiniteCheck, as in the row copies).
bool TransposeF32(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst,
                  int64_t ldd) {
  NonFiniteCheck check;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int nr = static_cast<int>(std::min<int64_t>(16, rows - r0));
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
      const int nc = static_cast<int>(std::min<int64_t>(16, cols - c0));
      const __mmask16 in = LaneMask(nc);
      // The same 16 columns of the next 16 rows, requested now: rows of one
      // head lie D * H floats apart (new lines, often a new page, every
      // row), and the hardware prefetchers do not follow such a stride.
      const int ahead = static_cast<int>(std::clamp<int64_t>(rows - r0 - 16, 0, 16));
      for (int i = 0; i < ahead; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(src + (r0 + 16 + i) * lds + c0), _MM_HINT_T0);
      }
      __m512 r[16];
      RINGSPLASH_UNROLL
      for (int i = 0; i < 16; ++i) {
        r[i] = i < nr ? _mm512_maskz_loadu_ps(in, src + (r0 + i) * lds + c0) : _mm512_setzero_ps();
        check.Add(r[i]);
      }
      Transpose16(r);
      // r[c] is column c0 + c over rows r0 .. r0 + 15 (zero beyond `rows`).
      for (int c = 0; c < nc; ++c) _mm512_storeu_ps(dst + (c0 + c) * ldd + r0, r[c]);
    }
  }
  // Lanes from RoundUp(rows, 16) to ldd.
  const int64_t done = RoundUp(rows, kVec);
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = done; r < ldd; ++r) dst[c * ldd + r] = 0.0f;
  }
  return check.Any();
}

void MaskBits(int64_t queries, int64_t keys, const uint8_t* bytes, int64_t ldb, uint16_t* bits,
              int64_t ldm, int32_t* key_lo, int32_t* key_hi, int32_t* query_lo, int32_t* query_hi) {
  for (int64_t i = 0; i < queries; ++i) key_lo[i] = key_hi[i] = 0;
  // 64 keys x 16 queries at a time: the queries' 64-bit rows (one byte test
  // each), then per key one bit test per query across the 16 rows.
  for (int64_t j0 = 0; j0 < keys; j0 += 64) {
    const int64_t nk = std::min<int64_t>(64, keys - j0);
    const __mmask64 in = nk == 64 ? ~__mmask64{0} : (__mmask64{1} << nk) - 1;
    for (int64_t g = 0; g < ldm; ++g) {
      alignas(64) uint64_t row[16];
      RINGSPLASH_UNROLL
      for (int l = 0; l < 16; ++l) {
        const int64_t i = 16 * g + l;
        row[l] = 0;
        if (i >= queries) continue;
        const __m512i b = _mm512_maskz_loadu_epi8(in, bytes + i * ldb + j0);
        row[l] = _mm512_test_epi8_mask(b, b);
        if (row[l] != 0) {
          const int32_t lo = static_cast<int32_t>(j0 + __builtin_ctzll(row[l]));
          const int32_t hi = static_cast<int32_t>(j0 + 64 - __builtin_clzll(row[l]));
          if (key_hi[i] == 0) key_lo[i] = lo;
          key_hi[i] = hi;
        }
      }
      const __m512i lo8 = _mm512_load_si512(row), hi8 = _mm512_load_si512(row + 8);
      for (int64_t jj = 0; jj < nk; ++jj) {
        const __m512i bit = _mm512_set1_epi64(static_cast<int64_t>(uint64_t{1} << jj));
        const unsigned m = _mm512_test_epi64_mask(lo8, bit) |
                           (static_cast<unsigned>(_mm512_test_epi64_mask(hi8, bit)) << 8);
        bits[(j0 + jj) * ldm + g] = static_cast<uint16_t>(m);
      }
    }
  }
  for (int64_t j = 0; j < keys; ++j) {
    query_lo[j] = query_hi[j] = 0;
    for (int64_t g = 0; g < ldm; ++g) {
      const unsigned w = bits[j * ldm + g];
      if (w == 0) continue;
      if (query_hi[j] == 0) query_lo[j] = static_cast<int32_t>(16 * g + __builtin_ctz(w));
      query_hi[j] = static_cast<int32_t>(16 * g + 32 - __builtin_clz(w));
    }
  }
}

void SoftmaxColumns(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  WithSwitches(t, [&](auto capped, auto masked) {
    const LogitOp<decltype(capped)::value> logit(t);
    const __m512 neg_inf = _mm512_set1_ps(kNegInf);
    const int64_t mp = RoundUp(t.queries, kVec);
    // One 16-query column strip at a time: the max and the sums run down the
    // keys lane-wise (the strip, keys x 64 bytes, stays in L1 between passes).
    for (int64_t i0 = 0; i0 < mp; i0 += 16) {
      __m512 vmax = neg_inf;
      for (int64_t j = 0; j < t.keys; ++j) {
        float* s = t.pt + j * t.ldp + i0;
        __m512 x = logit(_mm512_loadu_ps(s));
        if constexpr (decltype(masked)::value) {
          x = _mm512_mask_blend_ps(Allowed16(t, j, i0), neg_inf, x);
        }
        _mm512_storeu_ps(s, x);
        vmax = _mm512_max_ps(vmax, x);
      }
      ExpStrip(t, i0, vmax, row_max, row_sum, alpha);
    }
  });
}

void ForwardTile(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  if (TryLazyStep(t, row_max, row_sum, alpha)) return;
  // The exact step, its first pass fused into the (trimmed) products.
  const int64_t mp = RoundUp(t.queries, kVec);
  float* lane_max = t.scratch;
  for (int64_t i0 = 0; i0 < mp; i0 += 16) _mm512_store_ps(lane_max + i0, _mm512_set1_ps(kNegInf));
  WithSwitches(t, [&](auto capped, auto masked) {
    constexpr bool kCapped = decltype(capped)::value;
    ExactForwardEpilogue<decltype(masked)::value, kCapped> epi{t, lane_max, LogitOp<kCapped>(t)};
    Blocks(t.keys, mp, t.d, t.k, t.ldk, t.qt, t.ldq, t.mask, t.ldm, epi);
  });
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    ExpStrip(t, i0, _mm512_load_ps(lane_max + i0), row_max, row_sum, alpha);
  }
}

}  // namespace ringsplash::kernels::micro::avx512
