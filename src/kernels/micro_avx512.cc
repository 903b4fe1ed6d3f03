// AVX-512 f32 micro-kernels (compiled with -mavx512f/bw/vl/dq -mfma; called
// only after runtime detection, see micro.h).
//
// GEMM: register blocking MR rows x NV vectors of 16 columns (6 x 64 or
// 8 x 32: 24 or 16 zmm accumulators). Per p, the NV vectors of B's row p are
// loaded once and each A(i, p) is broadcast (an embedded-broadcast FMA
// operand), so a 6 x 64 block does 24 FMAs per 4 vector loads + 6 broadcasts.
// C is read (accumulate, optionally row-scaled: the online softmax's alpha)
// and written once per block. Column blocks are the outer loop so the B panel
// (k x 64 floats) stays in L1 while row blocks stream A.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -Wmaybe-uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "src/kernels/micro.h"
#include "src/kernels/micro_math_avx512.h"

namespace ringsplash::kernels::micro {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// How A(i, p) = a[i * a_rs + p * a_cs] is walked.
enum class ALayout { kRowMajor, kColMajor, kGeneral };  // a_cs == 1 / a_rs == 1 / other

template <int MR, int NV, ALayout L>
inline void GemmBlock(int64_t k, const float* a, int64_t a_rs, int64_t a_cs, const float* b,
                      int64_t ldb, float* c, int64_t ldc, const float* row_scale, bool accumulate) {
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
  if constexpr (L == ALayout::kRowMajor) {
    const float* ap[MR];
    for (int i = 0; i < MR; ++i) ap[i] = a + i * a_rs;
    for (int64_t p = 0; p < k; ++p) {
      __m512 bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + p * ldb + 16 * v);
      for (int i = 0; i < MR; ++i) {
        const __m512 ai = _mm512_set1_ps(ap[i][p]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
      }
    }
  } else {
    for (int64_t p = 0; p < k; ++p) {
      const float* ap = a + p * a_cs;
      __m512 bv[NV];
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_loadu_ps(b + p * ldb + 16 * v);
      for (int i = 0; i < MR; ++i) {
        const __m512 ai = _mm512_set1_ps(L == ALayout::kColMajor ? ap[i] : ap[i * a_rs]);
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, bv[v], acc[i][v]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
  }
}

// Calls the block of exactly `rows` rows, 1 <= rows <= R.
template <int R, int NV, ALayout L>
inline void GemmRows(int64_t rows, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                     const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                     bool accumulate) {
  if constexpr (R > 1) {
    if (rows < R) {
      GemmRows<R - 1, NV, L>(rows, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate);
      return;
    }
  }
  GemmBlock<R, NV, L>(k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate);
}

// One column panel (NV vectors wide) over all m rows, in ceil(m / MR) row
// blocks of balanced height (64 rows: 9 x 6 + 2 x 5 instead of 10 x 6 + 4),
// so no block runs with few accumulators.
template <int MR, int NV, ALayout L>
void GemmColumnPanel(int64_t m, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                     const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                     bool accumulate) {
  const int64_t blocks = (m + MR - 1) / MR;
  if (blocks == 0) return;
  const int64_t base = m / blocks, taller = m % blocks;  // `taller` blocks get base + 1 rows
  int64_t i = 0;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t rows = base + (blk < taller ? 1 : 0);
    GemmRows<MR, NV, L>(rows, k, a + i * a_rs, a_rs, a_cs, b, ldb, c + i * ldc, ldc,
                        row_scale != nullptr ? row_scale + i : nullptr, accumulate);
    i += rows;
  }
}

template <ALayout L>
void GemmLayout(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
                const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                bool accumulate) {
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    GemmColumnPanel<6, 4, L>(m, k, a, a_rs, a_cs, b + j, ldb, c + j, ldc, row_scale, accumulate);
  }
  for (; j + 32 <= n; j += 32) {
    GemmColumnPanel<8, 2, L>(m, k, a, a_rs, a_cs, b + j, ldb, c + j, ldc, row_scale, accumulate);
  }
  for (; j + 16 <= n; j += 16) {
    GemmColumnPanel<8, 1, L>(m, k, a, a_rs, a_cs, b + j, ldb, c + j, ldc, row_scale, accumulate);
  }
}

void GemmF32(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs, int64_t a_cs,
             const float* b, int64_t ldb, float* c, int64_t ldc, const float* row_scale,
             bool accumulate) {
  if (a_cs == 1) {
    GemmLayout<ALayout::kRowMajor>(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate);
  } else if (a_rs == 1) {
    GemmLayout<ALayout::kColMajor>(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate);
  } else {
    GemmLayout<ALayout::kGeneral>(m, n, k, a, a_rs, a_cs, b, ldb, c, ldc, row_scale, accumulate);
  }
}

inline __mmask16 LaneMask(int64_t lanes) {
  return lanes >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << lanes) - 1u);
}

// Lanes of mask bytes m[0..16) that are non-zero, within `valid`.
inline __mmask16 AllowedLanes(const uint8_t* m, __mmask16 valid) {
  const __m128i bytes = _mm_maskz_loadu_epi8(valid, m);
  return _mm_test_epi8_mask(bytes, bytes);
}

// scale, then soft cap: x = cap * tanh(x / cap).
inline __m512 Logit(__m512 s, __m512 scale, bool capped, __m512 cap, __m512 inv_cap) {
  __m512 x = _mm512_mul_ps(s, scale);
  if (capped) x = _mm512_mul_ps(cap, Tanh512(_mm512_mul_ps(x, inv_cap)));
  return x;
}

