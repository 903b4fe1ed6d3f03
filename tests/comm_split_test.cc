// Groups of ranks on the threads backend (include/ringsplash/comm.h):
// Communicator::Split (membership and order, shifts that stay in their group
// while the parent and sibling groups run theirs, collectives and
// all-to-alls within a group, one failure failing every group, lifetime),
// AllToAll on 1..4 ranks, DefaultThreads from the process's cores, and two
// rings of 2 side by side in one 4-rank job, each equal to its own
// single-device result.
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/error.h"
#include "ringsplash/ring.h"
#include "tests/mpi/mpi_problem.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using Clock = std::chrono::steady_clock;

// A recognisable payload: depends on (origin job rank, stream, index).
int32_t Payload(int origin, int stream, int i) { return origin * 1000003 + stream * 1009 + i; }

CommOptions Options(double timeout_s = 30) {
  CommOptions opt;
  opt.timeout_s = timeout_s;
  opt.link = LinkModel{};  // no delay, whatever RINGSPLASH_LINK says
  return opt;
}

std::string MessageOf(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no Error)";
}

// 4 ranks, color = rank % 2 and keys reversed: group 0 is {2, 0}, group 1
// {3, 1} (rank 0 of each group is the higher job rank); color -1 on rank 3
// alone: {0, 1, 2} and nothing for rank 3.
TEST(SplitTest, GroupsByColorRankedByKeyAndNoGroupIsNull) {
  std::mutex mu;
  std::vector<std::pair<int, int>> seen(4, {-1, -1});  // job rank -> (group rank, group size)
  std::vector<bool> third_null(4, false);
  RunThreadRanks(4, Options(), [&](Communicator& comm) {
    const int r = comm.rank();
    std::unique_ptr<Communicator> sub = comm.Split(r % 2, -r);
    ASSERT_NE(sub, nullptr);
    EXPECT_STREQ(sub->backend(), "threads");
    std::unique_ptr<Communicator> third = comm.Split(r == 3 ? Communicator::kNoGroup : 0, r);
    std::lock_guard<std::mutex> lock(mu);
    seen[r] = {sub->rank(), sub->size()};
    third_null[r] = third == nullptr;
    if (third != nullptr) {
      EXPECT_EQ(third->size(), 3);
      EXPECT_EQ(third->rank(), r);
    }
  });
  EXPECT_EQ(seen[0], std::make_pair(1, 2));
  EXPECT_EQ(seen[2], std::make_pair(0, 2));
  EXPECT_EQ(seen[1], std::make_pair(1, 2));
  EXPECT_EQ(seen[3], std::make_pair(0, 2));
  EXPECT_EQ(third_null, (std::vector<bool>{false, false, false, true}));
}

// Groups of 3 and 2 (and, inside the 3, a split again), each shifting its
// own payloads several hops while the parent ring shifts too, all in flight
// at once: every buffer receives exactly what its group's predecessor sent.
// A message that crossed to another group or to the parent would carry
// another origin.
TEST(SplitTest, ShiftsStayInTheirGroupWhileTheParentShifts) {
  constexpr int kLen = 257, kHops = 3;
  RunThreadRanks(5, Options(), [&](Communicator& comm) {
    const int r = comm.rank();
    std::unique_ptr<Communicator> group = comm.Split(r < 3 ? 0 : 1, r);
    std::unique_ptr<Communicator> pair = group->Split(group->rank() < 2 ? 7 : -1, 0);
    // Job ranks of this rank's group, in group order.
    const std::vector<int> members = r < 3 ? std::vector<int>{0, 1, 2} : std::vector<int>{3, 4};
    std::vector<int32_t> g_cur(kLen), g_nxt(kLen), p_cur(kLen), p_nxt(kLen), s_cur(kLen),
        s_nxt(kLen);
    for (int i = 0; i < kLen; ++i) {
      g_cur[i] = Payload(r, 1, i);
      p_cur[i] = Payload(r, 2, i);
      s_cur[i] = Payload(r, 3, i);
    }
    for (int hop = 1; hop <= kHops; ++hop) {
      const Communicator::Handle hp =
          comm.StartShift(p_cur.data(), p_nxt.data(), kLen * sizeof(int32_t));
      const Communicator::Handle hg =
          group->StartShift(g_cur.data(), g_nxt.data(), kLen * sizeof(int32_t));
      Communicator::Handle hs = -1;
      if (pair) hs = pair->StartShift(s_cur.data(), s_nxt.data(), kLen * sizeof(int32_t));
      group->Wait(hg);
      if (pair) pair->Wait(hs);
      comm.Wait(hp);
      std::swap(g_cur, g_nxt);
      std::swap(p_cur, p_nxt);
      std::swap(s_cur, s_nxt);
      const int n = static_cast<int>(members.size());
      const int g_origin = members[((group->rank() - hop) % n + n) % n];
      const int p_origin = ((r - hop) % 5 + 5) % 5;
      for (int i = 0; i < kLen; ++i) {
        ASSERT_EQ(g_cur[i], Payload(g_origin, 1, i)) << "group, rank " << r << " hop " << hop;
        ASSERT_EQ(p_cur[i], Payload(p_origin, 2, i)) << "parent, rank " << r << " hop " << hop;
      }
      if (pair) {
        const int s_origin = members[(pair->rank() + hop) % 2];  // the other one of the pair
        for (int i = 0; i < kLen; ++i) {
          ASSERT_EQ(s_cur[i], Payload(s_origin, 3, i)) << "pair, rank " << r << " hop " << hop;
        }
      }
    }
  });
}

