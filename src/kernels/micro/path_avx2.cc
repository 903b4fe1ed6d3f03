// AVX2 + FMA micro-kernel table (compiled with -mavx2 -mfma -mf16c; used only
// after runtime detection, see cpu_features.h): for x86-64 CPUs without
// AVX-512 (AMD Zen 1-3, Intel client cores), which the portable loops would
// leave at a small fraction of their FMA peak.
//
// f32 GEMM: a register block is MR = 6 rows x 16 columns in 12 ymm
// accumulators (two 8-lane halves of a kVec-wide column strip); per step p
// the strip's two B vectors are loaded once and each A(i, p) is broadcast:
// 12 FMAs per 2 loads + 6 broadcasts, 15 of the 16 ymm registers.
// Tiles (micro.h, transposed layout): S^T = K Q^T by that GEMM, one
// 16-query strip at a time (StripProducts), the softmax work in the
// products' epilogue, as on AVX-512. After a query's first tile the forward
// takes the lazy step of micro.h (exps against the reference max straight
// from the accumulators, one pass, no max); the exact step (first tile, or
// fallback) takes the logits and their max there and its exps in a second
// pass over the strip while it sits in L1. The backward's P^T and dS^T come
// from the S^T and dP^T accumulators (lse is known).
#include <immintrin.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/math_avx2.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro {
namespace avx2 {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int kRows = 6;  // MR of the GEMM's register blocks

// acc += A[MR x k] B[k x 16] for the 16-column strip at b.
template <int MR, ALayout L>
RINGSPLASH_INLINE void MultiplyBlock(int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                                     const float* b, int64_t ldb, __m256 (&acc)[MR][2]) {
  const float* ap[MR];
  RINGSPLASH_UNROLL
  for (int i = 0; i < MR; ++i) ap[i] = a + i * a_rs;
  for (int64_t p = 0; p < k; ++p) {
    const __m256 b0 = _mm256_loadu_ps(b + p * ldb);
    const __m256 b1 = _mm256_loadu_ps(b + p * ldb + 8);
    RINGSPLASH_UNROLL
    for (int i = 0; i < MR; ++i) {
      const float* aip = L == ALayout::kRowMajor   ? ap[i] + p
                         : L == ALayout::kColMajor ? a + p * a_cs + i
                                                   : ap[i] + p * a_cs;
      const __m256 av = _mm256_broadcast_ss(aip);
      acc[i][0] = _mm256_fmadd_ps(av, b0, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(av, b1, acc[i][1]);
    }
  }
}

// GemmF32RangesFn for one layout of A.
template <ALayout L>
void GemmLayout(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                bool accumulate, KRanges ranges) {
  // One 16-column strip of B at a time (k x 64 bytes: 8 KiB for k = 128)
  // stays in L1 while the row blocks stream A.
  for (int64_t j = 0; j < n; j += kVec) {
    ForEachRowBlock<kRows>(m, [&](int64_t i0, auto rows) {
      constexpr int R = decltype(rows)::value;
      __m256 acc[R][2];
      float* cb = c + i0 * ldc + j;
      RINGSPLASH_UNROLL
      for (int i = 0; i < R; ++i) {
        if (accumulate) {
          const __m256 r = _mm256_set1_ps(row_scale != nullptr ? row_scale[i0 + i] : 1.0f);
          acc[i][0] = _mm256_mul_ps(_mm256_loadu_ps(cb + i * ldc), r);
          acc[i][1] = _mm256_mul_ps(_mm256_loadu_ps(cb + i * ldc + 8), r);
        } else {
          acc[i][0] = _mm256_setzero_ps();
          acc[i][1] = _mm256_setzero_ps();
        }
      }
      int64_t lo, hi;
      BlockRange(ranges, i0, R, k, &lo, &hi);
      MultiplyBlock<R, L>(hi - lo, a + i0 * a_rs + lo * a_cs, a_rs, a_cs, b + lo * ldb + j, ldb,
                          acc);
      RINGSPLASH_UNROLL
      for (int i = 0; i < R; ++i) {
        _mm256_storeu_ps(cb + i * ldc, acc[i][0]);
        _mm256_storeu_ps(cb + i * ldc + 8, acc[i][1]);
      }
    });
  }
}

void GemmF32Ranges(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                   const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                   bool accumulate, KRanges ranges) {
  WithLayout(a_rs, a_cs, [&](auto layout) {
    GemmLayout<decltype(layout)::value>(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale,
                                        accumulate, ranges);
  });
}

void GemmF32(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
             const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
             bool accumulate) {
  GemmF32Ranges(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate, KRanges());
}

// Lanes l < count of 8 as all-ones (count clamped to [0, 8]).
inline __m256i FirstLanes(int64_t count) {
  const int32_t c = static_cast<int32_t>(count < 0 ? 0 : count > 8 ? 8 : count);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Allowed lanes of key j for the 8 queries from i0 (a multiple of 8), all-ones
// where allowed: the byte of the mask word that holds them, one bit per lane.
inline __m256 Allowed8(const TileArgs& t, int64_t j, int64_t i0) {
  const uint32_t bits = (t.mask[j * t.ldm + i0 / kVec] >> (i0 % kVec)) & 0xFFu;
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i hit = _mm256_and_si256(_mm256_set1_epi32(static_cast<int32_t>(bits)), lane_bit);
  return _mm256_castsi256_ps(_mm256_cmpeq_epi32(hit, lane_bit));
}

// The soft cap and the mask are compile-time switches of the loops below
// (WithSwitches, as in the AVX-512 kernels): with run-time tests, GCC kept
// the tanh code inline beside each exp and reloaded every constant per
// vector, and the fused forward tile ran ~5 % slower
// (docs/perf/DESIGN_MEASUREMENTS.md: AVX2 cap and mask as template switches).

// Logit of a raw product: x = s * scale, then softcap * tanh(x / softcap)
// with a cap (the same operations, in the same order, as the portable loops);
// *th receives the tanh (the backward's derivative needs it).
template <bool kCapped>
struct LogitOp {
  __m256 scale, cap, inv_cap;
  explicit LogitOp(const TileArgs& t)
      : scale(_mm256_set1_ps(t.scale)),
        cap(_mm256_set1_ps(t.softcap)),
        inv_cap(_mm256_set1_ps(kCapped ? 1.0f / t.softcap : 0.0f)) {}
  RINGSPLASH_INLINE __m256 operator()(__m256 s, __m256* th) const {
    const __m256 x = _mm256_mul_ps(s, scale);
    if constexpr (!kCapped) return x;
    *th = Tanh256(_mm256_mul_ps(x, inv_cap));
    return _mm256_mul_ps(cap, *th);
  }
};

// Base-2 exponent of a raw product against a shift2 = m * log2 e, for the
// lazy step: x * log2 e - shift2 in one FMA (the logit's scale folded into
// c2) without a cap; with one, cap * log2 e * tanh(s * scale / cap) - shift2.
template <bool kCapped>
struct ExponentOp {
  __m256 c2, in, out;
  explicit ExponentOp(const TileArgs& t)
      : c2(_mm256_set1_ps(t.scale * poly::kLog2e)),
        in(_mm256_set1_ps(kCapped ? t.scale / t.softcap : 0.0f)),
        out(_mm256_set1_ps(t.softcap * poly::kLog2e)) {}
  // *th (when given) receives the tanh: the backward's derivative needs it.
  RINGSPLASH_INLINE __m256 operator()(__m256 s, __m256 shift2, __m256* th = nullptr) const {
    if constexpr (!kCapped) return _mm256_fmsub_ps(s, c2, shift2);
    const __m256 tanh = Tanh256(_mm256_mul_ps(s, in));
    if (th != nullptr) *th = tanh;
    return _mm256_fmsub_ps(tanh, out, shift2);
  }
};

// The logits of raw products c for key j and the 8 queries from lane0, -inf
// where masked: the exact step's first pass, on stored products
// (SoftmaxStrip) or on the accumulators (ExactStep).
template <bool kCapped, bool kMasked>
RINGSPLASH_INLINE __m256 MaskedLogit(const TileArgs& t, const LogitOp<kCapped>& logit, __m256 c,
                                     int64_t j, int64_t lane0) {
  __m256 th;
  const __m256 x = logit(c, &th);
  if constexpr (!kMasked) return x;
  return _mm256_blendv_ps(_mm256_set1_ps(kNegInf), x, Allowed8(t, j, lane0));
}

// The exact step's second pass over the logits of the 8-query strip at i0
// (t.pt, -inf where masked) whose tile max is vmax: P^T = exp(x - shift) and
// the lane sums, then the state of the live lanes.
void ExpPass(const TileArgs& t, int64_t i0, __m256 vmax, float* row_max, float* row_sum,
             float* alpha) {
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const __m256i live = FirstLanes(t.queries - i0);
  const __m256 old_max =
      _mm256_blendv_ps(neg_inf, _mm256_maskload_ps(row_max + i0, live), _mm256_castsi256_ps(live));
  const __m256 m_new = _mm256_max_ps(old_max, vmax);
  const __m256 none = _mm256_cmp_ps(m_new, neg_inf, _CMP_EQ_OQ);
  const __m256 shift = _mm256_andnot_ps(none, m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < t.keys; ++j) {
    float* s = t.pt + j * t.ldp + i0;
    const __m256 p = Exp256(_mm256_sub_ps(_mm256_loadu_ps(s), shift));
    _mm256_storeu_ps(s, p);
    sum = _mm256_add_ps(sum, p);
  }
  const __m256 a = Exp256(_mm256_sub_ps(old_max, shift));
  const __m256 l = _mm256_fmadd_ps(a, _mm256_maskload_ps(row_sum + i0, live), sum);
  _mm256_maskstore_ps(alpha + i0, live, a);
  _mm256_maskstore_ps(row_sum + i0, live, l);
  _mm256_maskstore_ps(row_max + i0, live, m_new);
}

// The exact online-softmax step (SoftmaxColumnsFn) of the 8-query strip at
// i0: first pass logits (-inf where masked) and their max, second pass
// P^T = exp(x - shift) and the lane sums, then the state of the live lanes.
template <bool kCapped, bool kMasked>
void SoftmaxStrip(const TileArgs& t, const LogitOp<kCapped>& logit, int64_t i0, float* row_max,
                  float* row_sum, float* alpha) {
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  __m256 vmax = neg_inf;
  for (int64_t j = 0; j < t.keys; ++j) {
    float* s = t.pt + j * t.ldp + i0;
    const __m256 x = MaskedLogit<kCapped, kMasked>(t, logit, _mm256_loadu_ps(s), j, i0);
    _mm256_storeu_ps(s, x);
    vmax = _mm256_max_ps(vmax, x);
  }
  ExpPass(t, i0, vmax, row_max, row_sum, alpha);
}

void SoftmaxColumns(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  WithSwitches(t, [&](auto capped, auto masked) {
    const LogitOp<decltype(capped)::value> logit(t);
    const int64_t mp = RoundUp(t.queries, kVec);
    for (int64_t i0 = 0; i0 < mp; i0 += 8) {
      SoftmaxStrip<decltype(capped)::value, decltype(masked)::value>(t, logit, i0, row_max, row_sum,
                                                                     alpha);
    }
  });
}

// Whether the register block of keys [j0, j0 + rows) x the 16 queries from
// i0 (a multiple of 16: one mask word per key) holds an allowed pair; t.mask
// is set. The tile products skip blocks without one (written as zeros or
// -inf, never computed): this keeps the diagonal of causal masks and the
// edges of sliding windows from costing full tiles.
inline bool AnyAllowed(const TileArgs& t, int64_t j0, int rows, int64_t i0) {
  uint32_t any = 0;
  for (int r = 0; r < rows; ++r) any |= t.mask[(j0 + r) * t.ldm + i0 / kVec];
  return any != 0;
}

// The 16 lanes of a skipped block's row set to `value` (0, or -inf for
// logits).
RINGSPLASH_INLINE void FillRow(float* row, __m256 value) {
  _mm256_storeu_ps(row, value);
  _mm256_storeu_ps(row + 8, value);
}

// One 16-query strip (from i0) of the tile products C[keys x 16] = A[keys x
// k] B[k x 16] (A row-major with leading dimension lda, B from b with
// t.ldq), register block by register block in key order, each vector of C
// handed straight from the accumulators to out(j, v, c) (key j, lanes
// i0 + 8 v to i0 + 8 v + 7). With kMasked, a block without an allowed pair
// is not computed: skipped(j) is called for each of its keys instead.
template <bool kMasked, class Out, class Skipped>
RINGSPLASH_INLINE void StripProducts(const TileArgs& t, int64_t i0, int64_t k, const float* a,
                                     int64_t lda, const float* b, Out&& out, Skipped&& skipped) {
  ForEachRowBlock<kRows>(t.keys, [&](int64_t j0, auto rows) {
    constexpr int R = decltype(rows)::value;
    if (kMasked && !AnyAllowed(t, j0, R, i0)) {
      for (int r = 0; r < R; ++r) skipped(j0 + r);
      return;
    }
    __m256 acc[R][2];
    RINGSPLASH_UNROLL
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    MultiplyBlock<R, ALayout::kRowMajor>(k, a + j0 * lda, lda, 1, b + i0, t.ldq, acc);
    RINGSPLASH_UNROLL
    for (int r = 0; r < R; ++r) {
      RINGSPLASH_UNROLL
      for (int v = 0; v < 2; ++v) out(j0 + r, v, acc[r][v]);
    }
  });
}

// The lazy step's products: P^T = 2^(logit(K Q^T) log2 e - m2) straight
// from the accumulators (0 where masked), one 16-query strip at a time, with
// the strip's lane sums kept in registers and stored to sums[mp] at its end.
// m2[mp] holds each lane's reference max times log2 e (0 for dead lanes).
template <bool kCapped, bool kMasked>
void LazyScores(const TileArgs& t, const float* m2, float* sums) {
  const ExponentOp<kCapped> exponent(t);
  const int64_t mp = RoundUp(t.queries, kVec);
  for (int64_t i0 = 0; i0 < mp; i0 += kVec) {
    const __m256 ref[2] = {_mm256_loadu_ps(m2 + i0), _mm256_loadu_ps(m2 + i0 + 8)};
    __m256 sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    StripProducts<kMasked>(
        t, i0, t.d, t.k, t.ldk, t.qt,
        [&](int64_t j, int v, __m256 c) RINGSPLASH_INLINE_LAMBDA {
          __m256 p = Exp2Raw256(exponent(c, ref[v]));
          if constexpr (kMasked) p = _mm256_and_ps(p, Allowed8(t, j, i0 + 8 * v));
          _mm256_storeu_ps(t.pt + j * t.ldp + i0 + 8 * v, p);
          sum[v] = _mm256_add_ps(sum[v], p);
        },
        [&](int64_t j)
            RINGSPLASH_INLINE_LAMBDA { FillRow(t.pt + j * t.ldp + i0, _mm256_setzero_ps()); });
    _mm256_storeu_ps(sums + i0, sum[0]);
    _mm256_storeu_ps(sums + i0 + 8, sum[1]);
  }
}

// The lazy step of ForwardTileFn (micro.h): one pass, exps fused into the
// products, no max. Taken only when every live query has a finite reference
// max (not on its first tile); false, with nothing committed, when some
// query's tile sum exceeds kLazySumLimit (a logit ~14 above its reference)
// or is not finite — the caller then takes the exact step.
bool TryLazyStep(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  const int64_t mp = RoundUp(t.queries, kVec);
  for (int64_t i = 0; i < t.queries; ++i) {
    if (!std::isfinite(row_max[i])) return false;
  }
  float* m2 = t.scratch;
  float* sums = t.scratch + mp;
  for (int64_t i = 0; i < mp; ++i) m2[i] = i < t.queries ? row_max[i] * poly::kLog2e : 0.0f;
  WithSwitches(t, [&](auto capped, auto masked) {
    LazyScores<decltype(capped)::value, decltype(masked)::value>(t, m2, sums);
  });
  for (int64_t i = 0; i < t.queries; ++i) {
    if (!(sums[i] <= kLazySumLimit)) return false;  // a NaN fails too
  }
  for (int64_t i = 0; i < t.queries; ++i) {
    row_sum[i] += sums[i];
    alpha[i] = 1.0f;
  }
  return true;
}

// The exact step of ForwardTileFn (a query's first tile, or a failed lazy
// step), as the AVX-512 path does it: SoftmaxStrip's first pass (logits, -inf
// where masked or skipped, and their max) fused into the products'
// epilogue, then ExpPass on each 8-lane half of a 16-query strip while the
// strip (keys x 64 bytes) sits in L1. The same operations in the same order
// as the products then SoftmaxColumns, so the same bits, without storing
// and reloading the raw products (docs/perf/DESIGN_MEASUREMENTS.md: AVX2
// exact step fused).
template <bool kCapped, bool kMasked>
void ExactStep(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  const LogitOp<kCapped> logit(t);
  const __m256 neg_inf = _mm256_set1_ps(kNegInf);
  const int64_t mp = RoundUp(t.queries, kVec);
  for (int64_t i0 = 0; i0 < mp; i0 += kVec) {
    __m256 vmax[2] = {neg_inf, neg_inf};
    StripProducts<kMasked>(
        t, i0, t.d, t.k, t.ldk, t.qt,
        [&](int64_t j, int v, __m256 c) RINGSPLASH_INLINE_LAMBDA {
          const __m256 x = MaskedLogit<kCapped, kMasked>(t, logit, c, j, i0 + 8 * v);
          _mm256_storeu_ps(t.pt + j * t.ldp + i0 + 8 * v, x);
          vmax[v] = _mm256_max_ps(vmax[v], x);
        },
        [&](int64_t j) RINGSPLASH_INLINE_LAMBDA {
          FillRow(t.pt + j * t.ldp + i0, neg_inf);
          // As the unfused pass, which took the max of these -inf too (a
          // NaN in vmax is dropped in the same order).
          vmax[0] = _mm256_max_ps(vmax[0], neg_inf);
          vmax[1] = _mm256_max_ps(vmax[1], neg_inf);
        });
    ExpPass(t, i0, vmax[0], row_max, row_sum, alpha);
    ExpPass(t, i0 + 8, vmax[1], row_max, row_sum, alpha);
  }
}

void ForwardTile(const TileArgs& t, float* row_max, float* row_sum, float* alpha) {
  if (TryLazyStep(t, row_max, row_sum, alpha)) return;
  WithSwitches(t, [&](auto capped, auto masked) {
    ExactStep<decltype(capped)::value, decltype(masked)::value>(t, row_max, row_sum, alpha);
  });
}

// The fused backward tile (BackwardTileFn), as the AVX-512 path does it:
// lse is known, so P^T = 2^(x log2 e - lse log2 e) comes straight from the
// S^T accumulators (0 where masked or lse = -inf), and dS^T = scale P^T
// (dP^T - delta) [* (1 - tanh^2)] from the dP^T ones, one 16-query strip
// at a time (its P^T, keys x 64 bytes, stays in L1 between the two). This
// replaced a separate elementwise pass over both stored products (4-5 % of
// the backward rows; docs/perf/DESIGN_MEASUREMENTS.md: AVX2 fused backward).
// lse2, delta and keep are [mp]: lse * log2 e (0 where lse = -inf), delta,
// and all-ones on the lanes with lse > -inf (0 on dead lanes and NaN).
template <bool kCapped, bool kMasked>
void BackwardProducts(const BackwardTileArgs& b, const float* lse2, const float* delta,
                      const float* keep) {
  const TileArgs& t = b.t;
  const ExponentOp<kCapped> exponent(t);
  const __m256 scale = _mm256_set1_ps(t.scale);
  const __m256 one = _mm256_set1_ps(1.0f);
  const int64_t mp = RoundUp(t.queries, kVec);
  for (int64_t i0 = 0; i0 < mp; i0 += kVec) {
    const __m256 shift[2] = {_mm256_loadu_ps(lse2 + i0), _mm256_loadu_ps(lse2 + i0 + 8)};
    const __m256 live[2] = {_mm256_loadu_ps(keep + i0), _mm256_loadu_ps(keep + i0 + 8)};
    StripProducts<kMasked>(
        t, i0, t.d, t.k, t.ldk, t.qt,
        [&](int64_t j, int v, __m256 c) RINGSPLASH_INLINE_LAMBDA {
          const int64_t o = j * t.ldp + i0 + 8 * v;
          __m256 th;
          const __m256 p = Exp2Raw256(exponent(c, shift[v], &th));
          if constexpr (kCapped) _mm256_storeu_ps(b.deriv + o, _mm256_fnmadd_ps(th, th, one));
          __m256 ok = live[v];
          if constexpr (kMasked) ok = _mm256_and_ps(ok, Allowed8(t, j, i0 + 8 * v));
          _mm256_storeu_ps(t.pt + o, _mm256_and_ps(ok, p));
        },
        [&](int64_t j)
            RINGSPLASH_INLINE_LAMBDA { FillRow(t.pt + j * t.ldp + i0, _mm256_setzero_ps()); });
    const __m256 dl[2] = {_mm256_loadu_ps(delta + i0), _mm256_loadu_ps(delta + i0 + 8)};
    StripProducts<kMasked>(
        t, i0, b.dv, b.v, b.ldv, b.dot,
        [&](int64_t j, int v, __m256 c) RINGSPLASH_INLINE_LAMBDA {
          const int64_t o = j * t.ldp + i0 + 8 * v;
          const __m256 sp = _mm256_mul_ps(scale, _mm256_loadu_ps(t.pt + o));
          __m256 ds = _mm256_mul_ps(sp, _mm256_sub_ps(c, dl[v]));
          if constexpr (kCapped) ds = _mm256_mul_ps(ds, _mm256_loadu_ps(b.deriv + o));
          _mm256_storeu_ps(b.ds + o, ds);
        },
        [&](int64_t j)
            RINGSPLASH_INLINE_LAMBDA { FillRow(b.ds + j * t.ldp + i0, _mm256_setzero_ps()); });
  }
}

void BackwardTile(const BackwardTileArgs& b) {
  const TileArgs& t = b.t;
  const int64_t mp = RoundUp(t.queries, kVec);
  float* lse2 = t.scratch;
  float* delta = t.scratch + mp;
  float* keep = t.scratch + 2 * mp;
  // Dead lanes and queries with no allowed key (lse = -inf) get P = 0.
  for (int64_t i = 0; i < mp; ++i) {
    // As the unfused pass's ordered compare: a NaN lse gets P = 0 too.
    const bool keys = i < t.queries && b.lse[i] > kNegInf;
    lse2[i] = keys ? b.lse[i] * poly::kLog2e : 0.0f;
    delta[i] = i < t.queries ? b.delta[i] : 0.0f;
    keep[i] = std::bit_cast<float>(keys ? ~0u : 0u);
  }
  WithSwitches(t, [&](auto capped, auto masked) {
    BackwardProducts<decltype(capped)::value, decltype(masked)::value>(b, lse2, delta, keep);
  });
}

// Running NaN/Inf check over loaded f32 vectors (as NonFiniteCheck in
// micro/common_avx512.h): the max of |bits| reaches the infinity pattern (exponent
// all ones) iff some value was a NaN or an infinity.
class NonFiniteCheck {
 public:
  RINGSPLASH_INLINE void Add(__m256 v) {
    worst_ = _mm256_max_epi32(
        worst_, _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7FFFFFFF)));
  }
  bool Any() const {
    const __m256i inf = _mm256_set1_epi32(0x7F800000);
    return _mm256_movemask_epi8(_mm256_cmpgt_epi32(inf, worst_)) != -1;
  }

 private:
  __m256i worst_ = _mm256_setzero_si256();
};

// Rows this far ahead are requested while a row is copied (as in the
// AVX-512 copy: the rows are strided by other heads, which the hardware
// prefetchers do not follow).
constexpr int64_t kPrefetchRows = 8;

// `left` (0 to 8 and more) elements of a row from src as 8 f32 lanes (bf16
// zero extended and shifted into the high halves: exact), the rest 0. A
// bf16 row's last partial step goes through a zeroed staging vector (AVX2
// has no 16-bit masked load).
RINGSPLASH_INLINE __m256 LoadRowAsF32(const float* src, int64_t left) {
  return left >= 8  ? _mm256_loadu_ps(src)
         : left > 0 ? _mm256_maskload_ps(src, FirstLanes(left))
                    : _mm256_setzero_ps();
}
RINGSPLASH_INLINE __m256 LoadRowAsF32(const uint16_t* src, int64_t left) {
  __m128i half;
  if (left >= 8) {
    half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  } else {
    alignas(16) uint16_t stage[8] = {};
    for (int64_t i = 0; i < left; ++i) stage[i] = src[i];
    half = _mm_load_si128(reinterpret_cast<const __m128i*>(stage));
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// copy_rows_f32 (T = float) and widen_rows_bf16 (T = uint16_t): 8 elements per
// step.
template <typename T>
bool CopyRowsAsF32(const T* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  NonFiniteCheck check;  // lanes beyond `cols` load as 0
  for (int64_t r = 0; r < rows; ++r) {
    if (r + kPrefetchRows < rows) {
      const char* ahead = reinterpret_cast<const char*>(src + (r + kPrefetchRows) * lds);
      for (int64_t o = 0; o < cols * static_cast<int64_t>(sizeof(T)); o += 64) {
        _mm_prefetch(ahead + o, _MM_HINT_T0);
      }
    }
    const T* s = src + r * lds;
    float* d = dst + r * ldd;
    for (int64_t c = 0; c < ldd; c += 8) {
      const __m256 v = LoadRowAsF32(s + c, cols - c);
      check.Add(v);
      if (ldd - c >= 8) {
        _mm256_storeu_ps(d + c, v);
      } else {
        _mm256_maskstore_ps(d + c, FirstLanes(ldd - c), v);
      }
    }
  }
  return check.Any();
}

// 8 x 8 blocks transposed in registers: unpack pairs of rows, shuffle pairs
// of 64-bit pairs, then swap 128-bit halves. Each 8-row strip reads its rows
// front to back, where a column walk touches 128 strided cache lines per
// column (docs/perf/DESIGN_MEASUREMENTS.md: AVX2 Q^T transpose).
// The loaded values go through NonFiniteCheck (lanes beyond `cols` and rows
// beyond `rows` load as 0).
bool TransposeF32(int64_t rows, int64_t cols, const float* src, int64_t lds, float* dst,
                  int64_t ldd) {
  NonFiniteCheck check;
  for (int64_t r0 = 0; r0 < rows; r0 += 8) {
    const int64_t nr = std::min<int64_t>(8, rows - r0);
    for (int64_t c0 = 0; c0 < cols; c0 += 8) {
      const int64_t nc = std::min<int64_t>(8, cols - c0);
      const __m256i in = FirstLanes(nc);
      __m256 r[8], t[8];
      RINGSPLASH_UNROLL
      for (int i = 0; i < 8; ++i) {
        const float* s = src + (r0 + i) * lds + c0;
        r[i] = i >= nr   ? _mm256_setzero_ps()
               : nc == 8 ? _mm256_loadu_ps(s)
                         : _mm256_maskload_ps(s, in);
        check.Add(r[i]);
      }
      RINGSPLASH_UNROLL
      for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
      }
      RINGSPLASH_UNROLL
      for (int h = 0; h < 2; ++h) {  // rows 4h .. 4h + 3
        r[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
        r[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
        r[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
        r[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
      }
      RINGSPLASH_UNROLL
      for (int i = 0; i < 4; ++i) {
        t[i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x20);
        t[4 + i] = _mm256_permute2f128_ps(r[i], r[4 + i], 0x31);
      }
      // t[c] is column c0 + c over rows r0 .. r0 + 7 (zero beyond `rows`).
      for (int64_t c = 0; c < nc; ++c) _mm256_storeu_ps(dst + (c0 + c) * ldd + r0, t[c]);
    }
  }
  // Lanes from RoundUp(rows, 8) to ldd.
  const int64_t done = RoundUp(rows, 8);
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t r = done; r < ldd; ++r) dst[c * ldd + r] = 0.0f;
  }
  return check.Any();
}

}  // namespace

bool DecodeStep(const DecodeArgs& a);  // decode/step_avx2.cc

}  // namespace avx2

const MicroKernels& Avx2MicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t = PortableMicroKernels();
    t.name = "avx2";
    t.gemm_f32 = avx2::GemmF32;
    t.gemm_f32_ranges = avx2::GemmF32Ranges;
    t.copy_rows_f32 = avx2::CopyRowsAsF32<float>;
    t.widen_rows_bf16 = avx2::CopyRowsAsF32<uint16_t>;
    t.transpose_f32 = avx2::TransposeF32;
    t.softmax_columns = avx2::SoftmaxColumns;
    t.forward_tile = avx2::ForwardTile;
    t.backward_tile = avx2::BackwardTile;
    t.decode_step = avx2::DecodeStep;
    return t;
  }();
  return table;
}

}  // namespace ringsplash::kernels::micro
