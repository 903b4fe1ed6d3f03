// Vectorised exp and tanh for the AVX-512 micro-kernels. Include only from
// translation units compiled with AVX-512 flags (micro/*_avx512*.cc).
#ifndef RINGSPLASH_KERNELS_MICRO_MATH_AVX512_H_
#define RINGSPLASH_KERNELS_MICRO_MATH_AVX512_H_

#include <immintrin.h>

#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/poly.h"

namespace ringsplash::kernels::micro {

// 2^f for f in [-0.5, 0.5] by the kExp2 polynomial (micro/poly.h).
inline __m512 Exp2Poly512(__m512 f) {
  using namespace poly;
  __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(kExp2[0]), f, _mm512_set1_ps(kExp2[1]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2[2]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2[3]));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2[4]));
  return _mm512_fmadd_ps(y, f, _mm512_set1_ps(kExp2[5]));
}

// Results in the subnormal range cost a microcode assist per instruction on
// Intel cores (hundreds of cycles): masked logits (-inf) pushed through exp
// would slow the exact softmax step several times over (docs/perf/DESIGN_MEASUREMENTS.md:
// no subnormal exps). So the exps below never produce
// subnormals: tiny results are either clamped to a normal number or zeroed.

// 2^x, x = n + f with n = round(x) (adding 1.5 * 2^23 rounds to an integer),
// 2^f by Exp2Poly512, then scalef by 2^n. x is first clamped to >= -125, so
// the result is a normal number >= 2^-125.5 (never 0: callers zero masked
// lanes themselves), -inf gives that too and x >= 128 gives +inf. A NaN
// gives 2^-125 too (max returns its second operand when one is NaN); none
// arrives: inputs are finite by then (attention.cc cleans non-finite ones),
// so x = s * c - shift is finite or +-inf. 10 instructions — the softmax
// inner loop of the fused kernels.
inline __m512 Exp2Raw512(__m512 x) {
  using namespace poly;
  x = _mm512_max_ps(x, _mm512_set1_ps(kExp2Min));
  const __m512 magic = _mm512_set1_ps(kRoundMagic);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(x, magic), magic);
  return _mm512_scalef_ps(Exp2Poly512(_mm512_sub_ps(x, n)), n);
}

// exp(x), f32, ~2e-7 relative for the softmax range. x = n ln2 + r with n =
// round(x log2 e) and r = x - n ln2 (Cody-Waite, two constants, so r keeps
// full precision for large |x|) in [-ln2/2, ln2/2]; e^r = 2^(r / ln2) by the
// same minimax polynomial, with its coefficients scaled by ln2^-k.
// x < -86 (where e^x < 4e-38, next to nothing against the row's max term
// e^0) gives exactly 0 — in particular -inf, the masked logits — and x is
// clamped to [-86, 88.7] inside, so nothing subnormal or NaN is formed.
RINGSPLASH_INLINE __m512 Exp512(__m512 x) {
  using namespace poly;
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_LT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpMin));
  x = _mm512_min_ps(x, _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 y = _mm512_set1_ps(kExp[0]);
  RINGSPLASH_UNROLL
  for (int k = 1; k < 6; ++k) y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(kExp[k]));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(y, n));
}

// tanh(x), f32: odd/even rational approximation on [-7.9988, 7.9988] (beyond,
// tanh rounds to +-1 in f32), the minimax form Eigen uses for float; x itself
// for |x| < 4e-4 where tanh(x) = x in f32. Checked against std::tanh in
// flash_kernel_test.
RINGSPLASH_INLINE __m512 Tanh512(__m512 x) {
  using namespace poly;
  const __m512 kClamp = _mm512_set1_ps(kTanhClamp);
  const __m512 xc =
      _mm512_min_ps(_mm512_max_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), kClamp)), kClamp);
  const __m512 x2 = _mm512_mul_ps(xc, xc);
  __m512 p = _mm512_set1_ps(kTanhP[0]);
  RINGSPLASH_UNROLL
  for (int k = 1; k < 7; ++k) p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(kTanhP[k]));
  p = _mm512_mul_ps(p, xc);
  __m512 q = _mm512_set1_ps(kTanhQ[0]);
  RINGSPLASH_UNROLL
  for (int k = 1; k < 4; ++k) q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(kTanhQ[k]));
  const __m512 t = _mm512_div_ps(p, q);
  const __mmask16 tiny =
      _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(kTanhTiny), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(tiny, t, x);
}

// Horizontal max / sum of 16 lanes.
inline float ReduceMax512(__m512 v) { return _mm512_reduce_max_ps(v); }
inline float ReduceAdd512(__m512 v) { return _mm512_reduce_add_ps(v); }

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_MATH_AVX512_H_
