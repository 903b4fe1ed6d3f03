// A dense-mask ring whose ranks never hold the global Sq x Skv array, under
// mpirun (one process per rank, so each process's peak resident memory is
// its rank's): every rank builds Mask::DenseRows of its own rows only, runs
// forward and backward, and its peak stays below HALF the global mask's
// bytes — then, as a control that the measurement can fail, building the
// global Mask::Dense raises it beyond that; and the ring's shard equals the
// single-device result on the global mask.
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/ring.h"
#include "tests/mpi/mpi_problem.h"
#include "tests/support/peak_memory.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using mpi_testing::Global;
using mpi_testing::Local;
using mpi_testing::Problem;

Communicator& Comm() { return mpi_testing::WorldComm(); }

// The mask's value at (i, j), computed from the positions alone, so a rank
// can build its rows without the rest: causal, with a pseudo-random third of
// the allowed pairs removed.
uint8_t MaskAt(int64_t i, int64_t j) {
  return j <= i && (i * 2654435761u + j * 40503u) % 3 != 0 ? 1 : 0;
}

TEST(MpiDenseRowsTest, RanksHoldOnlyTheirRowsAndMatchTheSingleDevice) {
  if (!testing::ResetPeak() || testing::StatusBytes("VmHWM") < 0)
    GTEST_SKIP() << "cannot measure peak memory";
  Communicator& comm = Comm();
  const int n = comm.size(), r = comm.rank();
  constexpr int64_t kSeq = 8192;  // the global mask: 64 MiB
  Problem p;
  p.spec = testing::ProblemSpec(1, kSeq, kSeq, 1, 1, 16, 16);
  const Global g = mpi_testing::MakeGlobal(p);
  const Layout layout = Layout::kZigzag;
  Local l = mpi_testing::MakeLocal(p, g, layout, r, n);
  comm.Barrier();

  testing::ResetPeak();
  const int64_t base = testing::StatusBytes("VmHWM");
  RingOptions options;
  options.layout = layout;
  options.attention.num_threads = 1;
  {
    const std::vector<int64_t> rows = LayoutPositions(layout, kSeq, r, n);
    std::vector<uint8_t> values(rows.size() * kSeq);
    for (size_t a = 0; a < rows.size(); ++a) {
      for (int64_t j = 0; j < kSeq; ++j) values[a * kSeq + j] = MaskAt(rows[a], j);
    }
    options.attention.mask = Mask::DenseRows(std::move(values), 0, rows, kSeq);
  }
  mpi_testing::RunRingOnRank(comm, p, options, l, /*backward=*/true);
  const int64_t peak = testing::StatusBytes("VmHWM") - base;
  const int64_t global_bytes = kSeq * kSeq;
  EXPECT_LT(peak, global_bytes / 2) << "rank " << r << " peak " << peak / (1 << 20) << " MiB";

  // The control: the global mask on this rank, and a single-device run on
  // it to compare the shard with.
  std::vector<uint8_t> all(static_cast<size_t>(global_bytes));
  for (int64_t i = 0; i < kSeq; ++i) {
    for (int64_t j = 0; j < kSeq; ++j) all[i * kSeq + j] = MaskAt(i, j);
  }
  AttentionOptions single;
  single.mask = Mask::Dense(std::move(all), 0, kSeq, kSeq);
  EXPECT_GT(testing::StatusBytes("VmHWM") - base, global_bytes / 2)
      << "the measurement cannot fail";
  Tensor out(DType::kF32, {1, kSeq, 1, 16}), lse(DType::kF32, {1, 1, kSeq});
  Tensor dq(DType::kF32, {1, kSeq, 1, 16}), dk(DType::kF32, {1, kSeq, 1, 16});
  Tensor dv(DType::kF32, {1, kSeq, 1, 16});
  const AttentionInputs in = g.in.inputs();
  AttentionForward(in, single, out.view(), lse.view());
  AttentionBackward(in, single, out.view(), lse.view(), g.dout.view(), dq.view(), dk.view(),
                    dv.view(), TensorView{});
  // As tests/mpi/mpi_ring_test.cc: the ring reorders f32 merges and sums of
  // the same tile products; both are within ~1e-6 of exact, a wrong mask row
  // moves a result by a whole term (>= 1/8192 of its sum here, ~1e-4).
  constexpr double kTol = 1e-5;
  auto expect_close = [&](const Tensor& ring, const Tensor& whole, const char* what) {
    const Tensor shard = mpi_testing::ShardOf(layout, r, n, whole);
    const testing::Comparison c =
        testing::Compare(testing::ToDoubles(ring.view()), testing::ToDoubles(shard.view()));
    EXPECT_LE(c.Relative(1e-2), kTol) << what << " on rank " << r << ": " << c.Describe();
  };
  expect_close(l.out, out, "out");
  expect_close(l.dq, dq, "dq");
  expect_close(l.dk, dk, "dk");
  expect_close(l.dv, dv, "dv");
  const Tensor lse_shard = mpi_testing::ShardOfLse(layout, r, n, lse);
  const testing::Comparison c =
      testing::Compare(testing::ToDoubles(l.lse.view()), testing::ToDoubles(lse_shard.view()));
  EXPECT_LE(c.Relative(1.0), kTol) << "lse on rank " << r << ": " << c.Describe();
}

}  // namespace
}  // namespace ringsplash
