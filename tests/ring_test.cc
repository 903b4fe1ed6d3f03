// Ring attention on the threads backend equals single-device attention over
// the whole sequence: out, lse, dq, dk, dv and dsinks, for ring sizes 1, 2, 3,
// 4, 8 x the three layouts x masks (causal, windows/chunks crossing shard
// boundaries, non-zero causal and window offsets, dense per-head, per-head
// mixes, `&`/`|` combinations) x GQA/MQA
// x sinks x soft cap x segment ids crossing shards x Sq != Skv, forward and
// backward — a covering subset in which every value of every factor appears.
// Every case is also checked against the f64 reference. Plus: per-rank work
// balance of the layouts, from the ring's own FLOP counts. All on 16 x 16
// tiles with one kernel thread per rank; the default tiles with several
// threads per rank, and bf16 on the paths that round P, are in
// ring_tiles_test.cc.
#include "ringsplash/ring.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "tests/support/accuracy.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using testing::ApiResult;
using testing::Compare;
using testing::OwnedInputs;
using testing::ProblemSpec;
using testing::Rng;

// Tolerance, relative to the largest expected magnitude of each tensor (lse:
// to max(1, |lse|)). The ring computes the same f32 tile products as the
// single-device kernel but merges per-slice partial results in a different
// order (online softmax across slices, dk/dv sums across ranks, dsinks
// all-reduce). Each path is within ~1e-6 of the exact value for these sizes
// (<= 96 keys, D <= 32, inputs O(1); kernel tests bound single-device vs f64
// at 1e-5 with margin), so they differ by a few 1e-6 at most. 1e-5 is far
// below what any real bug produces (a wrong global position, a dropped or
// double-counted step, a missing segment id moves results by > 1e-2).
constexpr double kTol = 1e-5;

constexpr Layout kLayouts[] = {Layout::kContiguous, Layout::kZigzag, Layout::kStriped};
constexpr int kRingSizes[] = {1, 2, 3, 4, 8};

struct MaskCase {
  std::string name;
  // Builds the mask for global lengths (sq, skv) and h query heads.
  std::function<Mask(int64_t sq, int64_t skv, int64_t h)> make;
};

std::vector<MaskCase> MaskCases() {
  return {
      {"full", [](int64_t, int64_t, int64_t) { return Mask::Full(); }},
      {"causal", [](int64_t, int64_t, int64_t) { return Mask::Causal(); }},
      // Bottom-right aligned causal for Sq != Skv.
      {"causal_offset", [](int64_t sq, int64_t skv, int64_t) { return Mask::Causal(skv - sq); }},
      // A window of 7 back, 3 ahead: crosses every shard boundary.
      {"local_7_3", [](int64_t, int64_t, int64_t) { return Mask::Local(7, 3); }},
      // Chunks of 20 never align with shards of 6, 12, 16, 24 or 48.
      {"chunked_20", [](int64_t, int64_t, int64_t) { return Mask::ChunkedCausal(20); }},
      {"dense_per_head",
       [](int64_t sq, int64_t skv, int64_t h) {
         std::vector<uint8_t> bits(static_cast<size_t>(h * sq * skv));
         Rng rng(static_cast<uint64_t>(sq * 131 + skv * 7 + h));
         for (uint8_t& b : bits) b = (rng() % 5) < 2;  // 40% allowed
         return Mask::Dense(std::move(bits), h, sq, skv);
       }},
      {"per_head_mix",
       [](int64_t, int64_t, int64_t h) {
         std::vector<Mask> per;
         for (int64_t i = 0; i < h; ++i) {
           const Mask options[] = {Mask::Causal(), Mask::Local(5, 5), Mask::ChunkedCausal(20),
                                   Mask::Full()};
           per.push_back(options[i % 4]);
         }
         return Mask::PerHead(std::move(per));
       }},
      {"causal_and_window",
       [](int64_t, int64_t, int64_t) { return Mask::Causal() & Mask::Local(16, std::nullopt); }},
      {"chunked_or_band",
       [](int64_t, int64_t, int64_t) { return Mask::ChunkedCausal(24) | Mask::Local(3, 3); }},
      // Offsets that are not 0 whatever Sq and Skv (the seed's backward
      // ignored offsets across shards): 5 keys ahead; a window shifted 6
      // ahead; a band 10 behind or anything 40 behind.
      {"causal_plus_5", [](int64_t, int64_t, int64_t) { return Mask::Causal(5); }},
      {"local_4_2_offset_6", [](int64_t, int64_t, int64_t) { return Mask::Local(4, 2, 6); }},
      {"band_behind_or_causal_behind",
       [](int64_t, int64_t, int64_t) { return Mask::Local(3, 3, -10) | Mask::Causal(-40); }},
  };
}

