// Mask::DenseRows: a dense mask holding only some query rows — a ring
// rank's own — so no rank needs the global Sq x Skv array. Checked here:
// the predicate, tile classification and partial-tile masks equal those of
// the global Dense mask on the rows held (and nothing is allowed elsewhere);
// a ring whose ranks each hold only their rows gives bitwise the result of a
// ring on the global mask, and matches the f64 reference; uncovered
// positions are Errors naming them. (That a rank's memory then stays below
// the global array is measured per process under MPI:
// tests/mpi/mpi_dense_rows_test.cc.)
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "src/mask/block_map.h"
#include "tests/support/accuracy.h"
#include "tests/support/ring_run.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

// A random [heads or 1, s, s] 0/1 matrix: a causal band with holes, plus
// empty and full 16 x 16 squares so tiles of every kind occur.
std::vector<uint8_t> RandomMatrix(int64_t heads, int64_t s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> m(static_cast<size_t>(std::max<int64_t>(heads, 1) * s * s));
  for (size_t e = 0; e < m.size(); ++e) {
    const int64_t i = static_cast<int64_t>(e) / s % s, j = static_cast<int64_t>(e) % s;
    const int64_t square = (i / 16 * 7 + j / 16 * 3) % 5;
    m[e] = square == 0 ? 0 : square == 1 ? 1 : (j <= i && rng() % 4 != 0) ? 1 : 0;
  }
  return m;
}

// Rows `rows` of a [heads or 1, s, s] matrix, as DenseRows wants them.
std::vector<uint8_t> RowsOf(const std::vector<uint8_t>& m, int64_t heads, int64_t s,
                            const std::vector<int64_t>& rows) {
  std::vector<uint8_t> out;
  for (int64_t h = 0; h < std::max<int64_t>(heads, 1); ++h) {
    for (const int64_t r : rows) {
      const auto* row = m.data() + (h * s + r) * s;
      out.insert(out.end(), row, row + s);
    }
  }
  return out;
}

std::vector<int64_t> AllPositions(int64_t s) {
  std::vector<int64_t> p(static_cast<size_t>(s));
  for (int64_t i = 0; i < s; ++i) p[static_cast<size_t>(i)] = i;
  return p;
}

TEST(DenseRowsTest, MatchesTheGlobalMaskOnItsRowsAndAllowsNothingElse) {
  constexpr int64_t kS = 96;
  for (const int64_t heads : {int64_t{0}, int64_t{2}}) {
    const std::vector<uint8_t> g = RandomMatrix(heads, kS, 7);
    const Mask global = Mask::Dense(g, heads, kS, kS);
    for (const Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped}) {
      for (int r = 0; r < 3; ++r) {
        SCOPED_TRACE(std::string(LayoutName(layout)) + " rank " + std::to_string(r) + " heads " +
                     std::to_string(heads));
        const std::vector<int64_t> rows = LayoutPositions(layout, kS, r, 3);
        const Mask local = Mask::DenseRows(RowsOf(g, heads, kS, rows), heads, rows, kS);
        EXPECT_EQ(local.FirstUncoveredQuery(rows), std::nullopt);
        const std::optional<int64_t> missing = local.FirstUncoveredQuery(AllPositions(kS));
        ASSERT_TRUE(missing.has_value());
        EXPECT_EQ(std::find(rows.begin(), rows.end(), *missing), rows.end());
        size_t at = 0;
        for (int64_t q = 0; q < kS; ++q) {
          const bool held = at < rows.size() && rows[at] == q;
          at += held ? 1 : 0;
          for (int64_t h = 0; h < std::max<int64_t>(heads, 1); ++h) {
            for (int64_t kv = 0; kv < kS; ++kv) {
              ASSERT_EQ(local.Allowed(h, q, kv), held && global.Allowed(h, q, kv))
                  << "q " << q << " kv " << kv << " head " << h;
            }
          }
        }
        // Block maps on the rank's rows against every source's columns, by
        // row and by column: the same kinds and partial masks as the global
        // mask's (both scan the actual positions of their tiles).
        const int64_t planes = std::max<int64_t>(heads, 1), hq = std::max<int64_t>(heads, 1);
        for (int src = 0; src < 3; ++src) {
          const std::vector<int64_t> cols = LayoutPositions(layout, kS, src, 3);
          for (const bool by_column : {false, true}) {
            const auto a = mask::BlockMap::Build(local, rows, cols, 16, 16, hq, by_column);
            const auto b = mask::BlockMap::Build(global, rows, cols, 16, 16, hq, by_column);
            for (const auto kind :
                 {mask::BlockKind::kEmpty, mask::BlockKind::kPartial, mask::BlockKind::kFull}) {
              EXPECT_EQ(a.Count(kind), b.Count(kind));
            }
            std::vector<uint8_t> ta(16 * 16), tb(16 * 16);
            for (int64_t h = 0; h < planes; ++h) {
              for (int64_t qb = 0; qb < a.num_q_blocks(); ++qb) {
                for (int64_t kvb = 0; kvb < a.num_kv_blocks(); ++kvb) {
                  a.FillPartial(h, qb, kvb, ta.data(), 16);
                  b.FillPartial(h, qb, kvb, tb.data(), 16);
                  ASSERT_EQ(ta, tb) << "tile " << qb << "," << kvb;
                }
              }
            }
          }
        }
      }
    }
  }
}

