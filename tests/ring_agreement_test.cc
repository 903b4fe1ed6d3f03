// Ranks of one ring call must agree on the collective arguments (local
// lengths, sizes, dtype, layout, mask, scale, soft cap, sinks, segment ids,
// block sizes, forward vs backward). Each kind of disagreement makes EVERY
// rank throw the same Error naming what differs — promptly, not by timeout —
// and leaves the communicator usable.
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using testing::OwnedInputs;
using testing::ProblemSpec;
using testing::Rng;

// One rank's call: its local problem, options and which entry point.
struct RankCall {
  ProblemSpec spec{1, 8, 8, 2, 1, 8, 8};  // local sizes: B, Sq, Skv, H, Hkv, D, Dv
  RingOptions options;
  bool backward = false;
  // Applied to the rank's inputs after they were made (e.g. set sinks values).
  std::function<void(OwnedInputs&)> edit_inputs;
};

RankCall DefaultCall() {
  RankCall c;
  c.options.layout = Layout::kContiguous;
  c.options.attention.num_threads = 1;
  return c;
}

// Runs `call` on this rank: the forward, or (backward) a forward then the
// backward with the forward's out/lse and dout = out.
void RunCall(Communicator& comm, const RankCall& call) {
  Rng rng(static_cast<uint64_t>(comm.rank()) + 5);
  OwnedInputs owned = testing::RandomInputs(rng, call.spec);
  if (call.edit_inputs) call.edit_inputs(owned);
  const AttentionInputs in = owned.inputs();
  const ProblemSpec& s = call.spec;
  Tensor out(DType::kF32, {s.b, s.sq, s.h, s.dv});
  Tensor lse(DType::kF32, {s.b, s.h, s.sq});
  if (!call.backward) {
    RingAttentionForward(comm, in, call.options, out.view(), lse.view());
    return;
  }
  // The backward needs a forward's out/lse; make them without the ring (a
  // forward through the ring would fail first on the same disagreement).
  AttentionOptions single = call.options.attention;
  AttentionForward(in, single, out.view(), lse.view());
  Tensor dq(DType::kF32, {s.b, s.sq, s.h, s.d});
  Tensor dk(DType::kF32, {s.b, s.skv, s.hkv, s.d});
  Tensor dv(DType::kF32, {s.b, s.skv, s.hkv, s.dv});
  Tensor dsinks(DType::kF32, {s.h});
  RingAttentionBackward(comm, in, call.options, out.view(), lse.view(), out.view(), dq.view(),
                        dk.view(), dv.view(), in.sinks.defined() ? dsinks.view() : TensorView{});
}

// What every rank's call threw ("" if it returned). RunThreadRanks itself
// throws only if a rank aborted the communicator: then into `run_error`
// when given, else out of the test.
std::vector<std::string> RunRanks(int n, const std::function<RankCall(int rank)>& call_of,
                                  std::string* run_error = nullptr) {
  std::vector<std::string> errors(static_cast<size_t>(n));
  CommOptions copt;
  copt.timeout_s = 30;  // a hang would show as a timeout message, not a stuck test
  try {
    RunThreadRanks(n, copt, [&](Communicator& comm) {
      try {
        RunCall(comm, call_of(comm.rank()));
      } catch (const Error& e) {
        errors[static_cast<size_t>(comm.rank())] = e.what();
      }
    });
  } catch (const Error& e) {
    if (run_error == nullptr) throw;
    *run_error = e.what();
  }
  return errors;
}

// Rank `odd` gets `change` applied to the default call; the others not.
std::vector<std::string> RunWithOneOdd(int n, int odd,
                                       const std::function<void(RankCall&)>& change) {
  return RunRanks(n, [&](int rank) {
    RankCall c = DefaultCall();
    if (rank == odd) change(c);
    return c;
  });
}

// Every rank threw exactly `message`.
void ExpectAllRanksThrew(const std::vector<std::string>& errors, const std::string& message) {
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_EQ(errors[r], message) << "rank " << r;
  }
}

TEST(RingAgreementTest, AgreeingRanksRunAndDefaultScaleEqualsExplicitDefault) {
  // Rank 1 spells out the default scale 1/sqrt(D) (as the library computes
  // it, in f32): the effective scales agree, so the call runs.
  const std::vector<std::string> errors =
      RunWithOneOdd(2, 1, [](RankCall& c) { c.options.attention.scale = 1.0f / std::sqrt(8.0f); });
  ExpectAllRanksThrew(errors, "");
}

TEST(RingAgreementTest, LocalQueryRows) {
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.sq = 16; }),
                      "ring: rank 1 passed q with 16 local rows but rank 0 passed 8");
}