// All-reduce, barrier and all-to-all within each group sum and exchange only
// the group's values.
TEST(SplitTest, CollectivesRunWithinTheGroup) {
  RunThreadRanks(4, Options(), [&](Communicator& comm) {
    const int r = comm.rank();
    std::unique_ptr<Communicator> group = comm.Split(r % 2, -r);
    float x[2] = {static_cast<float>(r), 1.0f};
    group->AllReduceSum(x, 2);
    EXPECT_EQ(x[0], r % 2 == 0 ? 2.0f : 4.0f) << "rank " << r;  // 0 + 2, 1 + 3
    EXPECT_EQ(x[1], 2.0f);
    group->Barrier();
    // Block q of rank r goes to group rank q: (job rank r, q).
    std::vector<int32_t> send(2 * 3), recv(2 * 3, -1);
    for (int q = 0; q < 2; ++q)
      for (int i = 0; i < 3; ++i) send[q * 3 + i] = Payload(r, q, i);
    group->AllToAll(send.data(), recv.data(), 3 * sizeof(int32_t));
    const int members[2][2] = {{2, 0}, {3, 1}};  // group rank -> job rank (keys reversed)
    for (int q = 0; q < 2; ++q) {
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(recv[q * 3 + i], Payload(members[r % 2][q], group->rank(), i)) << "rank " << r;
      }
    }
    comm.Barrier();
  });
}

class AllToAllTest : public ::testing::TestWithParam<int> {};

// Rank r's block q is (r, q); after the exchange rank r's block q is (q, r).
// Odd sizes, several calls in a row (the same buffers reused), and zero
// bytes.
TEST_P(AllToAllTest, EveryBlockReachesItsRank) {
  const int n = GetParam();
  RunThreadRanks(n, Options(), [&](Communicator& comm) {
    const int r = comm.rank();
    for (int len : {1, 37, 1001}) {
      std::vector<int32_t> send(static_cast<size_t>(n * len)), recv(send.size(), -1);
      for (int q = 0; q < n; ++q)
        for (int i = 0; i < len; ++i) send[q * len + i] = Payload(r, q, i + len);
      comm.AllToAll(send.data(), recv.data(), len * sizeof(int32_t));
      for (int q = 0; q < n; ++q)
        for (int i = 0; i < len; ++i) ASSERT_EQ(recv[q * len + i], Payload(q, r, i + len));
    }
    comm.AllToAll(nullptr, nullptr, 0);
  });
}

INSTANTIATE_TEST_SUITE_P(RingSizes, AllToAllTest, ::testing::Values(1, 2, 3, 4));

