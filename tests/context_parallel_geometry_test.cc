// The pieces of 2-D context parallelism below the numbers
// (src/ring/ulysses_internal.h) and its contract around them: which ranks
// form a group, that a group's rows are exactly one rank's rows of the same
// layout over N/U ranks, the head split and its GQA rule, masks restricted
// to a head range, row copies; and at the API: the per-call overloads, the
// errors every rank throws alike (and that leave the communicator usable),
// and fault injection. The numeric equality with the single device is
// context_parallel_test.cc's.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "ringsplash/comm.h"
#include "ringsplash/context_parallel.h"
#include "ringsplash/error.h"
#include "ringsplash/mask.h"
#include "ringsplash/ring.h"
#include "src/ring/ulysses_internal.h"
#include "tests/support/test_util.h"

namespace ringsplash {
namespace {

using ulysses_internal::GroupRows;
using ulysses_internal::HeadSplit;
using ulysses_internal::MaskForHeads;
using ulysses_internal::RankOf;
using ulysses_internal::SplitHeads;

constexpr Layout kLayouts[] = {Layout::kContiguous, Layout::kZigzag, Layout::kStriped};

// Expects `fn` to throw an Error whose message contains every one of `parts`.
template <typename Fn>
void ExpectErrorWith(const Fn& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an Error";
  } catch (const Error& e) {
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "'" << part << "' not in: " << e.what();
    }
  }
}

// ---- Geometry ------------------------------------------------------------------

TEST(ContextParallelGeometryTest, GroupsFollowTheLayout) {
  // contiguous and zigzag: consecutive ranks; striped: ranks g + j N/U.
  for (Layout layout : {Layout::kContiguous, Layout::kZigzag}) {
    const ContextParallelCoordinates at = ContextParallelPlace(layout, 5, 8, 2);
    EXPECT_EQ(at.group, 2);
    EXPECT_EQ(at.member, 1);
  }
  const ContextParallelCoordinates at = ContextParallelPlace(Layout::kStriped, 5, 8, 2);
  EXPECT_EQ(at.group, 1);   // 5 mod 4
  EXPECT_EQ(at.member, 1);  // 5 / 4
  for (Layout layout : kLayouts) {
    for (int n : {1, 2, 4, 6, 8}) {
      for (int u = 1; u <= n; ++u) {
        if (n % u != 0) continue;
        std::set<std::pair<int, int>> seen;
        for (int r = 0; r < n; ++r) {
          const ContextParallelCoordinates c = ContextParallelPlace(layout, r, n, u);
          ASSERT_GE(c.group, 0);
          ASSERT_LT(c.group, n / u);
          ASSERT_GE(c.member, 0);
          ASSERT_LT(c.member, u);
          EXPECT_EQ(RankOf(layout, c.group, c.member, n, u), r);
          seen.insert({c.group, c.member});
        }
        EXPECT_EQ(seen.size(), static_cast<size_t>(n));
      }
    }
  }
  ExpectErrorWith([] { ContextParallelPlace(Layout::kZigzag, 0, 6, 4); },
                  {"ulysses", "N = 6", "U = 4"});
  ExpectErrorWith([] { ContextParallelPlace(Layout::kZigzag, 0, 6, 0); }, {"U = 0"});
}

