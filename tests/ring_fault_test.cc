// Fault injection in the ring (threads backend): a rank that fails at a given
// step, forward or backward, makes EVERY rank fail with a message naming it,
// quickly (not by timeout) — nothing hangs. Plus FaultSpec parsing.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using Clock = std::chrono::steady_clock;
using testing::OwnedInputs;
using testing::Rng;

TEST(FaultSpecTest, Parses) {
  FaultSpec f = FaultSpec::Parse("2:3");
  EXPECT_EQ(f.rank, 2);
  EXPECT_EQ(f.step, 3);
  EXPECT_FALSE(f.backward);
  f = FaultSpec::Parse("0:1:bwd");
  EXPECT_EQ(f.rank, 0);
  EXPECT_EQ(f.step, 1);
  EXPECT_TRUE(f.backward);
  f = FaultSpec::Parse("1:4:fwd");  // the forward, spelled out
  EXPECT_EQ(f.rank, 1);
  EXPECT_EQ(f.step, 4);
  EXPECT_FALSE(f.backward);
  for (const char* bad : {"", "1", "1:", ":1", "a:1", "1:2:3", "-1:2", "1:2:back", "1:2:bwd:x"}) {
    EXPECT_THROW(FaultSpec::Parse(bad), Error) << "'" << bad << "'";
  }
}

TEST(FaultSpecTest, FromEnvironment) {
  ::unsetenv("RINGSPLASH_FAULT");
  EXPECT_FALSE(FaultSpec::FromEnv().has_value());
  ::setenv("RINGSPLASH_FAULT", "1:0:bwd", 1);
  const std::optional<FaultSpec> f = FaultSpec::FromEnv();
  ::unsetenv("RINGSPLASH_FAULT");
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->rank, 1);
  EXPECT_TRUE(f->backward);
}

struct Outcome {
  std::vector<std::string> rank_errors;  // what each rank's ring call threw ("" = returned)
  std::string run_error;                 // what RunThreadRanks threw
  double seconds = 0;
};

// Each rank runs the ring forward and backward on its shard of a causal
// problem with the given fault; records what every rank saw.
Outcome RunWithFault(int n, Layout layout, const FaultSpec& fault) {
  Rng rng(17);
  testing::ProblemSpec spec;
  spec.sq = spec.skv = 96;
  spec.h = 4;
  spec.hkv = 2;
  spec.sinks = true;
  const OwnedInputs global = testing::RandomInputs(rng, spec);
  RingOptions options;
  options.layout = layout;
  options.attention.mask = Mask::Causal();
  options.attention.block_sizes = {16, 16};
  options.attention.num_threads = 1;
  options.fault = fault;
  CommOptions comm_options;
  comm_options.timeout_s = 60;  // detection must not rely on it

  Outcome outcome;
  outcome.rank_errors.assign(static_cast<size_t>(n), "");
  std::mutex mu;
  const Clock::time_point start = Clock::now();
  try {
    RunThreadRanks(n, comm_options, [&](Communicator& comm) {
      const int r = comm.rank();
      const int64_t ls = 96 / n;
      Tensor q(DType::kF32, {1, ls, 4, 16}), k(DType::kF32, {1, ls, 2, 16}),
          v(DType::kF32, {1, ls, 2, 16});
      ShardSequence(layout, r, n, global.q.view(), q.view());
      ShardSequence(layout, r, n, global.k.view(), k.view());
      ShardSequence(layout, r, n, global.v.view(), v.view());
      AttentionInputs local;
      local.q = q.view();
      local.k = k.view();
      local.v = v.view();
      local.sinks = global.sinks.view();
      Tensor out(DType::kF32, {1, ls, 4, 16}), lse(DType::kF32, {1, 4, ls});
      Tensor dq(DType::kF32, {1, ls, 4, 16}), dk(DType::kF32, {1, ls, 2, 16}),
          dv(DType::kF32, {1, ls, 2, 16}), dsinks(DType::kF32, {4});
      try {
        RingAttentionForward(comm, local, options, out.view(), lse.view());
        RingAttentionBackward(comm, local, options, out.view(), lse.view(), out.view(), dq.view(),
                              dk.view(), dv.view(), dsinks.view());
      } catch (const Error& e) {
        std::lock_guard<std::mutex> lock(mu);
        outcome.rank_errors[static_cast<size_t>(r)] = e.what();
        throw;
      }
    });
  } catch (const Error& e) {
    outcome.run_error = e.what();
  }
  outcome.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return outcome;
}

