// Checks of the f64 reference itself, independent of the kernels:
//  - its backward equals central finite differences of its forward, through
//    L = sum(out * dout), for q, k, v and sinks, with soft cap, GQA, masks,
//    segments and positions;
//  - closed-form identities (one key, uniform logits, sinks, empty rows, soft
//    cap saturation, GQA == replicated MHA, positions == mask offsets).
#include "tests/support/reference.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ringsplash/mask.h"

namespace ringsplash::testing {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<double> Uniform(std::mt19937_64& rng, size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

RefProblem RandomProblem(std::mt19937_64& rng, int64_t b, int64_t sq, int64_t skv, int64_t h,
                         int64_t hkv, int64_t d, int64_t dv, double qk = 1.0) {
  RefProblem p;
  p.b = b;
  p.sq = sq;
  p.skv = skv;
  p.h = h;
  p.hkv = hkv;
  p.d = d;
  p.dv = dv;
  p.q = Uniform(rng, b * sq * h * d, -qk, qk);
  p.k = Uniform(rng, b * skv * hkv * d, -qk, qk);
  p.v = Uniform(rng, b * skv * hkv * dv, -1, 1);
  return p;
}

double Loss(const RefProblem& p, const std::vector<double>& dout) {
  const RefForward f = ReferenceForward(p);
  double l = 0;
  for (size_t i = 0; i < dout.size(); ++i) l += f.out[i] * dout[i];
  return l;
}

// Max |analytic - numeric| over every element of `param` (a member of p),
// relative to the max |analytic| (or 1 when the gradient is all zero).
double GradError(RefProblem p, std::vector<double> RefProblem::*param,
                 const std::vector<double>& analytic, const std::vector<double>& dout) {
  // Central differences: truncation error O(eps^2 * L''') ~ 1e-10 and
  // cancellation error ~ 1e-16 * |L| / eps ~ 1e-10 for eps = 1e-5.
  constexpr double kEps = 1e-5;
  double max_err = 0, max_ref = 0;
  std::vector<double>& x = p.*param;
  EXPECT_EQ(x.size(), analytic.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + kEps;
    const double lp = Loss(p, dout);
    x[i] = saved - kEps;
    const double lm = Loss(p, dout);
    x[i] = saved;
    const double numeric = (lp - lm) / (2 * kEps);
    max_err = std::max(max_err, std::fabs(numeric - analytic[i]));
    max_ref = std::max(max_ref, std::fabs(analytic[i]));
  }
  return max_err / std::max(max_ref, 1.0);
}

struct FdCase {
  std::string name;
  Mask mask;
  int64_t h = 2, hkv = 2;
  bool sinks = false;
  bool segments = false;
  double softcap = 0;
  double qk = 1.0;
  std::vector<int64_t> q_pos, kv_pos;
};

// Readable names in failure messages instead of a byte dump.
void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }

class FiniteDifferenceTest : public ::testing::TestWithParam<FdCase> {};

TEST_P(FiniteDifferenceTest, BackwardMatchesCentralDifferences) {
  const FdCase& c = GetParam();
  std::mt19937_64 rng(1234);
  const int64_t sq = 5, skv = 6;
  RefProblem p = RandomProblem(rng, 2, sq, skv, c.h, c.hkv, 3, 2, c.qk);
  p.mask = c.mask;
  p.softcap = c.softcap;
  p.q_pos = c.q_pos;
  p.kv_pos = c.kv_pos;
  if (c.sinks) p.sinks = Uniform(rng, c.h, -1, 1);
  if (c.segments) {
    // Batch 0: q rows 3..4 are in document 9 which has no keys (empty rows).
    p.q_seg = {0, 0, 1, 9, 9, 0, 0, 0, 1, 1};
    p.kv_seg = {0, 0, 0, 1, 1, 1, 0, 1, 1, 1, 1, 1};
  }
  const std::vector<double> dout = Uniform(rng, 2 * sq * c.h * 2, -1, 1);
  const RefBackward g = ReferenceBackward(p, dout);
  // Tolerance: 1e-7 relative is ~1000x the finite-difference error estimate
  // above yet far below any real mistake (a wrong term is O(1) relative).
  EXPECT_LT(GradError(p, &RefProblem::q, g.dq, dout), 1e-7) << "dq";
  EXPECT_LT(GradError(p, &RefProblem::k, g.dk, dout), 1e-7) << "dk";
  EXPECT_LT(GradError(p, &RefProblem::v, g.dv, dout), 1e-7) << "dv";
  if (c.sinks) {
    ASSERT_EQ(g.dsinks.size(), static_cast<size_t>(c.h));
    EXPECT_LT(GradError(p, &RefProblem::sinks, g.dsinks, dout), 1e-7) << "dsinks";
  } else {
    EXPECT_TRUE(g.dsinks.empty());
  }
}

std::vector<FdCase> FdCases() {
  std::vector<FdCase> cases;
  auto add = [&cases](const char* name, Mask mask) -> FdCase& {
    FdCase& c = cases.emplace_back();
    c.name = name;
    c.mask = std::move(mask);
    return c;
  };
  add("full", Mask::Full());
  add("causal", Mask::Causal());
  {
    FdCase& c = add("causal_offset_gqa", Mask::Causal(1));
    c.h = 4;
  }
  {
    FdCase& c = add("mqa_sinks", Mask::Full());
    c.h = 3;
    c.hkv = 1;
    c.sinks = true;
  }
  {
    FdCase& c = add("softcap", Mask::Full());
    c.softcap = 2.0;
    c.qk = 2.0;
  }
  {
    FdCase& c = add("local_or_chunked_softcap_sinks", Mask::Local(1, 0) | Mask::ChunkedCausal(3));
    c.h = 4;
    c.hkv = 1;
    c.sinks = true;
    c.softcap = 1.5;
    c.qk = 2.0;
  }
  {
    FdCase& c = add("segments_sinks", Mask::Causal());
    c.sinks = true;
    c.segments = true;
  }
  add("segments_no_sinks", Mask::Full()).segments = true;
  {
    FdCase& c = add("per_head_positions", Mask::PerHead({Mask::Causal(), Mask::Local(2, 1)}));
    c.q_pos = {10, 11, 12, 13, 14};
    c.kv_pos = {8, 9, 10, 11, 12, 13};
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, FiniteDifferenceTest, ::testing::ValuesIn(FdCases()),
                         [](const auto& info) { return info.param.name; });

// One allowed key per row (causal, row 0): the softmax is 1 on that key.
TEST(ReferenceIdentityTest, SingleKeyGivesItsValue) {
  std::mt19937_64 rng(1);
  RefProblem p = RandomProblem(rng, 1, 3, 3, 1, 1, 4, 3);
  p.mask = Mask::Causal();
  const RefForward f = ReferenceForward(p);
  double dot = 0;
  for (int d = 0; d < 4; ++d) dot += p.q[d] * p.k[d];
  EXPECT_NEAR(f.lse[0], dot / 2.0, 1e-14);  // scale = 1/sqrt(4)
  for (int e = 0; e < 3; ++e) EXPECT_NEAR(f.out[e], p.v[e], 1e-14);
}

// q = 0 makes every logit 0: out is the mean of the allowed values and
// lse = log(count); with a sink s, lse = log(count + e^s) and
// out = sum(v) / (count + e^s).
TEST(ReferenceIdentityTest, UniformLogitsAverageAllowedValues) {
  std::mt19937_64 rng(2);
  for (bool sink : {false, true}) {
    RefProblem p = RandomProblem(rng, 1, 4, 4, 1, 1, 2, 2);
    std::fill(p.q.begin(), p.q.end(), 0.0);
    p.mask = Mask::Causal();
    if (sink) p.sinks = {0.7};
    const RefForward f = ReferenceForward(p);
    for (int i = 0; i < 4; ++i) {
      const double denom = (i + 1) + (sink ? std::exp(0.7) : 0.0);
      EXPECT_NEAR(f.lse[i], std::log(denom), 1e-14);
      for (int e = 0; e < 2; ++e) {
        double sum = 0;
        for (int j = 0; j <= i; ++j) sum += p.v[j * 2 + e];
        EXPECT_NEAR(f.out[i * 2 + e], sum / denom, 1e-14);
      }
    }
  }
}

// Rows with no allowed key: out 0, lse -inf (or the sink), zero gradients.
TEST(ReferenceIdentityTest, EmptyRowsAreZero) {
  std::mt19937_64 rng(3);
  for (bool sink : {false, true}) {
    RefProblem p = RandomProblem(rng, 1, 2, 3, 1, 1, 2, 2);
    p.q_seg = {5, 1};  // row 0's document has no keys
    p.kv_seg = {1, 1, 2};
    if (sink) p.sinks = {-0.3};
    const RefForward f = ReferenceForward(p);
    EXPECT_EQ(f.lse[0], sink ? -0.3 : -kInf);
    EXPECT_EQ(f.out[0], 0.0);
    EXPECT_EQ(f.out[1], 0.0);
    EXPECT_TRUE(std::isfinite(f.lse[1]));
    const std::vector<double> dout = {1, 1, 1, 1};
    const RefBackward g = ReferenceBackward(p, dout);
    EXPECT_EQ(g.dq[0], 0.0);
    EXPECT_EQ(g.dq[1], 0.0);
    EXPECT_EQ(g.dk[4], 0.0);  // key 2 (segment 2) is seen by nobody
    EXPECT_EQ(g.dv[4], 0.0);
    for (double x : g.dq) EXPECT_FALSE(std::isnan(x));
  }
}

// A soft cap bounds logits: with pre-cap logits of ~1e3 and cap 5 the single
// key's lse is 5 * tanh(raw / 5) ~= 5, and the softmax over two saturated keys
// is uniform.
TEST(ReferenceIdentityTest, SoftCapSaturates) {
  RefProblem p;
  p.sq = 1;
  p.skv = 2;
  p.d = 1;
  p.dv = 1;
  p.q = {1000.0};
  p.k = {1.0, 2.0};
  p.v = {3.0, 5.0};
  p.scale = 1.0;
  p.softcap = 5.0;
  const RefForward f = ReferenceForward(p);
  EXPECT_NEAR(f.lse[0], 5.0 + std::log(2.0), 1e-12);
  EXPECT_NEAR(f.out[0], 4.0, 1e-12);
  const RefBackward g = ReferenceBackward(p, {1.0});
  // tanh'(200) and tanh'(400) underflow: the cap kills the gradient.
  EXPECT_NEAR(g.dq[0], 0.0, 1e-12);
  EXPECT_NEAR(g.dv[0], 0.5, 1e-12);
}

// GQA reads kv head h / (H / Hkv): equal to MHA over replicated k/v, and the
// GQA dk/dv are the sums over each group of the replicated gradients.
TEST(ReferenceIdentityTest, GqaEqualsReplicatedMha) {
  std::mt19937_64 rng(4);
  const int64_t b = 2, sq = 3, skv = 4, h = 4, hkv = 2, d = 3, dv = 2, group = h / hkv;
  RefProblem g = RandomProblem(rng, b, sq, skv, h, hkv, d, dv);
  g.mask = Mask::Causal(1);
  g.sinks = Uniform(rng, h, -1, 1);
  RefProblem m = g;
  m.hkv = h;
  m.k.assign(b * skv * h * d, 0);
  m.v.assign(b * skv * h * dv, 0);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t j = 0; j < skv; ++j)
      for (int64_t hh = 0; hh < h; ++hh) {
        for (int64_t x = 0; x < d; ++x)
          m.k[((bi * skv + j) * h + hh) * d + x] = g.k[((bi * skv + j) * hkv + hh / group) * d + x];
        for (int64_t x = 0; x < dv; ++x)
          m.v[((bi * skv + j) * h + hh) * dv + x] =
              g.v[((bi * skv + j) * hkv + hh / group) * dv + x];
      }
  const RefForward fg = ReferenceForward(g), fm = ReferenceForward(m);
  for (size_t i = 0; i < fg.out.size(); ++i) EXPECT_NEAR(fg.out[i], fm.out[i], 1e-14);
  for (size_t i = 0; i < fg.lse.size(); ++i) EXPECT_NEAR(fg.lse[i], fm.lse[i], 1e-14);
  const std::vector<double> dout = Uniform(rng, b * sq * h * dv, -1, 1);
  const RefBackward bg = ReferenceBackward(g, dout), bm = ReferenceBackward(m, dout);
  for (size_t i = 0; i < bg.dq.size(); ++i) EXPECT_NEAR(bg.dq[i], bm.dq[i], 1e-14);
  for (size_t i = 0; i < bg.dsinks.size(); ++i) EXPECT_NEAR(bg.dsinks[i], bm.dsinks[i], 1e-14);
  for (int64_t bi = 0; bi < b; ++bi)
    for (int64_t j = 0; j < skv; ++j)
      for (int64_t gh = 0; gh < hkv; ++gh)
        for (int64_t x = 0; x < d; ++x) {
          double sum = 0;
          for (int64_t r = 0; r < group; ++r)
            sum += bm.dk[((bi * skv + j) * h + gh * group + r) * d + x];
          EXPECT_NEAR(bg.dk[((bi * skv + j) * hkv + gh) * d + x], sum, 1e-14);
        }
}

// Masks see global positions: causal over positions shifted by 3 (q) equals
// Causal(3) over the default positions.
TEST(ReferenceIdentityTest, PositionsShiftMasks) {
  std::mt19937_64 rng(5);
  RefProblem a = RandomProblem(rng, 1, 4, 6, 2, 1, 2, 2);
  RefProblem b = a;
  a.mask = Mask::Causal();
  a.q_pos = {3, 4, 5, 6};
  b.mask = Mask::Causal(3);
  const RefForward fa = ReferenceForward(a), fb = ReferenceForward(b);
  EXPECT_EQ(fa.out, fb.out);
  EXPECT_EQ(fa.lse, fb.lse);
}

}  // namespace
}  // namespace ringsplash::testing
