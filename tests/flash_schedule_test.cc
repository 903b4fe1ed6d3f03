// The flash kernels' schedules: block sparsity and FLOP counts, results
// bitwise independent of the thread count (and of which schedule the thread
// count picks), the backward's head parts, stacked query heads for short
// query blocks, merging forwards, block-size invariance. Numeric checks
// compare against the f64 reference (tests/support/reference.h) or against
// another run of the same kernel where the claim is invariance.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "ringsplash/attention.h"
#include "src/kernels/combine.h"
#include "src/kernels/decode/stacked_heads.h"
#include "src/kernels/flash/flash.h"
#include "src/kernels/flash/merge.h"
#include "src/kernels/flash/schedule.h"
#include "src/kernels/micro/cpu_features.h"
#include "src/kernels/micro/micro.h"
#include "src/kernels/thread_pool.h"
#include "src/kernels/tiling/tiles.h"
#include "tests/support/accuracy.h"
#include "tests/support/flash_problem.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using kernels::FlashParams;
using kernels::ThreadPool;
using testing::BitwiseEqual;
using testing::CheckAgainstReference;
using testing::ExpectClose;
using testing::ExpectGradients;
using testing::Iota;
using testing::kF32Tol;
using testing::Problem;
using testing::ProblemSpec;
using testing::Result;
using testing::RoundsP;
using testing::RunConfig;
using testing::Shape;
using testing::SliceRows;
using testing::SpecOf;
using testing::ToDoubleVec;

// --- Block sparsity, determinism, block-size invariance -----------------------

TEST(FlashTest, CausalSkipsEmptyTilesAndCountsFlops) {
  // S = 256, blocks 32 x 32: per (b, h) 8 x 8 tiles; causal computes the 36 on
  // or below the diagonal (8 partial diagonal ones) and skips 28.
  ProblemSpec spec(2, 256, 256, 2, 1, 16, 32);
  Problem prob(600, spec);
  for (KernelPath path : SupportedKernelPaths()) {
    RunConfig s;
    s.path = path;
    s.mask = Mask::Causal();
    const Result r = prob.Run(s, true);
    const int64_t heads = spec.b * spec.h;
    for (const KernelStats* st : {&r.fwd_stats, &r.bwd_stats}) {
      EXPECT_EQ(st->computed_blocks, heads * 36);
      EXPECT_EQ(st->partial_blocks, heads * 8);
      EXPECT_EQ(st->full_blocks, heads * 28);
      EXPECT_EQ(st->skipped_blocks, heads * 28);
    }
    const double tile = 32.0 * 32.0;
    EXPECT_EQ(r.fwd_stats.flops, heads * 36 * 2 * tile * (spec.d + spec.dv));
    const kernels::Geometry g = kernels::Geometry::Of(prob.Params(s));
    if (kernels::BackwardInOnePass(g, s.threads)) {  // S, dP, dV, dK, dQ once
      EXPECT_EQ(r.bwd_stats.flops, heads * 36 * 2 * tile * (3.0 * spec.d + 2.0 * spec.dv));
    } else {  // dK/dV pass: S, dP, dV, dK; dQ pass: S, dP, dQ.
      EXPECT_EQ(r.bwd_stats.flops,
                heads * 36 * tile * (4.0 * (spec.d + spec.dv) + 2.0 * (2 * spec.d + spec.dv)));
    }
  }
}

TEST(FlashTest, BitwiseIdenticalAcrossThreadCounts) {
  for (KernelPath path : SupportedKernelPaths()) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      ProblemSpec spec(2, 100, 90, 4, 2, 32, 32);
      spec.dtype = dtype;
      spec.segments = true;
      Problem prob(700, spec);
      RunConfig s;
      s.path = path;
      s.mask = Mask::Causal(20);
      s.threads = 1;
      const Result r1 = prob.Run(s, true);
      for (int threads : {2, 3, 7}) {  // 7: two passes
        s.threads = threads;
        const Result rn = prob.Run(s, true);
        EXPECT_TRUE(BitwiseEqual(r1, rn));
      }
    }
  }
}

// The gradients of `added` (Problem::Run with add_gradients: added to 0.5)
// against those of `written` (written into NaN): the same but for the
// rounding of each partial sum added to 0.5, at most half an ulp of 0.5 +
// |partial sum| per add, one add per computed tile (at most 10 per row in
// the tests below): 32 ulps of 0.5 + the largest |gradient| (partial sums
// stay within a few times it) bound them. A NaN (an element left unwritten)
// fails the comparison.
void ExpectAddedMatchesWritten(const Result& added, const Result& written,
                               const std::string& what) {
  for (auto [a, w] :
       {std::pair{&added.dq, &written.dq}, {&added.dk, &written.dk}, {&added.dv, &written.dv}}) {
    double largest = 0;
    for (float x : *w) largest = std::max(largest, std::abs(double{x}));
    const double bound = 32 * std::ldexp(0.5 + largest, -24);
    for (size_t e = 0; e < w->size(); ++e) {
      ASSERT_LE(std::abs(double{(*a)[e]} - (*w)[e]), bound) << what << " element " << e;
    }
  }
}

