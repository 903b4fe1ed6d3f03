// Bad input everywhere (issue #6.6): every check of every public function
// outside the attention entry points (those have tests/attention_errors_test.cc;
// the command line has tests/cli/cli_errors_test.cc) — tensors and dtypes,
// kernel paths, masks and their text, layouts and sharding, fault specs, the
// threads communicator, and the ring entry points, including ranks that
// disagree with each other. Each case makes one bad call and expects a
// ringsplash::Error whose message contains the argument's name first and
// then what was given. The table in docs/RELIABILITY.md lists these cases by
// name.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdlib>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "ringsplash/tensor.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

struct BadCall {
  std::string name;
  std::function<void()> call;
  std::vector<std::string> expected;  // substrings of the message, in order of importance
};

// A small valid global problem for the ring entry points: B=1, S=16, H=2,
// Hkv=1, D=Dv=8, f32.
struct RingProblem {
  OwnedInputs in;
  Tensor out{DType::kF32, {1, 16, 2, 8}}, lse{DType::kF32, {1, 2, 16}};
  RingProblem() {
    Rng rng(3);
    ProblemSpec spec;
    spec.sq = spec.skv = 16;
    spec.h = 2;
    spec.hkv = 1;
    spec.d = spec.dv = 8;
    in = RandomInputs(rng, spec);
  }
};

void RunRingThreads(int ranks, const std::function<void(RingRun&, AttentionInputs&)>& edit) {
  RingProblem p;
  RingRun run;
  run.num_ranks = ranks;
  run.comm.timeout_s = 10;
  AttentionInputs in = p.in.inputs();
  edit(run, in);
  RingAttentionThreads(run, in, p.out.view(), p.lse.view());
}

// Per-rank API on 2 thread ranks; `local_len(rank)` gives each rank's local
// q and kv lengths (they should agree).
void RunPerRank(const std::function<int64_t(int)>& q_len, const std::function<int64_t(int)>& kv_len,
                const std::function<void(int, AttentionInputs&, RingOptions&)>& edit = {}) {
  CommOptions copt;
  copt.timeout_s = 10;
  RunThreadRanks(2, copt, [&](Communicator& comm) {
    Rng rng(static_cast<uint64_t>(comm.rank()) + 11);
    const int64_t sq = q_len(comm.rank()), skv = kv_len(comm.rank());
    const Tensor q = RandomTensor(rng, DType::kF32, {1, sq, 2, 8});
    const Tensor k = RandomTensor(rng, DType::kF32, {1, skv, 1, 8});
    const Tensor v = RandomTensor(rng, DType::kF32, {1, skv, 1, 8});
    Tensor out(DType::kF32, {1, sq, 2, 8}), lse(DType::kF32, {1, 2, sq});
    AttentionInputs in;
    in.q = q.view();
    in.k = k.view();
    in.v = v.view();
    RingOptions ro;
    ro.layout = Layout::kContiguous;
    ro.attention.num_threads = 1;
    if (edit) edit(comm.rank(), in, ro);
    RingAttentionForward(comm, in, ro, out.view(), lse.view());
  });
}

