// Block skipping proven by KernelStats (SPEC §3: tiles a mask rules out are
// never computed): forward and backward tile counts against counts derived
// here element by element, for single masks, compositions and segments.
// Results are also checked against the f64 reference
// (tests/support/reference.h), so skipping never trades away correctness.
//
// Tolerances: f32, explained in tests/support/accuracy.{h,cc}.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ringsplash/mask.h"
#include "tests/support/accuracy.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

constexpr double kF32Tol = kF32Tolerance;

// Tile counts, derived element by element (independent of the block map's
// analytic classification): a tile is computed iff some pair in it is
// allowed, full iff every pair is. allowed(head, q, kv) for heads [0, h),
// each tile counted b times (batch).
template <class Allowed>
KernelStats CountTiles(const Allowed& allowed, int64_t b, int64_t h, int64_t sq, int64_t skv,
                       int64_t bq, int64_t bkv) {
  KernelStats s;
  for (int64_t hh = 0; hh < h; ++hh)
    for (int64_t q0 = 0; q0 < sq; q0 += bq)
      for (int64_t k0 = 0; k0 < skv; k0 += bkv) {
        int64_t in = 0, total = 0;
        for (int64_t i = q0; i < std::min(q0 + bq, sq); ++i)
          for (int64_t j = k0; j < std::min(k0 + bkv, skv); ++j, ++total)
            in += allowed(hh, i, j) ? 1 : 0;
        if (in == 0) {
          s.skipped_blocks += b;
        } else {
          s.computed_blocks += b;
          (in == total ? s.full_blocks : s.partial_blocks) += b;
        }
      }
  return s;
}

// The counts of `mask` (through Mask::Allowed).
KernelStats ExpectedStats(const Mask& mask, int64_t b, int64_t h, int64_t sq, int64_t skv,
                          int64_t bq, int64_t bkv) {
  return CountTiles([&](int64_t hh, int64_t i, int64_t j) { return mask.Allowed(hh, i, j); }, b, h,
                    sq, skv, bq, bkv);
}

void ExpectStats(const KernelStats& got, const KernelStats& want, const std::string& what) {
  EXPECT_EQ(got.computed_blocks, want.computed_blocks) << what;
  EXPECT_EQ(got.full_blocks, want.full_blocks) << what;
  EXPECT_EQ(got.partial_blocks, want.partial_blocks) << what;
  EXPECT_EQ(got.skipped_blocks, want.skipped_blocks) << what;
}

TEST(SkippingTest, CausalComputesAboutHalfTheTiles) {
  const int64_t b = 2, h = 2, s = 256, bq = 32, bkv = 64;
  Rng rng(10);
  const OwnedInputs in = RandomInputs(rng, ProblemSpec{b, s, s, h, 1, 16, 16});
  AttentionOptions opt;
  opt.mask = Mask::Causal();
  opt.block_sizes = {bq, bkv};
  const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
  const ApiResult r = RunAttention(in, opt, &dout);
  // Closed form: q block qb (rows qb*bq .. qb*bq+bq-1) needs kv blocks
  // 0 .. floor((qb*bq + bq - 1) / bkv); it is full for kv blocks whose last
  // key (kb+1)*bkv - 1 <= qb*bq.
  int64_t computed = 0, full = 0;
  for (int64_t qb = 0; qb < s / bq; ++qb) {
    computed += (qb * bq + bq - 1) / bkv + 1;
    full += (qb * bq + 1) / bkv;  // kb with (kb + 1) * bkv <= qb * bq + 1
  }
  const int64_t total = (s / bq) * (s / bkv);
  EXPECT_EQ(r.fwd.computed_blocks, b * h * computed);
  EXPECT_EQ(r.fwd.full_blocks, b * h * full);
  EXPECT_EQ(r.fwd.skipped_blocks, b * h * (total - computed));
  ExpectStats(r.fwd, ExpectedStats(opt.mask, b, h, s, s, bq, bkv), "causal forward");
  ExpectStats(r.bwd, ExpectedStats(opt.mask, b, h, s, s, bq, bkv), "causal backward");
  // About half (plus the diagonal): 20 of 32 tiles per head here.
  EXPECT_EQ(computed, 20);
  EXPECT_EQ(total, 32);
  // FLOPs are spent only on computed tiles: 2 * bq * bkv * (D + Dv) each.
  EXPECT_EQ(r.fwd.flops, static_cast<double>(b * h * computed * 2 * bq * bkv * (16 + 16)));
  EXPECT_LT(Compare(r.out, RunReference(in, opt, nullptr).fwd.out).Relative(), kF32Tol);
}

