// Fused transposed-layout tile kernels (micro.h TileArgs) for AVX-512:
// S^T = K Q^T is computed one register block (6 keys x 64 queries) at a
// time and the softmax work is done while the block is still in registers.
//
// Forward (lazy rescaling): once a query has a finite reference max m_i (its
// running max after an exact step), the next tiles need no max pass at all:
// P^T = 2^(x * log2 e - m_i * log2 e) is evaluated straight from the
// accumulators (one FMA gives the shifted exponent), stored, and summed per
// lane. Only if some query's tile sum exceeds kLazySumLimit (a logit more
// than ~14 above m_i: rare after the first tile) or is not finite is the tile
// recomputed with the exact two-pass step, which then also raises m_i. The
// first tile of every query takes the exact step.
//
// Backward: lse is known, so P^T = 2^(x * log2 e - lse * log2 e) is always
// fused into the S^T block, and dS^T = scale P^T (dP^T - delta) into the
// dP^T = V dO^T block.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -W(maybe-)uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cstdint>
#include <limits>

#include "src/kernels/micro.h"
#include "src/kernels/micro_avx512.h"
#include "src/kernels/micro_math_avx512.h"

namespace ringsplash::kernels::micro::avx512 {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.44269504088896341f;
// Stands in for log2(lse) of a query without any allowed key: the shifted
// exponent becomes ~-1e30 and 2^that is exactly 0 (no -inf, hence no NaN).
constexpr float kHugeShift = 1e30f;

inline __mmask16 LaneMask(int64_t lanes) {
  return lanes >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << lanes) - 1u);
}

// Lanes whose mask byte m[0..16) is non-zero (the transposed mask has a
// leading dimension >= mp, so 16 bytes are always readable).
inline __mmask16 Allowed16(const uint8_t* m) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m));
  return _mm_test_epi8_mask(bytes, bytes);
}

// Register blocks of C[rows x mp] = A[rows x k] B[k x mp] (A row-major with
// leading dimension lda, B with ldb), each handed to epi.Apply(acc, j0, i0)
// instead of being stored: rows j0.., lanes i0.. .
template <class Epilogue>
void Blocks(int64_t rows, int64_t mp, int64_t k, const float* a, int64_t lda, const float* b,
            int64_t ldb, Epilogue& epi) {
  auto panel = [&]<int MR, int NV>(int64_t i0) {
    ForEachRowBlock<MR>(rows, [&](int64_t j0, auto r) {
      constexpr int R = decltype(r)::value;
      __m512 acc[R][NV];
      ZeroBlock(acc);
      MultiplyBlock<R, NV, ALayout::kRowMajor>(k, a + j0 * lda, lda, 1, b + i0, ldb, acc);
      epi.template Apply<R, NV>(acc, j0, i0);
    });
  };
  int64_t i = 0;
  for (; i + 64 <= mp; i += 64) panel.template operator()<6, 4>(i);
  for (; i + 32 <= mp; i += 32) panel.template operator()<8, 2>(i);
  for (; i + 16 <= mp; i += 16) panel.template operator()<8, 1>(i);
}

// Natural logit of the raw product (scale, then the soft cap).
struct LogitOp {
  __m512 scale, cap, inv_cap;
  bool capped;
  explicit LogitOp(const TileArgs& t)
      : scale(_mm512_set1_ps(t.scale)),
        cap(_mm512_set1_ps(t.softcap)),
        inv_cap(_mm512_set1_ps(t.softcap > 0.0f ? 1.0f / t.softcap : 0.0f)),
        capped(t.softcap > 0.0f) {}
  __m512 operator()(__m512 s) const {
    __m512 x = _mm512_mul_ps(s, scale);
    if (capped) x = _mm512_mul_ps(cap, Tanh512(_mm512_mul_ps(x, inv_cap)));
    return x;
  }
};

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

// --- Forward --------------------------------------------------------------------

// Lazy step: P^T = 2^(x2 - m2) from the registers, per-lane sums into `sums`.
template <bool kMasked, bool kCapped>
struct LazyForwardEpilogue {
  const TileArgs& t;
  const float* m2;  // [mp] row_max * log2 e
  float* sums;      // [mp]
  ExponentOp<kCapped> exponent;

