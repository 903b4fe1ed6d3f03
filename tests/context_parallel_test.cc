// 2-D context parallelism (include/ringsplash/context_parallel.h) on the
// threads backend equals single-device attention over the whole sequence —
// out, lse, dq, dk, dv and dsinks — and the f64 reference, for the grids
// (U, N/U) in {(2,2), (4,1), (1,4), (2,4)} x the three layouts x the mask
// kinds (causal and offsets, windows, chunks, dense per-head, per-head mixes,
// compositions) x GQA (kv heads split, and replicated when Hkv < U, MQA
// included) x sinks x soft cap x segment ids crossing shards and groups x
// Sq != Skv, forward and backward: a covering subset in which every value of
// every factor meets every grid. Plus: U = 1 is the 1-D ring bit for bit, the
// stats, bf16 strided tensors, the per-call overloads, and the errors (U not
// dividing N or H, the GQA rule, ranks disagreeing on U). Geometry, head
// split and mask restriction alone: context_parallel_geometry_test.cc.
#include "ringsplash/context_parallel.h"

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using testing::ApiResult;
using testing::Compare;
using testing::OwnedInputs;
using testing::ProblemSpec;
using testing::Rng;

// Tolerance relative to each tensor's largest expected magnitude (lse: to
// max(1, |lse|)), as in ring_test.cc: the 2-D run computes the same f32 tile
// products as the single-device kernel and merges them in another order
// (the ring's online softmax over N/U slices, dk/dv sums over the ring and,
// for replicated kv heads, over the replicas; dsinks summed per ring and then
// assembled exactly). Both are within ~1e-6 of exact at these sizes (<= 96
// keys, D <= 32, O(1) inputs); the all-to-alls only move bits. A wrong row
// order, head, position or segment id, a lost replica or a double-counted
// dsinks moves results by > 1e-2.
constexpr double kTol = 1e-5;

constexpr Layout kLayouts[] = {Layout::kContiguous, Layout::kZigzag, Layout::kStriped};

struct Grid {
  int u = 1;  // ranks per Ulysses group
  int p = 1;  // groups = ring size
  int n() const { return u * p; }
};
constexpr Grid kGrids[] = {{2, 2}, {4, 1}, {1, 4}, {2, 4}};

struct MaskCase {
  std::string name;
  std::function<Mask(int64_t sq, int64_t skv, int64_t h)> make;
};

std::vector<MaskCase> MaskCases() {
  return {
      {"causal", [](int64_t, int64_t, int64_t) { return Mask::Causal(); }},
      {"causal_offset", [](int64_t sq, int64_t skv, int64_t) { return Mask::Causal(skv - sq); }},
      // Crosses every shard and group boundary.
      {"local_7_3", [](int64_t, int64_t, int64_t) { return Mask::Local(7, 3); }},
      // Chunks of 20 align with no shard (6, 12, 24 rows) or group.
      {"chunked_20", [](int64_t, int64_t, int64_t) { return Mask::ChunkedCausal(20); }},
      {"dense_per_head",
       [](int64_t sq, int64_t skv, int64_t h) {
         std::vector<uint8_t> bits(static_cast<size_t>(h * sq * skv));
         Rng rng(static_cast<uint64_t>(sq * 131 + skv * 7 + h));
         for (uint8_t& b : bits) b = (rng() % 5) < 2;  // 40% allowed
         return Mask::Dense(std::move(bits), h, sq, skv);
       }},
      // Every head a different mask: a rank must get its own heads' masks.
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
      // A head-dependent composition: per-head windows AND a shared dense
      // matrix, OR a causal band 40 behind.
      {"per_head_and_dense_or_causal",
       [](int64_t sq, int64_t skv, int64_t h) {
         std::vector<Mask> per;
         for (int64_t i = 0; i < h; ++i) per.push_back(Mask::Local(4 + 3 * i, 2));
         std::vector<uint8_t> bits(static_cast<size_t>(sq * skv));
         Rng rng(static_cast<uint64_t>(sq + skv));
         for (uint8_t& b : bits) b = (rng() % 4) != 0;
         return (Mask::PerHead(std::move(per)) & Mask::Dense(std::move(bits), 0, sq, skv)) |
                Mask::Causal(-40);
       }},
      {"local_4_2_offset_6", [](int64_t, int64_t, int64_t) { return Mask::Local(4, 2, 6); }},
      {"full", [](int64_t, int64_t, int64_t) { return Mask::Full(); }},
  };
}

