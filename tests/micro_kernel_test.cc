// Tests of the micro-kernels (src/kernels/micro/micro.h) on every supported
// KernelPath: each one against plain double-precision loops over the same
// inputs, with tolerances derived from f32 rounding in the comments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/tensor.h"
#include "src/kernels/micro/cpu_features.h"
#include "src/kernels/micro/micro.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using testing::RandomFloats;
using testing::Rng;
using testing::RoundUpTo16;

constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(MicroKernelTest, GemmF32MatchesDoubleLoopsOnEveryPath) {
  Rng rng(1);
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    for (int64_t m : {1, 5, 6, 8, 13, 64}) {
      for (int64_t n : {16, 48, 64, 80, 144}) {
        for (int64_t k : {0, 1, 7, 128}) {
          for (int layout = 0; layout < 3; ++layout) {
            // layout 0: A row-major; 1: A transposed; 2: general strides.
            const int64_t a_rs = layout == 0 ? k + 3 : layout == 1 ? 1 : 2 * k + 1;
            const int64_t a_cs = layout == 0 ? 1 : layout == 1 ? m + 2 : 2;
            const size_t a_size = static_cast<size_t>((m + 2) * (a_rs + 1) + (k + 1) * a_cs);
            const std::vector<float> a = RandomFloats(rng, a_size);
            const int64_t ldb = n + 16, ldc = n + 32;
            const std::vector<float> b = RandomFloats(rng, static_cast<size_t>(k * ldb + 1));
            const std::vector<float> c0 = RandomFloats(rng, static_cast<size_t>(m * ldc));
            const std::vector<float> rs = RandomFloats(rng, static_cast<size_t>(m));
            for (int mode = 0; mode < 3; ++mode) {  // overwrite, +=, row-scaled +=
              std::vector<float> c = c0;
              mk.gemm_f32(m, n, k, a.data(), a_rs, a_cs, b.data(), ldb, c.data(), ldc,
                          mode == 2 ? rs.data() : nullptr, mode != 0);
              double worst = 0;
              for (int64_t i = 0; i < m; ++i) {
                for (int64_t j = 0; j < ldc; ++j) {
                  const size_t o = static_cast<size_t>(i * ldc + j);
                  if (j >= n) {  // outside the tile: untouched
                    ASSERT_EQ(c[o], c0[o]);
                    continue;
                  }
                  double e = mode == 0 ? 0.0 : mode == 1 ? c0[o] : double{rs[i]} * c0[o];
                  for (int64_t p = 0; p < k; ++p) {
                    e += double{a[i * a_rs + p * a_cs]} * b[p * ldb + j];
                  }
                  worst = std::max(worst, std::abs(c[o] - e));
                }
              }
              // k <= 128 products of |x| <= 1 in f32: error <= k * 2^-24 * k.
              EXPECT_LE(worst, 1e-5 * (1.0 + static_cast<double>(k)))
                  << KernelPathName(path) << " m=" << m << " n=" << n << " k=" << k
                  << " layout=" << layout << " mode=" << mode;
            }
          }
        }
      }
    }
  }
}

// The bf16 GEMM of every path that has one (vdpbf16ps, AMX tiles) against
// double loops. Shapes cover AMX's whole 16 x 16 tiles and 16-pair k steps,
// their remainders (rows, pairs: handed to vdpbf16ps), 2 x 2 tile blocks with
// a 16-wide column or row tail, accumulate with and without row_scale.
TEST(MicroKernelTest, GemmBf16MatchesDoubleLoopsOnRoundedInputs) {
  int paths = 0;
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    if (mk.gemm_bf16 == nullptr) continue;
    ++paths;
    Rng rng(2);
    for (int64_t m : {1, 7, 8, 16, 40, 64}) {
      for (int64_t n : {16, 48, 64, 112}) {
        for (int64_t k2 : {1, 3, 16, 40, 64}) {
          for (int mode = 0; mode < 3; ++mode) {  // plain, accumulate, accumulate + row_scale
            const int64_t lda = 2 * k2 + 4, ldb = n + 16, ldc = n + 16;
            std::vector<uint16_t> a(static_cast<size_t>(m * lda)),
                b(static_cast<size_t>(k2 * ldb * 2));
            std::uniform_real_distribution<float> u(-1, 1);
            for (auto& x : a) x = F32ToBF16(u(rng));
            for (auto& x : b) x = F32ToBF16(u(rng));
            std::vector<float> c(static_cast<size_t>(m * ldc)), scale(static_cast<size_t>(m));
            for (auto& x : c) x = u(rng);
            for (auto& x : scale) x = u(rng);
            const std::vector<float> c0 = c;
            mk.gemm_bf16(m, n, k2, a.data(), lda, b.data(), ldb, c.data(), ldc,
                         mode == 2 ? scale.data() : nullptr, mode > 0);
            double worst = 0;
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                double e = mode == 0   ? 0.0
                           : mode == 1 ? c0[i * ldc + j]
                                       : double{scale[i]} * c0[i * ldc + j];
                for (int64_t p = 0; p < 2 * k2; ++p) {
                  e += double{BF16ToF32(a[i * lda + p])} *
                       BF16ToF32(b[((p / 2) * ldb + j) * 2 + p % 2]);
                }
                worst = std::max(worst, std::abs(c[i * ldc + j] - e));
              }
              // Columns n.. of C are not the GEMM's to touch.
              for (int64_t j = n; j < ldc; ++j) {
                ASSERT_EQ(c[i * ldc + j], c0[i * ldc + j]) << KernelPathName(path);
              }
            }
            // Products of bf16 values are exact in f32; only the f32 sums
            // round: at most 2 k2 + 1 roundings of partial sums below 2 k2 + 1.
            EXPECT_LE(worst, 1e-5 * static_cast<double>(2 * k2 + 1))
                << KernelPathName(path) << " m=" << m << " n=" << n << " k2=" << k2
                << " mode=" << mode;
          }
        }
      }
    }
  }
  if (paths == 0) GTEST_SKIP() << "no path with a bf16 GEMM (needs AVX512_BF16)";
}

