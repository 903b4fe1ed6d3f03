// Vectorised exp and tanh for the AVX2 micro-kernels: the same polynomials
// as micro_math_avx512.h on 8-lane ymm vectors, so both paths round alike.
// Include only from translation units compiled with AVX2 flags (*_avx2.cc).
#ifndef RINGSPLASH_KERNELS_MICRO_MATH_AVX2_H_
#define RINGSPLASH_KERNELS_MICRO_MATH_AVX2_H_

#include <immintrin.h>

namespace ringsplash::kernels::micro {

// exp(x), f32, ~2e-7 relative for the softmax range: Cody-Waite reduction
// x = n ln2 + r, r in [-ln2/2, ln2/2], the degree-5 minimax polynomial of
// Exp512 for e^r, then 2^n. x < -86 gives exactly 0 (the masked logits,
// -inf, among them) and x is clamped to [-86, 88.7], so no subnormal is
// ever formed (an assist per instruction on Intel cores). AVX2 has no
// scalef: 2^n is built as the bits of 2^(n-1) (biased exponent n + 126, in
// [2, 254] for the clamped range, so n = 128 does not overflow) times 2y.
// A NaN stays NaN: max/min return their second operand when either is NaN.
inline __m256 Exp256(__m256 x) {
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-86.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(-86.0f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.7f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_fmadd_ps(_mm256_set1_ps(8.29765508e-3f), r, _mm256_set1_ps(4.19153820e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.66675747e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.99988949e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(9.99999692e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.0f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
  const __m256 e = _mm256_mul_ps(_mm256_add_ps(y, y), _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(tiny, e);
}

// tanh(x), f32: the rational approximation of Tanh512 (Eigen's float form)
// on [-7.9988, 7.9988], x itself for |x| < 4e-4.
inline __m256 Tanh256(__m256 x) {
  const __m256 kClamp = _mm256_set1_ps(7.99881172180175781f);
  const __m256 xc =
      _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), kClamp)), kClamp);
  const __m256 x2 = _mm256_mul_ps(xc, xc);
  __m256 p = _mm256_set1_ps(-2.76076847742355e-16f);
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(2.00018790482477e-13f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(-8.60467152213735e-11f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(5.12229709037114e-08f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(1.48572235717979e-05f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(6.37261928875436e-04f));
  p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(4.89352455891786e-03f));
  p = _mm256_mul_ps(p, xc);
  __m256 q = _mm256_set1_ps(1.19825839466702e-06f);
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(1.18534705686654e-04f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(2.26843463243900e-03f));
  q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(4.89352518554385e-03f));
  const __m256 t = _mm256_div_ps(p, q);
  const __m256 abs_x = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 tiny = _mm256_cmp_ps(abs_x, _mm256_set1_ps(4e-4f), _CMP_LT_OQ);
  return _mm256_blendv_ps(t, x, tiny);
}

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_MATH_AVX2_H_