// The backward splits each kv head's group of query heads into parts when
// there are fewer than 16 (batch, kv head) pairs (MQA, small batches), so
// that its one-pass schedule has enough tasks. Each split: gradients against
// the reference, and bitwise the same on 1 to 4 and 7 threads, i.e. through
// both schedules (8 or 16 tasks on 7 threads take the two-pass one).
TEST(FlashTest, BackwardHeadPartsMatchReferenceOnAnyThreadCount) {
  struct Case {
    Shape shape;
    int64_t parts;  // the documented rule: the smallest divisor of the group
                    // giving >= 16 tasks, else the whole group
  };
  const std::vector<Case> cases = {
      {{2, 40, 50, 16, 8, 16, 16}, 1},  // 16 pairs: groups of 2 stay whole
      {{2, 40, 50, 16, 4, 16, 24}, 2},  // 8 pairs: groups of 4 in halves
      {{1, 40, 50, 8, 1, 16, 16}, 8},   // MQA: every query head its own part
  };
  uint64_t seed = 720;
  for (const Case& c : cases) {
    for (KernelPath path : SupportedKernelPaths()) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        RunConfig s;
        s.path = path;
        s.mask = Mask::Causal(5);
        s.blocks = {16, 16};
        s.threads = 1;
        CheckAgainstReference(c.shape, dtype, s, /*segments=*/false, ++seed);
        Problem prob(seed, SpecOf(c.shape, dtype));
        const kernels::Geometry g = kernels::Geometry::Of(prob.Params(s));
        EXPECT_EQ(kernels::BackwardHeadParts(g), c.parts);
        const Result r1 = prob.Run(s, true);
        for (int threads : {2, 3, 4, 7}) {
          s.threads = threads;
          EXPECT_EQ(kernels::BackwardInOnePass(g, threads), threads != 7);
          const Result rn = prob.Run(s, true);
          EXPECT_TRUE(BitwiseEqual(r1, rn))
              << KernelPathName(path) << " " << DTypeName(dtype) << " parts " << c.parts << ", "
              << threads << " threads";
        }
        // Added to accumulators holding 0.5 (GradientSums; the ring's
        // steps) rather than written (here <= 4 adds per dQ row, <= 10 per
        // dK/dV row); bitwise the same through both schedules (1 and 7
        // threads).
        s.add_gradients = true;
        s.threads = 1;
        const Result a1 = prob.Run(s, true);
        s.threads = 7;
        EXPECT_TRUE(BitwiseEqual(a1, prob.Run(s, true))) << KernelPathName(path);
        s.add_gradients = false;
        ExpectAddedMatchesWritten(a1, r1,
                                  std::string(KernelPathName(path)) + " " + DTypeName(dtype) +
                                      " parts " + std::to_string(c.parts));
      }
    }
  }
  // The rule on long sequences, where the parts' dK/dV buffers ((parts - 1)
  // x 144 MiB here: rows padded to 144 floats) must stay within one f32 copy
  // of q (512 MiB): MQA at S = 131072 takes 4 parts, not 8; 16 pairs none.
  // Shapes only (no data): Geometry::Of reads nothing else.
  auto geometry = [](int64_t b, int64_t s, int64_t h, int64_t hkv) {
    FlashParams p;
    p.q = TensorView::Contiguous(nullptr, DType::kF32, {b, s, h, 128});
    p.k = TensorView::Contiguous(nullptr, DType::kF32, {b, s, hkv, 128});
    p.v = p.k;
    p.blocks = {128, 128};
    return kernels::Geometry::Of(p);
  };
  EXPECT_EQ(kernels::BackwardHeadParts(geometry(1, 131072, 8, 1)), 4);
  EXPECT_EQ(kernels::BackwardHeadParts(geometry(1, 1024, 8, 1)), 8);  // small: the whole group
  EXPECT_EQ(kernels::BackwardHeadParts(geometry(16, 1024, 8, 1)), 1);
  EXPECT_EQ(kernels::BackwardHeadParts(geometry(2, 1024, 16, 4)), 2);

  // MQA on 2 threads: one pass (the five products once per tile).
  ProblemSpec spec(1, 64, 64, 8, 1, 16, 16);
  Problem prob(730, spec);
  RunConfig s;
  s.blocks = {16, 16};
  s.threads = 2;
  EXPECT_TRUE(kernels::BackwardInOnePass(kernels::Geometry::Of(prob.Params(s)), 2));
  const Result r = prob.Run(s, true);
  const double tiles = 8.0 * 4 * 4;
  EXPECT_EQ(r.bwd_stats.flops, tiles * 2 * 16 * 16 * (3.0 * 16 + 2.0 * 16));
}