void ExpectEveryRankFailed(const Outcome& o, int n, const FaultSpec& f) {
  const std::string reason = "injected fault at rank " + std::to_string(f.rank) + " step " +
                             std::to_string(f.step) + (f.backward ? " (backward)" : "");
  EXPECT_EQ(o.run_error, "rank " + std::to_string(f.rank) + " failed: " + reason);
  for (int r = 0; r < n; ++r) {
    const std::string& e = o.rank_errors[static_cast<size_t>(r)];
    if (r == f.rank) {
      EXPECT_EQ(e, reason);
    } else {
      EXPECT_EQ(e, "rank " + std::to_string(f.rank) + " failed: " + reason) << "rank " << r;
    }
  }
  // Well within the 60 s timeout: the failure is announced, not timed out.
  EXPECT_LT(o.seconds, 30.0);
  std::printf("[ fault ] N=%d %s: all ranks failed after %.1f ms\n", n,
              f.backward ? "backward" : "forward", o.seconds * 1e3);
}

TEST(RingFaultTest, ForwardFaultFailsEveryRank) {
  for (int n : {2, 3, 4}) {
    for (int step = 0; step < n; ++step) {
      FaultSpec f;
      f.rank = (step + 1) % n;
      f.step = step;
      const Outcome o = RunWithFault(n, Layout::kZigzag, f);
      ExpectEveryRankFailed(o, n, f);
    }
  }
}

TEST(RingFaultTest, BackwardFaultFailsEveryRank) {
  for (int n : {2, 3, 4}) {
    FaultSpec f;
    f.rank = n - 1;
    f.step = n / 2;
    f.backward = true;
    const Outcome o = RunWithFault(n, Layout::kStriped, f);
    ExpectEveryRankFailed(o, n, f);
  }
}

// A fault the ring would never reach (a step or rank it does not have) is an
// error on every rank naming it, not a run that silently injects nothing.
TEST(RingFaultTest, FaultOutsideTheRingIsAnError) {
  for (const auto& [rank, step, what] : {std::tuple<int, int, const char*>{1, 3, "step 3"},
                                         std::tuple<int, int, const char*>{3, 0, "rank 3"}}) {
    FaultSpec f;
    f.rank = rank;
    f.step = step;  // N = 3: ranks and steps 0..2
    const Outcome o = RunWithFault(3, Layout::kContiguous, f);
    EXPECT_NE(o.run_error.find(what), std::string::npos) << o.run_error;
    for (const std::string& e : o.rank_errors) {
      EXPECT_NE(e.find("options.fault: " + std::string(what)), std::string::npos) << e;
    }
  }
}

// RingAttentionThreads reports the failed rank too, and an explicit
// options.fault wins over the environment.
TEST(RingFaultTest, ConvenienceEntryPointReportsTheFailedRank) {
  ::setenv("RINGSPLASH_FAULT", "0:0", 1);
  Rng rng(4);
  testing::ProblemSpec spec;
  spec.sq = spec.skv = 48;
  const OwnedInputs in = testing::RandomInputs(rng, spec);
  RingRun run;
  run.num_ranks = 3;
  run.options.attention.num_threads = 1;
  FaultSpec f;
  f.rank = 2;
  f.step = 1;
  run.options.fault = f;
  Tensor out(DType::kF32, {1, 48, 2, 16}), lse(DType::kF32, {1, 2, 48});
  try {
    RingAttentionThreads(run, in.inputs(), out.view(), lse.view());
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 2 failed: injected fault at rank 2 step 1");
  }
  // Without options.fault the environment's spec applies.
  run.options.fault.reset();
  try {
    RingAttentionThreads(run, in.inputs(), out.view(), lse.view());
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "rank 0 failed: injected fault at rank 0 step 0");
  }
  ::unsetenv("RINGSPLASH_FAULT");
}

}  // namespace
}  // namespace ringsplash
