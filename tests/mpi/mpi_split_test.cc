// Groups of ranks on the MPI backend, in an application that owns MPI (it
// initialises MPI itself with MPI_THREAD_MULTIPLE and finalises it at the
// end, with ringsplash still holding communicators' worth of MPI objects):
// MakeMpiCommunicator(MPI_Comm) on the application's own MPI_Comm_split
// (whose messages must never match ringsplash's, even on the same tag),
// DefaultThreads against the machine's ranks computed here independently,
// and the dp x cp grid the groups are for: two rings of 2 in one 4-rank
// job, different data, each equal to its single-device result — on Split
// communicators, on the application's communicators, and two rings at once
// in every process (one per thread, on crossing groups). Run under mpirun
// with 4 ranks (tests that need 4 skip otherwise).
#include <mpi.h>
#include <sched.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/comm_mpi.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "tests/mpi/mpi_problem.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

int WorldRank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int WorldSize() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

CommOptions Options() {
  CommOptions opt;
  opt.timeout_s = 120;
  return opt;
}

int32_t Payload(int origin, int stream, int i) { return origin * 1000003 + stream * 1009 + i; }

// The application's MPI_Comm_split of the world into `color` groups ranked
// by `key`; freed when it goes (ringsplash keeps its own duplicate).
struct AppComm {
  AppComm(int color, int key) { MPI_Comm_split(MPI_COMM_WORLD, color, key, &comm); }
  ~AppComm() {
    if (comm != MPI_COMM_NULL) MPI_Comm_free(&comm);
  }
  MPI_Comm comm = MPI_COMM_NULL;
};

// The application sends on its communicator with ringsplash's own shift tag
// (7301) before ringsplash shifts on a communicator made from it, and
// receives after: with ringsplash's duplicate the two never match (without
// it, ringsplash's receive would take the application's message).
TEST(MpiSplitTest, ApplicationCommunicatorIsDuplicated) {
  const int w = WorldRank();
  AppComm app(w % 2, -w);
  int app_rank = 0, app_size = 0;
  MPI_Comm_rank(app.comm, &app_rank);
  MPI_Comm_size(app.comm, &app_size);
  std::unique_ptr<Communicator> comm = MakeMpiCommunicator(app.comm, Options());
  ASSERT_EQ(comm->rank(), app_rank);
  ASSERT_EQ(comm->size(), app_size);
  EXPECT_STREQ(comm->backend(), "mpi");
  const int next = (app_rank + 1) % app_size, prev = (app_rank + app_size - 1) % app_size;
  std::vector<int32_t> app_out(64, Payload(w, 9, 0)), app_in(64, -1);
  MPI_Request send_rq;
  MPI_Isend(app_out.data(), 64, MPI_INT32_T, next, 7301, app.comm, &send_rq);
  std::vector<int32_t> out(64), in(64, -1);
  for (int i = 0; i < 64; ++i) out[static_cast<size_t>(i)] = Payload(w, 1, i);
  comm->Wait(comm->StartShift(out.data(), in.data(), out.size() * sizeof(int32_t)));
  MPI_Recv(app_in.data(), 64, MPI_INT32_T, prev, 7301, app.comm, MPI_STATUS_IGNORE);
  MPI_Wait(&send_rq, MPI_STATUS_IGNORE);
  int prev_world = 0;
  MPI_Group app_group, world_group;
  MPI_Comm_group(app.comm, &app_group);
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  MPI_Group_translate_ranks(app_group, 1, &prev, world_group, &prev_world);
  MPI_Group_free(&app_group);
  MPI_Group_free(&world_group);
  for (int i = 0; i < 64; ++i) {
    ASSERT_EQ(in[static_cast<size_t>(i)], Payload(prev_world, 1, i));
    ASSERT_EQ(app_in[static_cast<size_t>(i)], Payload(prev_world, 9, 0));
  }
  // The application may free its communicator while ringsplash's runs on.
  MPI_Comm_free(&app.comm);
  comm->Barrier();
  float x = 1;
  comm->AllReduceSum(&x, 1);
  EXPECT_EQ(x, static_cast<float>(app_size));
}

TEST(MpiSplitTest, NullCommunicatorIsAnError) {
  try {
    MakeMpiCommunicator(MPI_COMM_NULL, Options());
    FAIL() << "no Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MPI_COMM_NULL"), std::string::npos) << e.what();
  }
  // The backend is still fine: this was an argument error, not a failure.
  MakeMpiCommunicator(MPI_COMM_WORLD, Options())->Barrier();
}