// The composition the design rests on: for every layout, grid and length,
// the U members' rows of a group are exactly (as a set) rank g's rows of the
// same layout over N/U ranks, and GroupRows maps them one to one.
TEST(ContextParallelGeometryTest, GroupRowsAreTheRingLayoutsRows) {
  for (Layout layout : kLayouts) {
    for (int n : {2, 4, 6, 8}) {
      for (int u = 1; u <= n; ++u) {
        if (n % u != 0) continue;
        const int p = n / u;
        for (int64_t s : {int64_t{2} * n * 3, int64_t{2} * n * 8}) {
          SCOPED_TRACE(std::string(LayoutName(layout)) + " N=" + std::to_string(n) +
                       " U=" + std::to_string(u) + " S=" + std::to_string(s));
          for (int g = 0; g < p; ++g) {
            const std::vector<std::vector<int64_t>> rows = GroupRows(layout, s, g, n, u, "S");
            const std::vector<int64_t> ring = LayoutPositions(layout, s, g, p);
            ASSERT_EQ(rows.size(), static_cast<size_t>(u));
            std::vector<int64_t> hit(ring.size(), 0);
            for (int m = 0; m < u; ++m) {
              const std::vector<int64_t> mine =
                  LayoutPositions(layout, s, RankOf(layout, g, m, n, u), n);
              ASSERT_EQ(rows[m].size(), mine.size());
              for (size_t l = 0; l < mine.size(); ++l) {
                const int64_t i = rows[m][l];
                ASSERT_GE(i, 0);
                ASSERT_LT(i, static_cast<int64_t>(ring.size()));
                EXPECT_EQ(ring[static_cast<size_t>(i)], mine[l]);
                ++hit[static_cast<size_t>(i)];
              }
            }
            for (int64_t h : hit) EXPECT_EQ(h, 1);
          }
        }
      }
    }
  }
  // Zigzag needs 2N chunks.
  ExpectErrorWith([] { GroupRows(Layout::kZigzag, 12, 0, 4, 2, "global q sequence length"); },
                  {"global q sequence length 12", "2N = 8"});
}

