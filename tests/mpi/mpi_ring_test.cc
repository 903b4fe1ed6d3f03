// Ring attention over the MPI backend, run under mpirun: each rank computes
// its shard with RingAttentionForward/Backward; every rank also computes the
// single-device result over the whole (identically seeded) sequence and
// checks its shard of it. One configuration is also checked against the f64
// reference, and so is a ring at the default tiles with two kernel threads
// per rank. And the ring hides its communication: with an emulated link as
// slow as half a step, the exposed wait stays far below the link time — and
// with RINGSPLASH_MPI_PROGRESS=wait (CTest's *_progress_in_wait run) the
// same check is asserted to FAIL, proving it can.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/ring.h"
#include "tests/mpi/mpi_problem.h"
#include "tests/mpi/ring_overlap.h"
#include "tests/support/accuracy.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using mpi_testing::Global;
using mpi_testing::Local;
using mpi_testing::Problem;

// Same tolerance and reasoning as tests/ring_test.cc: the ring only reorders
// f32 merges/sums of identical tile products; both paths are within ~1e-6 of
// exact here, bugs move results by > 1e-2.
constexpr double kTol = 1e-5;

Communicator& Comm() { return mpi_testing::WorldComm(); }

void ExpectClose(const Tensor& actual, const Tensor& expected, double floor, const char* what) {
  const testing::Comparison c =
      testing::Compare(testing::ToDoubles(actual.view()), testing::ToDoubles(expected.view()));
  EXPECT_LE(c.Relative(floor), kTol)
      << what << " on rank " << Comm().rank() << ": " << c.Describe();
}

struct Config {
  std::string name;
  Problem problem;
  Mask mask;
  Layout layout;
  float softcap = 0;
};

std::vector<Config> Configs() {
  std::vector<Config> out;
  {
    Config c{"causal_zigzag_gqa_sinks", {}, Mask::Causal(), Layout::kZigzag};
    c.problem.spec.sq = c.problem.spec.skv = 96;
    c.problem.spec.h = 4;
    c.problem.spec.hkv = 2;
    c.problem.spec.sinks = true;
    out.push_back(c);
  }
  {
    Config c{"window_striped_segments_softcap", {}, Mask::Local(7, 3), Layout::kStriped, 4.0f};
    c.problem.spec.sq = c.problem.spec.skv = 72;
    c.problem.segments = true;
    c.problem.seed = 2;
    out.push_back(c);
  }
  {
    Config c{"chunked_contiguous_mqa_sq_ne_skv", {}, Mask::ChunkedCausal(20), Layout::kContiguous};
    c.problem.spec.sq = 48;
    c.problem.spec.skv = 96;
    c.problem.spec.h = 4;
    c.problem.spec.hkv = 1;
    c.problem.spec.dv = 32;
    c.problem.spec.sinks = true;
    c.problem.seed = 3;
    out.push_back(c);
  }
  {
    Config c{"causal_or_band_zigzag_batch2",
             {},
             Mask::ChunkedCausal(24) | Mask::Local(3, 3),
             Layout::kZigzag};
    c.problem.spec.b = 2;
    c.problem.spec.sq = c.problem.spec.skv = 48;
    c.problem.segments = true;
    c.problem.seed = 4;
    out.push_back(c);
  }
  return out;
}

class MpiRingTest : public ::testing::TestWithParam<Config> {};