  template <int R, int NV>
  RINGSPLASH_INLINE void Apply(__m512 (&acc)[R][NV], int64_t j0, int64_t i0) {
    for (int v = 0; v < NV; ++v) {
      const int64_t col = i0 + 16 * v;
      const __m512 shift = _mm512_load_ps(m2 + col);
      __m512 sum = _mm512_setzero_ps();
      for (int r = 0; r < R; ++r) {
        __m512 th;
        __m512 p = Exp2Raw512(exponent(acc[r][v], shift, &th));
        if constexpr (kMasked) {
          p = _mm512_maskz_mov_ps(Allowed16(t.mask + (j0 + r) * t.ldm + col), p);
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
  Blocks(t.keys, mp, t.d, t.k, t.ldk, t.qt, t.ldq, epi);
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
  const bool masked = t.mask != nullptr, capped = t.softcap > 0.0f;
  if (masked) {
    capped ? LazyScores<true, true>(t, mp) : LazyScores<true, false>(t, mp);
  } else {
    capped ? LazyScores<false, true>(t, mp) : LazyScores<false, false>(t, mp);
  }
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

// --- Backward -------------------------------------------------------------------

// P^T = 2^(x2 - lse2) (0 where masked), with a cap also deriv^T = 1 - tanh^2.
template <bool kMasked, bool kCapped>
struct ProbsEpilogue {
  const TileArgs& t;
  const float* lse2;  // [mp] lse * log2 e, kHugeShift for queries without keys
  float* deriv;
  ExponentOp<kCapped> exponent;

  template <int R, int NV>
  RINGSPLASH_INLINE void Apply(__m512 (&acc)[R][NV], int64_t j0, int64_t i0) {
    for (int v = 0; v < NV; ++v) {
      const int64_t col = i0 + 16 * v;
      const __m512 shift = _mm512_load_ps(lse2 + col);
      for (int r = 0; r < R; ++r) {
        const int64_t o = (j0 + r) * t.ldp + col;
        __m512 th;
        __m512 p = Exp2Raw512(exponent(acc[r][v], shift, &th));
        if constexpr (kCapped) {
          _mm512_storeu_ps(deriv + o, _mm512_fnmadd_ps(th, th, _mm512_set1_ps(1.0f)));
        }
        if constexpr (kMasked)
          p = _mm512_maskz_mov_ps(Allowed16(t.mask + (j0 + r) * t.ldm + col), p);
        _mm512_storeu_ps(t.pt + o, p);
      }
    }
  }
};

// dS^T = scale P^T (dP^T - delta) [* deriv^T] from the dP^T registers.
template <bool kCapped>
struct DsEpilogue {
  const BackwardTileArgs& b;
  const float* delta;  // [mp]
  __m512 scale;

  template <int R, int NV>
  RINGSPLASH_INLINE void Apply(__m512 (&acc)[R][NV], int64_t j0, int64_t i0) {
    const int64_t ldp = b.t.ldp;
    for (int v = 0; v < NV; ++v) {
      const int64_t col = i0 + 16 * v;
      const __m512 dl = _mm512_load_ps(delta + col);
      for (int r = 0; r < R; ++r) {
        const int64_t o = (j0 + r) * ldp + col;
        const __m512 sp = _mm512_mul_ps(scale, _mm512_loadu_ps(b.t.pt + o));
        __m512 ds = _mm512_mul_ps(sp, _mm512_sub_ps(acc[r][v], dl));
        if constexpr (kCapped) ds = _mm512_mul_ps(ds, _mm512_loadu_ps(b.deriv + o));
        _mm512_storeu_ps(b.ds + o, ds);
      }
    }
  }
};

template <bool kMasked, bool kCapped>
void Probs(const TileArgs& t, int64_t mp, const float* lse2, float* deriv) {
  ProbsEpilogue<kMasked, kCapped> epi{t, lse2, deriv, ExponentOp<kCapped>(t)};
  Blocks(t.keys, mp, t.d, t.k, t.ldk, t.qt, t.ldq, epi);
}

}  // namespace

void SoftmaxColumns(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  const LogitOp logit(t);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  const int64_t mp = RoundUp(t.queries, kVec);
  // One 16-query column strip at a time: the max and the sums run down the
  // keys lane-wise (the strip, keys x 64 bytes, stays in L1 between passes).
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    __m512 vmax = neg_inf;
    for (int64_t j = 0; j < t.keys; ++j) {
      float* s = t.pt + j * t.ldp + i0;
      __m512 x = logit(_mm512_loadu_ps(s));
      if (t.mask != nullptr)
        x = _mm512_mask_blend_ps(Allowed16(t.mask + j * t.ldm + i0), neg_inf, x);
      _mm512_storeu_ps(s, x);
      vmax = _mm512_max_ps(vmax, x);
    }
    const __m512 old_max = _mm512_mask_loadu_ps(neg_inf, live, row_max + i0);
    const __m512 m_new = _mm512_max_ps(old_max, vmax);
    const __mmask16 none = _mm512_cmp_ps_mask(m_new, neg_inf, _CMP_EQ_OQ);
    const __m512 shift = _mm512_mask_blend_ps(none, m_new, _mm512_setzero_ps());
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < t.keys; ++j) {
      float* s = t.pt + j * t.ldp + i0;
      const __m512 p = Exp512(_mm512_sub_ps(_mm512_loadu_ps(s), shift));
      _mm512_storeu_ps(s, p);
      sum = _mm512_add_ps(sum, p);
    }
    const __m512 a = Exp512(_mm512_sub_ps(old_max, shift));
    _mm512_mask_storeu_ps(alpha + i0, live, a);
    const __m512 l = _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(live, row_sum + i0), sum);
    _mm512_mask_storeu_ps(row_sum + i0, live, l);
    _mm512_mask_storeu_ps(row_max + i0, live, m_new);
  }
}

void ForwardTile(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  if (TryLazyStep(t, row_max, row_sum, alpha)) return;
  GemmF32Avx512(t.keys, RoundUp(t.queries, kVec), t.d, t.k, t.ldk, 1, t.qt, t.ldq, t.pt, t.ldp,
                nullptr, false);
  SoftmaxColumns(t, row_max, row_sum, alpha);
}

void BackwardTile(const BackwardTileArgs& b) {
  const TileArgs& t = b.t;
  const int64_t mp = RoundUp(t.queries, kVec);
  float* lse2 = t.scratch;
  float* delta = t.scratch + mp;
  for (int64_t i0 = 0; i0 < mp; i0 += 16) {
    const __mmask16 live = LaneMask(t.queries - i0);
    const __m512 l = _mm512_maskz_loadu_ps(live, b.lse + i0);
    // Dead lanes and queries without keys (lse = -inf) get P = 0.
    const __mmask16 keys = _mm512_mask_cmp_ps_mask(live, l, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
    _mm512_store_ps(
        lse2 + i0, _mm512_mask_mul_ps(_mm512_set1_ps(kHugeShift), keys, l, _mm512_set1_ps(kLog2e)));
    _mm512_store_ps(delta + i0, _mm512_maskz_loadu_ps(live, b.delta + i0));
  }
  const bool masked = t.mask != nullptr, capped = t.softcap > 0.0f;
  if (masked) {
    capped ? Probs<true, true>(t, mp, lse2, b.deriv) : Probs<true, false>(t, mp, lse2, b.deriv);
  } else {
    capped ? Probs<false, true>(t, mp, lse2, b.deriv) : Probs<false, false>(t, mp, lse2, b.deriv);
  }
  const __m512 scale = _mm512_set1_ps(t.scale);
  if (capped) {
    DsEpilogue<true> epi{b, delta, scale};
    Blocks(t.keys, mp, b.dv, b.v, b.ldv, b.dot, t.ldq, epi);
  } else {
    DsEpilogue<false> epi{b, delta, scale};
    Blocks(t.keys, mp, b.dv, b.v, b.ldv, b.dot, t.ldq, epi);
  }
}

}  // namespace ringsplash::kernels::micro::avx512