// Gradients written whole into accumulators larger than the caches (>= 16
// MiB) go out with non-temporal stores. Written into buffers full of NaN,
// they must equal the gradients added to 0.5 (ordinary stores;
// ExpectAddedMatchesWritten), with nothing left unwritten, through each
// schedule: one head of D = 256 (6.3 M floats) on 2 threads (two passes,
// one task) and on 1 (one pass, in order); MQA with 8 head parts, D = 40,
// Dv = 24 (4.7 M floats) on 2 threads (one pass, the later parts' dK/dV
// buffered), with q rows 0..19 allowed no key (their dQ rows written 0).
// Narrow windows (one or two tiles per q block) keep it cheap enough for
// the portable path under qemu.
TEST(FlashTest, StreamedGradientsAreWrittenWhole) {
  struct Case {
    Shape shape;
    Mask mask;
    int threads;
    bool one_pass;
  };
  const Mask offset = Mask::Causal(-20) & Mask::Local(28, std::nullopt);
  const std::vector<Case> cases = {
      {{1, 8192, 8192, 1, 1, 256, 256}, Mask::Causal() & Mask::Local(12, std::nullopt), 2, false},
      {{1, 8192, 8192, 1, 1, 256, 256}, Mask::Causal() & Mask::Local(12, std::nullopt), 1, true},
      {{1, 12288, 12288, 8, 1, 40, 24}, offset, 2, true},
  };
  uint64_t seed = 740;
  for (const Case& c : cases) {
    Problem prob(++seed, SpecOf(c.shape, DType::kF32));
    for (KernelPath path : SupportedKernelPaths()) {
      RunConfig s;
      s.path = path;
      s.mask = c.mask;
      s.blocks = {16, 16};
      s.threads = c.threads;
      const kernels::Geometry g = kernels::Geometry::Of(prob.Params(s));
      EXPECT_EQ(kernels::BackwardInOnePass(g, c.threads), c.one_pass);
      const Result written = prob.Run(s, true);
      s.add_gradients = true;
      const Result added = prob.Run(s, true);
      const std::string what = std::string(KernelPathName(path)) +
                               " H=" + std::to_string(c.shape.h) + ", " +
                               std::to_string(c.threads) + " threads";
      ExpectAddedMatchesWritten(added, written, what);
      if (c.shape.h == 8) {  // rows 0..19 of every head: no allowed key
        for (size_t e = 0; e < static_cast<size_t>(20 * 8 * 40); ++e) {
          ASSERT_EQ(written.dq[e], 0.0f) << what << " element " << e;
        }
      }
    }
  }
}

// The one-pass backward computes a group of up to four kv tiles per pass
// over the q tiles (kKvGroup in flash/backward.cc), walking the tiles' runs
// of q blocks together; the two-pass schedule takes one kv tile at a time.
// 11 kv tiles of 16 keys (groups of 4, 4 and 3) under masks whose runs start,
// end and break at different q blocks for each tile of a group: gradients
// against the reference, and bitwise the same on 1 thread (one pass, tiles
// added in order), 2 (one pass, the later head part's tiles buffered) and 3
// (two passes: 4 tasks would leave a thread idle half the time).
TEST(FlashTest, BackwardKvGroupsMatchOneTileAtATime) {
  const Shape sh{1, 150, 170, 4, 2, 16, 16};
  // Per head, blocks of 16 x 16 with no allowed pair in a pattern that
  // differs from one kv block (and head) to the next, so a kv tile's runs
  // break where its neighbours' do not; inside the other blocks a sparse
  // element pattern.
  std::vector<uint8_t> dense(static_cast<size_t>(sh.h * sh.sq * sh.skv));
  for (int64_t h = 0; h < sh.h; ++h) {
    for (int64_t i = 0; i < sh.sq; ++i) {
      for (int64_t j = 0; j < sh.skv; ++j) {
        const bool block = ((i / 16) * 7 + (j / 16) * 3 + h) % 5 != 0;
        dense[static_cast<size_t>((h * sh.sq + i) * sh.skv + j)] = block && (i + 2 * j) % 7 != 0;
      }
    }
  }
  const std::vector<std::pair<Mask, bool>> cases = {
      // mask, segments
      {Mask::Causal(20), false},
      {Mask::Local(40, 10), true},
      {Mask::Local(20, 0) | Mask::Local(20, 0, -90), false},  // two runs per kv tile
      {Mask::Dense(dense, sh.h, sh.sq, sh.skv), false},
  };
  uint64_t seed = 740;
  for (const auto& [mask, segments] : cases) {
    for (KernelPath path : SupportedKernelPaths()) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        RunConfig s;
        s.path = path;
        s.mask = mask;
        s.blocks = {16, 16};
        s.threads = 1;
        CheckAgainstReference(sh, dtype, s, segments, ++seed);
        Problem prob(seed, SpecOf(sh, dtype, segments));
        const kernels::Geometry g = kernels::Geometry::Of(prob.Params(s));
        ASSERT_EQ(g.nkvb, 11);
        const Result r1 = prob.Run(s, true);
        for (int threads : {2, 3}) {
          s.threads = threads;
          EXPECT_EQ(kernels::BackwardInOnePass(g, threads), threads == 2);
          EXPECT_TRUE(BitwiseEqual(r1, prob.Run(s, true)))
              << mask.ToString() << " " << KernelPathName(path) << " " << DTypeName(dtype) << ", "
              << threads << " threads";
        }
      }
    }
  }
}