// The bf16 P V's V pair packer (avx512_bf16, amx) against plain loops: values rounded
// to nearest even exactly as F32ToBF16 does, zero k padding up to whole
// 16-pair steps, nothing written past it. Row (key) counts off every multiple.
TEST(MicroKernelTest, Bf16PairPackerForTilePvMatchesLoops) {
  int paths = 0;
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    if (mk.pack_pairs_bf16 == nullptr) continue;
    ++paths;
    Rng rng(4);
    std::uniform_real_distribution<float> u(-3, 3);
    constexpr uint16_t kCanary = 0xABCD;
    for (int64_t rows : {1, 17, 31, 32, 45, 128}) {
      const int64_t padded = (rows + 31) / 32 * 32;
      for (int64_t cols : {16, 48, 128}) {
        const int64_t lds = cols + 16;
        std::vector<float> src(static_cast<size_t>(rows * lds));
        for (auto& x : src) x = u(rng);
        // PackPairsBf16: B[p][c] at ((p / 2) * ldd + c) * 2 + p % 2.
        const int64_t ldd = cols + 16;
        std::vector<uint16_t> pairs(static_cast<size_t>((padded / 2 + 1) * ldd * 2), kCanary);
        mk.pack_pairs_bf16(rows, cols, src.data(), lds, pairs.data(), ldd);
        for (int64_t p = 0; p < padded + 2; ++p) {
          for (int64_t c = 0; c < ldd; ++c) {
            const uint16_t got = pairs[static_cast<size_t>(((p / 2) * ldd + c) * 2 + p % 2)];
            const uint16_t want = p >= padded || c >= cols ? kCanary
                                  : p < rows               ? F32ToBF16(src[p * lds + c])
                                                           : uint16_t{0};
            ASSERT_EQ(got, want) << KernelPathName(path) << " pairs rows=" << rows
                                 << " cols=" << cols << " p=" << p << " c=" << c;
          }
        }
      }
    }
  }
  if (paths == 0) GTEST_SKIP() << "no path packs V pairs for the bf16 P V (needs AVX512_BF16)";
}

// The bf16 forward's V pairs straight from bf16 rows: bits copied exactly,
// columns past cols (any count, not only multiples of 16) zero up to the
// next multiple of 16 even though the source holds other data there (the
// next head's), zero k padding, canaries past every row. The source is
// allocated to end exactly at the last row's last column, so a read past it
// is a heap overflow for the sanitizer builds.
TEST(MicroKernelTest, Bf16PairPackerFromBf16RowsMatchesLoops) {
  int paths = 0;
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    if (mk.pack_pairs_from_bf16 == nullptr) continue;
    ++paths;
    Rng rng(5);
    std::uniform_int_distribution<int> bits(0, 0xffff);
    constexpr uint16_t kCanary = 0xABCD;
    for (int64_t rows : {1, 17, 32, 45, 128}) {
      const int64_t padded = (rows + 31) / 32 * 32;
      for (int64_t cols : {1, 16, 33, 80, 128}) {
        const int64_t lds = cols + 7, cols16 = RoundUpTo16(cols);
        std::vector<uint16_t> src(static_cast<size_t>((rows - 1) * lds + cols));
        for (auto& x : src) x = static_cast<uint16_t>(bits(rng));
        const int64_t ldd = cols16 + 16;
        std::vector<uint16_t> pairs(static_cast<size_t>((padded / 2 + 1) * ldd * 2), kCanary);
        mk.pack_pairs_from_bf16(rows, cols, src.data(), lds, pairs.data(), ldd);
        for (int64_t p = 0; p < padded + 2; ++p) {
          for (int64_t c = 0; c < ldd; ++c) {
            const uint16_t got = pairs[static_cast<size_t>(((p / 2) * ldd + c) * 2 + p % 2)];
            const uint16_t want = p >= padded || c >= cols16 ? kCanary
                                  : p < rows && c < cols     ? src[static_cast<size_t>(p * lds + c)]
                                                             : uint16_t{0};
            ASSERT_EQ(got, want) << KernelPathName(path) << " rows=" << rows << " cols=" << cols
                                 << " p=" << p << " c=" << c;
          }
        }
      }
    }
  }
  if (paths == 0) GTEST_SKIP() << "no path packs V pairs from bf16 rows (needs AVX512_BF16)";
}

