// The read-bandwidth loop on 32-byte loads. Compiled with AVX2 flags
// (tools/CMakeLists.txt); only called when the CPU has AVX2.
#include <immintrin.h>

#include "tools/bandwidth.h"

namespace ringsplash::cli::bandwidth_detail {

uint64_t ReadAvx2(const uint64_t* words, size_t n) {
  // As ReadAvx512 with two loads per 64-byte line: eight loads and adds per
  // step of 256 bytes, into four independent sums.
  __m256i acc0 = _mm256_setzero_si256(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  for (size_t i = 0; i < n; i += kWordsPerStep) {
    const auto* line = reinterpret_cast<const __m256i*>(words + i);
    acc0 = _mm256_add_epi64(acc0, _mm256_load_si256(line));
    acc1 = _mm256_add_epi64(acc1, _mm256_load_si256(line + 1));
    acc2 = _mm256_add_epi64(acc2, _mm256_load_si256(line + 2));
    acc3 = _mm256_add_epi64(acc3, _mm256_load_si256(line + 3));
    acc0 = _mm256_add_epi64(acc0, _mm256_load_si256(line + 4));
    acc1 = _mm256_add_epi64(acc1, _mm256_load_si256(line + 5));
    acc2 = _mm256_add_epi64(acc2, _mm256_load_si256(line + 6));
    acc3 = _mm256_add_epi64(acc3, _mm256_load_si256(line + 7));
  }
  const __m256i sum = _mm256_add_epi64(_mm256_add_epi64(acc0, acc1), _mm256_add_epi64(acc2, acc3));
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), sum);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

}  // namespace ringsplash::cli::bandwidth_detail