void SoftmaxForward(int64_t m, int64_t n, float* s, int64_t lds, const uint8_t* mask, int64_t ldm,
                    float scale, float softcap, float* row_max, float* row_sum, float* alpha) {
  const bool capped = softcap > 0.0f;
  const __m512 vscale = _mm512_set1_ps(scale), vcap = _mm512_set1_ps(softcap);
  const __m512 vinv = _mm512_set1_ps(capped ? 1.0f / softcap : 0.0f);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf);
  // Rows in groups of 16: the element work is vectorised along each row, the
  // row bookkeeping (alpha = exp(old max - shift), running sums) across the
  // group's rows, so no scalar exp per row.
  for (int64_t i0 = 0; i0 < m; i0 += 16) {
    alignas(64) float new_max[16], shift[16], tile_sum[16];
    const int64_t rows = std::min<int64_t>(16, m - i0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      float* si = s + i * lds;
      const uint8_t* mi = mask != nullptr ? mask + i * ldm : nullptr;
      __m512 vmax = neg_inf;
      for (int64_t j = 0; j < n; j += 16) {
        const __mmask16 valid = LaneMask(n - j);
        const __mmask16 keep = mi != nullptr ? AllowedLanes(mi + j, valid) : valid;
        __m512 x = Logit(_mm512_maskz_loadu_ps(valid, si + j), vscale, capped, vcap, vinv);
        x = _mm512_mask_blend_ps(keep, neg_inf, x);
        _mm512_storeu_ps(si + j, x);
        vmax = _mm512_max_ps(vmax, x);
      }
      new_max[r] = std::fmax(row_max[i], ReduceMax512(vmax));
      shift[r] = new_max[r] == kNegInf ? 0.0f : new_max[r];
      const __m512 vshift = _mm512_set1_ps(shift[r]);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += 16) {
        const __m512 e = Exp512(_mm512_sub_ps(_mm512_loadu_ps(si + j), vshift));
        _mm512_storeu_ps(si + j, e);  // lanes >= n hold -inf -> 0: the zero padding
        vsum = _mm512_add_ps(vsum, e);
      }
      tile_sum[r] = ReduceAdd512(vsum);
    }
    const __mmask16 live = LaneMask(rows);
    const __m512 old_max = _mm512_maskz_loadu_ps(live, row_max + i0);
    const __m512 a = Exp512(_mm512_sub_ps(old_max, _mm512_load_ps(shift)));
    _mm512_mask_storeu_ps(alpha + i0, live, a);
    const __m512 sum =
        _mm512_fmadd_ps(a, _mm512_maskz_loadu_ps(live, row_sum + i0), _mm512_load_ps(tile_sum));
    _mm512_mask_storeu_ps(row_sum + i0, live, sum);
    _mm512_mask_storeu_ps(row_max + i0, live, _mm512_load_ps(new_max));
  }
}

void ProbsBackward(int64_t m, int64_t n, float* s, int64_t lds, const uint8_t* mask, int64_t ldm,
                   float scale, float softcap, const float* lse, float* deriv) {
  const bool capped = softcap > 0.0f;
  const __m512 vscale = _mm512_set1_ps(scale), vcap = _mm512_set1_ps(softcap);
  const __m512 vinv = _mm512_set1_ps(capped ? 1.0f / softcap : 0.0f);
  const __m512 neg_inf = _mm512_set1_ps(kNegInf), one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < m; ++i) {
    float* si = s + i * lds;
    const uint8_t* mi = mask != nullptr ? mask + i * ldm : nullptr;
    // lse = -inf: no allowed key in the row; exp(x - inf) = 0 everywhere.
    const __m512 vshift = _mm512_set1_ps(lse[i] == kNegInf ? -kNegInf : lse[i]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 valid = LaneMask(n - j);
      const __mmask16 keep = mi != nullptr ? AllowedLanes(mi + j, valid) : valid;
      __m512 x = Logit(_mm512_maskz_loadu_ps(valid, si + j), vscale, capped, vcap, vinv);
      if (capped) {
        const __m512 t = _mm512_mul_ps(x, vinv);
        _mm512_storeu_ps(deriv + i * lds + j, _mm512_fnmadd_ps(t, t, one));
      }
      x = _mm512_mask_blend_ps(keep, neg_inf, x);
      _mm512_storeu_ps(si + j, Exp512(_mm512_sub_ps(x, vshift)));
    }
  }
}

void DsBackward(int64_t m, int64_t n, const float* p, float* dp, int64_t ld, const float* delta,
                const float* deriv, float scale) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < m; ++i) {
    const __m512 vdelta = _mm512_set1_ps(delta[i]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 valid = LaneMask(n - j);
      const int64_t o = i * ld + j;
      __m512 ds = _mm512_mul_ps(_mm512_mul_ps(vscale, _mm512_loadu_ps(p + o)),
                                _mm512_sub_ps(_mm512_loadu_ps(dp + o), vdelta));
      if (deriv != nullptr) ds = _mm512_mul_ps(ds, _mm512_loadu_ps(deriv + o));
      _mm512_storeu_ps(dp + o, _mm512_maskz_mov_ps(valid, ds));
    }
  }
}

}  // namespace

const MicroKernels& Avx512MicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t = PortableMicroKernels();
    t.name = "avx512";
    t.gemm_f32 = GemmF32;
    t.softmax_forward = SoftmaxForward;
    t.probs_backward = ProbsBackward;
    t.ds_backward = DsBackward;
    return t;
  }();
  return table;
}

}  // namespace ringsplash::kernels::micro
