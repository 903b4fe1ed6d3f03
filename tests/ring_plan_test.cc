// RingPlan (include/ringsplash/ring.h): the block metadata of a rank's ring
// is built once per plan and serves every later call and step — proved with
// the plan's own counter and the process-wide count of block maps built
// (mask::BlockMap::BuildCount), which a call without a plan does increase —
// and a ring with a plan gives bitwise the result of one without, checked
// against the f64 reference. A plan that does not fit a call is an Error
// naming the difference.
#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "src/mask/block_map.h"
#include "tests/support/accuracy.h"
#include "tests/support/ring_run.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

constexpr int kRanks = 4;
constexpr int64_t kSeq = 256;  // 64 rows per rank: 4 tiles of 16

// Global inputs, the ring's global outputs and dout.
struct Problem {
  OwnedInputs in;
  Tensor dout;
};

Problem MakeProblem(uint64_t seed) {
  Rng rng(seed);
  ProblemSpec spec(1, kSeq, kSeq, 2, 1, 16, 16);
  spec.sinks = true;
  spec.segments = true;
  Problem p;
  p.in = RandomInputs(rng, spec);
  p.dout = RandomTensor(rng, DType::kF32, {1, kSeq, 2, 16});
  return p;
}

// Forward + backward on kRanks thread ranks; rank r uses plans[r] when
// `plans` is given.
ApiResult RunRing(const Problem& p, const RingOptions& base,
                  const std::vector<std::unique_ptr<RingPlan>>* plans) {
  return RunRingSharded(p.in, p.dout, kRanks, base.layout, [&](int r) {
    RingOptions options = base;
    if (plans != nullptr) options.plan = (*plans)[static_cast<size_t>(r)].get();
    return options;
  });
}

// A dense mask (causal with holes, per position): the case where building
// the maps scans every tile, which the plan saves.
Mask HoleyCausal() {
  std::vector<uint8_t> m(static_cast<size_t>(kSeq * kSeq));
  for (int64_t i = 0; i < kSeq; ++i) {
    for (int64_t j = 0; j <= i; ++j) m[i * kSeq + j] = (i * 7 + j * 3) % 5 != 0 ? 1 : 0;
  }
  return Mask::Dense(std::move(m), 0, kSeq, kSeq);
}

struct PlanCase {
  std::string name;
  Mask mask;
  Layout layout;
};

class RingPlanTest : public ::testing::TestWithParam<PlanCase> {};

TEST_P(RingPlanTest, BuildsMetadataOnceAndMatchesTheReference) {
  const PlanCase& c = GetParam();
  const Problem p = MakeProblem(11);
  RingOptions options;
  options.layout = c.layout;
  options.attention.mask = c.mask;
  options.attention.block_sizes = {16, 16};
  options.attention.num_threads = 1;
  std::vector<std::unique_ptr<RingPlan>> plans;
  for (int r = 0; r < kRanks; ++r) {
    plans.push_back(std::make_unique<RingPlan>(r, kRanks, options, kSeq / kRanks, kSeq / kRanks,
                                               /*num_heads=*/2));
    EXPECT_EQ(plans.back()->metadata_builds(), 0) << "maps are built on first use";
  }

  const ApiResult first = RunRing(p, options, &plans);
  // One map by row and one by column per source rank, for forward and
  // backward together.
  for (const auto& plan : plans) EXPECT_EQ(plan->metadata_builds(), 2 * kRanks);
  const int64_t built = mask::BlockMap::BuildCount();
  const ApiResult second = RunRing(p, options, &plans);
  EXPECT_EQ(mask::BlockMap::BuildCount(), built) << "a call with a plan built block maps";
  for (const auto& plan : plans) EXPECT_EQ(plan->metadata_builds(), 2 * kRanks);
  EXPECT_GT(plans[0]->memory_bytes(), 0u);

  // Without a plan every step builds its maps (on each rank, the forward one
  // per step, the backward at least one per step: by column, and by row too
  // when it runs a separate dQ pass): the counter above is one that can fail.
  const ApiResult unplanned = RunRing(p, options, nullptr);
  EXPECT_GE(mask::BlockMap::BuildCount() - built, int64_t{2} * kRanks * kRanks);

  // The same maps give the same tiles: bitwise equal results.
  EXPECT_EQ(first.out, second.out);
  EXPECT_EQ(first.dq, second.dq);
  EXPECT_EQ(first.out, unplanned.out);
  EXPECT_EQ(first.lse, unplanned.lse);
  EXPECT_EQ(first.dq, unplanned.dq);
  EXPECT_EQ(first.dk, unplanned.dk);
  EXPECT_EQ(first.dv, unplanned.dv);
  EXPECT_EQ(first.dsinks, unplanned.dsinks);

  // And right: against the f64 reference within the f32 bound of
  // accuracy.h (kF32Tolerance: rows of <= 256 keys, 3 ring merges).
  const RefResult ref = RunReference(p.in, options.attention, &p.dout);
  const Errors e = ErrorsOf(first, ref);
  const Errors bound = ReferenceBounds(ref, ToDoubles(p.in.v.view()), KernelPath::kPortable,
                                       DType::kF32, DType::kF32, Tolerances{});
  EXPECT_EQ(ExceedsBounds(c.name, e, bound), "") << e.Describe();
}