TEST(RingAgreementTest, LocalKeyValueRows) {
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.skv = 24; }),
                      "ring: rank 1 passed k/v with 24 local rows but rank 0 passed 8");
}

TEST(RingAgreementTest, BatchHeadsAndHeadDims) {
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.b = 2; }),
                      "ring: rank 1 passed q with batch size 2 but rank 0 passed 1");
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.h = 4; }),
                      "ring: rank 1 passed q with 4 heads (H) but rank 0 passed 2");
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.hkv = 2; }),
                      "ring: rank 1 passed k/v with 2 heads (Hkv) but rank 0 passed 1");
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.d = 16; }),
                      "ring: rank 1 passed q/k with head dim D=16 but rank 0 passed 8");
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.dv = 16; }),
                      "ring: rank 1 passed v with head dim Dv=16 but rank 0 passed 8");
}

TEST(RingAgreementTest, DType) {
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.dtype = DType::kBF16; }),
                      "ring: rank 1 passed q/k/v in bf16 but rank 0 passed f32");
}

TEST(RingAgreementTest, Layout) {
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.options.layout = Layout::kZigzag; }),
                      "ring: rank 1 uses layout 'zigzag' but rank 0 uses 'contiguous'");
}

TEST(RingAgreementTest, Mask) {
  const auto errors = RunRanks(2, [](int rank) {
    RankCall c = DefaultCall();
    c.options.attention.mask = rank == 0 ? Mask::Causal() : Mask::Full();
    return c;
  });
  ExpectAllRanksThrew(errors,
                      "ring: ranks disagree on the mask (rank 0: 'causal', rank 1: 'full')");
}

TEST(RingAgreementTest, LongMaskTextIsShortened) {
  Mask long_mask = Mask::Causal(1);
  for (int i = 2; i < 40; ++i) long_mask = long_mask & Mask::Causal(i);
  ASSERT_GT(long_mask.ToString().size(), 200u);
  const auto errors =
      RunWithOneOdd(2, 1, [&](RankCall& c) { c.options.attention.mask = long_mask; });
  const std::string expected_start = "ring: ranks disagree on the mask (rank 0: 'full', rank 1: '" +
                                     long_mask.ToString().substr(0, 197) + "...')";
  ExpectAllRanksThrew(errors, expected_start);
}

TEST(RingAgreementTest, DenseMaskContents) {
  // Global extent 16 x 16 (2 ranks x 8 local rows); rank 1's matrix differs
  // in one element, so the mask texts agree but the contents do not.
  const auto errors = RunRanks(2, [](int rank) {
    std::vector<uint8_t> bits(16 * 16, 1);
    if (rank == 1) bits[5 * 16 + 3] = 0;
    RankCall c = DefaultCall();
    c.options.attention.mask = Mask::Dense(std::move(bits), 0, 16, 16);
    return c;
  });
  ExpectAllRanksThrew(errors,
                      "ring: ranks disagree on the dense mask values (rank 0 and rank 1 both pass "
                      "'dense[16x16]' but with different contents)");
}

TEST(RingAgreementTest, ScaleAndSoftcap) {
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.options.attention.scale = 0.5f; }),
                      "ring: rank 1 uses scale 0.5 but rank 0 uses scale 0.353553385");
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.options.attention.softcap = 30.0f; }),
                      "ring: rank 1 uses softcap 30 but rank 0 uses softcap none");
  ExpectAllRanksThrew(RunRanks(2,
                               [](int rank) {
                                 RankCall c = DefaultCall();
                                 c.options.attention.softcap = rank == 0 ? 20.0f : 30.0f;
                                 return c;
                               }),
                      "ring: rank 1 uses softcap 30 but rank 0 uses softcap 20");
}

TEST(RingAgreementTest, PresenceOfSinksAndSegments) {
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.sinks = true; }),
                      "ring: rank 1 passed sinks but rank 0 passed none");
  ExpectAllRanksThrew(RunWithOneOdd(2, 0, [](RankCall& c) { c.spec.sinks = true; }),
                      "ring: rank 1 passed no sinks but rank 0 passed them");
  ExpectAllRanksThrew(RunWithOneOdd(2, 1, [](RankCall& c) { c.spec.segments = true; }),
                      "ring: rank 1 passed segment ids but rank 0 passed none");
}

TEST(RingAgreementTest, SinksValues) {
  const auto errors = RunRanks(2, [](int rank) {
    RankCall c = DefaultCall();
    c.spec.sinks = true;
    c.edit_inputs = [rank](OwnedInputs& in) {
      float* s = in.sinks.data_as<float>();
      s[0] = -1.5f;
      s[1] = rank == 0 ? 0.5f : 0.25f;
    };
    return c;
  });
  ExpectAllRanksThrew(errors, "ring: ranks disagree on sinks[1] (rank 0: 0.5, rank 1: 0.25)");
}

