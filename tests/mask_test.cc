// Mask: element predicate of every kind against formulas written here from
// SPEC §3 (not computed by the code under test), composition, head
// dependence, argument validation and the canonical text round trip.
#include "ringsplash/mask.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "ringsplash/error.h"

namespace ringsplash {
namespace {

using Pred = std::function<bool(int64_t q, int64_t kv)>;

// Positions and offsets used by the grid checks: small enough for int64
// formulas, including negative kv - q differences.
constexpr int64_t kGrid = 40;

// The grid, then pairs far out (positions up to 2^40, as long sequences and
// ring slices have them; the reference and the kernels' tile masks call
// Allowed there): mostly near the diagonal, where offsets, windows and
// chunk edges decide, some anywhere.
void ExpectMatches(const Mask& m, const Pred& expected, const std::string& what, int64_t head = 0) {
  for (int64_t q = 0; q < kGrid; ++q) {
    for (int64_t kv = 0; kv < kGrid; ++kv) {
      ASSERT_EQ(m.Allowed(head, q, kv), expected(q, kv))
          << what << " head=" << head << " q=" << q << " kv=" << kv;
    }
  }
  std::mt19937_64 rng(std::hash<std::string>()(what) + static_cast<uint64_t>(head));
  std::uniform_int_distribution<int64_t> far(0, int64_t{1} << 40), near(-3 * kGrid, 3 * kGrid);
  for (int n = 0; n < 4000; ++n) {
    const int64_t q = far(rng);
    const int64_t kv = n % 8 == 0 ? far(rng) : std::max<int64_t>(0, q + near(rng));
    ASSERT_EQ(m.Allowed(head, q, kv), expected(q, kv))
        << what << " head=" << head << " q=" << q << " kv=" << kv;
  }
}

TEST(MaskTest, FullAllowsEverything) {
  ExpectMatches(
      Mask(), [](int64_t, int64_t) { return true; }, "default");
  ExpectMatches(
      Mask::Full(), [](int64_t, int64_t) { return true; }, "full");
  EXPECT_EQ(Mask().num_heads(), 0);
  EXPECT_FALSE(Mask().has_dense());
}

TEST(MaskTest, CausalWithOffsets) {
  for (int64_t off : {-7, -1, 0, 1, 5}) {
    ExpectMatches(
        Mask::Causal(off), [off](int64_t q, int64_t kv) { return q + off >= kv; },
        "causal:" + std::to_string(off));
  }
}

TEST(MaskTest, LocalWithEveryCombinationOfSides) {
  const std::vector<std::optional<int64_t>> sides = {std::nullopt, 0, 1, 3, 9};
  for (const auto& left : sides) {
    for (const auto& right : sides) {
      for (int64_t off : {-4, 0, 2}) {
        const Pred expected = [=](int64_t q, int64_t kv) {
          const bool lo_ok = !left || q + off - *left <= kv;
          const bool hi_ok = !right || kv <= q + off + *right;
          return lo_ok && hi_ok;
        };
        ExpectMatches(Mask::Local(left, right, off), expected,
                      "local L=" + std::to_string(left.value_or(-1)) + " R=" +
                          std::to_string(right.value_or(-1)) + " off=" + std::to_string(off));
      }
    }
  }
}

TEST(MaskTest, ChunkedCausal) {
  for (int64_t chunk : {1, 3, 8, 100}) {
    ExpectMatches(
        Mask::ChunkedCausal(chunk),
        [chunk](int64_t q, int64_t kv) { return q / chunk == kv / chunk && q >= kv; },
        "chunked:" + std::to_string(chunk));
  }
}

// Documented choice for negative positions: chunks are [k*C, (k+1)*C)
// (floor division). Expected values worked out by hand for C = 4.
TEST(MaskTest, ChunkedCausalUsesFloorChunksForNegativePositions) {
  const Mask m = Mask::ChunkedCausal(4);
  EXPECT_TRUE(m.Allowed(0, -1, -4));   // chunk [-4, -1]
  EXPECT_TRUE(m.Allowed(0, -3, -3));   // same position
  EXPECT_FALSE(m.Allowed(0, -1, -5));  // -5 is in chunk [-8, -5]
  EXPECT_FALSE(m.Allowed(0, 0, -1));   // 0 starts chunk [0, 3]
  EXPECT_FALSE(m.Allowed(0, -4, -3));  // not causal
}

// Offsets and positions at the int64 extremes must not overflow: the
// expected values are the mathematical (unbounded integer) answers.
TEST(MaskTest, ExtremeValuesDoNotOverflow) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  EXPECT_TRUE(Mask::Causal(kMax).Allowed(0, kMax, kMax));             // 2^64 - 2 >= kMax
  EXPECT_FALSE(Mask::Causal(kMin).Allowed(0, kMin, kMin));            // -2^64 >= kMin is false
  EXPECT_FALSE(Mask::Local(kMax, kMax).Allowed(0, 0, kMin));          // lower end -kMax > kMin
  EXPECT_TRUE(Mask::Local(kMax, std::nullopt).Allowed(0, -1, kMin));  // lower end == kMin
  EXPECT_FALSE(Mask::Local(0, 0, kMax).Allowed(0, 1, kMax));          // only kv = 2^63 allowed
  EXPECT_TRUE(Mask::Local(0, 0, kMax).Allowed(0, 0, kMax));
  EXPECT_TRUE(Mask::ChunkedCausal(kMax).Allowed(0, kMax - 1, 0));
  EXPECT_FALSE(Mask::ChunkedCausal(kMax).Allowed(0, kMax, 0));  // kMax starts chunk 1
}

TEST(MaskTest, AndOrCompose) {
  const Mask causal = Mask::Causal();
  const Mask window = Mask::Local(5, 0);
  const Mask diag_band = Mask::Local(0, 2, 10);
  ExpectMatches(
      causal & window, [](int64_t q, int64_t kv) { return kv <= q && kv >= q - 5; },
      "causal & local:5,0");
  ExpectMatches(
      window | diag_band,
      [](int64_t q, int64_t kv) {
        return (q - 5 <= kv && kv <= q) || (q + 10 <= kv && kv <= q + 12);
      },
      "local:5,0 | local:0,2,10");
  ExpectMatches((causal | diag_band) & (Mask::ChunkedCausal(7) | Mask::Local(1, 1)),
                [](int64_t q, int64_t kv) {
                  const bool a = kv <= q || (q + 10 <= kv && kv <= q + 12);
                  const bool b = (q / 7 == kv / 7 && q >= kv) || (q - 1 <= kv && kv <= q + 1);
                  return a && b;
                },
                "(causal | local:0,2,10) & (chunked:7 | local:1,1)");
}

TEST(MaskTest, PerHeadUsesEachHeadsMask) {
  const Mask m = Mask::PerHead({Mask::Causal(), Mask::Full(), Mask::Local(2, 2)});
  EXPECT_EQ(m.num_heads(), 3);
  ExpectMatches(
      m, [](int64_t q, int64_t kv) { return kv <= q; }, "head 0", 0);
  ExpectMatches(
      m, [](int64_t, int64_t) { return true; }, "head 1", 1);
  ExpectMatches(
      m, [](int64_t q, int64_t kv) { return q - 2 <= kv && kv <= q + 2; }, "head 2", 2);
  // Combining with a head-independent mask keeps the head count.
  const Mask both = m & Mask::Causal(1);
  EXPECT_EQ(both.num_heads(), 3);
  ExpectMatches(
      both, [](int64_t q, int64_t kv) { return kv <= q + 1; }, "head 1 & causal:1", 1);
  EXPECT_THROW(m.Allowed(3, 0, 0), Error);
  EXPECT_THROW(m.Allowed(-1, 0, 0), Error);
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = static_cast<uint8_t>(rng() % 3 == 0 ? 0 : rng() % 7);  // nonzero = allowed
  return v;
}

TEST(MaskTest, DenseSharedByHeads) {
  const int64_t sq = 13, skv = 17;
  const std::vector<uint8_t> v = RandomBytes(sq * skv, 1);
  const Mask m = Mask::Dense(v, 0, sq, skv);
  EXPECT_EQ(m.num_heads(), 0);
  EXPECT_TRUE(m.has_dense());
  EXPECT_EQ(m.dense_sq(), sq);
  EXPECT_EQ(m.dense_skv(), skv);
  for (int64_t q = -2; q < sq + 2; ++q) {
    for (int64_t kv = -2; kv < skv + 2; ++kv) {
      const bool inside = q >= 0 && q < sq && kv >= 0 && kv < skv;
      const bool expected = inside && v[q * skv + kv] != 0;
      ASSERT_EQ(m.Allowed(5, q, kv), expected) << q << "," << kv;
    }
  }
}

TEST(MaskTest, DensePerHead) {
  const int64_t h = 3, sq = 9, skv = 11;
  const std::vector<uint8_t> v = RandomBytes(h * sq * skv, 2);
  const Mask m = Mask::Dense(v, h, sq, skv);
  EXPECT_EQ(m.num_heads(), h);
  for (int64_t head = 0; head < h; ++head) {
    for (int64_t q = 0; q < sq; ++q) {
      for (int64_t kv = 0; kv < skv; ++kv) {
        ASSERT_EQ(m.Allowed(head, q, kv), v[(head * sq + q) * skv + kv] != 0);
      }
    }
  }
  // PerHead accepts head-dependent children of the same head count.
  const Mask ph = Mask::PerHead({m, Mask::Causal(), m});
  EXPECT_EQ(ph.num_heads(), 3);
  EXPECT_EQ(ph.Allowed(2, 4, 5), v[(2 * sq + 4) * skv + 5] != 0);
  EXPECT_EQ(ph.Allowed(1, 4, 5), false);
}

TEST(MaskTest, DenseExtentIsTheSmallestOfItsLeaves) {
  const Mask a = Mask::Dense(std::vector<uint8_t>(20 * 30, 1), 0, 20, 30);
  const Mask b = Mask::Dense(std::vector<uint8_t>(25 * 10, 1), 0, 25, 10);
  const Mask m = (a & Mask::Causal()) | b;
  EXPECT_TRUE(m.has_dense());
  EXPECT_EQ(m.dense_sq(), 20);
  EXPECT_EQ(m.dense_skv(), 10);
  EXPECT_EQ(Mask::Causal().dense_sq(), 0);
}

void ExpectErrorMentions(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(MaskTest, RejectsBadArguments) {
  ExpectErrorMentions([] { Mask::Local(-1, 3); }, "left");
  ExpectErrorMentions([] { Mask::Local(3, -2); }, "right");
  ExpectErrorMentions([] { Mask::ChunkedCausal(0); }, "chunk");
  ExpectErrorMentions([] { Mask::ChunkedCausal(-5); }, "-5");
  ExpectErrorMentions([] { Mask::Dense(std::vector<uint8_t>(11), 0, 3, 4); }, "11");
  ExpectErrorMentions([] { Mask::Dense(std::vector<uint8_t>(12), 2, 3, 4); }, "24");
  ExpectErrorMentions([] { Mask::Dense({}, -1, 0, 0); }, "heads");
  ExpectErrorMentions([] { Mask::Dense({}, 0, -1, 0); }, "sq");
  ExpectErrorMentions([] { Mask::Dense({}, 0, 0, 4); }, "sq and skv must be > 0, got sq=0 skv=4");
  ExpectErrorMentions([] { Mask::Dense({}, 0, 3, 0); }, "sq and skv must be > 0, got sq=3 skv=0");
  ExpectErrorMentions([] { Mask::Dense({}, 2, 0, 0); }, "sq and skv must be > 0, got sq=0 skv=0");
  ExpectErrorMentions([] { Mask::PerHead({}); }, "PerHead");
  const Mask two = Mask::PerHead({Mask::Causal(), Mask::Full()});
  const Mask three = Mask::PerHead({Mask::Causal(), Mask::Full(), Mask::Full()});
  ExpectErrorMentions([&] { Mask::PerHead({two, Mask::Full(), Mask::Full()}); }, "2");
  ExpectErrorMentions([&] { (void)(two & three); }, "3");
  ExpectErrorMentions([&] { (void)(two | Mask::Dense(std::vector<uint8_t>(3), 3, 1, 1)); }, "3");
}

TEST(MaskTest, ToStringIsCanonical) {
  EXPECT_EQ(Mask().ToString(), "full");
  EXPECT_EQ(Mask::Causal().ToString(), "causal");
  EXPECT_EQ(Mask::Causal(-3).ToString(), "causal:-3");
  EXPECT_EQ(Mask::Local(4, 0).ToString(), "local:4,0");
  EXPECT_EQ(Mask::Local(std::nullopt, 2, 7).ToString(), "local:,2,7");
  EXPECT_EQ(Mask::Local(1, std::nullopt, -2).ToString(), "local:1,,-2");
  EXPECT_EQ(Mask::ChunkedCausal(64).ToString(), "chunked:64");
  EXPECT_EQ((Mask::Causal() & Mask::Local(8, 0)).ToString(), "causal & local:8,0");
  EXPECT_EQ(((Mask::Causal() | Mask::Full()) & Mask::ChunkedCausal(2)).ToString(),
            "(causal | full) & chunked:2");
  EXPECT_EQ((Mask::Causal() | (Mask::Full() & Mask::ChunkedCausal(2))).ToString(),
            "causal | full & chunked:2");
}

TEST(MaskTest, ParseInvertsToString) {
  const std::vector<Mask> masks = {
      Mask(),
      Mask::Causal(12),
      Mask::Local(std::nullopt, std::nullopt, -3),
      Mask::Local(0, 0),
      Mask::ChunkedCausal(5) | Mask::Local(3, std::nullopt, 9),
      (Mask::Causal(-2) | Mask::Local(1, 1)) & (Mask::ChunkedCausal(6) | Mask::Full()),
      Mask::Causal() & (Mask::Local(2, 2) | (Mask::ChunkedCausal(4) & Mask::Causal(-1))),
  };
  for (const Mask& m : masks) {
    const std::string text = m.ToString();
    const Mask back = Mask::Parse(text);
    EXPECT_EQ(back.ToString(), text);
    for (int64_t q = 0; q < kGrid; ++q) {
      for (int64_t kv = 0; kv < kGrid; ++kv) {
        ASSERT_EQ(back.Allowed(0, q, kv), m.Allowed(0, q, kv)) << text << " " << q << "," << kv;
      }
    }
  }
}

TEST(MaskTest, NonTextMasksHaveADescriptiveString) {
  const Mask d = Mask::Dense(std::vector<uint8_t>(2 * 3 * 4), 2, 3, 4);
  EXPECT_EQ(d.ToString(), "dense[2x3x4]");
  EXPECT_EQ(Mask::PerHead({Mask::Causal(), Mask::Full()}).ToString(), "perhead(causal; full)");
  EXPECT_THROW(Mask::Parse(d.ToString()), Error);
}

}  // namespace
}  // namespace ringsplash