// Where the rows go, spelled out for N = 4, U = 2, S = 16 (4 rows a rank).
TEST(ContextParallelGeometryTest, RowOrderExamples) {
  // contiguous: group 1 = ranks 2, 3 = positions 8..15, concatenated.
  EXPECT_EQ(GroupRows(Layout::kContiguous, 16, 1, 4, 2, "S"),
            (std::vector<std::vector<int64_t>>{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  // zigzag (chunks of 2 over 4 ranks): group 0 = ranks 0 {0,1,14,15} and
  // 1 {2,3,12,13} = rank 0 over 2 ranks {0..3, 12..15}: member 0's second
  // chunk comes last.
  EXPECT_EQ(GroupRows(Layout::kZigzag, 16, 0, 4, 2, "S"),
            (std::vector<std::vector<int64_t>>{{0, 1, 6, 7}, {2, 3, 4, 5}}));
  // striped: group 1 = ranks 1 {1,5,9,13} and 3 {3,7,11,15} = odd
  // positions, interleaved.
  EXPECT_EQ(GroupRows(Layout::kStriped, 16, 1, 4, 2, "S"),
            (std::vector<std::vector<int64_t>>{{0, 2, 4, 6}, {1, 3, 5, 7}}));
}

// ---- Heads ---------------------------------------------------------------------

TEST(ContextParallelGeometryTest, HeadSplitAndTheGqaRule) {
  // kv heads split: member m reads kv heads [m Hkv/U, (m+1) Hkv/U).
  HeadSplit s = SplitHeads(8, 4, 2);
  EXPECT_EQ(s.local_heads, 4);
  EXPECT_EQ(s.local_kv, 2);
  EXPECT_EQ(s.kv_replicas, 1);
  EXPECT_EQ(s.FirstKvHead(1), 2);
  // Hkv < U: one kv head each, U / Hkv replicas; every query head of a
  // member reads that head (h / (H / Hkv) == FirstKvHead).
  for (int64_t hkv : {1, 2, 4}) {
    s = SplitHeads(8, hkv, 8);
    EXPECT_EQ(s.local_heads, 1);
    EXPECT_EQ(s.local_kv, 1);
    EXPECT_EQ(s.kv_replicas, 8 / hkv);
    for (int m = 0; m < 8; ++m) EXPECT_EQ(s.FirstKvHead(m), m / (8 / hkv)) << "Hkv " << hkv;
  }
  s = SplitHeads(12, 2, 4);  // 3 query heads a member, one kv head per 2 members
  for (int m = 0; m < 4; ++m) {
    for (int64_t h = s.FirstHead(m); h < s.FirstHead(m) + s.local_heads; ++h) {
      EXPECT_EQ(h / (12 / 2), s.FirstKvHead(m));
    }
  }
  ExpectErrorWith([] { SplitHeads(6, 6, 4); }, {"U = 4", "H = 6"});
  ExpectErrorWith([] { SplitHeads(12, 6, 4); }, {"U = 4", "Hkv = 6", "H = 12"});
}

// A restricted mask's head i is the original's head first + i, for every
// head-dependent kind and composition; a head-independent mask is shared.
TEST(ContextParallelGeometryTest, MasksRestrictedToHeads) {
  constexpr int64_t kH = 4, kS = 24;
  testing::Rng rng(3);
  std::vector<uint8_t> per_head(kH * kS * kS), shared(kS * kS);
  for (uint8_t& b : per_head) b = rng() % 2;
  for (uint8_t& b : shared) b = rng() % 3 != 0;
  std::vector<Mask> windows;
  for (int64_t h = 0; h < kH; ++h) windows.push_back(Mask::Local(h, 2 * h + 1));
  std::vector<Mask> nested = {Mask::Causal(), Mask::Dense(per_head, kH, kS, kS), Mask::Full(),
                              Mask::ChunkedCausal(5)};
  const Mask masks[] = {
      Mask::Dense(per_head, kH, kS, kS),
      Mask::PerHead(windows),
      // PerHead children that depend on the head themselves.
      Mask::PerHead(nested),
      (Mask::PerHead(windows) & Mask::Dense(shared, 0, kS, kS)) | Mask::Causal(-7),
      Mask::Dense(per_head, kH, kS, kS) & Mask::Local(std::nullopt, 3, 1),
  };
  for (const Mask& mask : masks) {
    for (int64_t first = 0; first < kH; ++first) {
      for (int64_t count = 1; first + count <= kH; count *= 2) {
        const Mask part = MaskForHeads(mask, first, count);
        ASSERT_EQ(part.num_heads(), count) << mask.ToString();
        for (int64_t i = 0; i < count; ++i) {
          for (int64_t q = 0; q < kS; ++q) {
            for (int64_t kv = 0; kv < kS; ++kv) {
              ASSERT_EQ(part.Allowed(i, q, kv), mask.Allowed(first + i, q, kv))
                  << mask.ToString() << " heads [" << first << ", " << first + count << ") head "
                  << i << " at (" << q << ", " << kv << ")";
            }
          }
        }
      }
    }
  }
  const Mask causal = Mask::Causal(3) & Mask::Local(4, std::nullopt);
  EXPECT_EQ(&MaskForHeads(causal, 1, 2).node(), &causal.node());
}

TEST(ContextParallelGeometryTest, MoveRowsGathersAndScattersAlongAnyDim) {
  // [2, 5, 3] i32 (bit copies: ids too), rows along dim 1.
  Tensor src(DType::kI32, {2, 5, 3});
  std::iota(src.data_as<int32_t>(), src.data_as<int32_t>() + src.numel(), 100);
  Tensor dst(DType::kI32, {2, 3, 3});
  const std::vector<int64_t> pick = {4, 0, 2};
  ulysses_internal::MoveRows(src.view(), dst.view(), 1, pick, {});
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t x = 0; x < 3; ++x) {
        EXPECT_EQ(dst.data_as<int32_t>()[(b * 3 + i) * 3 + x],
                  src.data_as<int32_t>()[(b * 5 + pick[i]) * 3 + x]);
      }
    }
  }
  // Scatter back along the last dim of a transposed (strided) view.
  Tensor back(DType::kI32, {2, 3, 5});
  ulysses_internal::MoveRows(src.view().Transposed(1, 2), back.view(), 2, {}, {});
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t i = 0; i < 5; ++i) {
      for (int64_t x = 0; x < 3; ++x) {
        EXPECT_EQ(back.data_as<int32_t>()[(b * 3 + x) * 5 + i],
                  src.data_as<int32_t>()[(b * 5 + i) * 3 + x]);
      }
    }
  }
}

