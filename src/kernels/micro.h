// Micro-kernel interface of the flash loops: the few tile operations whose
// speed matters, as a table of function pointers per KernelPath.
//
// Tile formats (all row-major, leading dimensions in elements):
//   f32 operands: plain row-major; vector widths (n of a GEMM, ldb, ldc) are
//     multiples of kVec = 16 lanes and padded with zeros by the packers.
//   bf16 operands of GemmBf16: A is row-major bf16 whose consecutive pairs
//     (elements 2t, 2t+1 of a row) are read as one 32-bit word; B is
//     "pair-interleaved": B(p, j) = b[((p / 2) * ldb + j) * 2 + p % 2], so one
//     512-bit load holds 16 columns x 2 consecutive p — what vdpbf16ps wants.
// The flash loops only ever call these through MicroKernelsFor(path), so the
// AVX-512 code runs only after runtime detection (cpu_features.h).
#ifndef RINGSPLASH_KERNELS_MICRO_H_
#define RINGSPLASH_KERNELS_MICRO_H_

#include <cstdint>

#include "ringsplash/attention.h"

namespace ringsplash::kernels::micro {

constexpr int64_t kVec = 16;  // f32 lanes of a 512-bit vector
inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
// Leading dimension for a tile with n columns of 4-byte lanes: n rounded up to
// kVec, plus one vector when the row stride would be a multiple of 512 bytes.
// Such strides map a column panel's rows onto a fraction of the L1 sets
// (e.g. 128 floats: half of them), so a 32 KB B panel no longer fits in L1.
inline int64_t PaddedLd(int64_t n) {
  const int64_t ld = RoundUp(n, kVec);
  return ld % 128 == 0 ? ld + kVec : ld;
}

// C[m x n] = A[m x k] B[k x n]                      when !accumulate,
// C[m x n] = diag(row_scale) C + A B                when accumulate
//            (row_scale == nullptr: plain C += A B).
// A(i, p) = a[i * a_rs + p * a_cs] (row-major, or transposed for P^T dO);
// B(p, j) = b[p * ldb + j]; C(i, j) = c[i * ldc + j].
// Requires n % kVec == 0; k may be 0 (C = 0 or diag(row_scale) C).
using GemmF32Fn = void (*)(int64_t m, int64_t n, int64_t k, const float* a, int64_t a_rs,
                           int64_t a_cs, const float* b, int64_t ldb, float* c, int64_t ldc,
                           const float* row_scale, bool accumulate);

// As GemmF32Fn with bf16 operands (f32 accumulation): k2 pairs of p, A(i, p)
// = a[i * lda + p] (lda even), B pair-interleaved with ldb columns.
using GemmBf16Fn = void (*)(int64_t m, int64_t n, int64_t k2, const uint16_t* a, int64_t lda,
                            const uint16_t* b, int64_t ldb, float* c, int64_t ldc,
                            const float* row_scale, bool accumulate);

// Online-softmax step of the forward on an S tile (s[i * lds + j], i < m,
// j < n, lds >= RoundUp(n, kVec)). Per row i:
//   x_j   = scale * s_ij, then softcap > 0: x_j = softcap * tanh(x_j / softcap),
//           then masked (mask != nullptr && mask[i * ldm + j] == 0): x_j = -inf
//   m_new = max(row_max_i, max_j x_j); shift = (m_new == -inf) ? 0 : m_new
//   s_ij  = exp(x_j - shift) for j < n, 0 for n <= j < RoundUp(n, kVec)
//   alpha_i = exp(row_max_i - shift); row_sum_i = alpha_i * row_sum_i + sum_j s_ij;
//   row_max_i = m_new.
// A row masked in this tile keeps row_max = -inf or its old value; never NaN.
using SoftmaxForwardFn = void (*)(int64_t m, int64_t n, float* s, int64_t lds, const uint8_t* mask,
                                  int64_t ldm, float scale, float softcap, float* row_max,
                                  float* row_sum, float* alpha);

// Backward probabilities on an S tile, in place: x as above (cap, then mask),
// s_ij = exp(x_j - lse_i) (0 when lse_i == -inf: the row has no allowed key),
// 0 for n <= j < RoundUp(n, kVec). With softcap > 0 also writes the soft cap's
// derivative deriv[i * lds + j] = 1 - (x_capped / softcap)^2 (taken before
// masking, so finite) for j < n.
using ProbsBackwardFn = void (*)(int64_t m, int64_t n, float* s, int64_t lds, const uint8_t* mask,
                                 int64_t ldm, float scale, float softcap, const float* lse,
                                 float* deriv);

// dS in place of dP: dp_ij = scale * p_ij * (dp_ij - delta_i) * (deriv ? deriv_ij : 1)
// for j < n, 0 for n <= j < RoundUp(n, kVec). p, dp and deriv share `ld`.
using DsBackwardFn = void (*)(int64_t m, int64_t n, const float* p, float* dp, int64_t ld,
                              const float* delta, const float* deriv, float scale);

// Rounds an f32 tile to bf16 (round to nearest even): dst[i * ldd + j] for
// j < n, and 0 for n <= j < RoundUp(n, 2) (so pairs are complete).
using ToBf16Fn = void (*)(int64_t m, int64_t n, const float* src, int64_t lds, uint16_t* dst,
                          int64_t ldd);

struct MicroKernels {
  const char* name = "";
  GemmF32Fn gemm_f32 = nullptr;
  GemmBf16Fn gemm_bf16 = nullptr;  // only on the avx512_bf16 path
  SoftmaxForwardFn softmax_forward = nullptr;
  ProbsBackwardFn probs_backward = nullptr;
  DsBackwardFn ds_backward = nullptr;
  ToBf16Fn to_bf16 = nullptr;
};

const MicroKernels& PortableMicroKernels();
const MicroKernels& Avx512MicroKernels();      // call only if DetectCpuFeatures().avx512
const MicroKernels& Avx512Bf16MicroKernels();  // call only if ....avx512_bf16
// The table for a resolved path (kAuto is treated as kPortable).
const MicroKernels& MicroKernelsFor(KernelPath path);

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_H_