// Short query blocks with GQA / MQA (decoding, speculative and chunked
// steps) stack the query heads of each kv group into rows of one q block
// (decode/stacked_heads.h). Against the reference: decode steps at the end of the
// keys (a single query — stacked only on paths without a decoding kernel,
// UseDecodeStep — and 5 and 8), causal, windowed and chunked masks,
// packed documents, every path and dtype; and bitwise the same on 1 to 3
// threads. (The backward, run too, is not stacked.)
TEST(FlashTest, StackedHeadsMatchReferenceOnAnyThreadCount) {
  const std::vector<Shape> shapes = {
      {1, 1, 90, 6, 1, 16, 16},  // one decoding token, MQA
      {2, 5, 70, 8, 2, 32, 24},  // groups of 4
      {1, 8, 50, 4, 2, 48, 80},  // 2 * Sq = the q block
  };
  const std::vector<Mask> masks = {Mask::Causal(), Mask::Causal() & Mask::Local(20, 0),
                                   Mask::ChunkedCausal(24), Mask::Full()};
  uint64_t seed = 1200;
  for (KernelPath path : SupportedKernelPaths()) {
    for (const Shape& sh : shapes) {
      for (size_t m = 0; m < masks.size(); ++m) {
        for (DType dtype : {DType::kF32, DType::kBF16}) {
          RunConfig s;
          s.path = path;
          s.mask = masks[m];
          s.blocks = {16, 16};
          const bool segments = m == 0 && sh.b == 2;
          CheckAgainstReference(sh, dtype, s, segments, ++seed, /*backward=*/true,
                                /*q_offset=*/sh.skv - sh.sq);
          Problem prob(seed, SpecOf(sh, dtype, segments));
          const FlashParams p = prob.Params(s);
          EXPECT_EQ(kernels::StackedHeads::Applies(p), !kernels::UseDecodeStep(p));
          EXPECT_EQ(kernels::UseDecodeStep(p),
                    sh.sq == 1 && kernels::micro::MicroKernelsFor(path).decode_step != nullptr);
          s.threads = 1;
          const Result r1 = prob.Run(s, false);
          for (int threads : {2, 3}) {
            s.threads = threads;
            EXPECT_TRUE(BitwiseEqual(r1, prob.Run(s, false)))
                << KernelPathName(path) << " " << DTypeName(dtype) << " mask " << m;
          }
        }
      }
    }
  }
}

// The stacked copy of q reads any strides: a q view with inner stride 2 (and
// its heads and rows strided to match) gives bitwise the results of the
// same values stored contiguously, on every path, for f32 and bf16.
TEST(FlashTest, StackedHeadsReadStridedQueries) {
  for (KernelPath path : SupportedKernelPaths()) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      const ProblemSpec spec = SpecOf({2, 5, 70, 8, 2, 32, 24}, dtype);
      Problem prob(1250, spec);
      RunConfig s;
      s.path = path;
      s.mask = Mask::Causal(60);
      s.blocks = {16, 16};
      const FlashParams p = prob.Params(s);
      ASSERT_TRUE(kernels::StackedHeads::Applies(p));
      Tensor wide(dtype, {spec.b, spec.sq, spec.h, 2 * spec.d});
      TensorView strided = wide.view();
      strided.shape[3] = spec.d;
      strided.stride[3] = 2;
      testing::FromDoubles(testing::ToDoubles(p.q), strided);
      FlashParams ps = p;
      ps.q = strided;
      const auto n = static_cast<size_t>(spec.b * spec.sq * spec.h * spec.dv);
      const auto rows = static_cast<size_t>(spec.b * spec.h * spec.sq);
      std::vector<float> out(n), lse(rows), out_s(n), lse_s(rows);
      ThreadPool pool(2);
      kernels::FlashForward(p, pool, out.data(), lse.data(), nullptr);
      kernels::FlashForward(ps, pool, out_s.data(), lse_s.data(), nullptr);
      const std::string what = std::string(KernelPathName(path)) + " " + DTypeName(dtype);
      EXPECT_EQ(std::memcmp(out.data(), out_s.data(), n * sizeof(float)), 0) << what;
      EXPECT_EQ(std::memcmp(lse.data(), lse_s.data(), rows * sizeof(float)), 0) << what;
    }
  }
}

// When stacking does not apply: one head per kv head, a mask that depends
// on the head, or a query block more than half full.
TEST(FlashTest, StackedHeadsOnlyWhereTheyApply) {
  RunConfig s;
  s.blocks = {16, 16};
  EXPECT_TRUE(
      kernels::StackedHeads::Applies(Problem(1, SpecOf({1, 8, 20, 4, 2, 16, 16})).Params(s)));
  EXPECT_FALSE(
      kernels::StackedHeads::Applies(Problem(1, SpecOf({1, 9, 20, 4, 2, 16, 16})).Params(s)));
  EXPECT_FALSE(
      kernels::StackedHeads::Applies(Problem(1, SpecOf({1, 4, 20, 2, 2, 16, 16})).Params(s)));
  s.mask = Mask::PerHead({Mask::Causal(), Mask::Full(), Mask::Causal(), Mask::Full()});
  const ProblemSpec spec = SpecOf({1, 4, 20, 4, 2, 16, 16});
  Problem prob(2, spec);
  EXPECT_FALSE(kernels::StackedHeads::Applies(prob.Params(s)));
  // ... and the head-dependent mask still holds per head.
  const testing::RefForward ref = testing::ReferenceForward(prob.Ref(s));
  const Result r = prob.Run(s, false);
  ExpectClose(r.out, ref.out, kF32Tol, "out, per-head mask");
  ExpectClose(r.lse, ref.lse, kF32Tol, "lse, per-head mask");
}