// ---- The API on thread ranks ----------------------------------------------------

struct Shards {
  Tensor q, k, v, out, lse, dout, dq, dk, dv, dsinks;
  AttentionInputs in;
};

// Rank r's shards (zigzag over n) of one random problem; sinks [H].
Shards MakeShards(const testing::OwnedInputs& g, const Tensor& dout, Layout layout, int r, int n) {
  Shards s;
  auto shard = [&](const Tensor& t) {
    std::vector<int64_t> shape = t.shape();
    shape[1] /= n;
    Tensor local(t.dtype(), shape);
    ShardSequence(layout, r, n, t.view(), local.view());
    return local;
  };
  s.q = shard(g.q);
  s.k = shard(g.k);
  s.v = shard(g.v);
  s.dout = shard(dout);
  s.in.q = s.q.view();
  s.in.k = s.k.view();
  s.in.v = s.v.view();
  s.in.sinks = g.sinks.view();
  const int64_t b = g.q.shape()[0], sq = g.q.shape()[1] / n, h = g.q.shape()[2];
  s.out = Tensor(DType::kF32, {b, sq, h, g.v.shape()[3]});
  s.lse = Tensor(DType::kF32, {b, h, sq});
  s.dq = Tensor(DType::kF32, s.q.shape());
  s.dk = Tensor(DType::kF32, s.k.shape());
  s.dv = Tensor(DType::kF32, s.v.shape());
  s.dsinks = Tensor(DType::kF32, {h});
  return s;
}

// The per-call overloads (groups made inside each call) give what the
// groups-once overloads give, bit for bit, and equal the single device.
TEST(ContextParallelApiTest, PerCallGroupsEqualGroupsMadeOnce) {
  constexpr int kN = 4;
  testing::Rng rng(8);
  testing::ProblemSpec spec(1, 64, 64, 4, 2, 16, 16);
  spec.sinks = true;
  const testing::OwnedInputs g = testing::RandomInputs(rng, spec);
  const Tensor dout = testing::RandomTensor(rng, DType::kF32, {1, 64, 4, 16});
  ContextParallelOptions options;
  options.ulysses = 2;
  options.ring.layout = Layout::kZigzag;
  options.ring.attention.mask = Mask::Causal();
  options.ring.attention.block_sizes = {16, 16};
  options.ring.attention.num_threads = 1;
  std::vector<std::vector<double>> once(kN), per_call(kN);
  RunThreadRanks(kN, CommOptions{}, [&](Communicator& comm) {
    const int r = comm.rank();
    Shards a = MakeShards(g, dout, options.ring.layout, r, kN);
    Shards b = MakeShards(g, dout, options.ring.layout, r, kN);
    ContextParallelGroups groups(comm, 2, Layout::kZigzag);
    ContextParallelForward(groups, a.in, options, a.out.view(), a.lse.view());
    ContextParallelBackward(groups, a.in, options, a.out.view(), a.lse.view(), a.dout.view(),
                            a.dq.view(), a.dk.view(), a.dv.view(), a.dsinks.view());
    ContextParallelForward(comm, b.in, options, b.out.view(), b.lse.view());
    ContextParallelBackward(comm, b.in, options, b.out.view(), b.lse.view(), b.dout.view(),
                            b.dq.view(), b.dk.view(), b.dv.view(), b.dsinks.view());
    for (const Tensor* t : {&a.out, &a.lse, &a.dq, &a.dk, &a.dv, &a.dsinks}) {
      const std::vector<double> v = testing::ToDoubles(t->view());
      once[r].insert(once[r].end(), v.begin(), v.end());
    }
    for (const Tensor* t : {&b.out, &b.lse, &b.dq, &b.dk, &b.dv, &b.dsinks}) {
      const std::vector<double> v = testing::ToDoubles(t->view());
      per_call[r].insert(per_call[r].end(), v.begin(), v.end());
    }
  });
  for (int r = 0; r < kN; ++r) EXPECT_EQ(once[r], per_call[r]) << "rank " << r;
}