// A sink of -inf ("no sink for this head") is a value like any other: ranks
// that all pass it agree, and one that does not is named with it.
TEST(RingAgreementTest, MinusInfSinks) {
  constexpr float kMinusInf = -std::numeric_limits<float>::infinity();
  auto call_with = [](float rank1_sink) {
    return [rank1_sink](int rank) {
      RankCall c = DefaultCall();
      c.spec.sinks = true;
      c.backward = true;
      c.edit_inputs = [rank, rank1_sink](OwnedInputs& in) {
        float* s = in.sinks.data_as<float>();
        s[0] = 0.5f;
        s[1] = rank == 0 ? kMinusInf : rank1_sink;
      };
      return c;
    };
  };
  for (const std::string& e : RunRanks(3, call_with(kMinusInf))) EXPECT_EQ(e, "");
  ExpectAllRanksThrew(RunRanks(2, call_with(0.5f)),
                      "ring: ranks disagree on sinks[1] (rank 0: -inf, rank 1: 0.5)");
}

TEST(RingAgreementTest, BlockSizes) {
  ExpectAllRanksThrew(
      RunWithOneOdd(2, 1, [](RankCall& c) { c.options.attention.block_sizes.q = 32; }),
      "ring: rank 1 uses block_sizes.q=32 but rank 0 uses block_sizes.q=128");
  ExpectAllRanksThrew(
      RunWithOneOdd(2, 1, [](RankCall& c) { c.options.attention.block_sizes.kv = 64; }),
      "ring: rank 1 uses block_sizes.kv=64 but rank 0 uses block_sizes.kv=128");
}

TEST(RingAgreementTest, ForwardVersusBackward) {
  ExpectAllRanksThrew(
      RunWithOneOdd(2, 1, [](RankCall& c) { c.backward = true; }),
      "ring: rank 1 called RingAttentionBackward but rank 0 called RingAttentionForward");
}

TEST(RingAgreementTest, BackwardChecksToo) {
  const auto errors = RunRanks(2, [](int rank) {
    RankCall c = DefaultCall();
    c.backward = true;
    c.options.attention.mask = rank == 0 ? Mask::Local(3, 0) : Mask::Causal();
    return c;
  });
  ExpectAllRanksThrew(errors,
                      "ring: ranks disagree on the mask (rank 0: 'local:3,0', rank 1: 'causal')");
}

TEST(RingAgreementTest, NamesTheFirstRankThatDiffersOnEveryRank) {
  // Four ranks; only rank 2 differs: all four report rank 2.
  ExpectAllRanksThrew(RunWithOneOdd(4, 2, [](RankCall& c) { c.spec.sq = 4; }),
                      "ring: rank 2 passed q with 4 local rows but rank 0 passed 8");
  // Rank 0 is the odd one: the lowest other rank is named against it.
  ExpectAllRanksThrew(RunWithOneOdd(3, 0, [](RankCall& c) { c.spec.sq = 4; }),
                      "ring: rank 1 passed q with 8 local rows but rank 0 passed 4");
}

TEST(RingAgreementTest, CommunicatorStaysUsableAfterADisagreement) {
  std::vector<std::string> first(2), second(2);
  CommOptions copt;
  copt.timeout_s = 30;
  RunThreadRanks(2, copt, [&](Communicator& comm) {
    const auto r = static_cast<size_t>(comm.rank());
    RankCall bad = DefaultCall();
    if (comm.rank() == 1) bad.spec.sq = 16;
    try {
      RunCall(comm, bad);
    } catch (const Error& e) {
      first[r] = e.what();
    }
    try {
      RunCall(comm, DefaultCall());
    } catch (const Error& e) {
      second[r] = e.what();
    }
  });
  ExpectAllRanksThrew(first, "ring: rank 1 passed q with 16 local rows but rank 0 passed 8");
  ExpectAllRanksThrew(second, "");
}

TEST(RingAgreementTest, LocalArgumentErrorsStillReachEveryRank) {
  // A rank whose own arguments are invalid fails before the agreement check;
  // its peer, waiting in the check's collective, hears of it (no hang).
  std::string run_error;
  const auto errors = RunRanks(
      2,
      [](int rank) {
        RankCall c = DefaultCall();
        if (rank == 1) c.options.attention.block_sizes.q = 20;
        return c;
      },
      &run_error);
  EXPECT_EQ(errors[1], "block_sizes.q: expected a positive multiple of 16, got 20");
  EXPECT_EQ(errors[0], "rank 1 failed: " + errors[1]);
  EXPECT_EQ(run_error, errors[0]);  // the failed rank aborted the communicator
}

}  // namespace
}  // namespace ringsplash