enum class Segments { kNone, kShared, kQueryOnlyDoc };

struct Case {
  int n = 1;
  Layout layout = Layout::kContiguous;
  int mask = 0;  // index into MaskCases()
  int64_t b = 1, sq = 48, skv = 48, h = 4, hkv = 4, d = 16, dv = 16;
  bool sinks = false;
  float softcap = 0;
  Segments segments = Segments::kNone;
  bool backward = true;
  uint64_t seed = 1;

  std::string Describe(const std::vector<MaskCase>& masks) const {
    std::ostringstream os;
    os << "N=" << n << " layout=" << LayoutName(layout) << " mask=" << masks[mask].name
       << " B=" << b << " Sq=" << sq << " Skv=" << skv << " H=" << h << " Hkv=" << hkv << " D=" << d
       << " Dv=" << dv << " sinks=" << sinks << " softcap=" << softcap
       << " segments=" << static_cast<int>(segments) << " backward=" << backward;
    return os.str();
  }
};

// Readable test names in failure messages.
void PrintTo(const Case& c, std::ostream* os) { *os << c.Describe(MaskCases()); }

// Segment ids [B, S] with document boundaries at 13/48, 29/48, 37/48 of the
// length: they cross shard boundaries for every ring size used. With
// kQueryOnlyDoc the queries in [20/48, 24/48) get a document id no key has,
// so (without sinks) those rows attend to nothing: out 0, lse -inf, no NaN.
Tensor MakeSegments(int64_t b, int64_t s, bool query_only_doc) {
  Tensor t(DType::kI32, {b, s});
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t i = 0; i < s; ++i) {
      const int64_t x = i * 48 / s;
      int32_t id = (x >= 13) + (x >= 29) + (x >= 37) + static_cast<int32_t>(bi);
      if (query_only_doc && x >= 20 && x < 24) id = 99;
      t.data_as<int32_t>()[bi * s + i] = id;
    }
  }
  return t;
}

struct RingResult {
  ApiResult api;  // same fields as the single-device run
  std::vector<RankStats> stats;
};

RingResult RunRing(const Case& c, const OwnedInputs& in, const AttentionOptions& opt,
                   const Tensor* dout) {
  RingRun run;
  run.num_ranks = c.n;
  run.options.attention = opt;
  run.options.layout = c.layout;
  run.comm.timeout_s = 60;
  Tensor out(DType::kF32, {c.b, c.sq, c.h, c.dv});
  Tensor lse(DType::kF32, {c.b, c.h, c.sq});
  Tensor dq(DType::kF32, {c.b, c.sq, c.h, c.d});
  Tensor dk(DType::kF32, {c.b, c.skv, c.hkv, c.d});
  Tensor dv(DType::kF32, {c.b, c.skv, c.hkv, c.dv});
  Tensor dsinks(DType::kF32, {c.h});
  RingResult r;
  r.stats = RingAttentionThreads(
      run, in.inputs(), out.view(), lse.view(), dout ? dout->view() : TensorView{},
      dout ? dq.view() : TensorView{}, dout ? dk.view() : TensorView{},
      dout ? dv.view() : TensorView{}, dout && c.sinks ? dsinks.view() : TensorView{});
  r.api.out = testing::ToDoubles(out.view());
  r.api.lse = testing::ToDoubles(lse.view());
  if (dout != nullptr) {
    r.api.dq = testing::ToDoubles(dq.view());
    r.api.dk = testing::ToDoubles(dk.view());
    r.api.dv = testing::ToDoubles(dv.view());
    if (c.sinks) r.api.dsinks = testing::ToDoubles(dsinks.view());
  }
  return r;
}