// The bf16 backward's gradient operands (avx512_bf16, amx) against plain loops: P^T and
// dS^T rounded to nearest even as F32ToBF16 does, lanes from `queries` to the
// vector's end zero even where the input holds garbage there (BackwardTileFn
// leaves them unspecified), dS transposed with keys zero up to whole 32-key
// steps, nothing written past that (canaries), and either output skipped
// when its pointers are null.
TEST(MicroKernelTest, Bf16GradientOperandsMatchLoops) {
  int paths = 0;
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    if (mk.grad_operands_bf16 == nullptr) continue;
    ++paths;
    Rng rng(6);
    constexpr uint16_t kCanary = 0xABCD;
    for (int64_t keys : {1, 16, 33, 48, 128}) {
      for (int64_t queries : {1, 16, 20, 64, 128}) {
        const int64_t mp = RoundUpTo16(queries), ldp = mp + 16;
        const int64_t ldr = mp + 16, kp = (keys + 31) / 32 * 32, ldc = kp + 16;
        // Garbage (99) in lanes >= queries: the function must not read it through.
        std::vector<float> pt = RandomFloats(rng, static_cast<size_t>(keys * ldp), 0, 1);
        std::vector<float> ds = RandomFloats(rng, static_cast<size_t>(keys * ldp), -3, 3);
        for (int64_t j = 0; j < keys; ++j) {
          for (int64_t i = queries; i < ldp; ++i) pt[j * ldp + i] = ds[j * ldp + i] = 99.0f;
        }
        for (int variant = 0; variant < 3; ++variant) {  // both, rows only, cols only
          const bool rows = variant != 2, cols = variant != 1;
          // Two canary rows past each output's last.
          std::vector<uint16_t> pt_rows(static_cast<size_t>((keys + 2) * ldr), kCanary);
          std::vector<uint16_t> ds_rows(pt_rows),
              ds_cols(static_cast<size_t>((queries + 2) * ldc), kCanary);
          mk.grad_operands_bf16(keys, queries, pt.data(), ds.data(), ldp,
                                rows ? pt_rows.data() : nullptr, rows ? ds_rows.data() : nullptr,
                                ldr, cols ? ds_cols.data() : nullptr, ldc);
          const std::string what =
              std::string(KernelPathName(path)) + " keys=" + std::to_string(keys) +
              " queries=" + std::to_string(queries) + " variant=" + std::to_string(variant);
          for (int64_t j = 0; j < keys + 2; ++j) {
            for (int64_t i = 0; i < ldr; ++i) {
              const size_t at = static_cast<size_t>(j * ldr + i);
              const bool live = rows && j < keys && i < mp;
              const uint16_t want_p = !live         ? kCanary
                                      : i < queries ? F32ToBF16(pt[j * ldp + i])
                                                    : uint16_t{0};
              const uint16_t want_s = !live         ? kCanary
                                      : i < queries ? F32ToBF16(ds[j * ldp + i])
                                                    : uint16_t{0};
              ASSERT_EQ(pt_rows[at], want_p) << what << " pt_rows j=" << j << " i=" << i;
              ASSERT_EQ(ds_rows[at], want_s) << what << " ds_rows j=" << j << " i=" << i;
            }
          }
          for (int64_t i = 0; i < queries + 2; ++i) {
            for (int64_t j = 0; j < ldc; ++j) {
              const uint16_t want = !cols || i >= queries || j >= kp ? kCanary
                                    : j < keys                       ? F32ToBF16(ds[j * ldp + i])
                                                                     : uint16_t{0};
              ASSERT_EQ(ds_cols[static_cast<size_t>(i * ldc + j)], want)
                  << what << " ds_cols i=" << i << " j=" << j;
            }
          }
        }
      }
    }
  }
  if (paths == 0) GTEST_SKIP() << "no path makes bf16 gradient operands (needs AVX512_BF16)";
}