// Errors every rank sees alike are thrown on every rank, before anything is
// sent, and the communicator still works afterwards (no Abort).
TEST(ContextParallelApiTest, AgreedErrorsLeaveTheCommunicatorUsable) {
  constexpr int kN = 4;
  testing::Rng rng(9);
  // H = 6: U = 4 does not divide it.
  const testing::OwnedInputs g =
      testing::RandomInputs(rng, testing::ProblemSpec(1, 32, 32, 6, 6, 16, 16));
  const Tensor dout = testing::RandomTensor(rng, DType::kF32, {1, 32, 6, 16});
  std::vector<std::string> errors(kN);
  std::atomic<int> usable{0};
  RunThreadRanks(kN, CommOptions{}, [&](Communicator& comm) {
    const int r = comm.rank();
    Shards s = MakeShards(g, dout, Layout::kContiguous, r, kN);
    s.in.sinks = TensorView{};
    ContextParallelOptions options;
    options.ring.layout = Layout::kContiguous;
    options.ring.attention.num_threads = 1;
    // 1. Ranks disagree on U.
    options.ulysses = r == 3 ? 4 : 2;
    try {
      ContextParallelForward(comm, s.in, options, s.out.view(), s.lse.view());
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    // 2. U = 3 does not divide N = 4.
    options.ulysses = 3;
    try {
      ContextParallelGroups groups(comm, 3, Layout::kContiguous);
      ADD_FAILURE() << "expected an Error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("N = 4"), std::string::npos) << e.what();
    }
    // 3. U = 4 does not divide H = 6 (found after the agreement check).
    options.ulysses = 4;
    try {
      ContextParallelForward(comm, s.in, options, s.out.view(), s.lse.view());
      ADD_FAILURE() << "expected an Error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("H = 6"), std::string::npos) << e.what();
    }
    // Still usable: a collective, then a valid call.
    comm.Barrier();
    options.ulysses = 2;
    ContextParallelForward(comm, s.in, options, s.out.view(), s.lse.view());
    ++usable;
  });
  for (int r = 0; r < kN; ++r) {
    EXPECT_NE(errors[r].find("disagree on U (rank 0 passed 2, rank 3 passed 4)"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  EXPECT_EQ(usable.load(), kN);
}

// Options that do not match the groups, and a thread-run U that breaks the
// GQA rule, are Errors naming what to change.
TEST(ContextParallelApiTest, MismatchesAndTheGqaRuleAreErrors) {
  testing::Rng rng(10);
  const testing::OwnedInputs g =
      testing::RandomInputs(rng, testing::ProblemSpec(1, 32, 32, 12, 6, 16, 16));
  Tensor out(DType::kF32, {1, 32, 12, 16}), lse(DType::kF32, {1, 12, 32});
  ContextParallelRun run;
  run.num_ranks = 4;
  run.options.ulysses = 4;
  run.options.ring.attention.num_threads = 1;
  ExpectErrorWith([&] { ContextParallelThreads(run, g.inputs(), out.view(), lse.view()); },
                  {"U = 4", "Hkv = 6", "H = 12"});
  run.options.ulysses = 3;
  ExpectErrorWith([&] { ContextParallelThreads(run, g.inputs(), out.view(), lse.view()); },
                  {"N = 4", "U = 3"});

  // A layout other than the groups': a local error, so the rank aborts the
  // job; each rank throws either its own message or its peer's ("rank R
  // failed: ...", if the peer's abort reached it first).
  std::vector<std::string> errors(2);
  try {
    RunThreadRanks(2, CommOptions{}, [&](Communicator& comm) {
      try {
        Shards s =
            MakeShards(g, Tensor(DType::kF32, {1, 32, 12, 16}), Layout::kZigzag, comm.rank(), 2);
        s.in.sinks = TensorView{};
        ContextParallelGroups groups(comm, 2, Layout::kZigzag);
        ContextParallelOptions options;
        options.ulysses = 2;
        options.ring.layout = Layout::kStriped;
        ContextParallelForward(groups, s.in, options, s.out.view(), s.lse.view());
      } catch (const Error& e) {
        errors[comm.rank()] = e.what();
        throw;
      }
    });
  } catch (const Error&) {
  }
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("layout: options.ring.layout is 'striped' but the ContextParallelGroups were "
                     "made for 'zigzag'"),
              std::string::npos)
        << e;
  }
}

// RINGSPLASH_FAULT / options.ring.fault names a rank of the whole
// communicator and a step of the ring of groups: that rank fails there, and
// so does every rank that still needs it; a rank that no longer does (its
// ring and group done without it) returns its results, as in ring.h.
TEST(ContextParallelApiTest, InjectedFaultFailsTheRanksThatNeedIt) {
  constexpr int kN = 4;
  testing::Rng rng(11);
  const testing::OwnedInputs g =
      testing::RandomInputs(rng, testing::ProblemSpec(1, 32, 32, 4, 4, 16, 16));
  const Tensor dout = testing::RandomTensor(rng, DType::kF32, {1, 32, 4, 16});
  std::vector<std::string> errors(kN);
  try {
    RunThreadRanks(kN, CommOptions{}, [&](Communicator& comm) {
      try {
        Shards s = MakeShards(g, dout, Layout::kZigzag, comm.rank(), kN);
        s.in.sinks = TensorView{};
        ContextParallelOptions options;
        options.ulysses = 2;
        options.ring.layout = Layout::kZigzag;
        options.ring.attention.num_threads = 1;
        options.ring.fault = FaultSpec{3, 1, false};
        ContextParallelForward(comm, s.in, options, s.out.view(), s.lse.view());
      } catch (const Error& e) {
        errors[comm.rank()] = e.what();
        throw;
      }
    });
    ADD_FAILURE() << "expected the job to fail";
  } catch (const Error&) {
  }
  // Rank 3 is member 1 of group 1: rank 1 of its ring (ranks 1 and 3).
  EXPECT_EQ(errors[3].rfind("injected fault at rank 1 step 1", 0), 0u) << errors[3];
  // Rank 2, its group partner, waits for its block of the second all-to-all.
  EXPECT_NE(errors[2].find("rank 3 failed: injected fault"), std::string::npos) << errors[2];
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(errors[r].empty() || errors[r].find("rank 3 failed") != std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  // A step past the ring of N/U = 2 groups is refused.
  ContextParallelRun run;
  run.num_ranks = kN;
  run.options.ulysses = 2;
  run.options.ring.attention.num_threads = 1;
  run.options.ring.fault = FaultSpec{0, 2, false};
  Tensor out(DType::kF32, {1, 32, 4, 16}), lse(DType::kF32, {1, 4, 32});
  ExpectErrorWith([&] { ContextParallelThreads(run, g.inputs(), out.view(), lse.view()); },
                  {"step 2", "2 Ulysses groups"});
}

// Mask::DenseRows: each rank holds the dense rows of its own query positions
// (of the N-rank layout) only; the group gathers them for its ring. Per-head
// rows composed with causal, and head-independent rows OR a window, equal
// the single device on the global Dense masks (tolerance as
// context_parallel_test.cc: the grid reorders f32 merges, ~1e-6 here; a row
// of the wrong position or head moves results by > 1e-2).
TEST(ContextParallelApiTest, DenseRowsAreGatheredOverTheGroup) {
  constexpr int64_t kS = 64, kH = 4, kD = 16;
  testing::Rng rng(13);
  testing::ProblemSpec spec(1, kS, kS, kH, 2, kD, kD);
  spec.sinks = true;
  const testing::OwnedInputs g = testing::RandomInputs(rng, spec);
  const Tensor dout = testing::RandomTensor(rng, DType::kF32, {1, kS, kH, kD});
  std::vector<uint8_t> per_head(kH * kS * kS), shared(kS * kS);
  for (uint8_t& b : per_head) b = rng() % 5 < 3;
  for (uint8_t& b : shared) b = rng() % 4 == 0;
  // The rows of `positions` of a [heads, kS, kS] matrix (heads 0: one).
  auto rows_of = [](const std::vector<uint8_t>& bits, int64_t heads,
                    const std::vector<int64_t>& positions) {
    std::vector<uint8_t> out;
    for (int64_t h = 0; h < std::max<int64_t>(heads, 1); ++h) {
      for (int64_t p : positions) {
        const auto row = bits.begin() + (h * kS + p) * kS;
        out.insert(out.end(), row, row + kS);
      }
    }
    return out;
  };
  AttentionOptions single_opt;
  single_opt.mask = (Mask::Dense(per_head, kH, kS, kS) & Mask::Causal()) |
                    (Mask::Dense(shared, 0, kS, kS) & Mask::Local(9, 0));
  single_opt.block_sizes = {16, 16};
  single_opt.num_threads = 1;
  const testing::ApiResult single = testing::RunAttention(g, single_opt, &dout);
  for (const int u : {2, 4}) {
    for (Layout layout : kLayouts) {
      SCOPED_TRACE(std::string(LayoutName(layout)) + " U=" + std::to_string(u));
      constexpr int kN = 4;
      std::vector<std::vector<double>> got(kN);
      RunThreadRanks(kN, CommOptions{}, [&](Communicator& comm) {
        const int r = comm.rank();
        Shards s = MakeShards(g, dout, layout, r, kN);
        const std::vector<int64_t> mine = LayoutPositions(layout, kS, r, kN);
        ContextParallelOptions options;
        options.ulysses = u;
        options.ring.layout = layout;
        options.ring.attention = single_opt;
        options.ring.attention.mask =
            (Mask::DenseRows(rows_of(per_head, kH, mine), kH, mine, kS) & Mask::Causal()) |
            (Mask::DenseRows(rows_of(shared, 0, mine), 0, mine, kS) & Mask::Local(9, 0));
        ContextParallelGroups groups(comm, u, layout);
        ContextParallelForward(groups, s.in, options, s.out.view(), s.lse.view());
        ContextParallelBackward(groups, s.in, options, s.out.view(), s.lse.view(), s.dout.view(),
                                s.dq.view(), s.dk.view(), s.dv.view(), s.dsinks.view());
        for (const Tensor* t : {&s.out, &s.dq, &s.dk, &s.dv}) {
          std::vector<int64_t> shape = t->shape();
          shape[1] = kS;
          Tensor global(DType::kF32, shape);
          GatherSequence(layout, r, kN, t->view(), global.view(), 1);
          // Rows of other ranks are 0 here: compared per rank below.
          const std::vector<double> v = testing::ToDoubles(global.view());
          got[r].insert(got[r].end(), v.begin(), v.end());
        }
      });
      // Each rank's rows of each tensor, against the single device's.
      const std::vector<const std::vector<double>*> want = {&single.out, &single.dq, &single.dk,
                                                            &single.dv};
      const char* names[] = {"out", "dq", "dk", "dv"};
      for (int r = 0; r < kN; ++r) {
        const std::vector<int64_t> mine = LayoutPositions(layout, kS, r, kN);
        size_t offset = 0;
        for (size_t t = 0; t < want.size(); ++t) {
          const size_t row = want[t]->size() / kS;
          std::vector<double> a, e;
          for (int64_t p : mine) {
            for (size_t x = 0; x < row; ++x) {
              a.push_back(got[r][offset + static_cast<size_t>(p) * row + x]);
              e.push_back((*want[t])[static_cast<size_t>(p) * row + x]);
            }
          }
          const testing::Comparison c = testing::Compare(a, e);
          EXPECT_LE(c.Relative(), 1e-5) << names[t] << " rank " << r << ": " << c.Describe();
          offset += want[t]->size();
        }
      }
    }
  }
}

}  // namespace
}  // namespace ringsplash
