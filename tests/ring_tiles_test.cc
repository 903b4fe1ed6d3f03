// The threads-backend ring at the DEFAULT tiles (128 x 128) with several
// kernel threads per rank, against the f64 reference (tests/support/
// reference.h): ring_test.cc runs every case on 16 x 16 tiles with one thread
// per rank, which leaves untested how a rank's long shard splits into tiles
// (several per rank, the last one short), how a global mask meets 128-wide
// tiles of zigzag and striped shards, and the rank's thread pool splitting
// the tiles and backward tasks. Here: 2-4 ranks of 2-3 threads, S = 800-1440
// tokens, so each rank holds 288-500 rows (2.25-3.9 default tiles, the last
// one short); the three layouts; causal, sliding windows, chunked causal,
// segment ids crossing shards, sinks, a soft cap, GQA; forward and backward
// in f32; and bf16 rings (forward, and backward on the reference's out) on
// the paths that round P and dS to bf16, held to the P-rounding bound, and on
// a path that does not, held to the f32 bound. Bounds: tests/support/
// accuracy.h (ReferenceBounds); why its f32 part holds for these lengths is
// below.
#include <gtest/gtest.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "tests/support/accuracy.h"
#include "tests/support/sanitizers.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

// Sanitizer builds (scripts/ci_sanitizers.sh: ASan + UBSan over the whole
// suite, where the f64 reference and the -O1 kernels run ~5-10x slower) run
// the even f32 cases only, as the bf16 tests always do: each layout, mask
// feature and ring size still appears (AllCases() orders them so), and the
// tiling is the same.
using ringsplash::testing::kSanitized;

// f32 bound: kF32Tolerance (1e-5, accuracy.h), argued there for <= ~100
// terms. Here a row sums up to 1440 keys, where the worst case (D + Skv) u ~
// 1500 * 6e-8 = 9e-5 no longer sits below it; but the rounding errors of
// independent terms add like a random walk, ~sqrt(1500) u ~ 2.3e-6 per sum,
// and an element goes through a few such sums (the online softmax's
// rescales, one per 128-key tile, and the ring's N - 1 merges add ~15
// roundings of ~u each): ~5e-6 relative to the largest magnitude, as ErrorsOf
// measures (out against max|out| ~ 1 of early causal rows or short windows
// and documents, gradients against the sums of their terms' magnitudes).
// Measured: <= 5e-7 on every case. A wrong mask element, position or tile
// moves some element by one whole term, >= 1/1440 ~ 7e-4 of its sum.

struct Case {
  std::string name;
  int ranks = 2;
  int threads = 2;  // kernel threads per rank
  Layout layout = Layout::kZigzag;
  int64_t s = 768;  // global Sq = Skv
  int64_t h = 2, hkv = 1, d = 16, dv = 16;
  Mask mask;
  bool sinks = false;
  bool segments = false;
  float softcap = 0;

  std::string Describe() const {
    std::ostringstream os;
    os << name << ": N=" << ranks << " threads/rank=" << threads << " " << LayoutName(layout)
       << " S=" << s << " H=" << h << " Hkv=" << hkv << " D=" << d << " Dv=" << dv
       << " mask=" << mask.ToString() << " sinks=" << sinks << " segments=" << segments
       << " softcap=" << softcap;
    return os.str();
  }
};
void PrintTo(const Case& c, std::ostream* os) { *os << c.Describe(); }

// Local rows per rank: S / N = 500, 352, 324, 360, 288, 400, 420, 500: 2.25
// to 3.9 default 128-row q blocks, the last one short.
// Windows and chunks (300 back, 333, 200) cross shard and tile boundaries.
std::vector<Case> AllCases() {
  std::vector<Case> cases;
  auto add = [&cases](Case c) { cases.push_back(std::move(c)); };
  add({"causal, sinks, MHA", 2, 3, Layout::kContiguous, 1000, 2, 2, 16, 16, Mask::Causal(), true});
  add({"window 300 back 40 ahead, sinks", 3, 2, Layout::kZigzag, 1056, 4, 2, 16, 16,
       Mask::Local(300, 40), true});
  add({"chunked causal 333, segments", 4, 2, Layout::kStriped, 1296, 2, 1, 16, 8,
       Mask::ChunkedCausal(333), false, true});
  add({"causal, segments, sinks, soft cap", 4, 3, Layout::kZigzag, 1440, 2, 1, 8, 8, Mask::Causal(),
       true, true, 5.0f});
  add({"window 200 back, segments", 3, 2, Layout::kContiguous, 864, 2, 1, 16, 16,
       Mask::Local(200, 0), false, true});
  add({"causal and window, sinks", 2, 3, Layout::kStriped, 800, 4, 1, 16, 16,
       Mask::Causal() & Mask::Local(500, std::nullopt), true});
  add({"chunked causal 200, sinks, soft cap", 2, 2, Layout::kZigzag, 840, 2, 2, 16, 16,
       Mask::ChunkedCausal(200), true, false, 8.0f});
  add({"causal or band, segments", 2, 3, Layout::kContiguous, 1000, 2, 1, 16, 16,
       Mask::Causal() | Mask::Local(30, 30), false, true});
  return cases;
}

