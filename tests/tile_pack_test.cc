// PackTransposedPairsBf16 (src/kernels/tiling/tiles.h): the bf16 forward's
// Q^T as bf16 pairs, through the micro-kernels' 32-bit transpose where the
// rows allow it (bf16, unit inner stride, even C, 4-byte aligned rows) and
// through the element loop otherwise. Both against the layout written out
// here element by element, on every path with bf16 products, for views
// that take each road: contiguous, [B, H, S, D] memory, odd C (with odd and
// even row strides), a base
// pointer 2 bytes off alignment, an odd row stride, f16 data; row counts
// and word counts off every multiple of 16. End results of the forward are
// checked against the f64 reference in flash_kernel_test.cc.
// Also GemmBf16Panels, the bf16 products of partial tiles over the panels
// their mask ranges allow, against double sums.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/tensor.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/tiling/pack.h"
#include "src/kernels/tiling/tiles.h"

namespace ringsplash {
namespace {

struct ViewCase {
  std::string name;
  int64_t c;            // elements per row
  bool bhsd = false;    // [B, H, S, C] memory viewed as [B, S, H, C]
  bool offset = false;  // data starts one element (2 bytes) into the buffer
  int64_t pad = 0;      // extra elements per position (row stride H * C + pad)
  DType dtype = DType::kBF16;
};

constexpr int64_t kB = 2, kS = 40, kH = 3;

TEST(TilePackTest, TransposedPairsMatchTheLayoutOnEveryRoad) {
  const std::vector<ViewCase> cases = {
      {"contiguous C=128", 128},
      {"contiguous C=34 (17 words)", 34},
      {"contiguous C=2", 2},
      {"bhsd C=64", 64, true},
      {"odd C=33", 33},
      {"odd C=33, even row stride", 33, false, false, 1},
      {"misaligned base C=64", 64, false, true},
      {"odd row stride C=32", 32, false, false, 1},
      {"even padded row stride C=36", 36, false, false, 2},
      {"f16 C=32", 32, false, false, 0, DType::kF16},
  };
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> bits(0, 0xFFFF);
  int paths = 0;
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    if (mk.gemm_bf16 == nullptr) continue;  // only the bf16 product paths pack pairs
    ++paths;
    for (const ViewCase& vc : cases) {
      const int64_t row = kH * vc.c + vc.pad;  // elements per position
      std::vector<uint16_t> buf(static_cast<size_t>(kB * kS * row + 1));
      for (uint16_t& x : buf) {
        // Finite values only: exponent bits below all-ones in bf16 and f16.
        x = static_cast<uint16_t>(bits(rng) & 0x3FFF);
      }
      TensorView t;
      t.data = buf.data() + (vc.offset ? 1 : 0);
      t.dtype = vc.dtype;
      t.ndim = 4;
      t.shape = {kB, kS, kH, vc.c};
      t.stride = vc.bhsd ? std::array<int64_t, 4>{kH * kS * vc.c, vc.c, kS * vc.c, 1}
                         : std::array<int64_t, 4>{kS * row, row, vc.c, 1};
      for (const auto& [r0, rows] :
           {std::pair<int64_t, int64_t>{0, 40}, {3, 17}, {5, 1}, {8, 32}}) {
        const int64_t ld = (rows + 15) / 16 * 16 + 16;
        const int64_t c2 = (vc.c + 1) / 2 * 2;
        const int64_t extent = c2 * ld;
        constexpr uint16_t kCanary = 0xABCD;
        std::vector<uint16_t> got(static_cast<size_t>(extent + 64), kCanary);
        kernels::PackTransposedPairsBf16(mk, t, 1, 2, r0, rows, got.data(), ld);
        for (int64_t e = 0; e < extent + 64; ++e) {
          const int64_t pair_row = e / (2 * ld), r = (e / 2) % ld, c = 2 * pair_row + e % 2;
          uint16_t want = kCanary;
          if (e < extent) {
            want = 0;
            if (r < rows && c < vc.c) {
              const uint16_t stored =
                  static_cast<const uint16_t*>(t.data)[t.Offset(1, r0 + r, 2, c)];
              // Other dtypes are rounded to bf16 on the way (tiling/pack.h).
              want = vc.dtype == DType::kBF16 ? stored : F32ToBF16(F16ToF32(stored));
            }
          }
          ASSERT_EQ(got[static_cast<size_t>(e)], want)
              << KernelPathName(path) << ' ' << vc.name << " r0=" << r0 << " rows=" << rows
              << " element " << e << " (query " << r << ", column " << c << ")";
        }
      }
    }
  }
  if (paths == 0) GTEST_SKIP() << "no path with bf16 products (needs AVX512_BF16)";
}

// Large buffers (>= kHugeBytes) are kept for the next request of the same
// size: the same memory comes back (zeroed when asked), a request of another
// size gets fresh memory, the least recently kept go beyond kMaxKeptBytes,
// and ReleaseCachedThreads frees everything.
TEST(BufferCacheTest, KeepsLargeBlocksForTheSameSize) {
  if (!kernels::KeepsBuffers()) GTEST_SKIP() << "blocks are not kept under AddressSanitizer";
  kernels::ReleaseCachedBuffers();
  ASSERT_EQ(kernels::CachedBufferBytes(), 0u);
  const size_t n = (kernels::kHugeBytes + 100) / sizeof(float);  // 3 blocks of 2 MiB
  const float* first = nullptr;
  {
    kernels::AlignedBuffer<float> a(n);
    first = a.data();
    for (size_t i = 0; i < n; ++i) a[i] = 1.0f;
  }
  EXPECT_EQ(kernels::CachedBufferBytes(), size_t{6} << 20);
  {
    kernels::AlignedBuffer<float> b(n);  // zeroed, though it is the same memory
    EXPECT_EQ(b.data(), first);
    EXPECT_EQ(kernels::CachedBufferBytes(), 0u);
    for (size_t i = 0; i < n; i += 4099) ASSERT_EQ(b[i], 0.0f) << i;
    EXPECT_EQ(b[n - 1], 0.0f);
  }
  {
    kernels::AlignedBuffer<float> small(1024);   // small buffers never touch the cache
    kernels::AlignedBuffer<float> other(2 * n);  // another size: fresh memory
    EXPECT_NE(other.data(), first);
    EXPECT_EQ(kernels::CachedBufferBytes(), size_t{6} << 20);
  }
  EXPECT_EQ(kernels::CachedBufferBytes(), size_t{16} << 20);
  // Blocks of 1/4 of the cap (never touched): of five kept, the newest four
  // stay; the first comes back no more.
  const size_t quarter = kernels::kMaxKeptBytes / 4;
  std::vector<const char*> kept;
  {
    std::vector<kernels::AlignedBuffer<char>> quarters(5);
    for (auto& q : quarters) {
      q.Resize(quarter, /*zero=*/false);
      kept.push_back(q.data());
    }
    for (auto& q : quarters) q.Resize(0);  // released in this order
  }
  EXPECT_EQ(kernels::CachedBufferBytes(), kernels::kMaxKeptBytes);
  {
    std::vector<kernels::AlignedBuffer<char>> again(4);
    std::vector<const char*> got;
    for (auto& q : again) {
      q.Resize(quarter, /*zero=*/false);
      got.push_back(q.data());
    }
    std::sort(got.begin(), got.end());
    std::vector<const char*> newest(kept.begin() + 1, kept.end());
    std::sort(newest.begin(), newest.end());
    EXPECT_EQ(got, newest);
  }
  ReleaseCachedThreads();  // the public entry point frees them too
  EXPECT_EQ(kernels::CachedBufferBytes(), 0u);
}

// GemmBf16Panels on every path with bf16 products: A's rows zero outside
// their ranges (some rows empty, some panels wholly empty, ranges off every
// multiple of 32), m off a multiple of the panel, k2 both a multiple of 16
// pairs and not. Each C element against the double sum of the same bf16
// products, which are exact in f32: an f32 sum of at most 2 k2 = 128 terms
// errs by at most 128 u (u = 2^-24) of the sum of their magnitudes.
// Panels without any allowed element: C = 0 exactly (accumulate false) or
// untouched (true).
TEST(TilePackTest, GemmBf16PanelsMatchDoubleSumsOfTheAllowedElements) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  constexpr int64_t m = 72, n = 48, ldc = 56;
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    if (mk.gemm_bf16 == nullptr) continue;
    for (int64_t k2 : {24, 64}) {
      const int64_t lda = 2 * k2 + 8, ldb = n + 16;
      std::vector<int32_t> lo(m), hi(m);
      std::vector<uint16_t> a(static_cast<size_t>(m * lda), 0),
          b(static_cast<size_t>(k2 * ldb * 2));
      for (int64_t i = 0; i < m; ++i) {
        // Rows 32 .. 63 (the second panel) have nothing; every 5th row none.
        const bool none = (i >= 32 && i < 64) || i % 5 == 0;
        lo[i] = none ? 0 : static_cast<int32_t>((7 * i) % (2 * k2));
        hi[i] =
            none ? 0 : std::min<int32_t>(static_cast<int32_t>(2 * k2), lo[i] + 1 + (11 * i) % 37);
        for (int64_t e = lo[i]; e < hi[i]; ++e) a[i * lda + e] = F32ToBF16(u(rng));
      }
      for (auto& x : b) x = F32ToBF16(u(rng));
      for (bool accumulate : {false, true}) {
        const std::string what = std::string(KernelPathName(path)) + " k2 " + std::to_string(k2) +
                                 (accumulate ? " accumulate" : "");
        std::vector<float> c(static_cast<size_t>(m * ldc)), c0(c.size());
        for (auto& x : c0) x = u(rng);
        c = c0;
        kernels::GemmBf16Panels(mk, m, n, k2, a.data(), lda, b.data(), ldb, c.data(), ldc,
                                accumulate, kernels::micro::KRanges{lo.data(), hi.data()});
        for (int64_t i = 0; i < m; ++i) {
          for (int64_t j = 0; j < n; ++j) {
            double sum = 0, magnitude = 0;
            for (int64_t e = 0; e < 2 * k2; ++e) {
              const double x =
                  double{BF16ToF32(a[i * lda + e])} * BF16ToF32(b[((e / 2) * ldb + j) * 2 + e % 2]);
              sum += x;
              magnitude += std::abs(x);
            }
            const float got = c[i * ldc + j], start = accumulate ? c0[i * ldc + j] : 0.0f;
            if (i >= 32 && i < 64) {
              EXPECT_EQ(got, start) << what << " empty panel i=" << i << " j=" << j;
              continue;
            }
            EXPECT_NEAR(got, start + sum, 128 * 0x1p-24 * (magnitude + std::abs(start)))
                << what << " i=" << i << " j=" << j;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace ringsplash