// The geometry of the problem FlashForward runs for p: the stacked one
// where stacking applies (decode/stacked_heads.h).
kernels::Geometry ForwardGeometry(const FlashParams& p) {
  if (!kernels::StackedHeads::Applies(p)) return kernels::Geometry::Of(p);
  ThreadPool pool(1);
  const kernels::StackedHeads stacked(p, pool);
  return kernels::Geometry::Of(stacked.params());
}

// The forward of prob on 1 thread, expected bitwise the same on 2 and 3.
Result ExpectSameOnAnyThreadCount(const Problem& prob, RunConfig s, const std::string& what) {
  s.threads = 1;
  const Result r1 = prob.Run(s, false);
  for (int threads : {2, 3}) {
    s.threads = threads;
    EXPECT_TRUE(BitwiseEqual(r1, prob.Run(s, false))) << what << ", " << threads << " threads";
  }
  return r1;
}

// Calls with few (batch, head, q block) tasks split each walk over the kv
// tiles into ranges merged in order (ForwardKvSplits): decoding steps with
// and without stacked heads, windows that leave some rows nothing in some
// ranges, packed documents. Against the reference on every path and dtype,
// bitwise the same on 1 to 3 threads, and the bf16 out (written through the
// merge of the ranges) equal to the rounded f32 out.
TEST(FlashTest, KvSplitsMatchReferenceOnAnyThreadCount) {
  struct Case {
    Shape shape;
    Mask mask;
    // The rule: up to 16 items, ranges of at least 8 tiles; in decoding-shaped
    // calls with fewer than 4 (batch, kv head) items so split, ranges down to
    // 2 tiles for 4.
    int64_t splits;
  };
  const std::vector<Case> cases = {
      {{1, 1, 600, 2, 2, 32, 32}, Mask::Causal(), 4},  // 38 tiles, 2 tasks
      // Stacked (12 rows): 1 task, 19 tiles: 2 ranges of 8 or more, 4 of 2 or more.
      {{1, 3, 300, 4, 1, 16, 24}, Mask::Causal() & Mask::Local(150, 0), 4},
      // MQA over 8 tiles: 4 ranges of 2 (one kv head makes too few items);
      // with 4 kv heads the kv heads alone make 4 items, unsplit.
      {{1, 1, 128, 8, 1, 32, 32}, Mask::Full(), 4},
      {{1, 1, 128, 8, 4, 32, 32}, Mask::Full(), 1},
      // Stacked, segments: 2 items (both heads of a batch element together).
      {{2, 2, 1100, 4, 2, 16, 16}, Mask::Causal(), 8},
      // Two runs of tiles per row (far past, recent window): some ranges
      // start past a run's end or inside the gap.
      {{1, 2, 1100, 2, 2, 16, 16}, Mask::Causal(-250) | Mask::Local(40, 0), 8},
      // MQA with 512-byte V rows, used once each: read in place, not copied
      // (25 tiles: 3 ranges of 8 or more, 4 of 2 or more).
      {{1, 1, 400, 4, 1, 32, 128}, Mask::Causal(), 4},
  };
  uint64_t seed = 1300;
  for (const Case& c : cases) {
    for (KernelPath path : SupportedKernelPaths()) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        RunConfig s;
        s.path = path;
        s.mask = c.mask;
        s.blocks = {16, 16};
        const bool segments = c.shape.b == 2;
        CheckAgainstReference(c.shape, dtype, s, segments, ++seed, /*backward=*/false,
                              /*q_offset=*/c.shape.skv - c.shape.sq);
        Problem prob(seed, SpecOf(c.shape, dtype, segments));
        FlashParams p = prob.Params(s);
        EXPECT_EQ(kernels::StackedHeads::Applies(p),
                  c.shape.h > c.shape.hkv && !kernels::UseDecodeStep(p));
        EXPECT_EQ(kernels::ForwardKvSplits(ForwardGeometry(p)), c.splits);
        const Result r1 =
            ExpectSameOnAnyThreadCount(prob, s,
                                       std::string(KernelPathName(path)) + " " + DTypeName(dtype) +
                                           " splits " + std::to_string(c.splits));
        ThreadPool pool(2);
        const auto n = r1.out.size();
        std::vector<uint16_t> bf(n);
        std::vector<float> lse(r1.lse.size());
        const kernels::Bf16Out direct{
            .data = bf.data(),
            .stride = {c.shape.sq * c.shape.h * c.shape.dv, c.shape.h * c.shape.dv, c.shape.dv},
            .sinks = nullptr};
        ASSERT_TRUE(kernels::FlashForwardBf16Out(p, pool, direct, lse.data(), nullptr));
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(bf[i], F32ToBF16(r1.out[i])) << i;
        EXPECT_EQ(std::memcmp(lse.data(), r1.lse.data(), lse.size() * sizeof(float)), 0);
      }
    }
  }
}