TEST(MicroKernelTest, MaskBitsTransposesAndFindsRanges) {
  Rng rng(5);
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    for (int64_t queries : {1, 16, 37, 64}) {
      for (int64_t keys : {1, 63, 64, 100, 128}) {
        const int64_t ldb = 144, ldm = (queries + 15) / 16 + 1;
        std::vector<uint8_t> bytes(static_cast<size_t>(queries * ldb), 7);  // 7: outside
        // Rows of every kind: empty, one key, a band, random.
        for (int64_t i = 0; i < queries; ++i) {
          for (int64_t j = 0; j < keys; ++j) {
            const int kind = static_cast<int>(i % 4);
            bytes[i * ldb + j] = kind == 0   ? 0
                                 : kind == 1 ? j == (i * 7) % keys
                                 : kind == 2 ? (j >= i / 2 && j < i / 2 + 20)
                                             : (rng() % 2) * 3;
          }
        }
        std::vector<uint16_t> bits(static_cast<size_t>(keys * ldm), 0xAAAA);
        std::vector<int32_t> klo(queries, -1), khi(queries, -1), qlo(keys, -1), qhi(keys, -1);
        mk.mask_bits(queries, keys, bytes.data(), ldb, bits.data(), ldm, klo.data(), khi.data(),
                     qlo.data(), qhi.data());
        for (int64_t j = 0; j < keys; ++j) {
          int64_t lo = -1, hi = 0;
          for (int64_t i = 0; i < ldm * 16; ++i) {
            const bool allowed = i < queries && bytes[i * ldb + j] != 0;
            ASSERT_EQ(kernels::micro::Allowed(bits.data(), ldm, j, i), allowed)
                << KernelPathName(path) << " q" << queries << " k" << keys << " j" << j;
            if (allowed && lo < 0) lo = i;
            if (allowed) hi = i + 1;
          }
          EXPECT_EQ(qlo[j], lo < 0 ? 0 : lo);
          EXPECT_EQ(qhi[j], hi);
        }
        for (int64_t i = 0; i < queries; ++i) {
          int64_t lo = -1, hi = 0;
          for (int64_t j = 0; j < keys; ++j) {
            if (bytes[i * ldb + j] != 0 && lo < 0) lo = j;
            if (bytes[i * ldb + j] != 0) hi = j + 1;
          }
          EXPECT_EQ(klo[i], lo < 0 ? 0 : lo);
          EXPECT_EQ(khi[i], hi);
        }
      }
    }
  }
}

TEST(MicroKernelTest, GemmF32RangesSkipsOnlyZeroTerms) {
  // A is zero outside each row's range; the ranged product must equal the
  // full one (the same terms in the same order, minus exact zeros). Finite
  // garbage outside the ranges of B rows that no row needs must not matter.
  Rng rng(6);
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    for (int64_t m : {1, 6, 13, 64}) {
      for (int64_t n : {16, 64, 80}) {
        const int64_t k = 100, lda = k + 4, ldb = n + 16, ldc = n + 16;
        std::vector<float> a(static_cast<size_t>(m * lda), 0.0f);
        std::vector<int32_t> lo(m), hi(m);
        for (int64_t i = 0; i < m; ++i) {
          lo[i] = static_cast<int32_t>((i * 13) % 60);
          hi[i] = i % 5 == 0 ? lo[i] : static_cast<int32_t>(lo[i] + 1 + (i * 7) % 40);
          for (int64_t p = lo[i]; p < hi[i]; ++p) a[i * lda + p] = RandomFloats(rng, 1)[0];
        }
        const std::vector<float> b = RandomFloats(rng, static_cast<size_t>(k * ldb));
        const std::vector<float> c0 = RandomFloats(rng, static_cast<size_t>(m * ldc));
        const std::vector<float> rs = RandomFloats(rng, static_cast<size_t>(m));
        for (int mode = 0; mode < 3; ++mode) {
          std::vector<float> full = c0, ranged = c0;
          const float* scale = mode == 2 ? rs.data() : nullptr;
          mk.gemm_f32(m, n, k, a.data(), lda, 1, b.data(), ldb, full.data(), ldc, scale, mode != 0);
          mk.gemm_f32_ranges(m, n, k, a.data(), lda, 1, b.data(), ldb, ranged.data(), ldc, scale,
                             mode != 0, kernels::micro::KRanges{lo.data(), hi.data()});
          for (size_t o = 0; o < full.size(); ++o) {
            // x + 0 == x exactly, so skipping zero terms changes nothing.
            ASSERT_EQ(full[o], ranged[o]) << KernelPathName(path) << " m" << m << " n" << n;
          }
        }
      }
    }
  }
}

// A random transposed tile (micro.h TileArgs): keys x queries, D = 40, with
// a mask that allows about 2/3 of the pairs, masks query 3 entirely, and
// masks keys 0-7 of queries 16-31: the first register block of that
// 16-query strip has no allowed pair on every path (blocks of at most 8
// keys here), so the kernels' skipped-block code runs too.
struct RandomTile {
  static constexpr int64_t kKeys = 19, kQueries = 37, kD = 40, kDv = 24;
  static constexpr int64_t kMp = 48, kLd = 64;  // mp = RoundUp(37, 16); leading dims >= mp
  std::vector<float> k, qt, v, dot, pt, ds, deriv, scratch;
  std::vector<uint8_t> mask;   // transposed bytes: mask[j * kLd + i]
  std::vector<uint16_t> bits;  // the same as the kernels take it (micro::Allowed)
  float scale = 0.125f;