TEST(SkippingTest, SlidingWindowComputesAboutWindowOverBlockTilesPerRow) {
  const int64_t s = 512, w = 64, bq = 16, bkv = 32;
  Rng rng(11);
  const OwnedInputs in = RandomInputs(rng, ProblemSpec{1, s, s, 1, 1, 16, 16});
  AttentionOptions opt;
  opt.mask = Mask::Local(w, 0);
  opt.block_sizes = {bq, bkv};
  const ApiResult r = RunAttention(in, opt, nullptr);
  ExpectStats(r.fwd, ExpectedStats(opt.mask, 1, 1, s, s, bq, bkv), "local forward");
  // Each q block touches keys [q0 - w, q0 + bq - 1]: at most
  // (w + bq - 1) / bkv + 2 kv tiles, far fewer than the s / bkv = 16 a dense
  // loop would compute.
  const int64_t per_row_bound = (w + bq - 1) / bkv + 2;
  EXPECT_LE(r.fwd.computed_blocks, (s / bq) * per_row_bound);
  EXPECT_GE(r.fwd.computed_blocks, (s / bq - w / bq) * (w / bkv + 1));
  EXPECT_LT(Compare(r.out, RunReference(in, opt, nullptr).fwd.out).Relative(), kF32Tol);
}

// Tile counts of a mask given as a plain predicate on (q, kv) positions,
// written here from SPEC §3 (not Mask::Allowed), over contiguous positions
// [0, s) on both sides, each tile counted `copies` times (batch x heads).
KernelStats PairwiseStats(bool (*allowed)(int64_t q, int64_t kv), int64_t copies, int64_t s,
                          int64_t bq, int64_t bkv) {
  return CountTiles([&](int64_t, int64_t i, int64_t j) { return allowed(i, j); }, copies, 1, s, s,
                    bq, bkv);
}