// Decoding-shaped calls take the query heads of a work item together, kv
// tile by kv tile (ForwardHeadsTogether): more heads than one item takes,
// heads of one kv group sharing a fetched tile (a per-head mask keeps them
// unstacked), windows and packed documents that leave heads' walks with
// different tiles. Against the reference on every path and dtype, bitwise
// the same on 1 to 3 threads.
TEST(FlashTest, HeadsTogetherMatchReferenceOnAnyThreadCount) {
  struct Case {
    Shape shape;
    Mask mask;
    int64_t together;  // ForwardHeadsTogether of the (stacked) problem
    int64_t splits;
  };
  const std::vector<Case> cases = {
      // 40 heads: items of 32 and 8; 44 tiles of 16 keys.
      {{1, 1, 700, 40, 40, 16, 16}, Mask::Causal(), 32, 5},
      {{2, 3, 300, 6, 6, 32, 24}, Mask::Causal() & Mask::Local(50, 0), 6, 2},
      // 2 kv heads: 2 ranges (of 6 and 7 tiles) for 4 items.
      {{1, 2, 200, 4, 2, 16, 16},
       Mask::PerHead({Mask::Causal(), Mask::Full(), Mask::Local(30, 0), Mask::Causal(-100)}),
       4,
       2},
      // The same, split over 4 kv ranges.
      {{1, 2, 600, 4, 2, 16, 16},
       Mask::PerHead({Mask::Local(100, 0), Mask::Full(), Mask::Causal(), Mask::Causal(-300)}),
       4,
       4},
      // Stacked GQA: 2 kv heads x 4 query heads x 3 rows = 12 rows per head
      // (more than decoding mode takes, UseDecodeStep).
      {{1, 3, 260, 8, 2, 16, 16}, Mask::Causal(), 2, 2},
      // Not taken together: 17 rows per head (not decoding-shaped, unsplit),
      // or one head (decoding-shaped: 4 ranges of 3 or 4 tiles).
      {{1, 17, 200, 4, 4, 16, 16}, Mask::Causal(), 1, 1},
      {{1, 1, 200, 1, 1, 16, 16}, Mask::Causal(), 1, 4},
  };
  uint64_t seed = 1400;
  for (const Case& c : cases) {
    for (KernelPath path : SupportedKernelPaths()) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        RunConfig s;
        s.path = path;
        s.mask = c.mask;
        s.blocks = {16, 16};
        const bool segments = c.shape.b == 2;
        CheckAgainstReference(c.shape, dtype, s, segments, ++seed, /*backward=*/false,
                              /*q_offset=*/c.shape.skv - c.shape.sq);
        Problem prob(seed, SpecOf(c.shape, dtype, segments));
        const kernels::Geometry g = ForwardGeometry(prob.Params(s));
        EXPECT_EQ(kernels::ForwardHeadsTogether(g), c.together);
        EXPECT_EQ(kernels::ForwardKvSplits(g), c.splits);
        ExpectSameOnAnyThreadCount(prob, s,
                                   std::string(KernelPathName(path)) + " " + DTypeName(dtype) +
                                       " heads " + std::to_string(c.shape.h));
      }
    }
  }
}

// Decoding steps (up to 8 query rows per kv head: one token with GQA, a few
// with MHA) on the paths with a decoding kernel run in decoding mode
// (UseDecodeStep: K and V read in place, 16 keys per vector, 8 on AVX2): D and Dv that
// are no multiple of 16 or of 8 and Dv over 64 (the kernels' column tails), key
// counts that are no multiple of 16 (its key tail), GQA and MQA (no longer
// stacked), several rows per head that see different keys of a partial
// tile (the last query sits 5 keys before the end of the cache), per-head
// masks (one head sees no key at all: out 0, lse -inf), packed documents,
// bf16 rows read as word pairs (D and Dv multiples of 32 on AVX-512; on
// AVX2 multiples of 16 with no rows shared: half-line and one-group
// column tails), a
// soft cap over large logits, [B, H, S, D] views, one head; and calls with
// more rows per kv head, which keep the tile loop. On every path and dtype
// against the reference within kF32Tol — the decoding kernel never rounds
// P, so bf16 inputs (exact in f32) get the f32 bound too — and bitwise the
// same on 1 to 3 threads.
// A per-head mask: head 0 causal within a window of `window` keys, the
// other heads causal.
Mask WindowFirstHead(int64_t heads, int64_t window) {
  std::vector<Mask> masks(static_cast<size_t>(heads), Mask::Causal());
  masks[0] = Mask::Causal() & Mask::Local(window, 0);
  return Mask::PerHead(masks);
}

