// Vectorised exp and tanh for the AVX-512 micro-kernels. Include only from
// translation units compiled with AVX-512 flags (micro_avx512*.cc).
#ifndef RINGSPLASH_KERNELS_MICRO_MATH_AVX512_H_
#define RINGSPLASH_KERNELS_MICRO_MATH_AVX512_H_

#include <immintrin.h>

namespace ringsplash::kernels::micro {

// exp(x), f32, ~1 ulp for the softmax range. x = 2^n * e^r with n = round(x *
// log2 e), r = x - n ln2 (Cody-Waite, two constants) in [-ln2/2, ln2/2], and
// e^r by its degree-7 Taylor polynomial (truncation < 0.35^8 / 8! = 5e-9).
// x is clamped to [-110, 88.7]: -inf (masked logits) and anything below -110
// give exactly 0 (scalef by 2^-159 underflows), never NaN.
inline __m512 Exp512(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.0f / 5040.0f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 720.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 120.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 24.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f / 6.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// tanh(x), f32: odd/even rational approximation on [-7.9988, 7.9988] (beyond,
// tanh rounds to +-1 in f32), the minimax form Eigen uses for float; x itself
// for |x| < 4e-4 where tanh(x) = x in f32. Checked against std::tanh in
// flash_kernel_test.
inline __m512 Tanh512(__m512 x) {
  const __m512 kClamp = _mm512_set1_ps(7.99881172180175781f);
  const __m512 xc =
      _mm512_min_ps(_mm512_max_ps(x, _mm512_sub_ps(_mm512_setzero_ps(), kClamp)), kClamp);
  const __m512 x2 = _mm512_mul_ps(xc, xc);
  __m512 p = _mm512_set1_ps(-2.76076847742355e-16f);
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(2.00018790482477e-13f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(-8.60467152213735e-11f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(5.12229709037114e-08f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(1.48572235717979e-05f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(6.37261928875436e-04f));
  p = _mm512_fmadd_ps(p, x2, _mm512_set1_ps(4.89352455891786e-03f));
  p = _mm512_mul_ps(p, xc);
  __m512 q = _mm512_set1_ps(1.19825839466702e-06f);
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(1.18534705686654e-04f));
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(2.26843463243900e-03f));
  q = _mm512_fmadd_ps(q, x2, _mm512_set1_ps(4.89352518554385e-03f));
  const __m512 t = _mm512_div_ps(p, q);
  const __mmask16 tiny = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(4e-4f), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(tiny, t, x);
}

// Horizontal max / sum of 16 lanes.
inline float ReduceMax512(__m512 v) { return _mm512_reduce_max_ps(v); }
inline float ReduceAdd512(__m512 v) { return _mm512_reduce_add_ps(v); }

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_MATH_AVX512_H_