enum class Segments { kNone, kShared, kQueryOnlyDoc };

struct Case {
  Grid grid;
  Layout layout = Layout::kContiguous;
  int mask = 0;  // index into MaskCases()
  int64_t b = 1, sq = 48, skv = 48, h = 4, hkv = 4, d = 16, dv = 16;
  bool sinks = false;
  float softcap = 0;
  Segments segments = Segments::kNone;
  bool backward = true;
  uint64_t seed = 1;

  std::string Describe() const {
    std::ostringstream os;
    os << "U=" << grid.u << " N/U=" << grid.p << " layout=" << LayoutName(layout)
       << " mask=" << MaskCases()[static_cast<size_t>(mask)].name << " B=" << b << " Sq=" << sq
       << " Skv=" << skv << " H=" << h << " Hkv=" << hkv << " D=" << d << " Dv=" << dv
       << " sinks=" << sinks << " softcap=" << softcap << " segments=" << static_cast<int>(segments)
       << " backward=" << backward;
    return os.str();
  }
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.Describe(); }

// Segment ids [B, S], document boundaries at 13/48, 29/48, 37/48 of the
// length: they cross shard and group boundaries for every grid here. With
// kQueryOnlyDoc the queries in [20/48, 24/48) get a document no key has, so
// (without sinks) those rows attend to nothing: out 0, lse -inf, no NaN.
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

struct CpResult {
  ApiResult api;
  std::vector<ContextParallelStats> stats;
};

ContextParallelRun MakeRun(const Case& c, const AttentionOptions& opt) {
  ContextParallelRun run;
  run.num_ranks = c.grid.n();
  run.options.ulysses = c.grid.u;
  run.options.ring.attention = opt;
  run.options.ring.layout = c.layout;
  run.comm.timeout_s = 60;
  return run;
}