TEST(AllToAllTest, BadArgumentsAreErrorsNamingTheCall) {
  EXPECT_NE(MessageOf([&] {
              RunThreadRanks(2, Options(), [&](Communicator& c) {
                std::vector<char> b(64);
                c.AllToAll(b.data(), b.data() + 16, 16);  // 32 bytes each, overlapping
              });
            }).find("AllToAll: send and recv overlap"),
            std::string::npos);
  EXPECT_NE(MessageOf([&] {
              RunThreadRanks(2, Options(), [&](Communicator& c) {
                std::vector<char> b(64);
                c.AllToAll(nullptr, b.data(), 8);
              });
            }).find("AllToAll: send is null but bytes_per_rank = 8"),
            std::string::npos);
  // Ranks that disagree on the block size fail both, naming the call.
  const std::string msg = MessageOf([&] {
    RunThreadRanks(2, Options(), [&](Communicator& c) {
      std::vector<char> s(64), d(64);
      c.AllToAll(s.data(), d.data(), c.rank() == 0 ? 32 : 16);
    });
  });
  EXPECT_NE(msg.find("all-to-all #0 with"), std::string::npos) << msg;
  EXPECT_NE(msg.find("but another rank passed"), std::string::npos) << msg;
}

TEST(AllToAllTest, SilentPeerTimesOutNamingIt) {
  const std::string msg = MessageOf([&] {
    RunThreadRanks(3, Options(0.2), [&](Communicator& c) {
      if (c.rank() == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(600));
        return;
      }
      std::vector<char> s(30), d(30);
      c.AllToAll(s.data(), d.data(), 10);
    });
  });
  EXPECT_NE(msg.find("timed out after 0.2 s waiting for rank(s) 1 in all-to-all #0"),
            std::string::npos)
      << msg;
}

// Rank 3 (group {1, 3}) aborts on its group's communicator while ranks 0
// and 2 wait in a shift of the other group and rank 1 in one of its own:
// everyone fails at once, naming rank 3 — one job, one failure — long
// before the timeout.
TEST(SplitTest, AbortInOneGroupFailsEveryGroup) {
  const Clock::time_point start = Clock::now();
  std::atomic<int> peers_failed{0};
  const std::string msg = MessageOf([&] {
    RunThreadRanks(4, Options(60), [&](Communicator& comm) {
      const int r = comm.rank();
      std::unique_ptr<Communicator> group = comm.Split(r % 2, r);
      std::vector<char> s(1024), d(1024);
      group->Wait(group->StartShift(s.data(), d.data(), s.size()));  // everyone is in
      if (r == 3) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        group->Abort("group failure");
        throw Error("after the abort");
      }
      try {
        group->Wait(group->StartShift(s.data(), d.data(), s.size()));
        // Group {0, 2} completes that shift; its next one waits on a
        // parent barrier rank 3 never joins.
        comm.Barrier();
      } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), "rank 3 failed: group failure") << "rank " << r;
        ++peers_failed;
        throw;
      }
    });
  });
  EXPECT_EQ(msg, "rank 3 failed: group failure");
  EXPECT_EQ(peers_failed.load(), 3);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 30.0);
}

// A rank-detected failure in a group names job ranks and the group.
TEST(SplitTest, TimeoutInAGroupNamesJobRanksAndTheGroup) {
  const std::string msg = MessageOf([&] {
    RunThreadRanks(4, Options(0.2), [&](Communicator& comm) {
      const int r = comm.rank();
      std::unique_ptr<Communicator> group = comm.Split(r % 2, r);
      if (r == 3) {
        std::this_thread::sleep_for(std::chrono::milliseconds(600));  // "hung", group kept
        return;
      }
      if (r == 1) {
        std::vector<char> s(16), d(16);
        group->Wait(group->StartShift(s.data(), d.data(), 16));
      }
    });
  });
  EXPECT_EQ(msg,
            "rank 1 failed: timed out after 0.2 s waiting for rank 3 in shift #0 of "
            "group {1, 3}");
}