std::vector<BadCall> Cases() {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<BadCall> c;
  // ---- tensor.h
  c.push_back({"ParseDType_unknown", [] { ParseDType("f64", "--dtype"); }, {"--dtype", "'f64'"}});
  c.push_back({"Tensor_negative_dim", [] { Tensor t(DType::kF32, {2, -1}); }, {"Tensor", "-1"}});
  c.push_back({"Contiguous_too_many_dims",
               [] {
                 TensorView::Contiguous(nullptr, DType::kF32, {1, 2, 3, 4, 5});
               },
               {"at most 4 dims", "5"}});
  c.push_back({"Transposed_dim_out_of_range",
               [] {
                 Tensor t(DType::kF32, {2, 3});
                 t.view().Transposed(0, 2);
               },
               {"Transposed", "2"}});
  c.push_back({"CopyConvert_shape_mismatch",
               [] {
                 Tensor a(DType::kF32, {2, 3}), b(DType::kBF16, {3, 2});
                 CopyConvert(a.view(), b.view());
               },
               {"CopyConvert", "[2, 3]", "[3, 2]"}});
  c.push_back({"CopyConvert_rank_mismatch",
               [] {
                 Tensor a(DType::kF32, {6}), b(DType::kF32, {2, 3});
                 CopyConvert(a.view(), b.view());
               },
               {"CopyConvert", "1", "2"}});
  // ---- attention.h (kernel paths)
  c.push_back(
      {"ParseKernelPath_unknown", [] { ParseKernelPath("gpu"); }, {"kernel path", "'gpu'"}});
  // ---- mask.h
  c.push_back({"Local_negative_left", [] { Mask::Local(-1, 2); }, {"left", "-1"}});
  c.push_back({"Local_negative_right", [] { Mask::Local(1, -2); }, {"right", "-2"}});
  c.push_back({"ChunkedCausal_zero", [] { Mask::ChunkedCausal(0); }, {"chunk", "0"}});
  c.push_back({"ChunkedCausal_negative", [] { Mask::ChunkedCausal(-4); }, {"chunk", "-4"}});
  c.push_back({"Dense_wrong_value_count",
               [] { Mask::Dense(std::vector<uint8_t>(5, 1), 0, 2, 3); },
               {"values", "6", "5"}});
  c.push_back({"Dense_negative_heads",
               [] { Mask::Dense(std::vector<uint8_t>(6, 1), -1, 2, 3); },
               {"heads", "-1"}});
  c.push_back({"Dense_negative_extent",
               [] { Mask::Dense(std::vector<uint8_t>(6, 1), 0, -2, 3); },
               {"sq", "-2"}});
  c.push_back({"PerHead_empty", [] { Mask::PerHead({}); }, {"PerHead", "none"}});
  c.push_back({"PerHead_child_built_for_other_heads",
               [] {
                 const Mask two = Mask::PerHead({Mask::Causal(), Mask::Full()});
                 Mask::PerHead({two, two, two});
               },
               {"PerHead", "2"}});
  c.push_back({"And_of_different_head_counts",
               [] {
                 const Mask two = Mask::PerHead({Mask::Causal(), Mask::Full()});
                 const Mask three = Mask::PerHead({Mask::Full(), Mask::Full(), Mask::Full()});
                 (void)(two & three);
               },
               {"combine", "2", "3"}});
  c.push_back({"Allowed_head_out_of_range",
               [] {
                 Mask::PerHead({Mask::Causal(), Mask::Full()}).Allowed(5, 0, 0);
               },
               {"head", "5"}});
  c.push_back({"Parse_empty", [] { Mask::Parse("  "); }, {"mask", "empty"}});
  c.push_back({"Parse_bad_offset", [] { Mask::Parse("causal:x"); }, {"mask 'causal:x'", "x"}});
  c.push_back({"Parse_unknown_term", [] { Mask::Parse("causal & banana"); }, {"mask", "banana"}});
  c.push_back({"Parse_missing_operand", [] { Mask::Parse("causal &"); }, {"mask", "&"}});
  c.push_back({"Parse_negative_window", [] { Mask::Parse("local:-1,2"); }, {"mask", "-1"}});
  c.push_back({"Parse_zero_chunk", [] { Mask::Parse("chunked:0"); }, {"mask", "0"}});
  c.push_back({"Parse_unbalanced", [] { Mask::Parse("(causal"); }, {"mask", "("}});
  c.push_back({"Parse_offset_overflow",
               [] { Mask::Parse("causal:99999999999999999999"); },
               {"mask", "99999999999999999999"}});
  // ---- ring.h: layouts, sharding, fault specs
  c.push_back({"ParseLayout_unknown", [] { ParseLayout("diagonal"); }, {"layout", "'diagonal'"}});
  c.push_back({"LayoutPositions_indivisible",
               [] { LayoutPositions(Layout::kZigzag, 10, 0, 3, "q sequence length"); },
               {"q sequence length", "10", "3"}});
  c.push_back({"LayoutPositions_rank_out_of_range",
               [] { LayoutPositions(Layout::kContiguous, 12, 3, 3); },
               {"rank", "3"}});
  c.push_back({"LayoutPositions_no_ranks",
               [] { LayoutPositions(Layout::kContiguous, 12, 0, 0); },
               {"ranks", "0"}});
  c.push_back({"LayoutPositions_negative_length",
               [] { LayoutPositions(Layout::kContiguous, -4, 0, 2, "kv sequence length"); },
               {"kv sequence length", "-4"}});
  c.push_back({"ShardSequence_dtype_mismatch",
               [] {
                 Tensor g(DType::kF32, {1, 8, 1, 4}), l(DType::kBF16, {1, 4, 1, 4});
                 ShardSequence(Layout::kContiguous, 0, 2, g.view(), l.view());
               },
               {"ShardSequence", "dtype"}});
  c.push_back({"ShardSequence_wrong_local_rows",
               [] {
                 Tensor g(DType::kF32, {1, 8, 1, 4}), l(DType::kF32, {1, 3, 1, 4});
                 ShardSequence(Layout::kContiguous, 0, 2, g.view(), l.view());
               },
               {"ShardSequence", "local"}});
  c.push_back({"ShardSequence_undefined",
               [] {
                 Tensor l(DType::kF32, {1, 4, 1, 4});
                 ShardSequence(Layout::kContiguous, 0, 2, TensorView(), l.view());
               },
               {"ShardSequence", "defined"}});
  c.push_back({"GatherSequence_bad_seq_dim",
               [] {
                 Tensor g(DType::kF32, {1, 8}), l(DType::kF32, {1, 4});
                 GatherSequence(Layout::kContiguous, 0, 2, l.view(), g.view(), 5);
               },
               {"GatherSequence", "seq_dim"}});
  for (const char* bad : {"1", "a:b", "1:2:fwdx", "-1:0", "1:2:3", "", "99999999999:0"}) {
    c.push_back({std::string("FaultSpec_Parse_'") + bad + "'",
                 [bad] { FaultSpec::Parse(bad); },
                 {"RINGSPLASH_FAULT", std::string("'") + bad + "'"}});
  }
  c.push_back({"FaultSpec_FromEnv_bad",
               [] {
                 ::setenv("RINGSPLASH_FAULT", "one:two", 1);
                 try {
                   FaultSpec::FromEnv();
                 } catch (...) {
                   ::unsetenv("RINGSPLASH_FAULT");
                   throw;
                 }
                 ::unsetenv("RINGSPLASH_FAULT");
               },
               {"RINGSPLASH_FAULT", "one:two"}});
  // ---- comm.h
  c.push_back({"RunThreadRanks_no_ranks",
               [] { RunThreadRanks(0, CommOptions{}, [](Communicator&) {}); },
               {"num_ranks", "0"}});
  c.push_back({"RunThreadRanks_zero_timeout",
               [] {
                 CommOptions o;
                 o.timeout_s = 0;
                 RunThreadRanks(2, o, [](Communicator&) {});
               },
               {"timeout_s", "0"}});
  c.push_back({"RunThreadRanks_nan_timeout",
               [nan] {
                 CommOptions o;
                 o.timeout_s = nan;
                 RunThreadRanks(2, o, [](Communicator&) {});
               },
               {"timeout_s", "nan"}});
  c.push_back({"RunThreadRanks_empty_fn",
               [] { RunThreadRanks(2, CommOptions{}, std::function<void(Communicator&)>()); },
               {"fn"}});
  c.push_back({"Wait_unknown_handle",
               [] { RunThreadRanks(1, CommOptions{}, [](Communicator& comm) { comm.Wait(42); }); },
               {"Wait", "42"}});
  c.push_back({"Shift_null_buffers",
               [] {
                 RunThreadRanks(2, CommOptions{}, [](Communicator& comm) {
                   comm.Wait(comm.StartShift(nullptr, nullptr, 16));
                 });
               },
               {"StartShift", "null"}});
  c.push_back({"AllReduceSum_null_data",
               [] {
                 RunThreadRanks(2, CommOptions{},
                                [](Communicator& comm) { comm.AllReduceSum(nullptr, 4); });
               },
               {"AllReduceSum", "null"}});
  // ---- ring.h: entry points
  c.push_back({"RingAttentionThreads_no_ranks",
               [] { RunRingThreads(0, [](RingRun&, AttentionInputs&) {}); },
               {"num_ranks", "0"}});
  c.push_back({"RingAttentionThreads_positions_given",
               [] {
                 RunRingThreads(
                     2, [](RingRun&, AttentionInputs& in) { in.q_positions.assign(16, 0); });
               },
               {"q_positions"}});
  c.push_back({"RingAttentionThreads_indivisible",
               [] { RunRingThreads(3, [](RingRun&, AttentionInputs&) {}); },
               {"q sequence length", "16"}});
  c.push_back(
      {"RingAttentionThreads_zero_timeout",
       [] { RunRingThreads(2, [](RingRun& r, AttentionInputs&) { r.comm.timeout_s = 0; }); },
       {"timeout_s", "0"}});
  c.push_back({"RingAttentionThreads_bad_block_size",
               [] {
                 RunRingThreads(2, [](RingRun& r, AttentionInputs&) {
                   r.options.attention.block_sizes.kv = 20;
                 });
               },
               {"block_sizes.kv", "20"}});
  c.push_back({"RingAttentionThreads_dense_mask_too_small",
               [] {
                 RunRingThreads(2, [](RingRun& r, AttentionInputs&) {
                   r.options.attention.mask =
                       Mask::Dense(std::vector<uint8_t>(8 * 16, 1), 0, 8, 16);
                 });
               },
               {"mask", "8"}});
  c.push_back({"RingAttentionForward_positions_given",
               [] {
                 RunPerRank(
                     [](int) { return 8; }, [](int) { return 8; },
                     [](int, AttentionInputs& in, RingOptions&) { in.kv_positions.assign(8, 0); });
               },
               {"kv_positions"}});
  c.push_back({"RingAttentionForward_ranks_disagree_on_kv_length",
               [] { RunPerRank([](int) { return 8; }, [](int r) { return r == 0 ? 8 : 16; }); },
               {"rank"}});
  c.push_back({"RingAttentionForward_ranks_disagree_on_q_length",
               [] { RunPerRank([](int r) { return r == 0 ? 8 : 16; }, [](int) { return 8; }); },
               {"rank"}});
  return c;
}

void PrintTo(const BadCall& c, std::ostream* os) { *os << c.name; }

class BadCallTest : public ::testing::TestWithParam<BadCall> {};

TEST_P(BadCallTest, ThrowsErrorNamingTheArgument) {
  const BadCall& c = GetParam();
  try {
    c.call();
    ADD_FAILURE() << c.name << ": no Error thrown";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& want : c.expected) {
      EXPECT_NE(msg.find(want), std::string::npos)
          << c.name << ": message does not contain \"" << want << "\": " << msg;
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << c.name << ": threw a non-ringsplash exception: " << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Validation, BadCallTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<BadCall>& info) {
                           std::string name = info.param.name;
                           for (char& ch : name) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return name + "_" + std::to_string(info.index);
                         });

}  // namespace
}  // namespace ringsplash::testing
