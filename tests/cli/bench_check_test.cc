// The sampled check behind `bench --check` and `demo` (tools/bench_check.h),
// tested on its own: the CLI tests read its max_rel_err, so this is what
// makes that number trustworthy.
//
// The "ring results" fed to it are the f64 dense reference's, rounded to f32,
// over inputs regenerated from the bench's seeded streams and split over
// three ranks the way no real layout does (every third row). So:
//   - GatherSamples must return exactly the reference's sampled rows;
//   - CheckSamples must find them close (the single-device kernel against
//     the f64 reference);
//   - one perturbed element in any tensor must show up in that tensor's
//     error and in max_rel_err, and nowhere else.
#include "tools/bench_check.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/comm.h"
#include "ringsplash/mask.h"
#include "ringsplash/tensor.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"
#include "tools/random_fill.h"

namespace ringsplash::testing {
namespace {

constexpr int kRanks = 3;

// B=2, Sq=40 against Skv=48, GQA 4:2, D=16, Dv=8, a composed mask: every
// path of the check (q rows, kv rows, lse's [B, H, S] layout, Dv != D) in
// a problem small enough for the f64 reference.
cli::BenchConfig Config() {
  cli::BenchConfig c;
  c.batch = 2;
  c.q_seq = 40;
  c.seq = 48;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.v_head_dim = 8;
  c.mask = "causal & local:20,";
  c.pass = cli::Pass::kFwdBwd;
  c.check = true;
  c.check_rows = 7;
  c.blocks = {16, 16};
  c.seed = 5;
  return c;
}

// The bench's input `stream` as a C-order f32 tensor [B, rows, heads, dim].
Tensor Generated(const cli::BenchConfig& c, cli::RandomStream stream, int64_t rows, int64_t heads,
                 int64_t dim) {
  Tensor t(DType::kF32, {c.batch, rows, heads, dim});
  cli::FillRandom(t, c.seed, stream, cli::Iota(rows), rows);
  return t;
}

// Rows (dim 1) `rows` of a C-order [B, n, inner] array, as f32.
std::vector<float> Rows(const std::vector<double>& full, int64_t batch, int64_t n, int64_t inner,
                        std::span<const int64_t> rows) {
  std::vector<float> out;
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t r : rows) {
      for (int64_t i = 0; i < inner; ++i) {
        out.push_back(static_cast<float>(full[static_cast<size_t>((b * n + r) * inner + i)]));
      }
    }
  }
  return out;
}

struct Fixture {
  cli::BenchConfig c = Config();
  Mask mask = Mask::Parse(c.mask);
  RefForward fwd;
  RefBackward bwd;

  Fixture() {
    const Tensor q = Generated(c, cli::RandomStream::kQ, c.q_seq, c.heads, c.head_dim);
    const Tensor k = Generated(c, cli::RandomStream::kK, c.seq, c.kv_heads, c.head_dim);
    const Tensor v = Generated(c, cli::RandomStream::kV, c.seq, c.kv_heads, c.v_head_dim);
    const Tensor dout = Generated(c, cli::RandomStream::kDout, c.q_seq, c.heads, c.v_head_dim);
    AttentionInputs in;
    in.q = q.view();
    in.k = k.view();
    in.v = v.view();
    AttentionOptions opt;
    opt.mask = mask;
    const RefProblem p = MakeRefProblem(in, opt);
    fwd = ReferenceForward(p);
    bwd = ReferenceBackward(p, ToDoubles(dout.view()));
  }

  // The reference's results split over kRanks ranks (rank r holds rows r,
  // r + kRanks, ...), gathered by GatherSamples on the threads backend.
  cli::SampledResults Gathered() const {
    std::vector<cli::SampledResults> got(kRanks);
    RunThreadRanks(kRanks, CommOptions{}, [&](Communicator& comm) {
      const int r = comm.rank();
      std::vector<int64_t> q_pos, kv_pos;
      for (int64_t i = r; i < c.q_seq; i += kRanks) q_pos.push_back(i);
      for (int64_t j = r; j < c.seq; j += kRanks) kv_pos.push_back(j);
      const auto nq = static_cast<int64_t>(q_pos.size());
      const auto nkv = static_cast<int64_t>(kv_pos.size());
      const int64_t b = c.batch, h = c.heads, hkv = c.kv_heads, d = c.head_dim, dv = c.v_head_dim;
      // Rows `pos` of a [batch, n, inner] array as a tensor of `shape`.
      auto shard = [&](const std::vector<double>& full, int64_t batch, int64_t n, int64_t inner,
                       const std::vector<int64_t>& pos, std::vector<int64_t> shape) {
        const std::vector<float> rows = Rows(full, batch, n, inner, pos);
        return TensorFromDoubles(std::vector<double>(rows.begin(), rows.end()), DType::kF32,
                                 std::move(shape));
      };
      const Tensor out = shard(fwd.out, b, c.q_seq, h * dv, q_pos, {b, nq, h, dv});
      // lse [B, H, Sq]: rows of a [B * H, Sq, 1] array, sharded along Sq.
      const Tensor lse_rows = shard(fwd.lse, b * h, c.q_seq, 1, q_pos, {b * h, nq, 1});
      const Tensor lse = TensorFromDoubles(ToDoubles(lse_rows.view()), DType::kF32, {b, h, nq});
      const Tensor dq = shard(bwd.dq, b, c.q_seq, h * d, q_pos, {b, nq, h, d});
      const Tensor dk = shard(bwd.dk, b, c.seq, hkv * d, kv_pos, {b, nkv, hkv, d});
      const Tensor dvt = shard(bwd.dv, b, c.seq, hkv * dv, kv_pos, {b, nkv, hkv, dv});
      cli::LocalResults local{.q_pos = q_pos,
                              .kv_pos = kv_pos,
                              .out = &out,
                              .lse = &lse,
                              .dq = &dq,
                              .dk = &dk,
                              .dv = &dvt};
      got[static_cast<size_t>(r)] = cli::GatherSamples(comm, c, local);
    });
    for (int r = 1; r < kRanks; ++r) {
      EXPECT_EQ(got[static_cast<size_t>(r)].out, got[0].out) << "rank " << r;
      EXPECT_EQ(got[static_cast<size_t>(r)].dk, got[0].dk) << "rank " << r;
    }
    return got[0];
  }
};