// A peer that destroyed its group's communicator is gone: detected at once.
TEST(SplitTest, DestroyedPeerCommunicatorIsDetectedWithoutTimeout) {
  const Clock::time_point start = Clock::now();
  const std::string msg = MessageOf([&] {
    RunThreadRanks(2, Options(60), [&](Communicator& comm) {
      std::unique_ptr<Communicator> group = comm.Split(0, -comm.rank());  // {1, 0}
      if (comm.rank() == 1) {
        group.reset();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        return;
      }
      group->Barrier();
    });
  });
  EXPECT_EQ(msg,
            "rank 0 failed: rank 1 returned or destroyed its communicator without joining "
            "barrier #0 of group {1, 0}");
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 30.0);
}

TEST(SplitTest, RanksCallingDifferentCollectivesFail) {
  const std::string msg = MessageOf([&] {
    RunThreadRanks(2, Options(), [&](Communicator& comm) {
      if (comm.rank() == 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        comm.Split(0, 0);
      } else {
        comm.Barrier();
      }
    });
  });
  EXPECT_NE(msg.find("split #0, but another rank called barrier #0 there"), std::string::npos)
      << msg;
}

// A split may outlive RunThreadRanks: still safe to use (it fails at once:
// its peers are gone) and to destroy.
TEST(SplitTest, ASplitMayOutliveItsJob) {
  std::unique_ptr<Communicator> kept;
  RunThreadRanks(2, Options(60), [&](Communicator& comm) {
    std::unique_ptr<Communicator> group = comm.Split(0, comm.rank());
    group->Barrier();
    if (comm.rank() == 0) kept = std::move(group);
  });
  ASSERT_NE(kept, nullptr);
  EXPECT_EQ(kept->size(), 2);
  const Clock::time_point start = Clock::now();
  EXPECT_THROW(kept->Barrier(), Error);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 30.0);
  kept.reset();
}

// The link model carries over: a split's message waits its latency too.
TEST(SplitTest, TheLinkModelCarriesOver) {
  CommOptions opt = Options();
  opt.link = LinkModel{0.1, 0};
  RunThreadRanks(4, opt, [&](Communicator& comm) {
    std::unique_ptr<Communicator> group = comm.Split(comm.rank() % 2, 0);
    int32_t s = comm.rank(), d = -1;
    group->Barrier();
    const Clock::time_point start = Clock::now();
    group->Wait(group->StartShift(&s, &d, sizeof(s)));
    EXPECT_GE(std::chrono::duration<double>(Clock::now() - start).count(), 0.1 * 0.99);
    EXPECT_EQ(d, (comm.rank() + 2) % 4);
  });
}

int AffinityCount() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 0;
  return CPU_COUNT(&set);
}

// The ranks of a RunThreadRanks share the process's cores, splits included:
// cores / ranks of the job (>= 1). On a 2-core machine 2 ranks get 1 each.
TEST(DefaultThreadsTest, ThreadRanksShareTheProcessCores) {
  const int cores = AffinityCount();
  ASSERT_GT(cores, 0);
  for (int n : {1, 2, 3, 4}) {
    RunThreadRanks(n, Options(), [&](Communicator& comm) {
      EXPECT_EQ(comm.DefaultThreads(), std::max(1, cores / n)) << n << " ranks";
      std::unique_ptr<Communicator> group = comm.Split(comm.rank() % 2, 0);
      EXPECT_EQ(group->DefaultThreads(), std::max(1, cores / n)) << "a group of " << n;
    });
  }
}

// The affinity mask, not the machine, bounds it: on one CPU every rank gets 1.
TEST(DefaultThreadsTest, AMaskOfOneCpuGivesOneThread) {
  cpu_set_t saved;
  CPU_ZERO(&saved);
  ASSERT_EQ(sched_getaffinity(0, sizeof(saved), &saved), 0);
  int first = 0;
  while (!CPU_ISSET(first, &saved)) ++first;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(first, &one);
  ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
  int seen = 0;
  RunThreadRanks(1, Options(), [&](Communicator& comm) { seen = comm.DefaultThreads(); });
  sched_setaffinity(0, sizeof(saved), &saved);
  EXPECT_EQ(seen, 1);
}

// ---- two rings side by side ------------------------------------------------

// Same tolerance and reasoning as tests/ring_test.cc: the ring only reorders
// f32 merges/sums of the same tile products; both paths are within ~1e-6 of
// exact here, while data from the wrong group (another problem) or a wrong
// step moves results by > 1e-2.
constexpr double kTol = 1e-5;

