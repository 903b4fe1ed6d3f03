// 2-D context parallelism over the MPI backend, run under mpirun: the
// Ulysses groups and the rings are MPI sub-communicators (Split), the head
// exchange is MPI all-to-all. Each rank runs ContextParallelForward/Backward
// on its shard; every rank also computes the single-device result over the
// whole (identically seeded) sequence and checks its shard of it, and of
// dsinks. With 4 processes the grids (U, N/U) = (2, 2), (4, 1) and (1, 4) run;
// with 8, (2, 4) — each on the three layouts, with the mask kinds, segment
// ids, sinks, soft cap and GQA (kv heads split and, for Hkv < U, replicated)
// rotating over them (Mask::DenseRows, each rank holding its own rows, too).
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/context_parallel.h"
#include "ringsplash/ring.h"
#include "tests/mpi/mpi_problem.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using mpi_testing::Global;
using mpi_testing::Local;
using mpi_testing::Problem;

// As tests/context_parallel_test.cc: the grid reorders f32 merges and sums
// of the single device's tile products (and moves bits in its all-to-alls);
// both are within ~1e-6 of exact here, bugs move results by > 1e-2.
constexpr double kTol = 1e-5;

Communicator& Comm() { return mpi_testing::WorldComm(); }

void ExpectClose(const Tensor& actual, const Tensor& expected, double floor,
                 const std::string& what) {
  const testing::Comparison c =
      testing::Compare(testing::ToDoubles(actual.view()), testing::ToDoubles(expected.view()));
  EXPECT_LE(c.Relative(floor), kTol)
      << what << " on rank " << Comm().rank() << ": " << c.Describe();
}

// The masks rotated over the cases, for global lengths and H heads. Case 5
// is a per-head dense mask & causal: with `rows`, as Mask::DenseRows of
// those query positions only (a rank's own: the group gathers them);
// without, the global Dense mask (the single device's).
Mask MaskOf(int which, int64_t sq, int64_t skv, int64_t h, const std::vector<int64_t>* rows) {
  switch (which % 6) {
    case 0:
      return Mask::Causal();
    case 1:
      return Mask::Local(7, 3);
    case 2:
      return Mask::ChunkedCausal(20);
    case 3: {
      std::vector<uint8_t> bits(static_cast<size_t>(h * sq * skv));
      testing::Rng rng(static_cast<uint64_t>(sq * 131 + skv));
      for (uint8_t& b : bits) b = (rng() % 5) < 2;
      return Mask::Dense(std::move(bits), h, sq, skv);
    }
    case 5: {
      std::vector<uint8_t> bits(static_cast<size_t>(h * sq * skv));
      testing::Rng rng(static_cast<uint64_t>(sq * 7 + skv));
      for (uint8_t& b : bits) b = (rng() % 3) != 0;
      if (rows == nullptr) return Mask::Dense(std::move(bits), h, sq, skv) & Mask::Causal();
      std::vector<uint8_t> mine;
      for (int64_t hh = 0; hh < h; ++hh) {
        for (int64_t p : *rows) {
          const auto row = bits.begin() + (hh * sq + p) * skv;
          mine.insert(mine.end(), row, row + skv);
        }
      }
      return Mask::DenseRows(std::move(mine), h, *rows, skv) & Mask::Causal();
    }
    default: {
      std::vector<Mask> per;
      for (int64_t i = 0; i < h; ++i) per.push_back(Mask::Local(3 + 2 * i, 1));
      return (Mask::PerHead(std::move(per)) & Mask::Causal()) | Mask::ChunkedCausal(24);
    }
  }
}

struct Case {
  int u = 1;
  Layout layout = Layout::kZigzag;
  int mask = 0;
  Problem problem;
  float softcap = 0;
  std::string Describe() const {
    const auto& s = problem.spec;
    return "U=" + std::to_string(u) + " layout=" + LayoutName(layout) +
           " mask=" + std::to_string(mask) + " H=" + std::to_string(s.h) +
           " Hkv=" + std::to_string(s.hkv) + " Sq=" + std::to_string(s.sq) +
           " Skv=" + std::to_string(s.skv) + " sinks=" + std::to_string(s.sinks) +
           " segments=" + std::to_string(problem.segments) + " softcap=" + std::to_string(softcap);
  }
};

// The grids this process count runs: (2,2), (4,1), (1,4) on 4; (2,4) on 8.
std::vector<int> UlyssesSizes(int n) {
  if (n == 4) return {2, 4, 1};
  if (n == 8) return {2};
  return {};
}