void ExpectClose(const std::vector<double>& actual, const std::vector<double>& expected,
                 double floor, const std::string& what) {
  const testing::Comparison cmp = Compare(actual, expected);
  EXPECT_LE(cmp.Relative(floor), kTol) << what << ": " << cmp.Describe();
}

void CheckCase(const Case& c) {
  const std::vector<MaskCase> masks = MaskCases();
  SCOPED_TRACE(c.Describe(masks));
  Rng rng(c.seed);
  ProblemSpec spec;
  spec.b = c.b;
  spec.sq = c.sq;
  spec.skv = c.skv;
  spec.h = c.h;
  spec.hkv = c.hkv;
  spec.d = c.d;
  spec.dv = c.dv;
  spec.sinks = c.sinks;
  spec.qk_range = 1.5;  // peakier softmax than U(-1, 1): masks matter more
  OwnedInputs in = testing::RandomInputs(rng, spec);
  if (c.segments != Segments::kNone) {
    in.q_seg = MakeSegments(c.b, c.sq, c.segments == Segments::kQueryOnlyDoc);
    in.kv_seg = MakeSegments(c.b, c.skv, false);
  }
  AttentionOptions opt;
  opt.mask = masks[c.mask].make(c.sq, c.skv, c.h);
  if (c.softcap > 0) opt.softcap = c.softcap;
  opt.block_sizes = {16, 16};
  opt.num_threads = 1;  // per rank (and for the single-device run)
  Tensor dout = testing::RandomTensor(rng, DType::kF32, {c.b, c.sq, c.h, c.dv});
  const Tensor* dout_ptr = c.backward ? &dout : nullptr;

  const ApiResult single = testing::RunAttention(in, opt, dout_ptr);
  const RingResult ring = RunRing(c, in, opt, dout_ptr);
  const testing::RefResult ref = testing::RunReference(in, opt, dout_ptr);

  EXPECT_FALSE(testing::HasNaN(ring.api.out));
  EXPECT_FALSE(testing::HasNaN(ring.api.lse));
  ExpectClose(ring.api.out, single.out, 1e-30, "out vs single-device");
  ExpectClose(ring.api.lse, single.lse, 1.0, "lse vs single-device");
  ExpectClose(ring.api.out, ref.fwd.out, 1e-30, "out vs f64 reference");
  ExpectClose(ring.api.lse, ref.fwd.lse, 1.0, "lse vs f64 reference");
  if (c.backward) {
    for (const auto* v : {&ring.api.dq, &ring.api.dk, &ring.api.dv})
      EXPECT_FALSE(testing::HasNaN(*v));
    ExpectClose(ring.api.dq, single.dq, 1e-30, "dq vs single-device");
    ExpectClose(ring.api.dk, single.dk, 1e-30, "dk vs single-device");
    ExpectClose(ring.api.dv, single.dv, 1e-30, "dv vs single-device");
    ExpectClose(ring.api.dq, ref.bwd.dq, 1e-30, "dq vs f64 reference");
    ExpectClose(ring.api.dk, ref.bwd.dk, 1e-30, "dk vs f64 reference");
    ExpectClose(ring.api.dv, ref.bwd.dv, 1e-30, "dv vs f64 reference");
    if (c.sinks) {
      // dsinks sums B * Sq signed terms; where they cancel its f32 rounding
      // is ~sqrt(B * Sq) u times the sum of their magnitudes, not of the
      // result (as test_util.h's Errors measure it). The seed's bug, dsinks
      // counted once per step, moves it by (N - 1) |dsinks|, and a lost row
      // by that row's term: for these sizes both stay far above 1e-5 of the
      // terms' sum (<= B * Sq * O(0.1)).
      const double terms = testing::MaxAbs(ref.bwd.dsinks_terms);
      ExpectClose(ring.api.dsinks, single.dsinks, terms, "dsinks vs single-device");
      ExpectClose(ring.api.dsinks, ref.bwd.dsinks, terms, "dsinks vs f64 reference");
    }
  }
  // Stats: one entry per step, visiting every source rank once.
  ASSERT_EQ(ring.stats.size(), static_cast<size_t>(c.n));
  for (int r = 0; r < c.n; ++r) {
    const RankStats& st = ring.stats[r];
    EXPECT_EQ(st.rank, r);
    ASSERT_EQ(st.forward_steps.size(), static_cast<size_t>(c.n));
    EXPECT_EQ(st.backward_steps.size(), c.backward ? static_cast<size_t>(c.n) : 0u);
    for (int t = 0; t < c.n; ++t) {
      EXPECT_EQ(st.forward_steps[t].source_rank, ((r - t) % c.n + c.n) % c.n);
    }
  }
}