  explicit RandomTile(Rng& rng, float spread)
      : k(RandomFloats(rng, kKeys * kD, -spread, spread)),
        qt(static_cast<size_t>(kD * kLd), 0.0f),
        v(RandomFloats(rng, kKeys * kDv)),
        dot(static_cast<size_t>(kDv * kLd), 0.0f),
        pt(static_cast<size_t>(kKeys * kLd), -9.0f),
        ds(static_cast<size_t>(kKeys * kLd), -9.0f),
        deriv(static_cast<size_t>(kKeys * kLd), 0.0f),
        scratch(static_cast<size_t>(3 * kMp) + 64),
        mask(static_cast<size_t>(kKeys * kLd), 0),
        bits(static_cast<size_t>(kKeys * kLd / 16), 0) {
    std::uniform_real_distribution<float> u(-spread, spread), w(-1, 1);
    for (int64_t p = 0; p < kD; ++p) {
      for (int64_t i = 0; i < kQueries; ++i) qt[p * kLd + i] = u(rng);
    }
    for (int64_t c = 0; c < kDv; ++c) {
      for (int64_t i = 0; i < kQueries; ++i) dot[c * kLd + i] = w(rng);
    }
    for (int64_t j = 0; j < kKeys; ++j) {
      for (int64_t i = 0; i < kQueries; ++i) {
        const bool blank = j < 8 && i >= 16 && i < 32;
        mask[j * kLd + i] = i != 3 && !blank && (rng() % 3) != 0;
        if (mask[j * kLd + i] != 0) bits[j * (kLd / 16) + i / 16] |= uint16_t(1u << (i % 16));
      }
    }
  }
  // 64-byte aligned scratch, as the kernels require.
  float* AlignedScratch() {
    auto addr = reinterpret_cast<uintptr_t>(scratch.data());
    return scratch.data() + ((64 - addr % 64) % 64) / sizeof(float);
  }
  kernels::micro::TileArgs Args(bool masked, float softcap) {
    kernels::micro::TileArgs t;
    t.keys = kKeys;
    t.queries = kQueries;
    t.d = kD;
    t.k = k.data();
    t.ldk = kD;
    t.qt = qt.data();
    t.ldq = kLd;
    t.pt = pt.data();
    t.ldp = kLd;
    t.mask = masked ? bits.data() : nullptr;
    t.ldm = kLd / 16;
    t.scale = scale;
    t.softcap = softcap;
    t.scratch = AlignedScratch();
    return t;
  }
  // The logit of (key j, query i) in double, -inf where masked.
  double Logit(int64_t j, int64_t i, bool masked, float softcap) const {
    double s = 0;
    for (int64_t p = 0; p < kD; ++p) s += double{k[j * kD + p]} * qt[p * kLd + i];
    double x = double{scale} * s;
    if (softcap > 0) x = softcap * std::tanh(x / softcap);
    return masked && mask[j * kLd + i] == 0 ? -kInf : x;
  }
  // Rounding bound of the kernels' f32 logit: D products summed in f32 err by
  // ~sqrt(D) 2^-24 sum |products| (random signs), scaled; 4x margin. (A soft
  // cap only shrinks errors: |tanh'| <= 1.)
  double LogitErr(int64_t j, int64_t i) const {
    double s = 0;
    for (int64_t p = 0; p < kD; ++p) s += std::abs(double{k[j * kD + p]} * qt[p * kLd + i]);
    return 4.0 * std::sqrt(double{kD}) * 0x1p-24 * scale * s;
  }
};

// The contract shared by SoftmaxColumnsFn (exact) and ForwardTileFn (exact or
// lazy): with M = the new row_max (0 if -inf), P^T = exp(x - M), alpha =
// exp(old max - M), row_sum = alpha old_sum + sum_j P^T, and M >= the old max
// (equal when lazy). Returns whether the step was lazy (alpha == 1 with an
// unchanged finite max).
bool CheckForwardStep(const RandomTile& tile, bool masked, float softcap,
                      const std::vector<float>& max0, const std::vector<float>& sum0,
                      const std::vector<float>& row_max, const std::vector<float>& row_sum,
                      const std::vector<float>& alpha, const std::string& what,
                      double p_rel = 0.0) {
  bool lazy = true;
  for (int64_t i = 0; i < RandomTile::kQueries; ++i) {
    const double shift = row_max[i] == -kInf ? 0.0 : row_max[i];
    double mx = -kInf, sum = 0, mx_err = 0;
    for (int64_t j = 0; j < RandomTile::kKeys; ++j) {
      const double x = tile.Logit(j, i, masked, softcap);
      if (x != -kInf) mx_err = std::max(mx_err, tile.LogitErr(j, i));
      mx = std::max(mx, x);
      const double p = std::exp(x - shift);
      sum += p;
      // exp's argument is the f32 logit (LogitErr) minus the shift, each
      // also rounded relative to its magnitude (~2^-24 |x|, |shift|), and the
      // polynomial adds ~2e-7 relative: 4x margin on the last two.
      const double arg_err = tile.LogitErr(j, i) +
                             4.0 * 0x1p-24 * ((x != -kInf ? std::abs(x) : 0.0) + std::abs(shift));
      const double tol = 1e-7 + p * (arg_err + 8e-7 + p_rel);
      const float got = tile.pt[j * RandomTile::kLd + i];
      // Whatever the step, nothing may come near overflow.
      if (!(std::abs(got - p) <= tol) || !(got <= kernels::micro::kLazySumLimit)) {
        ADD_FAILURE() << what << " j=" << j << " i=" << i << ": P^T " << got << " expected " << p
                      << " +- " << tol;
        return false;
      }
    }
    if (max0[i] == -kInf || mx > max0[i]) {
      // The max must not drop, and a query seen for the first time gets an
      // exact step (its new max is the tile's max).
      EXPECT_GE(row_max[i], max0[i]) << what;
    }
    if (max0[i] == -kInf) {
      if (mx == -kInf) {
        EXPECT_EQ(row_max[i], -std::numeric_limits<float>::infinity()) << what;
      } else {
        EXPECT_NEAR(row_max[i], mx, mx_err + 4.0 * 0x1p-24 * std::abs(mx)) << what;
      }
    }
    const double a = std::exp(double{max0[i]} - shift);
    // alpha and the sum inherit the shift's error (as large as the max's).
    const double rel = mx_err + 4.0 * 0x1p-24 * (2.0 * std::abs(shift) + 2.0) + 1e-6;
    EXPECT_NEAR(alpha[i], a, rel * a + 1e-30) << what << " i=" << i;
    EXPECT_NEAR(row_sum[i], a * sum0[i] + sum, rel * (a * sum0[i] + sum)) << what << " i=" << i;
    lazy = lazy && alpha[i] == 1.0f && row_max[i] == max0[i] && max0[i] != -kInf;
  }
  return lazy;
}