// The f32 cases: all of them, or the even ones under sanitizers (kSanitized).
std::vector<Case> Cases() {
  const std::vector<Case> all = AllCases();
  if (!kSanitized) return all;
  std::vector<Case> even;
  for (size_t i = 0; i < all.size(); i += 2) even.push_back(all[i]);
  return even;
}

OwnedInputs MakeInputs(const Case& c, DType dtype, uint64_t seed) {
  Rng rng(seed);
  ProblemSpec spec(1, c.s, c.s, c.h, c.hkv, c.d, c.dv);
  spec.dtype = dtype;
  spec.sinks = c.sinks;
  spec.qk_range = 1.5;  // peakier softmax than U(-1, 1): masks matter more
  OwnedInputs in = RandomInputs(rng, spec);
  if (c.segments) {
    // Self-attention documents: up to 5, cut at random points, so they
    // cross shard and tile boundaries (the same ids for queries and keys).
    in.q_seg = RandomSegments(rng, 1, c.s, 5);
    in.kv_seg = TensorFromDoubles(ToDoubles(in.q_seg.view()), DType::kI32, {1, c.s});
  }
  return in;
}

AttentionOptions OptionsOf(const Case& c) {
  AttentionOptions opt;
  opt.mask = c.mask;
  if (c.softcap > 0) opt.softcap = c.softcap;
  opt.block_sizes = BlockSizes{};  // the default 128 x 128
  opt.num_threads = c.threads;
  return opt;
}

struct RingOutputs {
  ApiResult api;
  std::vector<RankStats> stats;
};

// RingAttentionThreads: forward, and backward (with its own out) when dout
// is given; outputs f32.
RingOutputs RunRing(const Case& c, const OwnedInputs& in, const AttentionOptions& opt,
                    const Tensor* dout) {
  RingRun run;
  run.num_ranks = c.ranks;
  run.options.attention = opt;
  run.options.layout = c.layout;
  run.options.fault = FaultSpec{};
  run.comm.timeout_s = 120;
  Tensor out(DType::kF32, {1, c.s, c.h, c.dv}), lse(DType::kF32, {1, c.h, c.s});
  Tensor dq(DType::kF32, {1, c.s, c.h, c.d}), dk(DType::kF32, {1, c.s, c.hkv, c.d});
  Tensor dv(DType::kF32, {1, c.s, c.hkv, c.dv}), dsinks(DType::kF32, {c.h});
  const bool bwd = dout != nullptr;
  RingOutputs r;
  r.stats = RingAttentionThreads(run, in.inputs(), out.view(), lse.view(),
                                 bwd ? dout->view() : TensorView(), bwd ? dq.view() : TensorView(),
                                 bwd ? dk.view() : TensorView(), bwd ? dv.view() : TensorView(),
                                 bwd && c.sinks ? dsinks.view() : TensorView());
  r.api.out = ToDoubles(out.view());
  r.api.lse = ToDoubles(lse.view());
  if (bwd) {
    r.api.dq = ToDoubles(dq.view());
    r.api.dk = ToDoubles(dk.view());
    r.api.dv = ToDoubles(dv.view());
    if (c.sinks) r.api.dsinks = ToDoubles(dsinks.view());
  }
  return r;
}

// The tiling the test is about really happened: every rank ran every step,
// computed tiles at the default size on every step that has any, and met
// partial tiles (an element mask) somewhere.
void ExpectDefaultTiling(const Case& c, const std::vector<RankStats>& stats) {
  ASSERT_EQ(stats.size(), static_cast<size_t>(c.ranks));
  for (const RankStats& st : stats) {
    ASSERT_EQ(st.forward_steps.size(), static_cast<size_t>(c.ranks)) << "rank " << st.rank;
    int64_t partial = 0;
    for (const RingStepStats& step : st.forward_steps) partial += step.kernel.partial_blocks;
    EXPECT_GT(partial, 0) << "rank " << st.rank;
    // Fewer tiles than 16 x 16 tiling would compute: 128 x 128 ones (at
    // most (S/N / 128 rounded up)^2 per head and step).
    const int64_t side = (c.s / c.ranks + 127) / 128;
    EXPECT_LE(st.forward_steps[0].kernel.computed_blocks, side * side * c.h) << "rank " << st.rank;
    EXPECT_GT(st.computed_blocks(), 0) << "rank " << st.rank;
  }
}