// The covering subset: every (ring size, layout) pair, four variants each;
// the other factors rotate with different strides so every value of every
// factor appears (and meets varied partners).
std::vector<Case> CoveringCases() {
  const int num_masks = static_cast<int>(MaskCases().size());
  const int64_t heads[][2] = {{4, 4}, {4, 2}, {4, 1}, {2, 2}};  // MHA, GQA, MQA
  const int64_t lengths[][2] = {{48, 48}, {96, 96}, {48, 96}, {96, 48}};
  std::vector<Case> cases;
  int i = 0;
  for (int n : kRingSizes) {
    for (Layout layout : kLayouts) {
      for (int variant = 0; variant < 4; ++variant, ++i) {
        Case c;
        c.n = n;
        c.layout = layout;
        c.mask = (i * 5 + variant) % num_masks;
        c.h = heads[i % 4][0];
        c.hkv = heads[i % 4][1];
        c.sq = lengths[(i / 2 + variant) % 4][0];
        c.skv = lengths[(i / 2 + variant) % 4][1];
        c.b = 1 + (i % 3 == 0);
        c.d = (i % 2) ? 32 : 16;
        c.dv = (i % 5 == 1) ? 32 : 16;  // Dv != D sometimes
        c.sinks = (i / 3) % 2 == 0;
        c.softcap = (i % 7 < 2) ? 4.0f : 0.0f;
        c.segments = static_cast<Segments>((i / 2) % 3);
        c.backward = i % 6 != 5;
        c.seed = 1000 + static_cast<uint64_t>(i);
        cases.push_back(c);
      }
    }
  }
  return cases;
}

class RingCoveringTest : public ::testing::TestWithParam<Case> {};