double ErrorOf(const cli::CheckResult& r, const std::string& name) {
  for (const auto& [n, e] : r.errors) {
    if (n == name) return e;
  }
  ADD_FAILURE() << "no error reported for " << name;
  return NAN;
}

TEST(BenchCheck, GathersExactlyTheSampledRows) {
  const Fixture f;
  const cli::SampledResults s = f.Gathered();
  const cli::BenchConfig& c = f.c;
  ASSERT_EQ(s.q_rows, cli::SampleRows(c.q_seq, c.check_rows));
  ASSERT_EQ(s.kv_rows, cli::SampleRows(c.seq, c.check_rows));
  EXPECT_EQ(s.q_rows.front(), 0);
  EXPECT_EQ(s.q_rows.back(), c.q_seq - 1);
  EXPECT_EQ(s.out, Rows(f.fwd.out, c.batch, c.q_seq, c.heads * c.v_head_dim, s.q_rows));
  EXPECT_EQ(s.lse, Rows(f.fwd.lse, c.batch * c.heads, c.q_seq, 1, s.q_rows));
  EXPECT_EQ(s.dq, Rows(f.bwd.dq, c.batch, c.q_seq, c.heads * c.head_dim, s.q_rows));
  EXPECT_EQ(s.dk, Rows(f.bwd.dk, c.batch, c.seq, c.kv_heads * c.head_dim, s.kv_rows));
  EXPECT_EQ(s.dv, Rows(f.bwd.dv, c.batch, c.seq, c.kv_heads * c.v_head_dim, s.kv_rows));
}

// f32 kernels over <= 48 keys against the f64 reference rounded to f32: a
// few f32 ulps of the largest entry (~1e-6). 1e-4 still fails on any
// misplaced row, head or batch (errors O(1)).
constexpr double kCloseTol = 1e-4;
// The perturbation: 1 % of the tensor's largest magnitude, 100x kCloseTol.
constexpr double kBump = 1e-2;

TEST(BenchCheck, ReferenceResultsPassAndEveryTensorIsCompared) {
  const Fixture f;
  const cli::SampledResults s = f.Gathered();
  const cli::CheckResult ok = cli::CheckSamples(f.c, f.mask, s, /*threads=*/2);
  EXPECT_EQ(ok.q_rows, static_cast<int64_t>(s.q_rows.size()));
  EXPECT_EQ(ok.kv_rows, static_cast<int64_t>(s.kv_rows.size()));
  ASSERT_EQ(ok.errors.size(), 5u);
  EXPECT_LT(ok.max_rel_err, kCloseTol);

  // One element of one tensor moved by kBump x its largest magnitude: that
  // tensor's error is ~kBump (relative to the same largest magnitude), the
  // others' stay where they were.
  using Field = std::vector<float> cli::SampledResults::*;
  const std::pair<const char*, Field> fields[] = {{"out", &cli::SampledResults::out},
                                                  {"lse", &cli::SampledResults::lse},
                                                  {"dq", &cli::SampledResults::dq},
                                                  {"dk", &cli::SampledResults::dk},
                                                  {"dv", &cli::SampledResults::dv}};
  for (const auto& [name, field] : fields) {
    SCOPED_TRACE(name);
    cli::SampledResults bad = s;
    std::vector<float>& t = bad.*field;
    size_t at = 0;
    float largest = 0;
    for (size_t i = 0; i < t.size(); ++i) {
      if (std::isfinite(t[i]) && std::fabs(t[i]) > largest) {
        largest = std::fabs(t[i]);
        at = i;
      }
    }
    ASSERT_GT(largest, 0.0f);
    t[at] += static_cast<float>(kBump) * largest;
    const cli::CheckResult r = cli::CheckSamples(f.c, f.mask, bad, /*threads=*/2);
    EXPECT_NEAR(ErrorOf(r, name), kBump, 2 * kCloseTol);
    // The bumped tensor's error is the largest: max_rel_err is exactly it.
    EXPECT_EQ(r.max_rel_err, ErrorOf(r, name));
    for (const auto& [other, e] : r.errors) {
      if (other != name) {
        EXPECT_DOUBLE_EQ(e, ErrorOf(ok, other)) << other;
      }
    }
  }
}

// A non-finite value where the single device has a finite one is an
// infinite error, not one skipped by max().
TEST(BenchCheck, NonFiniteResultIsAnInfiniteError) {
  const Fixture f;
  cli::SampledResults s = f.Gathered();
  s.dv[3] = NAN;
  const cli::CheckResult r = cli::CheckSamples(f.c, f.mask, s, /*threads=*/1);
  EXPECT_TRUE(std::isinf(ErrorOf(r, "dv")));
  EXPECT_TRUE(std::isinf(r.max_rel_err));
}

}  // namespace
}  // namespace ringsplash::testing
