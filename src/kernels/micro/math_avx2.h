// Vectorised exp and tanh for the AVX2 micro-kernels: the same polynomials
// as micro/math_avx512.h on 8-lane ymm vectors, so both paths round alike.
// Include only from translation units compiled with AVX2 flags (*_avx2.cc).
#ifndef RINGSPLASH_KERNELS_MICRO_MATH_AVX2_H_
#define RINGSPLASH_KERNELS_MICRO_MATH_AVX2_H_

#include <immintrin.h>

#include "src/kernels/micro/blocking.h"
#include "src/kernels/micro/poly.h"

namespace ringsplash::kernels::micro {

// exp(x), f32, ~2e-7 relative for the softmax range: Cody-Waite reduction
// x = n ln2 + r, r in [-ln2/2, ln2/2], the degree-5 minimax polynomial of
// Exp512 for e^r, then 2^n. x < -86 gives exactly 0 (the masked logits,
// -inf, among them) and x is clamped to [-86, 88.7], so no subnormal is
// ever formed (an assist per instruction on Intel cores). AVX2 has no
// scalef: 2^n is built as the bits of 2^(n-1) (biased exponent n + 126, in
// [2, 254] for the clamped range, so n = 128 does not overflow) times 2y.
// A NaN stays NaN: max/min return their second operand when either is NaN.
RINGSPLASH_INLINE __m256 Exp256(__m256 x) {
  using namespace poly;
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_set1_ps(kExpMin), x);
  x = _mm256_min_ps(_mm256_set1_ps(kExpMax), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 y = _mm256_set1_ps(kExp[0]);
  RINGSPLASH_UNROLL
  for (int k = 1; k < 6; ++k) y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(kExp[k]));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(126)), 23);
  const __m256 e = _mm256_mul_ps(_mm256_add_ps(y, y), _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(tiny, e);
}

// 2^x for the fused forward step (as Exp2Raw512): x = n + f with n =
// round(x) (adding kRoundMagic rounds, and leaves n + 0x4B400000 in the
// sum's bits, from which 2^n's bits come without a conversion), 2^f by the
// kExp2 polynomial, times 2^n. x is clamped to [-125, 128]: the result is a
// normal number >= 2^-125.5 (never 0: callers zero masked lanes), n = 128
// gives the bits of +inf (so x >= 127.5 gives +inf), and NaN stays NaN.
// 13 instructions against Exp256's 18.
RINGSPLASH_INLINE __m256 Exp2Raw256(__m256 x) {
  using namespace poly;
  x = _mm256_max_ps(_mm256_set1_ps(kExp2Min), x);  // NaN: the second operand
  x = _mm256_min_ps(_mm256_set1_ps(128.0f), x);
  const __m256 big = _mm256_add_ps(x, _mm256_set1_ps(kRoundMagic));
  const __m256 f = _mm256_sub_ps(x, _mm256_sub_ps(big, _mm256_set1_ps(kRoundMagic)));
  __m256 y = _mm256_set1_ps(kExp2[0]);
  RINGSPLASH_UNROLL
  for (int k = 1; k < 6; ++k) y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(kExp2[k]));
  // Bits of big = 0x4B400000 + n; 2^n = (n + 127) << 23, n + 127 in [2, 255].
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_castps_si256(big), _mm256_set1_epi32(127 - 0x4B400000)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// tanh(x), f32: the rational approximation of Tanh512 (Eigen's float form)
// on [-7.9988, 7.9988], x itself for |x| < 4e-4.
RINGSPLASH_INLINE __m256 Tanh256(__m256 x) {
  using namespace poly;
  const __m256 kClamp = _mm256_set1_ps(kTanhClamp);
  const __m256 xc =
      _mm256_min_ps(_mm256_max_ps(x, _mm256_sub_ps(_mm256_setzero_ps(), kClamp)), kClamp);
  const __m256 x2 = _mm256_mul_ps(xc, xc);
  __m256 p = _mm256_set1_ps(kTanhP[0]);
  RINGSPLASH_UNROLL
  for (int k = 1; k < 7; ++k) p = _mm256_fmadd_ps(p, x2, _mm256_set1_ps(kTanhP[k]));
  p = _mm256_mul_ps(p, xc);
  __m256 q = _mm256_set1_ps(kTanhQ[0]);
  RINGSPLASH_UNROLL
  for (int k = 1; k < 4; ++k) q = _mm256_fmadd_ps(q, x2, _mm256_set1_ps(kTanhQ[k]));
  const __m256 t = _mm256_div_ps(p, q);
  const __m256 abs_x = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
  const __m256 tiny = _mm256_cmp_ps(abs_x, _mm256_set1_ps(kTanhTiny), _CMP_LT_OQ);
  return _mm256_blendv_ps(t, x, tiny);
}

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_MATH_AVX2_H_