TEST_P(RingCoveringTest, EqualsSingleDeviceAndReference) { CheckCase(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Covering, RingCoveringTest, ::testing::ValuesIn(CoveringCases()));

// Every mask on the most demanding combination (8 ranks, zigzag and striped,
// GQA, sinks, segments crossing shards, backward).
TEST(RingTest, EveryMaskAtEightRanks) {
  const int num_masks = static_cast<int>(MaskCases().size());
  for (int m = 0; m < num_masks; ++m) {
    for (Layout layout : {Layout::kZigzag, Layout::kStriped}) {
      Case c;
      c.n = 8;
      c.layout = layout;
      c.mask = m;
      c.sq = c.skv = 96;
      c.hkv = 2;
      c.sinks = true;
      c.segments = Segments::kShared;
      c.seed = 77 + static_cast<uint64_t>(m);
      CheckCase(c);
    }
  }
}

// Six query rows per rank (48 over 8 ranks, q blocks of 16): each step's
// forward stacks the query heads of a kv group into rows (decode/stacked_heads.h),
// also when merging into the accumulators on later steps, with the
// non-affine positions of zigzag and striped shards. Every mask, GQA and MQA,
// sinks and segments crossing shards.
TEST(RingTest, StackedQueryHeadsOnEveryLayout) {
  const int num_masks = static_cast<int>(MaskCases().size());
  for (Layout layout : kLayouts) {
    for (int m = 0; m < num_masks; ++m) {
      Case c;
      c.n = 8;
      c.layout = layout;
      c.mask = m;
      c.sq = c.skv = 48;
      c.h = 4;
      c.hkv = m % 2 == 0 ? 2 : 1;
      c.sinks = true;
      c.segments = Segments::kShared;
      c.seed = 300 + static_cast<uint64_t>(m);
      CheckCase(c);
    }
  }
}

// Rows that see no key at all (a query document absent from the keys, no
// sinks): out 0, lse -inf, zero gradients on every ring size — never NaN.
TEST(RingTest, RowsWithoutKeysStayZero) {
  for (int n : {2, 3, 4}) {
    Case c;
    c.n = n;
    c.layout = Layout::kZigzag;
    c.mask = 1;  // causal
    c.segments = Segments::kQueryOnlyDoc;
    c.sinks = false;
    CheckCase(c);
  }
}

// The ring gives the same answer for every ring size (not only close to the
// single-device one): compare N = 1 with N = 4 under each layout.
TEST(RingTest, RingSizeDoesNotChangeResults) {
  Case base;
  base.mask = 7;  // causal & window
  base.sq = base.skv = 96;
  base.sinks = true;
  Rng rng(5);
  ProblemSpec spec;
  spec.sq = spec.skv = 96;
  spec.h = 4;
  spec.hkv = 2;
  spec.sinks = true;
  const OwnedInputs in = testing::RandomInputs(rng, spec);
  base.hkv = 2;
  AttentionOptions opt;
  opt.mask = Mask::Causal() & Mask::Local(16, std::nullopt);
  opt.block_sizes = {16, 16};
  opt.num_threads = 1;
  const Tensor dout = testing::RandomTensor(rng, DType::kF32, {1, 96, 4, 16});
  base.n = 1;
  const RingResult one = RunRing(base, in, opt, &dout);
  for (Layout layout : kLayouts) {
    Case c = base;
    c.n = 4;
    c.layout = layout;
    const RingResult four = RunRing(c, in, opt, &dout);
    ExpectClose(four.api.out, one.api.out, 1e-30, "out");
    ExpectClose(four.api.dk, one.api.dk, 1e-30, "dk");
    ExpectClose(four.api.dsinks, one.api.dsinks, 1e-30, "dsinks");
  }
}

// bf16 inputs stored [B, H, S, D] (strided [B, S, H, D] views) with bf16
// outputs in the same strided storage: shards, travelling slices and gathers
// must honour strides and dtype. Both paths compute in f32 from the same bf16
// inputs, but the bf16 micro-kernel rounds P to bf16 relative to different
// running maxima (per slice vs. one pass) and the results are rounded to
// bf16, so an element may differ by a bf16 ulp (2^-8 relative) where the f32
// values straddle a rounding boundary. Two ulps of the largest magnitude,
// 8e-3, allow that; a wrong position or missing step moves results by O(1).
// (Measured: ~2e-6.)
TEST(RingTest, Bf16StridedInputsAndOutputs) {
  constexpr double kBf16Tol = 8e-3;
  for (Layout layout : kLayouts) {
    Rng rng(21);
    ProblemSpec spec;
    spec.sq = spec.skv = 96;
    spec.h = 4;
    spec.hkv = 2;
    spec.dtype = DType::kBF16;
    spec.bhsd = true;
    spec.sinks = true;
    const OwnedInputs in = testing::RandomInputs(rng, spec);
    AttentionOptions opt;
    opt.mask = Mask::Causal() & Mask::Local(40, std::nullopt);
    opt.block_sizes = {16, 16};
    opt.num_threads = 1;
    const Tensor dout = testing::RandomTensor(rng, DType::kBF16, {1, 96, 4, 16});
    testing::ApiRun api_run;
    api_run.out_dtype = api_run.grad_dtype = DType::kBF16;
    api_run.strided_outputs = true;
    const ApiResult single = testing::RunAttention(in, opt, &dout, api_run);

    // [B, H, S, D] storage viewed as [B, S, H, D].
    auto strided = [](int64_t s, int64_t h, int64_t d, Tensor* storage) {
      *storage = Tensor(DType::kBF16, {1, h, s, d});
      return storage->view().Transposed(1, 2);
    };
    Tensor out_s, dq_s, dk_s, dv_s;
    Tensor lse(DType::kF32, {1, 4, 96}), dsinks(DType::kF32, {4});
    const TensorView out = strided(96, 4, 16, &out_s), dq = strided(96, 4, 16, &dq_s),
                     dk = strided(96, 2, 16, &dk_s), dv = strided(96, 2, 16, &dv_s);
    RingRun run;
    run.num_ranks = 4;
    run.options.attention = opt;
    run.options.layout = layout;
    RingAttentionThreads(run, in.inputs(), out, lse.view(), dout.view(), dq, dk, dv, dsinks.view());
    const std::pair<TensorView, const std::vector<double>*> checks[] = {
        {out, &single.out}, {dq, &single.dq}, {dk, &single.dk}, {dv, &single.dv}};
    for (const auto& [view, expected] : checks) {
      const testing::Comparison c = Compare(testing::ToDoubles(view), *expected);
      EXPECT_LE(c.Relative(), kBf16Tol) << LayoutName(layout) << ": " << c.Describe();
    }
    // lse and dsinks stay f32: only the inputs' rounding is shared, the
    // f32 math differs by reordering (and P's bf16 rounding for dsinks via
    // out).
    EXPECT_LE(Compare(testing::ToDoubles(lse.view()), single.lse).Relative(1.0), 1e-5);
    EXPECT_LE(Compare(testing::ToDoubles(dsinks.view()), single.dsinks).Relative(), kBf16Tol);
  }
}

// bf16 inputs, f32 outputs, on the fastest path that computes in f32 on the
// stored inputs (no bf16 rounding of P or dS: avx512 and the portable path
// widen the inputs; avx512_bf16 and amx round P and dS to bf16 for their
// products, which flash_kernel_test checks against its own error model): the
// ring must then match the f64 reference on the stored inputs to the f32
// tolerance. Eight ranks, so
// each slice's f32 dk/dv accumulators make seven hops; kept in bf16 on the
// way (SPEC §4: they travel as f32) they would lose ~2^-9 per hop, far above
// kTol. The test above checks bf16 outputs and strides against the single
// device only.
TEST(RingTest, Bf16InputsKeepF32AccumulatorsAcrossEightRanks) {
  const std::vector<MaskCase> masks = MaskCases();
  KernelPath path = KernelPath::kPortable;
  for (KernelPath p : SupportedKernelPaths()) {
    if (!testing::RoundsBf16Operands(p, DType::kBF16)) path = p;
  }
  for (Layout layout : {Layout::kZigzag, Layout::kStriped}) {
    Case c;
    c.n = 8;
    c.layout = layout;
    c.sq = c.skv = 96;
    c.h = 4;
    c.hkv = 2;
    c.sinks = true;
    SCOPED_TRACE(std::string(LayoutName(layout)) + " path " + KernelPathName(path));
    Rng rng(31);
    ProblemSpec spec(c.b, c.sq, c.skv, c.h, c.hkv, c.d, c.dv);
    spec.sinks = true;
    spec.qk_range = 1.5;
    const OwnedInputs in = testing::ConvertInputs(testing::RandomInputs(rng, spec), DType::kBF16);
    const Tensor dout = testing::RandomTensor(rng, DType::kBF16, {c.b, c.sq, c.h, c.dv});
    AttentionOptions opt;
    opt.mask = Mask::Causal() & Mask::Local(40, std::nullopt);
    opt.block_sizes = {16, 16};
    opt.num_threads = 1;
    opt.kernel_path = path;
    const RingResult ring = RunRing(c, in, opt, &dout);
    const testing::RefResult ref = testing::RunReference(in, opt, &dout);
    ExpectClose(ring.api.out, ref.fwd.out, 1e-30, "out vs f64 reference");
    ExpectClose(ring.api.lse, ref.fwd.lse, 1.0, "lse vs f64 reference");
    ExpectClose(ring.api.dq, ref.bwd.dq, 1e-30, "dq vs f64 reference");
    ExpectClose(ring.api.dk, ref.bwd.dk, 1e-30, "dk vs f64 reference");
    ExpectClose(ring.api.dv, ref.bwd.dv, 1e-30, "dv vs f64 reference");
    ExpectClose(ring.api.dsinks, ref.bwd.dsinks, testing::MaxAbs(ref.bwd.dsinks_terms),
                "dsinks vs f64 reference");
  }
}

// ---- Work balance ------------------------------------------------------------
//
// Causal mask, S = 512, N = 4, 16x16 tiles. Counting tiles of one (b, head):
// contiguous: rank r's q chunk meets kv chunks 0..r. With m = (S/N)/16 = 8
// tiles per chunk side, a chunk pair below the diagonal computes m^2 tiles,
// the diagonal pair m(m+1)/2, pairs above none. Rank r: r m^2 + m(m+1)/2, so
//   max/mean = ((N-1) m + (m+1)/2) / ((N-1) m / 2 + (m+1)/2)
// which is 2N/(N+1) (SPEC's figure) when a chunk is one tile (m = 1) and tends
// to (2N-1)/N for fine tiles; here (N=4, m=8) 28.5/16.5 = 1.727.
// zigzag: rank r holds chunks r and 2N-1-r of 2N; over all sources it meets
// 2N-1 full chunk pairs and 2 diagonal ones whatever r: exactly balanced.
// striped: for q tile i of rank r and kv tile j of source s, tiles j < i are
// full, j == i partial, j > i empty, for every (r, s): exactly balanced.
// FLOPs per computed tile are equal (all tiles are whole), so FLOP ratios
// equal tile ratios; the 5% allowance covers nothing but future changes in
// how partial tiles are counted.
std::vector<double> ForwardFlopsPerRank(Layout layout, int n, int64_t s,
                                        std::vector<RankStats>* stats_out = nullptr) {
  Rng rng(9);
  ProblemSpec spec;
  spec.sq = spec.skv = s;
  spec.h = spec.hkv = 1;
  const OwnedInputs in = testing::RandomInputs(rng, spec);
  RingRun run;
  run.num_ranks = n;
  run.options.layout = layout;
  run.options.attention.mask = Mask::Causal();
  run.options.attention.block_sizes = {16, 16};
  run.options.attention.num_threads = 1;
  Tensor out(DType::kF32, {1, s, 1, 16});
  Tensor lse(DType::kF32, {1, 1, s});
  const std::vector<RankStats> stats =
      RingAttentionThreads(run, in.inputs(), out.view(), lse.view());
  std::vector<double> flops;
  for (const RankStats& st : stats) flops.push_back(st.flops());
  if (stats_out != nullptr) *stats_out = stats;
  return flops;
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

TEST(RingBalanceTest, ZigzagAndStripedCausalAreBalanced) {
  constexpr int kN = 4;
  for (Layout layout : {Layout::kZigzag, Layout::kStriped}) {
    const std::vector<double> flops = ForwardFlopsPerRank(layout, kN, 512);
    const double mean = Mean(flops);
    ASSERT_GT(mean, 0);
    for (int r = 0; r < kN; ++r) {
      EXPECT_NEAR(flops[r] / mean, 1.0, 0.05) << LayoutName(layout) << " rank " << r;
    }
  }
}

TEST(RingBalanceTest, ContiguousCausalShowsTheExpectedImbalance) {
  constexpr int kN = 4;
  constexpr double kM = 512.0 / kN / 16;  // tiles per chunk side
  std::vector<RankStats> stats;
  const std::vector<double> flops = ForwardFlopsPerRank(Layout::kContiguous, kN, 512, &stats);
  const double mean = Mean(flops);
  const double max = *std::max_element(flops.begin(), flops.end());
  const double expect = ((kN - 1) * kM + (kM + 1) / 2) / ((kN - 1) * kM / 2 + (kM + 1) / 2);
  EXPECT_NEAR(max / mean, expect, 0.05 * expect);
  EXPECT_EQ(max, flops[kN - 1]) << "the last rank holds the latest queries";
  // Rank 0's queries precede every other rank's keys: its steps t >= 1 are
  // all-empty — no FLOPs, no computed tiles, yet the slice still travelled.
  for (int t = 1; t < kN; ++t) {
    EXPECT_EQ(stats[0].forward_steps[t].kernel.flops, 0.0) << "step " << t;
    EXPECT_EQ(stats[0].forward_steps[t].kernel.computed_blocks, 0) << "step " << t;
    EXPECT_GT(stats[0].forward_steps[t].kernel.skipped_blocks, 0) << "step " << t;
  }
}

// ---- Outputs sharing storage with inputs -------------------------------------

// In-place attention (a rank's out IS its q buffer, D == Dv) is refused like
// on a single device (attention.h's aliasing rule; every pair is in
// attention_errors_test.cc): each rank throws an Error naming out and q
// before writing anything, so q is intact.
TEST(RingTest, OutputSharingStorageWithQueriesIsRefused) {
  constexpr int kN = 3;
  constexpr int64_t kS = 96, kH = 2, kD = 16;
  Rng rng(17);
  ProblemSpec spec;
  spec.sq = spec.skv = kS;
  spec.h = spec.hkv = kH;
  spec.d = spec.dv = kD;
  const OwnedInputs in = testing::RandomInputs(rng, spec);
  RingOptions opt;
  opt.layout = Layout::kZigzag;
  opt.attention.mask = Mask::Causal();
  opt.attention.block_sizes = {16, 16};
  opt.attention.num_threads = 1;
  std::vector<std::string> errors(kN);
  std::atomic<bool> q_intact{true};
  try {
    RunThreadRanks(kN, CommOptions{}, [&](Communicator& comm) {
      const int r = comm.rank();
      Tensor q(DType::kF32, {1, kS / kN, kH, kD}), lse(DType::kF32, {1, kH, kS / kN});
      ShardSequence(opt.layout, r, kN, in.q.view(), q.view());
      const Tensor k = testing::TensorFromDoubles(testing::ToDoubles(q.view()), DType::kF32,
                                                  {1, kS / kN, kH, kD});
      const std::vector<double> before = testing::ToDoubles(q.view());
      AttentionInputs local;
      local.q = q.view();
      local.k = k.view();
      local.v = k.view();
      try {
        RingAttentionForward(comm, local, opt, q.view(), lse.view());
      } catch (const Error& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
      if (testing::ToDoubles(q.view()) != before) q_intact = false;
    });
  } catch (const Error&) {
    // The ranks aborted the communicator: expected, their own errors are checked.
  }
  for (int r = 0; r < kN; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)].rfind(
                  "out: expected memory shared with no input or other output, got a view "
                  "overlapping q (",
                  0),
              0u)
        << "rank " << r << ": " << errors[static_cast<size_t>(r)];
  }
  EXPECT_TRUE(q_intact);
}

// ---- Argument errors ---------------------------------------------------------

TEST(RingTest, IndivisibleLengthsAndPositionsAreErrors) {
  Rng rng(3);
  ProblemSpec spec;
  spec.sq = spec.skv = 40;  // 40 does not split over 2N = 6 (zigzag, N = 3)
  const OwnedInputs in = testing::RandomInputs(rng, spec);
  RingRun run;
  run.num_ranks = 3;
  Tensor out(DType::kF32, {1, 40, 2, 16});
  Tensor lse(DType::kF32, {1, 2, 40});
  try {
    RingAttentionThreads(run, in.inputs(), out.view(), lse.view());
    FAIL() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("q sequence length 40"), std::string::npos) << e.what();
  }
  AttentionInputs with_pos = in.inputs();
  with_pos.q_positions.assign(40, 0);
  run.options.layout = Layout::kContiguous;
  run.num_ranks = 2;
  EXPECT_THROW(RingAttentionThreads(run, with_pos, out.view(), lse.view()), Error);
}

}  // namespace
}  // namespace ringsplash
