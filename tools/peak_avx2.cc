// f32 FMA peak loop on 8-lane ymm vectors. Compiled with AVX2 flags
// (tools/CMakeLists.txt); only called when the CPU has AVX2 and FMA.
#include <immintrin.h>

#include "tools/peak.h"

namespace ringsplash::cli::peak_detail {

double FmaF32Avx2(int64_t iters) {
  // As FmaF32Avx512: 12 independent chains cover FMA latency (4-5) x ports
  // (2) and stay in the 16 ymm registers; acc = acc * 0.5 + 0.5 converges to
  // 1, so there is no overflow, no denormal and nothing to fold away.
  constexpr int kChains = 12;
  const __m256 a = _mm256_set1_ps(0.5f);
  const __m256 b = _mm256_set1_ps(0.5f);
  __m256 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm256_set1_ps(static_cast<float>(j));
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < kChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], a, b);
  }
  __m256 sum = acc[0];
  for (int j = 1; j < kChains; ++j) sum = _mm256_add_ps(sum, acc[j]);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  volatile float sink = lanes[0];
  (void)sink;
  return static_cast<double>(iters) * kChains * 8 * 2;
}

}  // namespace ringsplash::cli::peak_detail