TEST(FlashTest, DecodingStepsMatchReferenceOnAnyThreadCount) {
  struct Case {
    Shape shape;
    Mask mask;
    bool decode;  // decoding mode where the path has a decoding kernel
    float softcap = 0.0f;
    bool bhsd = false;
    double qk_range = 1.0;
    BlockSizes blocks{16, 48};
  };
  const std::vector<Case> cases = {
      {{1, 1, 203, 3, 3, 40, 72}, Mask::Causal(), true},
      {{1, 4, 203, 3, 3, 40, 72}, Mask::Causal(), true},
      {{2, 1, 300, 4, 4, 24, 200}, Mask::Causal() & Mask::Local(60, 0), true},
      {{2, 4, 300, 4, 2, 24, 200}, Mask::Causal() & Mask::Local(60, 0), true},
      {{1, 1, 500, 8, 2, 64, 64}, Mask::Causal(), true, 20.0f, false, 4.0},
      {{1, 1, 260, 4, 1, 16, 16},
       Mask::PerHead({Mask::Causal(), Mask::Full(), Mask::Local(30, 0), Mask::Causal(-300)}),
       true},
      {{1, 2, 333, 4, 2, 32, 32}, Mask::Causal(), true, 0.0f, true, 1.0, {16, 32}},
      {{1, 1, 100, 1, 1, 16, 16}, Mask::Full(), true, 0.0f, false, 1.0, {16, 16}},
      {{1, 8, 100, 2, 2, 16, 16}, Mask::Causal(), true, 0.0f, false, 1.0, {8, 16}},
      // Column tails of the 8-lane (AVX2) kernel too: D, Dv no multiple of 8.
      {{1, 2, 150, 2, 2, 20, 36}, Mask::Causal(), true},
      {{1, 1, 150, 4, 2, 12, 20}, Mask::Causal() & Mask::Local(70, 0), true},
      // Dv over 64 and no multiple of 8; 5 to 7 rows sharing each K/V row.
      {{1, 1, 150, 2, 2, 24, 70}, Mask::Causal(), true},
      {{1, 5, 150, 2, 2, 16, 24}, Mask::Causal(), true},
      {{1, 1, 150, 6, 1, 16, 16}, Mask::Causal() & Mask::Local(40, 0), true},
      {{1, 7, 130, 1, 1, 8, 40}, Mask::Causal(), true},
      // bf16 rows as word pairs on AVX-512 (D and Dv multiples of 32): Dv of
      // 3 x 32 columns (two-vector and one-vector column steps), 4 heads
      // per kv head; 8 entries (2 rows x 4 heads) sharing rows.
      {{1, 1, 260, 8, 2, 128, 96}, Mask::Causal() & Mask::Local(100, 0), true},
      {{1, 2, 200, 4, 1, 96, 32}, Mask::Causal(), true, 10.0f},
      // Word pairs on AVX2 (MHA steps, D and Dv multiples of 16): D with
      // half a line at its end and Dv past a whole pass (64 + 16 columns);
      // a window, a soft cap and Dv of one 16-column group; and a per-head
      // mask under which some heads skip tiles the others compute.
      {{1, 1, 150, 2, 2, 48, 80}, Mask::Causal(), true},
      {{1, 1, 150, 3, 3, 32, 16}, Mask::Causal() & Mask::Local(50, 0), true, 15.0f},
      {{1, 1, 260, 3, 3, 16, 32},
       Mask::PerHead({Mask::Causal(), Mask::Local(30, 0), Mask::Causal(-100)}),
       true},
      // GQA where head 0's window leaves it alone on most tiles (its kv
      // group partner computes them): a run of one among runs of two, which
      // items of any number of kv groups (thread counts) must round alike.
      {{1, 1, 1000, 16, 8, 64, 16}, WindowFirstHead(16, 30), true},
      // More rows per kv head than the kernel takes at once, or than a q block.
      {{1, 1, 150, 12, 1, 16, 16}, Mask::Causal(), false},
      {{1, 3, 150, 8, 2, 16, 16}, Mask::Causal(), false},
      {{1, 4, 150, 2, 2, 16, 16}, Mask::Causal(), false, 0.0f, false, 1.0, {2, 16}},
  };
  uint64_t seed = 1500;
  for (const Case& c : cases) {
    for (KernelPath path : SupportedKernelPaths()) {
      for (DType dtype : {DType::kF32, DType::kBF16}) {
        ProblemSpec spec = SpecOf(c.shape, dtype, /*segments=*/c.shape.b == 2);
        spec.bhsd = c.bhsd;
        spec.qk_range = c.qk_range;
        Problem prob(++seed, spec);
        prob.owned().q_pos = Iota(c.shape.sq);  // the last row 5 keys before the end
        for (int64_t& x : prob.owned().q_pos) x += c.shape.skv - c.shape.sq - 5;
        prob.Refresh();
        RunConfig s;
        s.path = path;
        s.mask = c.mask;
        s.softcap = c.softcap;
        s.blocks = c.blocks;
        const std::string what =
            std::string(KernelPathName(path)) + " " + DTypeName(dtype) +
            " sq=" + std::to_string(c.shape.sq) + " h=" + std::to_string(c.shape.h) +
            " hkv=" + std::to_string(c.shape.hkv) + " d=" + std::to_string(c.shape.d) +
            " dv=" + std::to_string(c.shape.dv);
        const FlashParams p = prob.Params(s);
        EXPECT_EQ(kernels::UseDecodeStep(p),
                  c.decode && kernels::micro::MicroKernelsFor(path).decode_step != nullptr)
            << what;
        EXPECT_FALSE(kernels::UseDecodeStep(p) && kernels::StackedHeads::Applies(p)) << what;
        const testing::RefForward ref = testing::ReferenceForward(prob.Ref(s));
        const Result r = ExpectSameOnAnyThreadCount(prob, s, what);
        {
          // The other choice of K/V requests (CpuFeatures::hw_prefetch_streams,
          // read by the AVX2 step) changes no arithmetic: bitwise the same.
          kernels::CpuFeatures flipped = kernels::DetectCpuFeatures();
          flipped.hw_prefetch_streams = !flipped.hw_prefetch_streams;
          const kernels::ScopedCpuFeaturesForTesting as(flipped);
          s.threads = 2;
          EXPECT_TRUE(BitwiseEqual(r, prob.Run(s, false))) << what << ", requests flipped";
        }
        // Rows stacked or run by the tile loop with P rounded to bf16 (the
        // avx512_bf16 and amx paths): CheckAgainstReference's bound; decoding mode: kF32Tol.
        double tol = kF32Tol;
        if (!kernels::UseDecodeStep(p) && dtype == DType::kBF16 && RoundsP(path)) {
          tol = 2 * kF32Tol + testing::PRoundingSlack(prob.Ref(s).v, ref.out);
        }
        ExpectClose(r.out, ref.out, tol, "out " + what);
        ExpectClose(r.lse, ref.lse, kF32Tol, "lse " + what);
      }
    }
  }
}