TEST(DenseRowsTest, ArgumentsAreChecked) {
  EXPECT_THROW(Mask::DenseRows(std::vector<uint8_t>(8), 0, {}, 4), Error);
  EXPECT_THROW(Mask::DenseRows(std::vector<uint8_t>(8), 0, {3, 3}, 4), Error);
  EXPECT_THROW(Mask::DenseRows(std::vector<uint8_t>(8), 0, {-1, 3}, 4), Error);
  EXPECT_THROW(Mask::DenseRows(std::vector<uint8_t>(7), 0, {1, 3}, 4), Error);
  const Mask m = Mask::DenseRows(std::vector<uint8_t>(8, 1), 0, {1, 3}, 4);
  EXPECT_EQ(m.ToString(), "dense_rows[2x4]");
  EXPECT_TRUE(m.has_dense_rows());
  EXPECT_TRUE((Mask::Causal() & m).has_dense_rows());
  EXPECT_FALSE(Mask::Dense(std::vector<uint8_t>(16, 1), 0, 4, 4).has_dense_rows());
  EXPECT_EQ(m.dense_sq(), 4);
  EXPECT_EQ(m.dense_skv(), 4);
}

// Ring problem: N = 4 thread ranks, S = 256, H = 2 (Hkv = 1), sinks and
// segment ids, 16 x 16 tiles.
constexpr int kRanks = 4;
constexpr int64_t kSeq = 256;

struct RingCase {
  std::string name;
  Layout layout;
  int64_t mask_heads;
};

class DenseRowsRingTest : public ::testing::TestWithParam<RingCase> {};

TEST_P(DenseRowsRingTest, EachRankHoldingOnlyItsRowsMatchesTheGlobalMask) {
  const RingCase& c = GetParam();
  Rng rng(21);
  ProblemSpec spec(1, kSeq, kSeq, 2, 1, 16, 16);
  spec.sinks = true;
  spec.segments = true;
  const OwnedInputs in = RandomInputs(rng, spec);
  const Tensor dout = RandomTensor(rng, DType::kF32, {1, kSeq, 2, 16});
  const std::vector<uint8_t> g = RandomMatrix(c.mask_heads, kSeq, 3);
  RingOptions base;
  base.layout = c.layout;
  base.attention.mask = Mask::Dense(g, c.mask_heads, kSeq, kSeq) & Mask::Local(150, 0);
  base.attention.block_sizes = {16, 16};
  base.attention.num_threads = 1;

  std::vector<Mask> own;
  for (int r = 0; r < kRanks; ++r) {
    const std::vector<int64_t> rows = LayoutPositions(c.layout, kSeq, r, kRanks);
    own.push_back(Mask::DenseRows(RowsOf(g, c.mask_heads, kSeq, rows), c.mask_heads, rows, kSeq) &
                  Mask::Local(150, 0));
  }
  const ApiResult rows = RunRingSharded(in, dout, kRanks, c.layout, [&](int r) {
    RingOptions o = base;
    o.attention.mask = own[static_cast<size_t>(r)];
    return o;
  });
  const ApiResult whole = RunRingSharded(in, dout, kRanks, c.layout, [&](int) { return base; });
  // The same tiles, kinds and element masks: bitwise the same results.
  EXPECT_EQ(rows.out, whole.out);
  EXPECT_EQ(rows.lse, whole.lse);
  EXPECT_EQ(rows.dq, whole.dq);
  EXPECT_EQ(rows.dk, whole.dk);
  EXPECT_EQ(rows.dv, whole.dv);
  EXPECT_EQ(rows.dsinks, whole.dsinks);
  // And right: the f64 reference on the global mask, within the f32 bound
  // of accuracy.h (rows of <= 151 keys, 3 ring merges: kF32Tolerance's
  // argument holds).
  const RefResult ref = RunReference(in, base.attention, &dout);
  const Errors bound = ReferenceBounds(ref, ToDoubles(in.v.view()), KernelPath::kPortable,
                                       DType::kF32, DType::kF32, Tolerances{});
  EXPECT_EQ(ExceedsBounds(c.name, ErrorsOf(rows, ref), bound), "");
}

INSTANTIATE_TEST_SUITE_P(Layouts, DenseRowsRingTest,
                         ::testing::Values(RingCase{"zigzag", Layout::kZigzag, 0},
                                           RingCase{"striped_per_head", Layout::kStriped, 2},
                                           RingCase{"contiguous", Layout::kContiguous, 0}),
                         [](const ::testing::TestParamInfo<RingCase>& info) {
                           return info.param.name;
                         });

std::string ErrorOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(DenseRowsErrorsTest, PositionsWithoutARowAreErrorsNamingThem) {
  Rng rng(2);
  const OwnedInputs in = RandomInputs(rng, ProblemSpec(1, 32, 32, 2, 2, 16, 16));
  const Tensor dout = RandomTensor(rng, DType::kF32, {1, 32, 2, 16});
  // Every rank passes rank 0's rows (zigzag, 2 ranks: 0..7 and 24..31).
  const std::vector<int64_t> rows0 = LayoutPositions(Layout::kZigzag, 32, 0, 2);
  const Mask rank0 = Mask::DenseRows(std::vector<uint8_t>(rows0.size() * 32, 1), 0, rows0, 32);
  const std::string msg = ErrorOf([&] {
    RunRingSharded(in, dout, 2, Layout::kZigzag, [&](int) {
      RingOptions o;
      o.attention.mask = rank0;
      return o;
    });
  });
  EXPECT_NE(msg.find("no row for global position 8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1 of 2"), std::string::npos) << msg;

  // On a single device, positions 0..31 against rows {0..7, 24..31}.
  AttentionOptions opt;
  opt.mask = rank0;
  Tensor out(DType::kF32, {1, 32, 2, 16}), lse(DType::kF32, {1, 2, 32});
  const std::string single =
      ErrorOf([&] { AttentionForward(in.inputs(), opt, out.view(), lse.view()); });
  EXPECT_NE(single.find("no row for query position 8"), std::string::npos) << single;
}

}  // namespace
}  // namespace ringsplash::testing
