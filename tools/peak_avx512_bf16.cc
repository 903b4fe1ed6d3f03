// bf16 dot-product peak loop. Compiled with AVX-512 BF16 flags
// (tools/CMakeLists.txt); only called when the CPU has AVX512_BF16.
#include <immintrin.h>

#include "tools/peak.h"

namespace ringsplash::cli::peak_detail {

double DpBf16Avx512(int64_t iters) {
  // Each vdpbf16ps does 16 lanes x 2 bf16 products + 2 adds = 64 FLOP.
  // Small inputs keep the accumulators far from overflow for any run length.
  constexpr int kChains = 12;
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  __m512 acc[kChains];
  for (int j = 0; j < kChains; ++j) acc[j] = _mm512_set1_ps(static_cast<float>(j));
  for (int64_t i = 0; i < iters; ++i) {
    for (int j = 0; j < kChains; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
  __m512 sum = acc[0];
  for (int j = 1; j < kChains; ++j) sum = _mm512_add_ps(sum, acc[j]);
  // Stored, not _mm512_reduce_add_ps: g++ 12 warns inside that intrinsic.
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, sum);
  volatile float sink = lanes[0];
  (void)sink;
  return static_cast<double>(iters) * kChains * 64;
}

}  // namespace ringsplash::cli::peak_detail
