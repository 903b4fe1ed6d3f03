// Tests of the micro-kernels' row copies (src/kernels/micro/micro.h:
// transpose_f32, copy_rows_f32, widen_rows_bf16, any_non_finite16) on every supported
// KernelPath: exact bit patterns, zero padding, nothing written past the
// rows, and the NaN/Inf report the non-finite check relies on.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "src/kernels/micro/cpu_features.h"
#include "src/kernels/micro/micro.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using testing::RandomFloats;
using testing::Rng;
using testing::RoundUpTo16;

// rows x lds random floats with a NaN in every column >= cols: what a
// NaN/Inf check of the first cols columns must not count.
std::vector<float> RowsWithNaNTail(Rng& rng, int64_t rows, int64_t cols, int64_t lds) {
  std::vector<float> src = RandomFloats(rng, static_cast<size_t>(rows * lds));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = cols; c < lds; ++c) {
      src[static_cast<size_t>(r * lds + c)] = std::numeric_limits<float>::quiet_NaN();
    }
  }
  return src;
}

// `src` with element (r, c) replaced by poison 1..3: NaN, +inf, -inf (0:
// unchanged).
std::vector<float> Poisoned(std::vector<float> src, int64_t lds, int poison, int64_t r, int64_t c) {
  const float inf = std::numeric_limits<float>::infinity();
  const float values[] = {0.0f, std::numeric_limits<float>::quiet_NaN(), inf, -inf};
  if (poison > 0) src[static_cast<size_t>(r * lds + c)] = values[poison];
  return src;
}

// transpose_f32 transposes exactly (bit patterns), zero pads rows to ldd,
// writes nothing past the last column and reports a NaN or an infinity
// wherever it sits — including the last row, in the partial last 16-row
// block — but never one beyond cols.
TEST(MicroKernelTest, TransposeF32IsExactAndFindsNonFinite) {
  Rng rng(7);
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    for (int64_t rows : {1, 15, 16, 17, 64, 70}) {
      for (int64_t cols : {1, 16, 31, 128}) {
        const int64_t lds = cols + 3, ldd = RoundUpTo16(rows) + 16;
        const std::vector<float> src = RowsWithNaNTail(rng, rows, cols, lds);
        for (int poison = 0; poison < 4; ++poison) {  // none, NaN, +inf, -inf
          // Rows: the last one (partial last 16-row block), then two inside.
          const int64_t r = poison == 1 ? rows - 1 : (poison * 7) % rows;
          const std::vector<float> s =
              Poisoned(src, lds, poison, r, cols - 1 - (poison * 5) % cols);
          std::vector<float> dst(static_cast<size_t>(cols * ldd + 8), -5.0f);
          const bool bad = mk.transpose_f32(rows, cols, s.data(), lds, dst.data(), ldd);
          EXPECT_EQ(bad, poison > 0) << KernelPathName(path) << " " << rows << "x" << cols;
          for (int64_t c = 0; c < cols; ++c) {
            for (int64_t r = 0; r < ldd; ++r) {
              const float want = r < rows ? s[static_cast<size_t>(r * lds + c)] : 0.0f;
              const float got = dst[static_cast<size_t>(c * ldd + r)];
              ASSERT_EQ(std::memcmp(&got, &want, sizeof got), 0)
                  << KernelPathName(path) << " " << rows << "x" << cols << " r" << r << " c" << c;
            }
          }
          for (size_t o = static_cast<size_t>(cols * ldd); o < dst.size(); ++o) {
            ASSERT_EQ(dst[o], -5.0f) << "wrote past the last column";
          }
        }
      }
    }
  }
}

// copy_rows_f32 copies exactly (bit patterns, NaN payloads included), zero
// pads to ldd and reports a NaN or an infinity wherever it sits (first,
// middle or last row; a column in the vector tail), never one beyond cols.
TEST(MicroKernelTest, CopyRowsF32CopiesPadsAndFindsNonFinite) {
  Rng rng(6);
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    for (int64_t rows : {1, 7, 20}) {
      for (int64_t cols : {1, 16, 37, 128}) {
        const int64_t lds = 3 * cols + 5, ldd = RoundUpTo16(cols) + 16;
        const std::vector<float> src = RowsWithNaNTail(rng, rows, cols, lds);
        for (int poison = 0; poison < 4; ++poison) {  // none, NaN, +inf, -inf
          const std::vector<float> s =
              Poisoned(src, lds, poison, (poison * 5) % rows, cols - 1 - (poison * 3) % cols);
          std::vector<float> dst(static_cast<size_t>(rows * ldd + 16), 7.0f);
          const bool bad = mk.copy_rows_f32(s.data(), lds, rows, cols, dst.data(), ldd);
          EXPECT_EQ(bad, poison > 0)
              << KernelPathName(path) << " rows " << rows << " cols " << cols;
          for (int64_t r = 0; r < rows; ++r) {
            EXPECT_EQ(std::memcmp(&dst[static_cast<size_t>(r * ldd)],
                                  &s[static_cast<size_t>(r * lds)], static_cast<size_t>(cols) * 4),
                      0);
            for (int64_t c = cols; c < ldd; ++c) {
              EXPECT_EQ(dst[static_cast<size_t>(r * ldd + c)], 0.0f);
            }
          }
          EXPECT_EQ(dst[static_cast<size_t>(rows * ldd)], 7.0f);  // nothing beyond the rows
        }
      }
    }
  }
}