struct Ring {
  mpi_testing::Problem problem;
  Mask mask;
  Layout layout;
};

// Ring g of the 4 ranks: job ranks {g, g + 2}; group 1 ranked in reverse.
// Different data (seed), masks and layouts, so crossed messages cannot pass.
std::vector<Ring> TwoRings() {
  Ring a{{}, Mask::Causal(), Layout::kZigzag};
  a.problem.spec.sq = a.problem.spec.skv = 64;
  a.problem.spec.h = 4;
  a.problem.spec.hkv = 2;
  a.problem.spec.sinks = true;
  a.problem.seed = 11;
  Ring b{{}, Mask::Local(7, 3), Layout::kContiguous};
  b.problem.spec.sq = b.problem.spec.skv = 64;
  b.problem.spec.h = 4;
  b.problem.spec.hkv = 2;
  b.problem.spec.sinks = true;
  b.problem.seed = 12;
  return {a, b};
}

void ExpectClose(const Tensor& actual, const Tensor& expected, double floor,
                 const std::string& what) {
  const testing::Comparison c =
      testing::Compare(testing::ToDoubles(actual.view()), testing::ToDoubles(expected.view()));
  EXPECT_LE(c.Relative(floor), kTol) << what << ": " << c.Describe();
}

TEST(SplitRingTest, TwoRingsOfTwoInOneJobEachEqualSingleDevice) {
  const std::vector<Ring> rings = TwoRings();
  std::vector<mpi_testing::Global> globals;
  for (const Ring& ring : rings) globals.push_back(mpi_testing::MakeGlobal(ring.problem));
  RunThreadRanks(4, Options(120), [&](Communicator& comm) {
    const int g = comm.rank() % 2;
    std::unique_ptr<Communicator> group = comm.Split(g, g == 1 ? -comm.rank() : comm.rank());
    const Ring& ring = rings[g];
    const int n = group->size(), r = group->rank();
    ASSERT_EQ(n, 2);
    RingOptions options;
    options.layout = ring.layout;
    options.attention.mask = ring.mask;
    options.attention.block_sizes = {16, 16};
    options.attention.num_threads = 1;
    mpi_testing::Local l = mpi_testing::MakeLocal(ring.problem, globals[g], ring.layout, r, n);
    RankStats stats;
    mpi_testing::RunRingOnRank(*group, ring.problem, options, l, /*backward=*/true, &stats);
    EXPECT_EQ(stats.forward_steps.size(), 2u);

    const auto& s = ring.problem.spec;
    Tensor out(DType::kF32, {s.b, s.sq, s.h, s.dv}), lse(DType::kF32, {s.b, s.h, s.sq});
    Tensor dq(DType::kF32, {s.b, s.sq, s.h, s.d}), dk(DType::kF32, {s.b, s.skv, s.hkv, s.d}),
        dv(DType::kF32, {s.b, s.skv, s.hkv, s.dv}), dsinks(DType::kF32, {s.h});
    const AttentionInputs in = globals[g].in.inputs();
    AttentionForward(in, options.attention, out.view(), lse.view());
    AttentionBackward(in, options.attention, out.view(), lse.view(), globals[g].dout.view(),
                      dq.view(), dk.view(), dv.view(), dsinks.view());
    const std::string who = "ring " + std::to_string(g) + " rank " + std::to_string(r);
    ExpectClose(l.out, mpi_testing::ShardOf(ring.layout, r, n, out), 1e-30, who + " out");
    ExpectClose(l.lse, mpi_testing::ShardOfLse(ring.layout, r, n, lse), 1.0, who + " lse");
    ExpectClose(l.dq, mpi_testing::ShardOf(ring.layout, r, n, dq), 1e-30, who + " dq");
    ExpectClose(l.dk, mpi_testing::ShardOf(ring.layout, r, n, dk), 1e-30, who + " dk");
    ExpectClose(l.dv, mpi_testing::ShardOf(ring.layout, r, n, dv), 1e-30, who + " dv");
    ExpectClose(l.dsinks, dsinks, 1e-30, who + " dsinks");
  });
}

}  // namespace
}  // namespace ringsplash