// out[j * kLd + i] = sum_p a[j * k + p] bt[p * kLd + i] for the tile's keys
// j and all kLd lanes i, summed in double: a tile product as a GEMM on other
// units would leave it.
void StoreProduct(const std::vector<float>& a, int64_t k, const std::vector<float>& bt,
                  std::vector<float>& out) {
  for (int64_t j = 0; j < RandomTile::kKeys; ++j) {
    for (int64_t i = 0; i < RandomTile::kLd; ++i) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) s += double{a[j * k + p]} * bt[p * RandomTile::kLd + i];
      out[j * RandomTile::kLd + i] = static_cast<float>(s);
    }
  }
}

// The raw products K Q^T of the tile into its P^T buffer (what the score
// GEMM leaves for SoftmaxColumnsFn and SoftmaxBf16Fn).
void StoreProducts(RandomTile& tile) { StoreProduct(tile.k, RandomTile::kD, tile.qt, tile.pt); }

// SoftmaxBf16Fn (avx512_bf16, amx): the ForwardTileFn contract with P as bf16 rows
// (relative rounding <= 2^-8, bf16's unit roundoff, on top of
// CheckForwardStep's bound), zero keys up
// to RoundUp(keys, 32), nothing written past them. From max0 (exact for the
// even queries), from the state reached (lazy unless a max is still -inf)
// and from a reference far below the logits (exact again: no overflow).
void CheckSoftmaxBf16(const kernels::micro::MicroKernels& mk, RandomTile& tile, bool masked,
                      float softcap, const std::vector<float>& max0, const std::string& what) {
  constexpr int64_t nq = RandomTile::kQueries, kKeys = RandomTile::kKeys;
  constexpr int64_t kPadded = 32, kLdp = kPadded + 8;
  constexpr uint16_t kCanary = 0xABCD;
  std::vector<float> row_max = max0, row_sum(nq), alpha(nq);
  for (int64_t i = 0; i < nq; ++i) row_sum[i] = max0[i] == -kInf ? 0.0f : 1.5f;
  auto step = [&](const std::vector<float>& from_max, const std::vector<float>& from_sum,
                  const std::string& label) {
    StoreProducts(tile);
    row_max = from_max;
    row_sum = from_sum;
    std::vector<uint16_t> p(static_cast<size_t>((nq + 1) * kLdp), kCanary);
    mk.softmax_bf16(tile.Args(masked, softcap), row_max.data(), row_sum.data(), alpha.data(),
                    p.data(), kLdp);
    for (int64_t i = 0; i < nq + 1; ++i) {
      for (int64_t j = 0; j < kLdp; ++j) {
        const uint16_t got = p[static_cast<size_t>(i * kLdp + j)];
        if (i >= nq || j >= kPadded) {
          EXPECT_EQ(got, kCanary) << label << " i=" << i << " j=" << j;
        } else if (j >= kKeys) {
          EXPECT_EQ(got, 0) << label << " i=" << i << " j=" << j;
        } else {
          tile.pt[j * RandomTile::kLd + i] = BF16ToF32(got);  // for CheckForwardStep
        }
      }
    }
    return CheckForwardStep(tile, masked, softcap, from_max, from_sum, row_max, row_sum, alpha,
                            label, 0x1p-8);
  };
  std::vector<float> sum0 = row_sum;
  step(max0, sum0, "softmax_bf16 " + what);
  const std::vector<float> max1 = row_max, sum1 = row_sum;
  bool any_inf = false;
  for (float x : max1) any_inf = any_inf || x == -kInf;
  const bool lazy = step(max1, sum1, "softmax_bf16 again " + what);
  if (!any_inf && softcap == 0.0f) {
    EXPECT_TRUE(lazy) << what;
  }
  if (softcap == 0.0f) {  // (with a cap the step is always exact)
    const std::vector<float> low(nq, -200.0f), sum_low(nq, 1.0f);
    EXPECT_FALSE(step(low, sum_low, "softmax_bf16 low " + what));
  }
}