// widen_rows_bf16 widens exactly: each bf16 becomes the f32 whose high 16
// bits it is (compared bit for bit with the f32 it was cut from, NaN
// payloads included), zero pads to ldd and finds a bf16 NaN or infinity
// wherever it sits, never one beyond cols (the tail holds NaNs).
TEST(MicroKernelTest, WidenRowsBf16IsExactPadsAndFindsNonFinite) {
  Rng rng(16);
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    for (int64_t rows : {1, 7, 20}) {
      for (int64_t cols : {1, 8, 16, 37, 128}) {
        // ldd: rows back to back (the Q^T pack's), a partial last vector, padding.
        for (int64_t ldd : {cols, cols + 3, RoundUpTo16(cols) + 16}) {
          const int64_t lds = 3 * cols + 5;
          const std::vector<float> src = RowsWithNaNTail(rng, rows, cols, lds);
          for (int poison = 0; poison < 4; ++poison) {  // none, NaN, +inf, -inf
            const std::vector<float> f =
                Poisoned(src, lds, poison, (poison * 5) % rows, cols - 1 - (poison * 3) % cols);
            std::vector<uint16_t> s(f.size());
            for (size_t i = 0; i < f.size(); ++i) {
              uint32_t bits;
              std::memcpy(&bits, &f[i], sizeof bits);
              s[i] = static_cast<uint16_t>(bits >> 16);  // truncation keeps NaN and inf
            }
            std::vector<float> dst(static_cast<size_t>(rows * ldd + 16), 7.0f);
            const bool bad = mk.widen_rows_bf16(s.data(), lds, rows, cols, dst.data(), ldd);
            EXPECT_EQ(bad, poison > 0)
                << KernelPathName(path) << " rows " << rows << " cols " << cols;
            for (int64_t r = 0; r < rows; ++r) {
              for (int64_t c = 0; c < cols; ++c) {
                uint32_t got;
                std::memcpy(&got, &dst[static_cast<size_t>(r * ldd + c)], sizeof got);
                ASSERT_EQ(got, static_cast<uint32_t>(s[static_cast<size_t>(r * lds + c)]) << 16)
                    << KernelPathName(path) << " r" << r << " c" << c;
              }
              for (int64_t c = cols; c < ldd; ++c) {
                EXPECT_EQ(dst[static_cast<size_t>(r * ldd + c)], 0.0f);
              }
            }
            EXPECT_EQ(dst[static_cast<size_t>(rows * ldd)], 7.0f);  // nothing beyond the rows
          }
        }
      }
    }
  }
}

// any_non_finite16 (the AVX-512 tables) against the scalar classification
// of every value: bf16 and f16 rows with a NaN in every element past cols
// (the stride gap it must not read as its own), the largest finite values
// and 0 elsewhere; then one NaN, +inf or -inf at a time, at the first, a
// middle and the last element (cols off every multiple of 32).
TEST(MicroKernelTest, AnyNonFinite16FindsExactlyNaNAndInf) {
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    if (mk.any_non_finite16 == nullptr) continue;
    for (bool bf16 : {true, false}) {
      const uint16_t inf = bf16 ? 0x7F80 : 0x7C00, nan = bf16 ? 0x7FC0 : 0x7E00;
      const uint16_t largest = bf16 ? 0x7F7F : 0x7BFF;  // finite: must not count
      for (int64_t rows : {1, 5}) {
        for (int64_t cols : {1, 31, 32, 45, 128}) {
          const int64_t lds = cols + 19;
          std::vector<uint16_t> src(static_cast<size_t>(rows * lds));
          for (int64_t r = 0; r < rows; ++r) {
            for (int64_t c = 0; c < lds; ++c) {
              src[static_cast<size_t>(r * lds + c)] =
                  c >= cols ? nan : ((r + c) % 3 == 0 ? largest : uint16_t(largest | 0x8000));
            }
          }
          const std::string what = std::string(KernelPathName(path)) + (bf16 ? " bf16" : " f16") +
                                   " rows " + std::to_string(rows) + " cols " +
                                   std::to_string(cols);
          EXPECT_FALSE(mk.any_non_finite16(src.data(), lds, rows, cols, inf)) << what;
          for (uint16_t bad : {nan, inf, uint16_t(inf | 0x8000)}) {
            for (int64_t at :
                 {int64_t{0}, (rows / 2) * lds + cols / 2, (rows - 1) * lds + cols - 1}) {
              std::vector<uint16_t> poisoned = src;
              poisoned[static_cast<size_t>(at)] = bad;
              const float value = bf16 ? BF16ToF32(bad) : F16ToF32(bad);
              ASSERT_FALSE(std::isfinite(value));
              EXPECT_TRUE(mk.any_non_finite16(poisoned.data(), lds, rows, cols, inf))
                  << what << " value " << value << " at " << at;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace ringsplash
