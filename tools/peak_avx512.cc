// f32 FMA peak loop. Compiled with AVX-512 flags (tools/CMakeLists.txt); only
// called when the CPU has AVX-512F.
#include <immintrin.h>

#include "tools/peak.h"

namespace ringsplash::cli::peak_detail {

double FmaF32Avx512(int64_t iters) {
  // 12 independent chains cover FMA latency (4) x ports (2) with margin and
  // stay in registers. acc = acc * 0.5 + 0.5 converges to 1: no overflow,
  // no denormals, and the compiler cannot fold it away.
  constexpr int kChains = 12;
  const __m512 a = _mm512_set1_ps(0.5f);
  const __m512 b = _mm512_set1_ps(0.5f);
  __m512 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_fmadd_ps(acc[j], a, b);
  }
  __m512 sum = acc[0];
  for (int j = 1; j < kChains; ++j) sum = _mm512_add_ps(sum, acc[j]);
  // Stored, not _mm512_reduce_add_ps: g++ 12 warns inside that intrinsic.
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  volatile float sink = lanes[0];
  (void)sink;
  return static_cast<double>(iters) * kChains * 16 * 2;
}

}  // namespace ringsplash::cli::peak_detail
