// ISA-neutral helpers of the register-blocked micro-kernels (micro/path_avx2.cc,
// micro/*_avx512*.cc): how a GEMM's rows are split into register blocks and
// which p range a block of masked rows needs. No intrinsics here, so any
// kernel translation unit may include it whatever its target flags.
#ifndef RINGSPLASH_KERNELS_MICRO_BLOCKING_H_
#define RINGSPLASH_KERNELS_MICRO_BLOCKING_H_

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "src/kernels/micro/micro.h"

namespace ringsplash::kernels::micro {

#define RINGSPLASH_INLINE inline __attribute__((always_inline))
// The same for a lambda (written after its parameter list), e.g. the chunk
// the decoding steps hand to their shared loop (decode/step_loop.h).
#define RINGSPLASH_INLINE_LAMBDA __attribute__((always_inline))
// Loops over the accumulator arrays must be unrolled completely: an array
// indexed by a loop variable lives on the stack, and every block then pays a
// round trip of all its accumulators through memory.
#define RINGSPLASH_UNROLL _Pragma("GCC unroll 32")

// How A(i, p) = a[i * a_rs + p * a_cs] is walked.
enum class ALayout { kRowMajor, kColMajor, kGeneral };  // a_cs == 1 / a_rs == 1 / other

// Calls f(std::integral_constant<ALayout, L>()) with the layout of A's strides,
// so each GEMM instantiates its inner loop once per layout.
template <class F>
RINGSPLASH_INLINE void WithLayout(int64_t a_rs, int64_t a_cs, F&& f) {
  if (a_cs == 1) {
    f(std::integral_constant<ALayout, ALayout::kRowMajor>());
  } else if (a_rs == 1) {
    f(std::integral_constant<ALayout, ALayout::kColMajor>());
  } else {
    f(std::integral_constant<ALayout, ALayout::kGeneral>());
  }
}

// Calls f(capped, masked), both std::bool_constant: whether tile t has a
// soft cap and a mask, as compile-time switches of the loops f runs (one
// instantiation each, chosen once per tile instead of tested per vector).
template <class F>
RINGSPLASH_INLINE void WithSwitches(const TileArgs& t, F&& f) {
  const bool capped = t.softcap > 0.0f, masked = t.mask != nullptr;
  using Yes = std::true_type;
  using No = std::false_type;
  if (capped) {
    masked ? f(Yes(), Yes()) : f(Yes(), No());
  } else {
    masked ? f(No(), Yes()) : f(No(), No());
  }
}

// Calls f(std::integral_constant<int, C>) with C == count, 1 <= count <= N:
// a run-time row or vector count turned into a compile-time one.
template <int N, class F>
RINGSPLASH_INLINE void WithCount(int64_t count, F&& f) {
  if constexpr (N > 1) {
    if (count < N) {
      WithCount<N - 1>(count, f);
      return;
    }
  }
  f(std::integral_constant<int, N>());
}

// Splits m rows into ceil(m / MR) blocks of balanced height (64 rows: 9 x 6 +
// 2 x 5 rather than 10 x 6 + 4, so no block runs with few accumulators) and
// calls f(first_row, std::integral_constant<int, rows>) for each, in order.
template <int MR, class F>
RINGSPLASH_INLINE void ForEachRowBlock(int64_t m, F&& f) {
  const int64_t blocks = (m + MR - 1) / MR;
  if (blocks == 0) return;
  const int64_t base = m / blocks, taller = m % blocks;  // `taller` blocks get base + 1 rows
  int64_t i = 0;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t rows = base + (blk < taller ? 1 : 0);
    WithCount<MR>(rows, [&](auto r) { f(i, r); });
    i += rows;
  }
}

// The union [lo, hi) of the p ranges of rows [i0, i0 + rows) (empty rows
// ignored; lo == hi == 0 when all are empty); [0, k) without ranges.
inline void BlockRange(const KRanges& r, int64_t i0, int rows, int64_t k, int64_t* lo,
                       int64_t* hi) {
  if (r.lo == nullptr) {
    *lo = 0;
    *hi = k;
    return;
  }
  int64_t l = k, h = 0;
  for (int i = 0; i < rows; ++i) {
    if (r.hi[i0 + i] > r.lo[i0 + i]) {
      l = std::min<int64_t>(l, r.lo[i0 + i]);
      h = std::max<int64_t>(h, r.hi[i0 + i]);
    }
  }
  *lo = h > l ? l : 0;
  *hi = h > l ? h : 0;
}

}  // namespace ringsplash::kernels::micro

#endif  // RINGSPLASH_KERNELS_MICRO_BLOCKING_H_