TEST(MicroKernelTest, SoftmaxColumnsAndForwardTileMatchDoubleMath) {
  Rng rng(3);
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    for (float softcap : {0.0f, 5.0f, 30.0f}) {
      for (bool masked : {false, true}) {
        // spread 8: logits up to ~scale * D * 64 = 320, beyond exp's range.
        for (float spread : {1.0f, 8.0f}) {
          const std::string what = std::string(KernelPathName(path)) + " cap " +
                                   std::to_string(softcap) + (masked ? " masked" : "") +
                                   " spread " + std::to_string(spread);
          RandomTile tile(rng, spread);
          const int64_t nq = RandomTile::kQueries;
          // Odd queries start from a finite state, even ones from nothing.
          std::vector<float> max0(nq), sum0(nq);
          for (int64_t i = 0; i < nq; ++i) {
            max0[i] = i % 2 == 0 ? -std::numeric_limits<float>::infinity() : 2.0f;
            sum0[i] = i % 2 == 0 ? 0.0f : 1.5f;
          }
          // SoftmaxColumns: in place on the raw products, always exact.
          std::vector<float> row_max = max0, row_sum = sum0, alpha(nq);
          kernels::micro::TileArgs t = tile.Args(masked, softcap);
          StoreProducts(tile);
          mk.softmax_columns(t, row_max.data(), row_sum.data(), alpha.data());
          EXPECT_FALSE(CheckForwardStep(tile, masked, softcap, max0, sum0, row_max, row_sum, alpha,
                                        "columns " + what));
          // ForwardTile from the same state: exact for the even queries.
          row_max = max0;
          row_sum = sum0;
          mk.forward_tile(t, row_max.data(), row_sum.data(), alpha.data());
          CheckForwardStep(tile, masked, softcap, max0, sum0, row_max, row_sum, alpha,
                           "tile " + what);
          // Again from the state it reached: every max is finite now (query 3
          // is masked throughout when masked), and with logits within ~14 of
          // it the fast paths take the lazy step.
          const std::vector<float> max1 = row_max, sum1 = row_sum;
          bool any_inf = false;
          for (float x : max1) any_inf = any_inf || x == -std::numeric_limits<float>::infinity();
          mk.forward_tile(t, row_max.data(), row_sum.data(), alpha.data());
          const bool lazy = CheckForwardStep(tile, masked, softcap, max1, sum1, row_max, row_sum,
                                             alpha, "tile again " + what);
          if (path != KernelPath::kPortable && !any_inf) {
            EXPECT_TRUE(lazy) << what;
          }
          // From a reference far below the logits the lazy step would
          // overflow: the kernel must fall back to the exact step.
          if (spread > 1.0f && softcap == 0.0f) {
            std::vector<float> low(nq, -200.0f), sum_low(nq, 1.0f);
            row_max = low;
            row_sum = sum_low;
            mk.forward_tile(t, row_max.data(), row_sum.data(), alpha.data());
            EXPECT_FALSE(CheckForwardStep(tile, masked, softcap, low, sum_low, row_max, row_sum,
                                          alpha, "tile low " + what));
          }
          if (mk.softmax_bf16 != nullptr) CheckSoftmaxBf16(mk, tile, masked, softcap, max0, what);
        }
      }
    }
  }
}