// Computed here without ringsplash: this process's affinity mask, the
// masks of the ranks on this machine (MPI_COMM_TYPE_SHARED), and how many
// of them overlap this one (this one included). Ranks that share cores
// share them evenly; a rank bound to cores of its own uses them all.
TEST(MpiSplitTest, DefaultThreadsIsThisRanksShareOfTheMachine) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  ASSERT_EQ(sched_getaffinity(0, sizeof(mine), &mine), 0);
  const int cores = CPU_COUNT(&mine);
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, WorldRank(), MPI_INFO_NULL, &local);
  int local_size = 0;
  MPI_Comm_size(local, &local_size);
  std::vector<cpu_set_t> all(static_cast<size_t>(local_size));
  MPI_Allgather(&mine, sizeof(mine), MPI_BYTE, all.data(), sizeof(mine), MPI_BYTE, local);
  MPI_Comm_free(&local);
  int sharing = 0;
  bool all_equal = true;
  for (cpu_set_t& other : all) {
    cpu_set_t both;
    CPU_AND(&both, &mine, &other);
    sharing += CPU_COUNT(&both) > 0;
    all_equal = all_equal && CPU_EQUAL(&mine, &other);
  }
  const int expected = std::max(1, cores / sharing);
  std::unique_ptr<Communicator> world = MakeMpiCommunicator(MPI_COMM_WORLD, Options());
  EXPECT_EQ(world->DefaultThreads(), expected)
      << cores << " cores, " << sharing << " of " << local_size << " local ranks sharing them";
  // The usual case under mpirun without binding: the machine's share.
  if (all_equal) {
    EXPECT_EQ(world->DefaultThreads(), std::max(1, cores / local_size));
  }
  // A group's ranks still share the machine with every rank on it.
  std::unique_ptr<Communicator> group = world->Split(WorldRank() % 2, 0);
  EXPECT_EQ(group->DefaultThreads(), expected);
  if (WorldRank() == 0) {
    std::printf("[ threads ] %d cores, %d local ranks (%d sharing): %d threads per rank\n", cores,
                local_size, sharing, expected);
  }
}

// ---- rings on groups ---------------------------------------------------------

// Same tolerance and reasoning as tests/ring_test.cc: the ring only reorders
// f32 merges/sums of the same tile products; both paths are within ~1e-6 of
// exact here, while data of the other group's problem (crossed messages) or
// a wrong step moves results by > 1e-2.
constexpr double kTol = 1e-5;

struct Ring {
  mpi_testing::Problem problem;
  Mask mask;
  Layout layout;
};

// Different data, masks and layouts for the groups, so a message that
// crossed groups cannot go unnoticed.
Ring RingOf(int g) {
  Ring ring{{},
            g % 2 == 0 ? Mask::Causal() : Mask::Local(7, 3),
            g % 2 == 0 ? Layout::kZigzag : Layout::kContiguous};
  ring.problem.spec.sq = ring.problem.spec.skv = 64;
  ring.problem.spec.h = 4;
  ring.problem.spec.hkv = 2;
  ring.problem.spec.sinks = true;
  ring.problem.seed = 20 + static_cast<uint64_t>(g);
  return ring;
}

void ExpectClose(const Tensor& actual, const Tensor& expected, double floor,
                 const std::string& what) {
  const testing::Comparison c =
      testing::Compare(testing::ToDoubles(actual.view()), testing::ToDoubles(expected.view()));
  EXPECT_LE(c.Relative(floor), kTol) << what << ": " << c.Describe();
}