INSTANTIATE_TEST_SUITE_P(
    Masks, RingPlanTest,
    ::testing::Values(PlanCase{"causal_zigzag", Mask::Causal(), Layout::kZigzag},
                      PlanCase{"window_striped", Mask::Local(40, 0), Layout::kStriped},
                      PlanCase{"dense_contiguous", HoleyCausal(), Layout::kContiguous},
                      PlanCase{"dense_and_window_zigzag", HoleyCausal() & Mask::Local(100, 0),
                               Layout::kZigzag}),
    [](const ::testing::TestParamInfo<PlanCase>& info) { return info.param.name; });

// One plan may serve calls running at once (the header promises it: maps
// are built under a lock): two rings on their own communicators share rank
// r's plan, their first calls racing to build its maps. Run under TSan too
// (scripts/ci_sanitizers.sh).
TEST(RingPlanConcurrencyTest, TwoRingsShareOnePlanPerRank) {
  const Problem p = MakeProblem(5);
  RingOptions options;
  options.attention.mask = Mask::Causal() & Mask::Local(50, 0);
  options.attention.block_sizes = {16, 16};
  options.attention.num_threads = 1;
  std::vector<std::unique_ptr<RingPlan>> plans;
  for (int r = 0; r < kRanks; ++r) {
    plans.push_back(
        std::make_unique<RingPlan>(r, kRanks, options, kSeq / kRanks, kSeq / kRanks, 2));
  }
  ApiResult a, b;
  std::thread other([&] { b = RunRing(p, options, &plans); });
  a = RunRing(p, options, &plans);
  other.join();
  for (const auto& plan : plans) EXPECT_EQ(plan->metadata_builds(), 2 * kRanks);
  // Both equal a ring without a plan, bitwise (which the test above checks
  // against the reference).
  const ApiResult alone = RunRing(p, options, nullptr);
  EXPECT_EQ(a.out, alone.out);
  EXPECT_EQ(b.out, alone.out);
  EXPECT_EQ(a.dk, alone.dk);
  EXPECT_EQ(b.dk, alone.dk);
}

// Runs one forward on 2 thread ranks with rank r's plan made from
// `plan_options` for local lengths `plan_sq`; returns the Error message.
std::string ForwardWithPlan(const RingOptions& call_options, const RingOptions& plan_options,
                            int64_t plan_sq, int64_t plan_heads = 2) {
  Rng rng(3);
  const OwnedInputs in = RandomInputs(rng, ProblemSpec(1, 32, 32, 2, 2, 16, 16));
  std::string message;
  try {
    RunThreadRanks(2, CommOptions{}, [&](Communicator& comm) {
      const RingPlan plan(comm, plan_options, plan_sq, plan_sq, plan_heads);
      RingOptions options = call_options;
      options.plan = &plan;
      Tensor q(DType::kF32, {1, 16, 2, 16}), k(DType::kF32, {1, 16, 2, 16});
      Tensor v(DType::kF32, {1, 16, 2, 16});
      ShardSequence(options.layout, comm.rank(), 2, in.q.view(), q.view());
      ShardSequence(options.layout, comm.rank(), 2, in.k.view(), k.view());
      ShardSequence(options.layout, comm.rank(), 2, in.v.view(), v.view());
      Tensor out(DType::kF32, {1, 16, 2, 16}), lse(DType::kF32, {1, 2, 16});
      AttentionInputs local;
      local.q = q.view();
      local.k = k.view();
      local.v = v.view();
      RingAttentionForward(comm, local, options, out.view(), lse.view());
    });
  } catch (const Error& e) {
    message = e.what();
  }
  return message;
}

TEST(RingPlanErrorsTest, APlanThatDoesNotFitTheCallIsAnErrorNamingTheDifference) {
  RingOptions options;
  options.attention.mask = Mask::Causal();
  options.attention.block_sizes = {16, 16};
  EXPECT_EQ(ForwardWithPlan(options, options, 16), "");

  EXPECT_NE(ForwardWithPlan(options, options, 8).find("local lengths q 8"), std::string::npos);
  EXPECT_NE(ForwardWithPlan(options, options, 16, 4).find("4 query heads"), std::string::npos);
  RingOptions other = options;
  other.attention.mask = Mask::Local(4, 0);
  EXPECT_NE(ForwardWithPlan(options, other, 16).find("the mask 'local:4,0'"), std::string::npos);
  other = options;
  other.layout = Layout::kStriped;
  EXPECT_NE(ForwardWithPlan(options, other, 16).find("layout 'striped'"), std::string::npos);
  other = options;
  other.attention.block_sizes = {32, 16};
  EXPECT_NE(ForwardWithPlan(options, other, 16).find("block sizes 32 x 16"), std::string::npos);
}

TEST(RingPlanErrorsTest, ArgumentsAreChecked) {
  RingOptions options;
  EXPECT_THROW(RingPlan(2, 2, options, 16, 16, 2), Error);
  EXPECT_THROW(RingPlan(0, 2, options, 0, 16, 2), Error);
  EXPECT_THROW(RingPlan(0, 2, options, 16, 16, 0), Error);
  // A zigzag ring needs 2N chunks.
  EXPECT_THROW(RingPlan(0, 2, options, 1, 16, 2), Error);
}

}  // namespace
}  // namespace ringsplash::testing
