// AVX-512 f32 micro-kernel table (compiled with -mavx512f/bw/vl/dq -mfma;
// used only after runtime detection, see micro.h) and the row copy. The GEMM
// building blocks live in micro/common_avx512.h, the fused transposed-layout tile
// kernels in micro/fused_avx512.h/.cc and micro/fused_bwd_avx512.cc.
// GCC 12's AVX-512 intrinsic headers initialise "undefined" operands from
// themselves, which -W(maybe-)uninitialized reports at every inlined use (GCC
// bug 105593, fixed in later releases); the warning is meaningless here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cstdint>

#include "src/kernels/micro/common_avx512.h"
#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro {
namespace avx512 {
namespace {

// Rows this far ahead are requested while a row is copied: enough misses in
// flight for a stream of 512-byte rows 4 KiB apart, which the hardware
// prefetchers do not follow (docs/perf/DESIGN_MEASUREMENTS.md:
// row prefetch in the f32 tile copy).
constexpr int64_t kPrefetchRows = 8;

// Lanes `in` of 16 consecutive elements of a row as f32 bits (bf16 zero
// extended and shifted into the high halves: exact); the others 0.
RINGSPLASH_INLINE __m512i LoadAsF32Bits(const float* src, __mmask16 in) {
  return _mm512_maskz_loadu_epi32(in, src);
}
RINGSPLASH_INLINE __m512i LoadAsF32Bits(const uint16_t* src, __mmask16 in) {
  return _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(in, src)), 16);
}

// copy_rows_f32 (T = float) and widen_rows_bf16 (T = uint16_t): 16 elements per
// step.
template <typename T>
bool CopyRowsAsF32(const T* src, int64_t lds, int64_t rows, int64_t cols, float* dst, int64_t ldd) {
  NonFiniteCheck check;
  for (int64_t r = 0; r < rows; ++r) {
    if (r + kPrefetchRows < rows) {
      const char* ahead = reinterpret_cast<const char*>(src + (r + kPrefetchRows) * lds);
      for (int64_t o = 0; o < cols * static_cast<int64_t>(sizeof(T)); o += 64) {
        _mm_prefetch(ahead + o, _MM_HINT_T0);
      }
    }
    const T* s = src + r * lds;
    float* d = dst + r * ldd;
    for (int64_t c = 0; c < ldd; c += 16) {
      const int64_t left = cols - c;
      const __mmask16 in = left >= 16  ? static_cast<__mmask16>(0xFFFF)
                           : left <= 0 ? static_cast<__mmask16>(0)
                                       : static_cast<__mmask16>((1u << left) - 1u);
      const __m512i v = LoadAsF32Bits(s + c, in);
      check.Add(v);
      const __mmask16 out = ldd - c >= 16 ? static_cast<__mmask16>(0xFFFF)
                                          : static_cast<__mmask16>((1u << (ldd - c)) - 1u);
      _mm512_mask_storeu_epi32(d + c, out, v);
    }
  }
  return check.Any();
}

// any_non_finite16: every row's lines requested first (rows of one head
// lie other heads apart, which the hardware prefetchers do not follow, so
// the misses overlap), then 32 lanes per compare.
bool AnyNonFinite16(const uint16_t* src, int64_t lds, int64_t rows, int64_t cols, uint16_t inf) {
  for (int64_t r = 0; r < rows; ++r) {
    const char* row = reinterpret_cast<const char*>(src + r * lds);
    for (int64_t o = 0; o < cols * 2; o += 64) _mm_prefetch(row + o, _MM_HINT_T0);
  }
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF), limit = _mm512_set1_epi16(inf);
  __mmask32 bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = src + r * lds;
    for (int64_t c = 0; c < cols; c += 32) {
      const int64_t left = cols - c;
      const __mmask32 in = left >= 32 ? ~__mmask32{0} : (__mmask32{1} << left) - 1;
      const __m512i v = _mm512_and_si512(_mm512_maskz_loadu_epi16(in, row + c), magnitude);
      bad |= _mm512_mask_cmpge_epu16_mask(in, v, limit);
    }
  }
  return bad != 0;
}

}  // namespace
}  // namespace avx512

const MicroKernels& Avx512MicroKernels() {
  static const MicroKernels table = [] {
    MicroKernels t = PortableMicroKernels();
    t.name = "avx512";
    t.gemm_f32 = GemmF32Avx512;
    t.gemm_f32_ranges = GemmF32RangesAvx512;
    t.mask_bits = avx512::MaskBits;
    t.transpose_f32 = avx512::TransposeF32;
    t.copy_rows_f32 = avx512::CopyRowsAsF32<float>;
    t.widen_rows_bf16 = avx512::CopyRowsAsF32<uint16_t>;
    t.any_non_finite16 = avx512::AnyNonFinite16;
    t.softmax_columns = avx512::SoftmaxColumns;
    t.forward_tile = avx512::ForwardTile;
    t.backward_tile = avx512::BackwardTile;
    t.decode_step = avx512::DecodeStep;
    return t;
  }();
  return table;
}

}  // namespace ringsplash::kernels::micro