// Ring `g` on `comm` (forward and backward), checked against the
// single-device result of the same problem on this rank.
void RunAndCheckRing(Communicator& comm, int g, const std::string& what) {
  const Ring ring = RingOf(g);
  const int n = comm.size(), r = comm.rank();
  const mpi_testing::Global global = mpi_testing::MakeGlobal(ring.problem);
  RingOptions options;
  options.layout = ring.layout;
  options.attention.mask = ring.mask;
  options.attention.block_sizes = {16, 16};
  options.attention.num_threads = 1;
  mpi_testing::Local l = mpi_testing::MakeLocal(ring.problem, global, ring.layout, r, n);
  mpi_testing::RunRingOnRank(comm, ring.problem, options, l, /*backward=*/true);

  const auto& s = ring.problem.spec;
  Tensor out(DType::kF32, {s.b, s.sq, s.h, s.dv}), lse(DType::kF32, {s.b, s.h, s.sq});
  Tensor dq(DType::kF32, {s.b, s.sq, s.h, s.d}), dk(DType::kF32, {s.b, s.skv, s.hkv, s.d}),
      dv(DType::kF32, {s.b, s.skv, s.hkv, s.dv}), dsinks(DType::kF32, {s.h});
  const AttentionInputs in = global.in.inputs();
  AttentionForward(in, options.attention, out.view(), lse.view());
  AttentionBackward(in, options.attention, out.view(), lse.view(), global.dout.view(), dq.view(),
                    dk.view(), dv.view(), dsinks.view());
  const std::string who = what + " ring " + std::to_string(g) + ", world rank " +
                          std::to_string(WorldRank()) + " (rank " + std::to_string(r) + ")";
  ExpectClose(l.out, mpi_testing::ShardOf(ring.layout, r, n, out), 1e-30, who + " out");
  ExpectClose(l.lse, mpi_testing::ShardOfLse(ring.layout, r, n, lse), 1.0, who + " lse");
  ExpectClose(l.dq, mpi_testing::ShardOf(ring.layout, r, n, dq), 1e-30, who + " dq");
  ExpectClose(l.dk, mpi_testing::ShardOf(ring.layout, r, n, dk), 1e-30, who + " dk");
  ExpectClose(l.dv, mpi_testing::ShardOf(ring.layout, r, n, dv), 1e-30, who + " dv");
  ExpectClose(l.dsinks, dsinks, 1e-30, who + " dsinks");
}

// Ranks {0, 2} and {3, 1} (keys reversed in group 1): two rings of 2.
TEST(MpiSplitRingTest, TwoRingsOfTwoOnSplitCommunicators) {
  if (WorldSize() != 4) GTEST_SKIP() << "needs 4 ranks";
  const int w = WorldRank();
  std::unique_ptr<Communicator> world = MakeMpiCommunicator(MPI_COMM_WORLD, Options());
  std::unique_ptr<Communicator> group = world->Split(w % 2, w % 2 == 1 ? -w : w);
  ASSERT_EQ(group->size(), 2);
  RunAndCheckRing(*group, w % 2, "Split");
}

// The same grid from the application's own MPI_Comm_split.
TEST(MpiSplitRingTest, TwoRingsOfTwoOnApplicationCommunicators) {
  if (WorldSize() != 4) GTEST_SKIP() << "needs 4 ranks";
  const int w = WorldRank();
  AppComm app(w / 2, w);  // {0, 1} and {2, 3}
  std::unique_ptr<Communicator> group = MakeMpiCommunicator(app.comm, Options());
  ASSERT_EQ(group->size(), 2);
  RunAndCheckRing(*group, w / 2, "MPI_Comm");
}

// A 2 x 2 grid: every process is in a "row" {0, 1}/{2, 3} and a "column"
// {0, 2}/{1, 3}, and runs a row ring and a column ring AT ONCE, on two
// threads — four rings of 2 in flight in the job, two per process.
TEST(MpiSplitRingTest, RingsOnTwoCommunicatorsOfOneProcessRunAtOnce) {
  if (WorldSize() != 4) GTEST_SKIP() << "needs 4 ranks";
  const int w = WorldRank();
  std::unique_ptr<Communicator> world = MakeMpiCommunicator(MPI_COMM_WORLD, Options());
  std::unique_ptr<Communicator> row = world->Split(w / 2, w);
  std::unique_ptr<Communicator> column = world->Split(w % 2, w);
  std::thread other([&] { RunAndCheckRing(*column, 2 + w % 2, "column"); });
  RunAndCheckRing(*row, w / 2, "row");
  other.join();
  world->Barrier();
}

}  // namespace
}  // namespace ringsplash

// The application owns MPI: it initialises it (ringsplash's progress thread
// needs MPI_THREAD_MULTIPLE then) and finalises it after the tests, while
// the runtime still has its own objects, which it lets go as MPI_Finalize
// starts.
int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  if (provided != MPI_THREAD_MULTIPLE) {
    std::fprintf(stderr, "MPI_THREAD_MULTIPLE not available (got %d)\n", provided);
    MPI_Finalize();
    return 1;
  }
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  MPI_Finalize();
  return rc;
}