// Compositions skip every tile either side rules out (SPEC §3; §6: the
// seed, with causal on, dropped every other mask and skipped nothing). S =
// 512, bq = 16, bkv = 32: 32 x 16 = 512 tiles per head. Causal alone
// computes 272 of them; each composition below computes far fewer, so a
// classifier that dropped the window or chunk operand, or that said
// "partial" where causal is full but the window empty, is caught by the
// counts. The window is written two ways: causal & local(64, 0), whose
// right operand alone is the window, and local(64, none) & causal, where
// neither operand alone is (local(64, none), the left side only, computes
// 330 tiles), so dropping either operand changes the counts.
//
// Window kv in [q - 64, q]: q block i holds rows [16i, 16i + 15]; kv block j
// [32j, 32j + 31] is computed iff 32j <= 16i + 15 and 32j + 31 >= 16i - 64,
// i.e. j in [m - 2, m] for m = floor(i / 2), and full iff 32j + 31 <= 16i
// and 32j >= 16i - 49, i.e. j = m - 1. Rows i = 0, 1 compute 1 tile (none
// full), i = 2, 3 compute 2 (1 full), the other 28 rows 3 (1 full):
// computed = 2 + 4 + 84 = 90, full = 2 + 28 = 30.
// Chunks of 64 (kv in q's chunk and kv <= q): a chunk holds q blocks a =
// 0..3 and kv blocks b = 0, 1 (local indices); computed iff 32b <= 16a + 15
// (b = 0 always, b = 1 iff a >= 2): 6 per chunk; full iff 32b + 31 <= 16a
// (b = 0, a >= 2): 2 per chunk. 8 chunks: computed = 48, full = 16.
TEST(SkippingTest, CompositionsWithCausalSkipWhatEitherSideRulesOut) {
  const int64_t s = 512, bq = 16, bkv = 32, b = 1, h = 2, d = 16;
  struct Case {
    std::string name;
    Mask mask;
    bool (*allowed)(int64_t q, int64_t kv);
    int64_t computed, full;  // per head, the closed forms above
  };
  const auto window = [](int64_t q, int64_t kv) { return q - 64 <= kv && kv <= q; };
  // Positions are >= 0 here, so / is the floor of SPEC's chunk index.
  const auto chunked = [](int64_t q, int64_t kv) { return q / 64 == kv / 64 && kv <= q; };
  const std::vector<Case> cases = {
      {"causal & local(64, 0)", Mask::Causal() & Mask::Local(64, 0), window, 90, 30},
      {"local(64, none) & causal", Mask::Local(64, std::nullopt) & Mask::Causal(), window, 90, 30},
      {"causal & chunked(64)", Mask::Causal() & Mask::ChunkedCausal(64), chunked, 48, 16},
  };
  Rng rng(17);
  // H == Hkv: no GQA, so the forward does not stack heads and its tiles are
  // the plain (batch, head, q block, kv block) ones.
  const OwnedInputs in = RandomInputs(rng, ProblemSpec{b, s, s, h, h, d, d});
  const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    AttentionOptions opt;
    opt.mask = c.mask;
    opt.block_sizes = {bq, bkv};
    const ApiResult r = RunAttention(in, opt, &dout);
    const KernelStats want = PairwiseStats(c.allowed, b * h, s, bq, bkv);
    // The brute force and the hand derivation agree (so neither is off).
    EXPECT_EQ(want.computed_blocks, b * h * c.computed);
    EXPECT_EQ(want.full_blocks, b * h * c.full);
    ExpectStats(r.fwd, want, "forward");
    ExpectStats(r.bwd, want, "backward");
    EXPECT_EQ(r.fwd.skipped_blocks, b * h * ((s / bq) * (s / bkv) - c.computed));
    // FLOPs are spent only on computed tiles: 2 * bq * bkv * (D + Dv) each.
    EXPECT_EQ(r.fwd.flops, static_cast<double>(b * h * c.computed * 2 * bq * bkv * (d + d)));
    const Errors e = ErrorsOf(r, RunReference(in, opt, &dout));
    EXPECT_LT(std::max({e.out, e.lse, e.dq, e.dk, e.dv}), kF32Tol) << e.Describe();
  }
}

TEST(SkippingTest, SegmentsSkipTilesAcrossDocuments) {
  // Two documents of 64 tokens each and Full mask: the cross-document tiles
  // (half of them) are skipped.
  Rng rng(12);
  ProblemSpec spec{1, 128, 128, 1, 1, 16, 16};
  spec.segments = true;
  OwnedInputs in = RandomInputs(rng, spec);
  for (int i = 0; i < 128; ++i) {
    in.q_seg.data_as<int32_t>()[i] = i / 64;
    in.kv_seg.data_as<int32_t>()[i] = i / 64;
  }
  AttentionOptions opt;
  opt.block_sizes = {32, 32};
  const ApiResult r = RunAttention(in, opt, nullptr);
  EXPECT_EQ(r.fwd.computed_blocks, 8);
  EXPECT_EQ(r.fwd.skipped_blocks, 8);
  EXPECT_EQ(r.fwd.full_blocks, 8);
  EXPECT_LT(Compare(r.out, RunReference(in, opt, nullptr).fwd.out).Relative(), kF32Tol);
}

}  // namespace
}  // namespace ringsplash::testing
