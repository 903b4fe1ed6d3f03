// The read-bandwidth loop on 64-byte loads. Compiled with AVX-512 flags
// (tools/CMakeLists.txt); only called when the CPU has AVX-512F.
#include <immintrin.h>

#include "tools/bandwidth.h"

namespace ringsplash::cli::bandwidth_detail {

uint64_t ReadAvx512(const uint64_t* words, size_t n) {
  // One load per 64-byte line, four independent sums: a step of the loop is
  // four loads and four adds, so the out-of-order window holds many lines'
  // loads at once (what a streaming read from memory needs), and no add
  // waits on the one before it.
  __m512i acc0 = _mm512_setzero_si512(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
  for (size_t i = 0; i < n; i += kWordsPerStep) {
    acc0 = _mm512_add_epi64(acc0, _mm512_load_si512(words + i));
    acc1 = _mm512_add_epi64(acc1, _mm512_load_si512(words + i + 8));
    acc2 = _mm512_add_epi64(acc2, _mm512_load_si512(words + i + 16));
    acc3 = _mm512_add_epi64(acc3, _mm512_load_si512(words + i + 24));
  }
  const __m512i sum = _mm512_add_epi64(_mm512_add_epi64(acc0, acc1), _mm512_add_epi64(acc2, acc3));
  // Stored, not _mm512_reduce_add_epi64: g++ 12 warns inside that intrinsic.
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, sum);
  uint64_t total = 0;
  for (uint64_t lane : lanes) total += lane;
  return total;
}

}  // namespace ringsplash::cli::bandwidth_detail