class RingDefaultTilesTest : public ::testing::TestWithParam<Case> {};

// f32, forward and backward of RingAttentionThreads against the reference.
TEST_P(RingDefaultTilesTest, F32ForwardAndBackwardMatchReference) {
  const Case& c = GetParam();
  const OwnedInputs in = MakeInputs(c, DType::kF32, 100 + static_cast<uint64_t>(c.s));
  Rng rng(7);
  const Tensor dout = RandomTensor(rng, DType::kF32, {1, c.s, c.h, c.dv});
  const AttentionOptions opt = OptionsOf(c);
  const RingOutputs ring = RunRing(c, in, opt, &dout);
  const RefResult ref = RunReference(in, opt, &dout);
  ExpectDefaultTiling(c, ring.stats);
  const Errors e = ErrorsOf(ring.api, ref);
  const Errors bound =
      ReferenceBounds(ref, ToDoubles(in.v.view()), opt.kernel_path, DType::kF32, DType::kF32);
  EXPECT_EQ(ExceedsBounds("f32 ring", e, bound), "") << "errors " << e.Describe();
}

INSTANTIATE_TEST_SUITE_P(Cases, RingDefaultTilesTest, ::testing::ValuesIn(Cases()));

// bf16 inputs and dout on `path`, default tiles, 2-3 threads per rank, on
// the even cases of AllCases() (every layout and mask feature): the ring's
// forward against the reference, and its backward given the reference's out
// and lse (so that the forward's rounding stays out of D), within
// ReferenceBounds for `path`: the f32 bound, plus where the path rounds P
// (and dS) to bf16 for its products the P-rounding slack on out and 2^-8 of
// the rounded terms on the gradients (the per-step partials each carry their
// P rounding relative to their own lse, and the ring's merges are convex
// combinations: the single device's bound).
void CheckBf16Ring(KernelPath path) {
  const std::vector<Case> cases = AllCases();
  for (size_t i = 0; i < cases.size(); i += 2) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.Describe() + " bf16 path " + KernelPathName(path));
    const OwnedInputs in = MakeInputs(c, DType::kBF16, 200 + static_cast<uint64_t>(c.s));
    Rng rng(8);
    const Tensor dout = RandomTensor(rng, DType::kBF16, {1, c.s, c.h, c.dv});
    AttentionOptions opt = OptionsOf(c);
    opt.kernel_path = path;
    const RefResult ref = RunReference(in, opt, &dout);
    const RingOutputs ring = RunRing(c, in, opt, nullptr);
    ExpectDefaultTiling(c, ring.stats);
    Errors e = RingBackwardOnReference(in, opt, dout, ref, c.ranks, c.layout);
    const Errors fwd = ErrorsOf(ring.api, ref);
    e.out = fwd.out;
    e.lse = fwd.lse;
    const Errors bound =
        ReferenceBounds(ref, ToDoubles(in.v.view()), path, DType::kBF16, DType::kBF16);
    EXPECT_EQ(ExceedsBounds("bf16 ring", e, bound), "")
        << "errors " << e.Describe() << " | bounds " << bound.Describe();
  }
}

// Each path that rounds P and dS (avx512_bf16, amx), within the rounding bound.
TEST(RingDefaultTilesBf16Test, PRoundingPathsWithinTheRoundingBound) {
  std::vector<KernelPath> paths;
  for (KernelPath p : SupportedKernelPaths()) {
    if (RoundsBf16Operands(p, DType::kBF16)) paths.push_back(p);
  }
  if (paths.empty()) {
    GTEST_SKIP() << "no kernel path of this CPU rounds P to bf16 (avx512_bf16 and amx need "
                    "AVX512_BF16 / AMX-BF16; SupportedKernelPaths() has none of them)";
  }
  for (KernelPath path : paths) CheckBf16Ring(path);
}

// The fastest path that widens bf16 to f32 and rounds nothing (avx512, avx2
// or portable): the f32 bound alone, with no P-rounding slack.
TEST(RingDefaultTilesBf16Test, WideningPathWithinTheF32Bound) {
  KernelPath path = KernelPath::kPortable;
  for (KernelPath p : SupportedKernelPaths()) {
    if (!RoundsBf16Operands(p, DType::kBF16)) path = p;
  }
  CheckBf16Ring(path);
}

}  // namespace
}  // namespace ringsplash::testing