CpResult RunCp(const Case& c, const OwnedInputs& in, const AttentionOptions& opt,
               const Tensor* dout) {
  Tensor out(DType::kF32, {c.b, c.sq, c.h, c.dv});
  Tensor lse(DType::kF32, {c.b, c.h, c.sq});
  Tensor dq(DType::kF32, {c.b, c.sq, c.h, c.d});
  Tensor dk(DType::kF32, {c.b, c.skv, c.hkv, c.d});
  Tensor dv(DType::kF32, {c.b, c.skv, c.hkv, c.dv});
  Tensor dsinks(DType::kF32, {c.h});
  CpResult r;
  const bool bwd = dout != nullptr;
  r.stats = ContextParallelThreads(
      MakeRun(c, opt), in.inputs(), out.view(), lse.view(), bwd ? dout->view() : TensorView{},
      bwd ? dq.view() : TensorView{}, bwd ? dk.view() : TensorView{},
      bwd ? dv.view() : TensorView{}, bwd && c.sinks ? dsinks.view() : TensorView{});
  r.api.out = testing::ToDoubles(out.view());
  r.api.lse = testing::ToDoubles(lse.view());
  if (bwd) {
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

OwnedInputs MakeInputs(const Case& c, Rng& rng) {
  ProblemSpec spec(c.b, c.sq, c.skv, c.h, c.hkv, c.d, c.dv);
  spec.sinks = c.sinks;
  spec.qk_range = 1.5;  // peakier softmax than U(-1, 1): masks matter more
  OwnedInputs in = testing::RandomInputs(rng, spec);
  if (c.segments != Segments::kNone) {
    in.q_seg = MakeSegments(c.b, c.sq, c.segments == Segments::kQueryOnlyDoc);
    in.kv_seg = MakeSegments(c.b, c.skv, false);
  }
  return in;
}

AttentionOptions MakeOptions(const Case& c) {
  AttentionOptions opt;
  opt.mask = MaskCases()[static_cast<size_t>(c.mask)].make(c.sq, c.skv, c.h);
  if (c.softcap > 0) opt.softcap = c.softcap;
  opt.block_sizes = {16, 16};
  opt.num_threads = 1;  // per rank (and for the single-device run)
  return opt;
}

void CheckCase(const Case& c) {
  SCOPED_TRACE(c.Describe());
  Rng rng(c.seed);
  const OwnedInputs in = MakeInputs(c, rng);
  const AttentionOptions opt = MakeOptions(c);
  const Tensor dout = testing::RandomTensor(rng, DType::kF32, {c.b, c.sq, c.h, c.dv});
  const Tensor* dout_ptr = c.backward ? &dout : nullptr;

  const ApiResult single = testing::RunAttention(in, opt, dout_ptr);
  const CpResult cp = RunCp(c, in, opt, dout_ptr);
  const testing::RefResult ref = testing::RunReference(in, opt, dout_ptr);

  EXPECT_FALSE(testing::HasNaN(cp.api.out));
  EXPECT_FALSE(testing::HasNaN(cp.api.lse));
  ExpectClose(cp.api.out, single.out, 1e-30, "out vs single-device");
  ExpectClose(cp.api.lse, single.lse, 1.0, "lse vs single-device");
  ExpectClose(cp.api.out, ref.fwd.out, 1e-30, "out vs f64 reference");
  ExpectClose(cp.api.lse, ref.fwd.lse, 1.0, "lse vs f64 reference");
  if (c.backward) {
    for (const auto* v : {&cp.api.dq, &cp.api.dk, &cp.api.dv}) EXPECT_FALSE(testing::HasNaN(*v));
    ExpectClose(cp.api.dq, single.dq, 1e-30, "dq vs single-device");
    ExpectClose(cp.api.dk, single.dk, 1e-30, "dk vs single-device");
    ExpectClose(cp.api.dv, single.dv, 1e-30, "dv vs single-device");
    ExpectClose(cp.api.dq, ref.bwd.dq, 1e-30, "dq vs f64 reference");
    ExpectClose(cp.api.dk, ref.bwd.dk, 1e-30, "dk vs f64 reference");
    ExpectClose(cp.api.dv, ref.bwd.dv, 1e-30, "dv vs f64 reference");
    if (c.sinks) {
      // dsinks sums B * Sq signed terms: measured against the sum of their
      // magnitudes (ring_test.cc); a head's dsinks counted by every member
      // (U x) or every group, or a lost head, is far above 1e-5 of it.
      const double terms = testing::MaxAbs(ref.bwd.dsinks_terms);
      ExpectClose(cp.api.dsinks, single.dsinks, terms, "dsinks vs single-device");
      ExpectClose(cp.api.dsinks, ref.bwd.dsinks, terms, "dsinks vs f64 reference");
    }
  }
  // Stats: every rank where ContextParallelPlace puts it, N/U ring steps
  // visiting every group once.
  ASSERT_EQ(cp.stats.size(), static_cast<size_t>(c.grid.n()));
  for (int r = 0; r < c.grid.n(); ++r) {
    const ContextParallelStats& st = cp.stats[static_cast<size_t>(r)];
    const ContextParallelCoordinates at = ContextParallelPlace(c.layout, r, c.grid.n(), c.grid.u);
    EXPECT_EQ(st.rank, r);
    EXPECT_EQ(st.coordinates.group, at.group);
    EXPECT_EQ(st.coordinates.member, at.member);
    ASSERT_EQ(st.ring.forward_steps.size(), static_cast<size_t>(c.grid.p));
    EXPECT_EQ(st.ring.backward_steps.size(), c.backward ? static_cast<size_t>(c.grid.p) : 0u);
    for (int t = 0; t < c.grid.p; ++t) {
      EXPECT_EQ(st.ring.forward_steps[static_cast<size_t>(t)].source_rank,
                ((at.group - t) % c.grid.p + c.grid.p) % c.grid.p);
    }
    // Only U > 1 trades heads; every rank sends U - 1 blocks each way.
    EXPECT_EQ(st.forward_all_to_all_bytes > 0, c.grid.u > 1);
    EXPECT_EQ(st.backward_all_to_all_bytes > 0, c.grid.u > 1 && c.backward);
  }
}

// The covering subset: every (grid, layout) pair, four variants each; the
// other factors rotate with different strides. Heads cycle through MHA,
// GQA and MQA, so Hkv < U (replicated kv heads) meets every layout of the
// U = 2 and U = 4 grids.
std::vector<Case> CoveringCases() {
  const int num_masks = static_cast<int>(MaskCases().size());
  const int64_t heads[][2] = {{4, 4}, {4, 2}, {4, 1}, {8, 2}};
  const int64_t lengths[][2] = {{48, 48}, {96, 96}, {48, 96}, {96, 48}};
  std::vector<Case> cases;
  int i = 0;
  for (const Grid& grid : kGrids) {
    for (Layout layout : kLayouts) {
      for (int variant = 0; variant < 4; ++variant, ++i) {
        Case c;
        c.grid = grid;
        c.layout = layout;
        c.mask = (i * 5 + variant) % num_masks;
        c.h = heads[(i + variant) % 4][0];
        c.hkv = heads[(i + variant) % 4][1];
        c.sq = lengths[(i / 2 + variant) % 4][0];
        c.skv = lengths[(i / 2 + variant) % 4][1];
        c.b = 1 + (i % 3 == 0);
        c.d = (i % 2) ? 32 : 16;
        c.dv = (i % 5 == 1) ? 32 : 16;
        c.sinks = (i / 3) % 2 == 0;
        c.softcap = (i % 7 < 2) ? 4.0f : 0.0f;
        c.segments = static_cast<Segments>((i / 2) % 3);
        c.backward = i % 6 != 5;
        c.seed = 2000 + static_cast<uint64_t>(i);
        cases.push_back(c);
      }
    }
  }
  return cases;
}

class ContextParallelCoveringTest : public ::testing::TestWithParam<Case> {};

TEST_P(ContextParallelCoveringTest, EqualsSingleDeviceAndReference) { CheckCase(GetParam()); }

INSTANTIATE_TEST_SUITE_P(Covering, ContextParallelCoveringTest,
                         ::testing::ValuesIn(CoveringCases()));

// Every mask on every layout of the largest grid (U = 2 x 4 groups, 8
// ranks), with GQA split over the group, sinks, segments and the backward.
TEST(ContextParallelTest, EveryMaskOnTwoByFour) {
  const int num_masks = static_cast<int>(MaskCases().size());
  for (int m = 0; m < num_masks; ++m) {
    for (Layout layout : kLayouts) {
      Case c;
      c.grid = {2, 4};
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

// Hkv < U: each rank gets the one kv head its query heads read, replicated
// over U / Hkv ranks of the group, and dk/dv come back summed over the
// replicas. MQA (Hkv = 1) on a group of 4 (every rank the same head), Hkv = 2
// on groups of 4 (pairs of ranks), with and without a ring of groups, on a
// head-dependent mask (per-head windows) so a replica's query heads differ.
TEST(ContextParallelTest, FewerKvHeadsThanGroupRanksAreReplicated) {
  for (const Grid grid : {Grid{4, 1}, Grid{4, 2}}) {
    for (int64_t hkv : {1, 2}) {
      for (Layout layout : kLayouts) {
        Case c;
        c.grid = grid;
        c.layout = layout;
        c.mask = 8;  // per_head_and_dense_or_causal
        c.sq = c.skv = 96;
        c.h = 8;
        c.hkv = hkv;
        c.sinks = true;
        c.segments = Segments::kShared;
        c.seed = 500 + static_cast<uint64_t>(hkv);
        CheckCase(c);
      }
    }
  }
}

// Rows that see no key at all: zeros, -inf lse and zero gradients through
// both all-to-alls, never NaN.
TEST(ContextParallelTest, RowsWithoutKeysStayZero) {
  for (const Grid& grid : kGrids) {
    Case c;
    c.grid = grid;
    c.layout = Layout::kZigzag;
    c.mask = 0;  // causal
    c.segments = Segments::kQueryOnlyDoc;
    CheckCase(c);
  }
}

// U = 1 is the 1-D ring (RingAttentionForward/Backward on the communicator
// itself): bit for bit equal to RingAttentionThreads.
TEST(ContextParallelTest, OneRankPerGroupIsTheRingBitForBit) {
  Case c;
  c.grid = {1, 4};
  c.layout = Layout::kZigzag;
  c.mask = 6;  // causal & window
  c.hkv = 2;
  c.sinks = true;
  c.segments = Segments::kShared;
  Rng rng(12);
  const OwnedInputs in = MakeInputs(c, rng);
  const AttentionOptions opt = MakeOptions(c);
  const Tensor dout = testing::RandomTensor(rng, DType::kF32, {c.b, c.sq, c.h, c.dv});
  const CpResult cp = RunCp(c, in, opt, &dout);
  RingRun run;
  run.num_ranks = 4;
  run.options.attention = opt;
  run.options.layout = c.layout;
  Tensor out(DType::kF32, {c.b, c.sq, c.h, c.dv}), lse(DType::kF32, {c.b, c.h, c.sq});
  Tensor dq(DType::kF32, {c.b, c.sq, c.h, c.d}), dk(DType::kF32, {c.b, c.skv, c.hkv, c.d});
  Tensor dv(DType::kF32, {c.b, c.skv, c.hkv, c.dv}), dsinks(DType::kF32, {c.h});
  RingAttentionThreads(run, in.inputs(), out.view(), lse.view(), dout.view(), dq.view(), dk.view(),
                       dv.view(), dsinks.view());
  EXPECT_EQ(cp.api.out, testing::ToDoubles(out.view()));
  EXPECT_EQ(cp.api.lse, testing::ToDoubles(lse.view()));
  EXPECT_EQ(cp.api.dq, testing::ToDoubles(dq.view()));
  EXPECT_EQ(cp.api.dk, testing::ToDoubles(dk.view()));
  EXPECT_EQ(cp.api.dv, testing::ToDoubles(dv.view()));
  EXPECT_EQ(cp.api.dsinks, testing::ToDoubles(dsinks.view()));
}

// bf16 inputs stored [B, H, S, D] (strided views) and bf16 outputs in the
// same strided storage, on a 2 x 2 grid with Hkv < U: shards, all-to-all
// blocks and head slices must honour strides and dtype, and replicated dk/dv
// are summed in f32 before their one rounding to bf16. Tolerance as
// ring_test.cc's bf16 test: the single device and the grid round P to bf16
// (on the paths that do) against different running maxima and round results
// to bf16, so an element may differ by a bf16 ulp (2^-8 relative) where
// values straddle a rounding boundary; two ulps of the largest magnitude,
// 8e-3, allow that, while a wrong head or row moves results by O(1).
TEST(ContextParallelTest, Bf16StridedInputsAndOutputs) {
  constexpr double kBf16Tol = 8e-3;
  for (Layout layout : kLayouts) {
    for (int64_t hkv : {1, 4}) {
      SCOPED_TRACE(std::string(LayoutName(layout)) + " Hkv " + std::to_string(hkv));
      Rng rng(21);
      ProblemSpec spec(1, 96, 96, 4, hkv, 16, 16);
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

      auto strided = [](int64_t s, int64_t h, int64_t d, Tensor* storage) {
        *storage = Tensor(DType::kBF16, {1, h, s, d});
        return storage->view().Transposed(1, 2);
      };
      Tensor out_s, dq_s, dk_s, dv_s;
      Tensor lse(DType::kF32, {1, 4, 96}), dsinks(DType::kF32, {4});
      const TensorView out = strided(96, 4, 16, &out_s), dq = strided(96, 4, 16, &dq_s),
                       dk = strided(96, hkv, 16, &dk_s), dv = strided(96, hkv, 16, &dv_s);
      ContextParallelRun run;
      run.num_ranks = 4;
      run.options.ulysses = 2;
      run.options.ring.attention = opt;
      run.options.ring.layout = layout;
      ContextParallelThreads(run, in.inputs(), out, lse.view(), dout.view(), dq, dk, dv,
                             dsinks.view());
      const std::pair<TensorView, const std::vector<double>*> checks[] = {
          {out, &single.out}, {dq, &single.dq}, {dk, &single.dk}, {dv, &single.dv}};
      for (const auto& [view, expected] : checks) {
        const testing::Comparison c = Compare(testing::ToDoubles(view), *expected);
        EXPECT_LE(c.Relative(), kBf16Tol) << c.Describe();
      }
      EXPECT_LE(Compare(testing::ToDoubles(lse.view()), single.lse).Relative(1.0), 1e-5);
      EXPECT_LE(Compare(testing::ToDoubles(dsinks.view()), single.dsinks).Relative(), kBf16Tol);
    }
  }
}

// Non-finite inputs follow the single device's rule (docs/RELIABILITY.md):
// NaN reaches exactly the rows that depend on it, through both all-to-alls,
// the ring and the sum of replicated kv heads' dk/dv — the same rows as on
// one device, every other value within kTol. A NaN in a q row, a k row of the
// one kv head every rank of a group replicates (MQA on U = 4), a v row and
// a dout row.
TEST(ContextParallelTest, NonFiniteInputsPoisonTheSameRows) {
  for (const Grid grid : {Grid{2, 2}, Grid{4, 1}, Grid{4, 2}}) {
    for (Layout layout : {Layout::kZigzag, Layout::kStriped}) {
      Case c;
      c.grid = grid;
      c.layout = layout;
      c.mask = 6;  // causal & window: a poisoned key reaches a band of rows
      c.h = 4;
      c.hkv = 1;
      c.sinks = true;
      SCOPED_TRACE(c.Describe());
      Rng rng(61);
      OwnedInputs in = MakeInputs(c, rng);
      const AttentionOptions opt = MakeOptions(c);
      Tensor dout = testing::RandomTensor(rng, DType::kF32, {c.b, c.sq, c.h, c.dv});
      const float nan = std::numeric_limits<float>::quiet_NaN();
      in.q.data_as<float>()[in.q.view().Offset(0, 5, 1, 3)] = nan;
      in.k.data_as<float>()[in.k.view().Offset(0, 20, 0, 2)] = nan;
      in.v.data_as<float>()[in.v.view().Offset(0, 33, 0, 0)] = nan;
      dout.data_as<float>()[dout.view().Offset(0, 40, 2, 1)] = nan;
      const ApiResult single = testing::RunAttention(in, opt, &dout);
      const CpResult cp = RunCp(c, in, opt, &dout);
      const std::pair<const char*,
                      std::pair<const std::vector<double>*, const std::vector<double>*>>
          tensors[] = {
              {"out", {&cp.api.out, &single.out}}, {"lse", {&cp.api.lse, &single.lse}},
              {"dq", {&cp.api.dq, &single.dq}},    {"dk", {&cp.api.dk, &single.dk}},
              {"dv", {&cp.api.dv, &single.dv}},    {"dsinks", {&cp.api.dsinks, &single.dsinks}}};
      for (const auto& [name, pair] : tensors) {
        const std::vector<double>& got = *pair.first;
        const std::vector<double>& want = *pair.second;
        ASSERT_EQ(got.size(), want.size()) << name;
        std::vector<double> got_finite, want_finite;
        int64_t nans = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          ASSERT_EQ(std::isnan(got[i]), std::isnan(want[i])) << name << " element " << i;
          if (std::isnan(want[i])) {
            ++nans;
            continue;
          }
          got_finite.push_back(got[i]);
          want_finite.push_back(want[i]);
        }
        EXPECT_GT(nans, 0) << name << ": the poison reaches every output";
        ExpectClose(got_finite, want_finite, std::string(name) == "lse" ? 1.0 : 1e-30, name);
      }
    }
  }
}

}  // namespace
}  // namespace ringsplash