TEST(FlashTest, ForwardMergeEqualsForwardThenMergePartial) {
  // The second problem has stacked query heads (6 queries per head).
  for (const auto& [spec, mask] :
       {std::pair{ProblemSpec(2, 70, 90, 4, 2, 32, 48), Mask::Causal(-10)},
        std::pair{ProblemSpec(2, 6, 90, 4, 2, 32, 48), Mask::Causal(36)}}) {
    for (KernelPath path : SupportedKernelPaths()) {
      Problem prob(900, spec);
      RunConfig s;
      s.path = path;
      // First problem: early queries see nothing of the first slice; second:
      // query 0 nothing of the second.
      s.mask = mask;
      const FlashParams p = prob.Params(s);
      EXPECT_EQ(kernels::StackedHeads::Applies(p), spec.sq == 6);
      const int64_t split = 37;
      FlashParams a = p, b = p;
      a.k = SliceRows(p.k, 0, split);
      a.v = SliceRows(p.v, 0, split);
      b.k = SliceRows(p.k, split, spec.skv - split);
      b.v = SliceRows(p.v, split, spec.skv - split);
      b.kv_pos = p.kv_pos + split;
      const size_t out_n = static_cast<size_t>(spec.b * spec.sq * spec.h * spec.dv);
      const size_t lse_n = static_cast<size_t>(spec.b * spec.h * spec.sq);
      ThreadPool pool(2);
      // Expected: forward of each slice, then MergePartial.
      std::vector<float> out(out_n), lse(lse_n), part(out_n), part_lse(lse_n);
      kernels::FlashForward(a, pool, out.data(), lse.data(), nullptr);
      std::vector<float> merged = out, merged_lse = lse;
      kernels::FlashForward(b, pool, part.data(), part_lse.data(), nullptr);
      kernels::MergePartial({spec.b, spec.sq, spec.h, spec.dv}, out.data(), lse.data(), part.data(),
                            part_lse.data());
      kernels::FlashForwardMerge(b, pool, merged.data(), merged_lse.data(), nullptr);
      EXPECT_EQ(std::memcmp(out.data(), merged.data(), out_n * 4), 0) << KernelPathName(path);
      EXPECT_EQ(std::memcmp(lse.data(), merged_lse.data(), lse_n * 4), 0) << KernelPathName(path);
      // And both equal the forward over all keys (f32 rounding of the merge).
      std::vector<float> whole(out_n), whole_lse(lse_n);
      kernels::FlashForward(p, pool, whole.data(), whole_lse.data(), nullptr);
      ExpectClose(merged, ToDoubleVec(whole), kF32Tol, "merged out");
      ExpectClose(merged_lse, ToDoubleVec(whole_lse), kF32Tol, "merged lse");
    }
  }
}

TEST(FlashTest, BlockSizesChangeResultsOnlyByRounding) {
  ProblemSpec spec(1, 130, 150, 2, 1, 64, 64);
  spec.segments = true;
  Problem prob(800, spec);
  for (KernelPath path : SupportedKernelPaths()) {
    RunConfig s;
    s.path = path;
    s.mask = Mask::Causal(10) | Mask::Local(3, 3);
    s.blocks = {16, 16};
    const Result a = prob.Run(s, true);
    for (BlockSizes bs : {BlockSizes{64, 128}, BlockSizes{48, 32}, BlockSizes{256, 256}}) {
      s.blocks = bs;
      const Result b = prob.Run(s, true);
      // Both are f32 computations of the same sums in different orders.
      ExpectClose(b.out, ToDoubleVec(a.out), kF32Tol, "out");
      ExpectClose(b.lse, ToDoubleVec(a.lse), kF32Tol, "lse");
      ExpectClose(b.dq, ToDoubleVec(a.dq), kF32Tol, "dq");
      ExpectClose(b.dk, ToDoubleVec(a.dk), kF32Tol, "dk");
      ExpectClose(b.dv, ToDoubleVec(a.dv), kF32Tol, "dv");
    }
  }
}

}  // namespace
}  // namespace ringsplash