std::vector<Case> Cases(int n) {
  const int64_t heads[][2] = {{4, 2}, {4, 1}, {4, 4}};  // GQA, MQA, MHA
  std::vector<Case> cases;
  int i = 0;
  for (int u : UlyssesSizes(n)) {
    for (Layout layout : {Layout::kContiguous, Layout::kZigzag, Layout::kStriped}) {
      Case c;
      c.u = u;
      c.layout = layout;
      c.mask = i;
      auto& s = c.problem.spec;
      s.sq = 16 * n;
      s.skv = (i % 2 == 0) ? 16 * n : 32 * n;
      s.h = heads[i % 3][0];
      s.hkv = heads[i % 3][1];
      s.sinks = i % 2 == 0;
      c.problem.segments = i % 3 != 1;
      c.problem.seed = 40 + static_cast<uint64_t>(i);
      c.softcap = i % 4 == 3 ? 4.0f : 0.0f;
      cases.push_back(c);
      ++i;
    }
  }
  return cases;
}

TEST(MpiContextParallelTest, ShardsEqualSingleDevice) {
  Communicator& comm = Comm();
  const int n = comm.size(), r = comm.rank();
  const std::vector<Case> cases = Cases(n);
  if (cases.empty()) GTEST_SKIP() << "runs with 4 or 8 processes, not " << n;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.Describe());
    const auto& s = c.problem.spec;
    const Global g = mpi_testing::MakeGlobal(c.problem);
    ContextParallelOptions options;
    options.ulysses = c.u;
    options.ring.layout = c.layout;
    const std::vector<int64_t> rows = LayoutPositions(c.layout, s.sq, r, n);
    options.ring.attention.mask = MaskOf(c.mask, s.sq, s.skv, s.h, &rows);
    if (c.softcap > 0) options.ring.attention.softcap = c.softcap;
    options.ring.attention.block_sizes = {16, 16};
    options.ring.attention.num_threads = 1;
    Local l = mpi_testing::MakeLocal(c.problem, g, c.layout, r, n);

    // The groups once for both passes (two MPI splits).
    ContextParallelGroups groups(comm, c.u, c.layout);
    ContextParallelStats stats;
    ContextParallelForward(groups, l.inputs, options, l.out.view(), l.lse.view(), &stats);
    ContextParallelBackward(groups, l.inputs, options, l.out.view(), l.lse.view(), l.dout.view(),
                            l.dq.view(), l.dk.view(), l.dv.view(),
                            s.sinks ? l.dsinks.view() : TensorView{}, &stats);
    EXPECT_EQ(stats.ring.forward_steps.size(), static_cast<size_t>(n / c.u));
    EXPECT_EQ(stats.ring.backward_steps.size(), static_cast<size_t>(n / c.u));

    Tensor out(DType::kF32, {s.b, s.sq, s.h, s.dv}), lse(DType::kF32, {s.b, s.h, s.sq});
    Tensor dq(DType::kF32, {s.b, s.sq, s.h, s.d}), dk(DType::kF32, {s.b, s.skv, s.hkv, s.d}),
        dv(DType::kF32, {s.b, s.skv, s.hkv, s.dv}), dsinks(DType::kF32, {s.h});
    const AttentionInputs in = g.in.inputs();
    AttentionOptions single = options.ring.attention;
    single.mask = MaskOf(c.mask, s.sq, s.skv, s.h, nullptr);
    AttentionForward(in, single, out.view(), lse.view());
    AttentionBackward(in, single, out.view(), lse.view(), g.dout.view(), dq.view(), dk.view(),
                      dv.view(), s.sinks ? dsinks.view() : TensorView{});
    ExpectClose(l.out, mpi_testing::ShardOf(c.layout, r, n, out), 1e-30, "out");
    ExpectClose(l.lse, mpi_testing::ShardOfLse(c.layout, r, n, lse), 1.0, "lse");
    ExpectClose(l.dq, mpi_testing::ShardOf(c.layout, r, n, dq), 1e-30, "dq");
    ExpectClose(l.dk, mpi_testing::ShardOf(c.layout, r, n, dk), 1e-30, "dk");
    ExpectClose(l.dv, mpi_testing::ShardOf(c.layout, r, n, dv), 1e-30, "dv");
    if (s.sinks) {
      // dsinks sums B x Sq signed terms that may cancel: measured against
      // the sum of their magnitudes (as ring_test.cc), from the reference.
      const testing::RefResult ref = testing::RunReference(g.in, single, &g.dout);
      ExpectClose(l.dsinks, dsinks, testing::MaxAbs(ref.bwd.dsinks_terms), "dsinks");
    }
  }
}

}  // namespace
}  // namespace ringsplash