TEST_P(MpiRingTest, ShardEqualsSingleDevice) {
  const Config& c = GetParam();
  Communicator& comm = Comm();
  const int n = comm.size(), r = comm.rank();
  const Global g = mpi_testing::MakeGlobal(c.problem);
  RingOptions options;
  options.layout = c.layout;
  options.attention.mask = c.mask;
  if (c.softcap > 0) options.attention.softcap = c.softcap;
  options.attention.block_sizes = {16, 16};
  options.attention.num_threads = 1;
  Local l = mpi_testing::MakeLocal(c.problem, g, c.layout, r, n);
  RankStats stats;
  mpi_testing::RunRingOnRank(comm, c.problem, options, l, /*backward=*/true, &stats);
  EXPECT_EQ(stats.forward_steps.size(), static_cast<size_t>(n));
  EXPECT_EQ(stats.backward_steps.size(), static_cast<size_t>(n));

  // Single device over the whole sequence, on every rank.
  const auto& s = c.problem.spec;
  Tensor out(DType::kF32, {s.b, s.sq, s.h, s.dv}), lse(DType::kF32, {s.b, s.h, s.sq});
  Tensor dq(DType::kF32, {s.b, s.sq, s.h, s.d}), dk(DType::kF32, {s.b, s.skv, s.hkv, s.d}),
      dv(DType::kF32, {s.b, s.skv, s.hkv, s.dv}), dsinks(DType::kF32, {s.h});
  AttentionOptions single = options.attention;
  const AttentionInputs in = g.in.inputs();
  AttentionForward(in, single, out.view(), lse.view());
  AttentionBackward(in, single, out.view(), lse.view(), g.dout.view(), dq.view(), dk.view(),
                    dv.view(), s.sinks ? dsinks.view() : TensorView{});

  ExpectClose(l.out, mpi_testing::ShardOf(c.layout, r, n, out), 1e-30, "out");
  ExpectClose(l.lse, mpi_testing::ShardOfLse(c.layout, r, n, lse), 1.0, "lse");
  ExpectClose(l.dq, mpi_testing::ShardOf(c.layout, r, n, dq), 1e-30, "dq");
  ExpectClose(l.dk, mpi_testing::ShardOf(c.layout, r, n, dk), 1e-30, "dk");
  ExpectClose(l.dv, mpi_testing::ShardOf(c.layout, r, n, dv), 1e-30, "dv");
  if (s.sinks) ExpectClose(l.dsinks, dsinks, 1e-30, "dsinks");

  if (c.name == "causal_zigzag_gqa_sinks") {
    // And against the f64 reference.
    const testing::RefResult ref = testing::RunReference(g.in, single, &g.dout);
    auto ref_tensor = [](const std::vector<double>& v, std::vector<int64_t> shape) {
      return testing::TensorFromDoubles(v, DType::kF32, std::move(shape));
    };
    ExpectClose(
        l.out,
        mpi_testing::ShardOf(c.layout, r, n, ref_tensor(ref.fwd.out, {s.b, s.sq, s.h, s.dv})),
        1e-30, "out vs f64");
    ExpectClose(
        l.dk,
        mpi_testing::ShardOf(c.layout, r, n, ref_tensor(ref.bwd.dk, {s.b, s.skv, s.hkv, s.d})),
        1e-30, "dk vs f64");
    ExpectClose(l.dsinks, ref_tensor(ref.bwd.dsinks, {s.h}), 1e-30, "dsinks vs f64");
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, MpiRingTest, ::testing::ValuesIn(Configs()),
                         [](const ::testing::TestParamInfo<Config>& info) {
                           return info.param.name;
                         });

// The ring's global result on every rank: each rank's shard put in its
// place of a zero tensor, then summed over ranks (adding zeros is exact).
std::vector<double> GatherAll(Communicator& comm, Layout layout, const Tensor& local,
                              std::vector<int64_t> global_shape, int seq_dim) {
  Tensor global(DType::kF32, std::move(global_shape));
  std::fill_n(global.data_as<float>(), global.numel(), 0.0f);
  GatherSequence(layout, comm.rank(), comm.size(), local.view(), global.view(), seq_dim);
  comm.AllReduceSum(global.data_as<float>(), static_cast<size_t>(global.numel()));
  return testing::ToDoubles(global.view());
}

// The default tiles (128 x 128: several per rank, partial ones at the zigzag
// chunk edges) with two kernel threads per rank, forward and backward,
// against the single-device call with the same options and against the f64
// reference.
TEST(MpiRingDefaultTilesTest, TwoThreadsPerRankMatchSingleDeviceAndReference) {
  Communicator& comm = Comm();
  const int n = comm.size(), r = comm.rank();
  Problem p;
  p.spec.sq = p.spec.skv = 512 * n;  // 512 rows per rank: 4 q tiles, zigzag chunks of 256
  p.spec.h = 4;
  p.spec.hkv = 2;
  p.spec.d = p.spec.dv = 64;
  p.spec.sinks = true;
  p.seed = 7;
  const Global g = mpi_testing::MakeGlobal(p);
  RingOptions options;
  options.layout = Layout::kZigzag;
  options.attention.mask = Mask::Causal();
  options.attention.num_threads = 2;
  ASSERT_EQ(options.attention.block_sizes.q, 128);  // the defaults this test is about
  ASSERT_EQ(options.attention.block_sizes.kv, 128);
  Local l = mpi_testing::MakeLocal(p, g, options.layout, r, n);
  mpi_testing::RunRingOnRank(comm, p, options, l, /*backward=*/true);

  const auto& s = p.spec;
  testing::ApiResult ring;
  ring.out = GatherAll(comm, options.layout, l.out, {s.b, s.sq, s.h, s.dv}, 1);
  ring.lse = GatherAll(comm, options.layout, l.lse, {s.b, s.h, s.sq}, 2);
  ring.dq = GatherAll(comm, options.layout, l.dq, {s.b, s.sq, s.h, s.d}, 1);
  ring.dk = GatherAll(comm, options.layout, l.dk, {s.b, s.skv, s.hkv, s.d}, 1);
  ring.dv = GatherAll(comm, options.layout, l.dv, {s.b, s.skv, s.hkv, s.dv}, 1);
  ring.dsinks = testing::ToDoubles(l.dsinks.view());  // global already

  // Single device, the same options: the ring merges the same tile products
  // in another order (kTol, as for the configurations above).
  const testing::ApiResult single = testing::RunAttention(g.in, options.attention, &g.dout);
  const std::pair<const char*, std::pair<const std::vector<double>*, const std::vector<double>*>>
      tensors[] = {{"out", {&ring.out, &single.out}}, {"lse", {&ring.lse, &single.lse}},
                   {"dq", {&ring.dq, &single.dq}},    {"dk", {&ring.dk, &single.dk}},
                   {"dv", {&ring.dv, &single.dv}},    {"dsinks", {&ring.dsinks, &single.dsinks}}};
  for (const auto& [name, pair] : tensors) {
    const testing::Comparison c = testing::Compare(*pair.first, *pair.second);
    EXPECT_LE(c.Relative(name == std::string("lse") ? 1.0 : 1e-30), kTol)
        << name << " vs single device, rank " << r << ": " << c.Describe();
  }

  // The f64 reference, with the suite's error model (testing::ErrorsOf) and
  // f32 bound (accuracy.h: 1e-5). Its (D + Skv) u worst case grows with the
  // 1024..1536 keys here, but rounding is random: the errors seen are
  // <= 3e-7, while a wrong tile, position or merge moves results by >= 1e-3.
  const testing::Errors e =
      testing::ErrorsOf(ring, testing::RunReference(g.in, options.attention, &g.dout));
  for (double err : {e.out, e.lse, e.dq, e.dk, e.dv, e.dsinks}) {
    EXPECT_LE(err, testing::kF32Tolerance) << "rank " << r << ": " << e.Describe();
  }
  if (r == 0) std::printf("[ default tiles ] %d ranks vs f64: %s\n", n, e.Describe().c_str());
}

// With a link whose latency d is half a forward step (ring_overlap.h), the
// ring's exposed wait stays under half the link time that could hide. Under
// RINGSPLASH_MPI_PROGRESS=wait — transfers progressed only inside Wait — the
// check is asserted to fail: each message's modelled time then starts in
// Wait (mpi_comm.cc), so the measurement tells a working progress thread
// from a broken one.
TEST(MpiRingOverlapTest, LinkDelayHidesBehindCompute) {
  namespace ot = overlap_testing;
  const char* mode = std::getenv("RINGSPLASH_MPI_PROGRESS");
  const bool progress_in_wait_only = mode != nullptr && std::string(mode) == "wait";
  CommOptions plain;
  plain.timeout_s = 120;
  plain.link = LinkModel{};  // whatever RINGSPLASH_LINK says
  const std::unique_ptr<Communicator> calibration = MakeMpiCommunicator(plain);
  const int n = calibration->size(), r = calibration->rank();
  if (n < 2) GTEST_SKIP() << "needs 2 ranks";
  const int64_t rows = ot::CalibrateRows(*calibration);
  const double d = ot::CalibrateLatency(*calibration, rows);
  CommOptions linked = plain;
  linked.link = LinkModel{d, 0};
  const std::unique_ptr<Communicator> comm = MakeMpiCommunicator(linked);
  ot::Timing t = ot::RunRing(*comm, rows);
  // One retry (the verdict reads ring-wide values, so every rank decides
  // alike): every rank descheduled for tens of ms in the few steps measured
  // is noise, not a missing overlap (which fails every time). The
  // no-overlap baseline needs none: a modelled delay never ends early.
  if (!ot::Judge(t, d, n).hidden() && !progress_in_wait_only) {
    std::printf("[ overlap ] mpi rank %d, first try: %s\n", r, ot::Describe(t, d, n).c_str());
    t = ot::RunRing(*comm, rows);
  }
  std::printf("[ overlap ] mpi rank %d/%d progress=%s, %lld rows/rank, link latency %.1f ms: %s\n",
              r, n, progress_in_wait_only ? "wait" : "thread", static_cast<long long>(rows),
              d * 1e3, ot::Describe(t, d, n).c_str());
  std::fflush(stdout);
  const ot::Verdict v = ot::Judge(t, d, n);
  if (progress_in_wait_only) {
    EXPECT_FALSE(v.fwd_hidden) << "rank " << r << ": " << ot::Describe(t, d, n);
    EXPECT_FALSE(v.bwd_hidden) << "rank " << r << ": " << ot::Describe(t, d, n);
  } else {
    EXPECT_TRUE(v.fwd_hidden) << "rank " << r << ": " << ot::Describe(t, d, n);
    EXPECT_TRUE(v.bwd_hidden) << "rank " << r << ": " << ot::Describe(t, d, n);
  }
}

}  // namespace
}  // namespace ringsplash
