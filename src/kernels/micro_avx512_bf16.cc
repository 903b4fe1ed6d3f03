// AVX512_BF16 micro-kernels (compiled with -mavx512bf16 on top of the AVX-512
// flags; called only after runtime detection). vdpbf16ps multiplies pairs of
// bf16 and accumulates both products into one f32 lane, so one instruction
// covers two steps of p: A's pair (2t, 2t+1) is broadcast as a 32-bit word and
// B is stored pair-interleaved (micro.h). Blocking as in micro_avx512.cc.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -Wmaybe-uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "src/kernels/micro.h"

namespace ringsplash::kernels::micro {
namespace {

template <int MR, int NV>
inline void GemmBf16Block(int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b,
                          int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                          bool accumulate) {
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
  for (int64_t t = 0; t < k2; ++t) {
    __m512bh bv[NV];
    for (int v = 0; v < NV; ++v) {
      bv[v] = (__m512bh)_mm512_loadu_si512(b + (t * ldb + 16 * v) * 2);
    }
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * t, sizeof(pair));
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], ai, bv[v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(c + i * ldc + 16 * v, acc[i][v]);
  }
}

template <int R, int NV>
inline void GemmBf16Tail(int64_t rem, int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b,
                         int64_t ldb, float* c, int64_t ldc, const float* row_scale,
                         bool accumulate) {
  if constexpr (R > 1) {
    if (rem == R - 1) {
      GemmBf16Block<R - 1, NV>(k2, a, lda, b, ldb, c, ldc, row_scale, accumulate);
    } else {
      GemmBf16Tail<R - 1, NV>(rem, k2, a, lda, b, ldb, c, ldc, row_scale, accumulate);
    }
  }
}

template <int MR, int NV>
void GemmBf16Panel(int64_t m, int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b,
                   int64_t ldb, float* c, int64_t ldc, const float* row_scale, bool accumulate) {
  int64_t i = 0;
  for (; i + MR <= m; i += MR) {
    GemmBf16Block<MR, NV>(k2, a + i * lda, lda, b, ldb, c + i * ldc, ldc,
                          row_scale != nullptr ? row_scale + i : nullptr, accumulate);
  }
  if (i < m) {
    GemmBf16Tail<MR, NV>(m - i, k2, a + i * lda, lda, b, ldb, c + i * ldc, ldc,
                         row_scale != nullptr ? row_scale + i : nullptr, accumulate);
  }
}

void GemmBf16(int64_t m, int64_t n, int64_t k2, const uint16_t* a, int64_t lda, const uint16_t* b,
              int64_t ldb, float* c, int64_t ldc, const float* row_scale, bool accumulate) {
  int64_t j = 0;
  // b + j * 2: column j of a pair-interleaved B starts 2 j elements into each row.
  for (; j + 64 <= n; j += 64) {
    GemmBf16Panel<6, 4>(m, k2, a, lda, b + 2 * j, ldb, c + j, ldc, row_scale, accumulate);
  }
  for (; j + 32 <= n; j += 32) {
    GemmBf16Panel<8, 2>(m, k2, a, lda, b + 2 * j, ldb, c + j, ldc, row_scale, accumulate);
  }
  for (; j + 16 <= n; j += 16) {
    GemmBf16Panel<8, 1>(m, k2, a, lda, b + 2 * j, ldb, c + j, ldc, row_scale, accumulate);
  }
}

}  // namespace

const MicroKernels& Avx512Bf16MicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t = Avx512MicroKernels();
    t.name = "avx512_bf16";
    t.gemm_bf16 = GemmBf16;
    return t;
  }();
  return table;
}

}  // namespace ringsplash::kernels::micro