// A product past f32's range (+inf in K Q^T): the bf16 step's own exact
// step (ExactStepBf16) declines it and the f32 step's result stands, so
// SoftmaxBf16Fn gives bit for bit what SoftmaxColumnsFn does on the same
// products and state, with P rounded to bf16 rows (what it gave before that
// step existed). From a state finite for every query (the lazy step runs
// and fails on the +inf sum), and from one without a max for the even
// queries (the lazy step declines at once).
TEST(MicroKernelTest, SoftmaxBf16WithAnInfiniteProductAsTheF32Step) {
  Rng rng(9);
  constexpr int64_t nq = RandomTile::kQueries, kLdp = 32;
  auto same = [](float a, float b) {
    return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, sizeof(a)) == 0;
  };
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    if (mk.softmax_bf16 == nullptr) continue;
    for (bool masked : {false, true}) {
      for (bool all_finite : {true, false}) {
        const std::string what = std::string(KernelPathName(path)) + (masked ? " masked" : "") +
                                 (all_finite ? " finite state" : " even queries new");
        RandomTile tile(rng, 1.0f);
        StoreProducts(tile);
        tile.pt[5 * RandomTile::kLd + 6] =
            std::numeric_limits<float>::infinity();  // query 6 sees key 5
        tile.mask[5 * RandomTile::kLd + 6] = 1;
        tile.bits[5 * (RandomTile::kLd / 16)] |= uint16_t{1u << 6};
        std::vector<float> max0(nq), sum0(nq);
        for (int64_t i = 0; i < nq; ++i) {
          const bool fresh = !all_finite && i % 2 == 0;
          max0[i] = fresh ? -kInf : 2.0f;
          sum0[i] = fresh ? 0.0f : 1.5f;
        }
        const std::vector<float> raw = tile.pt;
        std::vector<float> max_c = max0, sum_c = sum0, alpha_c(nq);
        mk.softmax_columns(tile.Args(masked, 0.0f), max_c.data(), sum_c.data(), alpha_c.data());
        const std::vector<float> p_columns = tile.pt;
        tile.pt = raw;
        std::vector<float> max_b = max0, sum_b = sum0, alpha_b(nq);
        std::vector<uint16_t> p(static_cast<size_t>(nq * kLdp));
        mk.softmax_bf16(tile.Args(masked, 0.0f), max_b.data(), sum_b.data(), alpha_b.data(),
                        p.data(), kLdp);
        for (int64_t i = 0; i < nq; ++i) {
          EXPECT_TRUE(same(max_b[i], max_c[i])) << what << " row_max " << i;
          EXPECT_TRUE(same(sum_b[i], sum_c[i])) << what << " row_sum " << i;
          EXPECT_TRUE(same(alpha_b[i], alpha_c[i])) << what << " alpha " << i;
          for (int64_t j = 0; j < RandomTile::kKeys; ++j) {
            const float want = p_columns[j * RandomTile::kLd + i];
            const uint16_t got = p[static_cast<size_t>(i * kLdp + j)];
            EXPECT_TRUE((std::isnan(want) && std::isnan(BF16ToF32(got))) || got == F32ToBF16(want))
                << what << " P " << i << " " << j;
          }
        }
        EXPECT_TRUE(std::isnan(sum_b[6]) || std::isinf(sum_b[6]) || std::isnan(max_b[6]) ||
                    std::isinf(max_b[6]))
            << what << ": the test's +inf product did not reach query 6";
      }
    }
  }
}

// Also with products_stored (the bf16 backward's stored products): S^T and dP^T
// stored beforehand (from double sums), the epilogues run on them in place.
// Only the AVX-512 kernels (avx512, avx512_bf16, amx) take that mode.
TEST(MicroKernelTest, BackwardTileMatchesDoubleMath) {
  Rng rng(4);
  for (KernelPath path : SupportedKernelPaths()) {
    const kernels::micro::MicroKernels& mk = kernels::micro::MicroKernelsFor(path);
    const bool avx512 =
        path == KernelPath::kAvx512 || path == KernelPath::kAvx512Bf16 || path == KernelPath::kAmx;
    for (bool stored : {false, true}) {
      if (stored && !avx512) continue;
      for (float softcap : {0.0f, 5.0f}) {
        for (bool masked : {false, true}) {
          RandomTile tile(rng, 1.0f);
          const int64_t nq = RandomTile::kQueries;
          std::vector<float> lse(nq), delta = RandomFloats(rng, nq);
          for (int64_t i = 0; i < nq; ++i) lse[i] = i == 5 ? -kInf : 1.0f + 0.1f * i;
          kernels::micro::BackwardTileArgs b;
          b.t = tile.Args(masked, softcap);
          b.dv = RandomTile::kDv;
          b.v = tile.v.data();
          b.ldv = RandomTile::kDv;
          b.dot = tile.dot.data();
          b.lse = lse.data();
          b.delta = delta.data();
          b.ds = tile.ds.data();
          b.deriv = tile.deriv.data();
          if (stored) {
            StoreProducts(tile);                                       // S^T
            StoreProduct(tile.v, RandomTile::kDv, tile.dot, tile.ds);  // dP^T
            b.products_stored = true;
            b.t.k = nullptr;  // unused in this mode
            b.v = nullptr;
          }
          mk.backward_tile(b);
          for (int64_t j = 0; j < RandomTile::kKeys; ++j) {
            for (int64_t i = 0; i < nq; ++i) {
              const double x = tile.Logit(j, i, masked, softcap);
              const double p = lse[i] == -kInf ? 0.0 : std::exp(x - lse[i]);
              double dp = 0;
              for (int64_t c = 0; c < RandomTile::kDv; ++c) {
                dp += double{tile.v[j * RandomTile::kDv + c]} * tile.dot[c * RandomTile::kLd + i];
              }
              double ds = tile.scale * p * (dp - delta[i]);
              if (softcap > 0) {
                const double th = std::tanh(tile.Logit(j, i, false, 0.0f) / softcap);
                ds *= 1.0 - th * th;
              }
              // |x|, |lse| <= ~5: exp's argument is good to ~1e-6, p <= ~1,
              // dp sums 24 products of |.| <= 1 (~1e-6 absolute).
              const size_t o = static_cast<size_t>(j * RandomTile::kLd + i);
              ASSERT_NEAR(tile.pt[o], p, 4e-6 * (p + 1e-3)) << KernelPathName(path) << stored;
              ASSERT_NEAR(tile.ds[o], ds, 4e-6) << KernelPathName(path) << stored;
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace ringsplash
