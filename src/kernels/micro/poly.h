// Coefficients of the vectorised exp and tanh of the fast paths
// (micro/math_avx2.h, micro/math_avx512.h), in one place so that every path
// evaluates the same polynomials in the same order and rounds alike.
// Plain constants: includable from any translation unit.
#ifndef RINGSPLASH_KERNELS_MICRO_POLY_H_
#define RINGSPLASH_KERNELS_MICRO_POLY_H_

namespace ringsplash::kernels::micro::poly {

// exp(x): x = n ln2 + r (Cody-Waite, ln2 = kLn2Hi + kLn2Lo, so r keeps full
// precision for large |x|), e^r on [-ln2/2, ln2/2] by this degree-5 minimax
// polynomial, highest degree first (Horner); ~2e-7 relative in f32.
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kExp[6] = {8.29765508e-3f, 4.19153820e-2f, 1.66675747e-1f,
                                  4.99988949e-1f, 9.99999692e-1f, 1.0f};
// Inputs below kExpMin give exactly 0 (nothing subnormal is formed); inputs
// are clamped to [kExpMin, kExpMax].
inline constexpr float kExpMin = -86.0f;
inline constexpr float kExpMax = 88.7f;

// 2^f for f in [-0.5, 0.5] (the base-2 exps of the fused kernels): degree-5
// minimax polynomial, highest degree first (Horner); relative error 7.5e-8
// in exact arithmetic, ~2e-7 with f32 coefficients and FMA. kExp2Min: the
// clamp that keeps 2^x a normal number (>= 2^-125.5), kRoundMagic = 1.5 *
// 2^23: (x + kRoundMagic) - kRoundMagic rounds |x| < 2^22 to an integer.
inline constexpr float kExp2[6] = {1.32764720e-3f, 9.67554133e-3f, 5.55071327e-2f,
                                   2.40221197e-1f, 6.93146967e-1f, 1.0f};
inline constexpr float kExp2Min = -125.0f;
inline constexpr float kRoundMagic = 12582912.0f;

// tanh(x) = x P(x^2) / Q(x^2) on [-kTanhClamp, kTanhClamp] (beyond, tanh
// rounds to +-1 in f32): the minimax form Eigen uses for float, highest
// degree first; x itself for |x| < kTanhTiny, where tanh(x) = x in f32.
inline constexpr float kTanhClamp = 7.99881172180175781f;
inline constexpr float kTanhTiny = 4e-4f;
inline constexpr float kTanhP[7] = {
    -2.76076847742355e-16f, 2.00018790482477e-13f, -8.60467152213735e-11f, 5.12229709037114e-08f,
    1.48572235717979e-05f,  6.37261928875436e-04f, 4.89352455891786e-03f};
inline constexpr float kTanhQ[4] = {1.19825839466702e-06f, 1.18534705686654e-04f,
                                    2.26843463243900e-03f, 4.89352518554385e-03f};

}  // namespace ringsplash::kernels::micro::poly

#endif  // RINGSPLASH_KERNELS_MICRO_POLY_H_
