// Tests of src/kernels/combine.cc against the f64 reference:
//  - merging the (out, lse) of two disjoint key sets equals attention over
//    their union, in either order and with empty parts;
//  - ApplySinks turns sink-free (out, lse) into the reference with sinks;
//  - ComputeDelta and AccumulateDSinks give the reference's dsinks.
#include "src/kernels/combine.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tests/support/reference.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {
namespace {

using kernels::RowShape;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

std::vector<float> ToF32(const std::vector<double>& v) { return {v.begin(), v.end()}; }
std::vector<double> ToF64(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// Random reference problem with B=2, Sq=5, H=2, Skv=8, D=4, Dv=3.
RefProblem MakeProblem(Rng& rng) {
  RefProblem p;
  p.b = 2;
  p.sq = 5;
  p.skv = 8;
  p.h = 2;
  p.hkv = 1;
  p.d = 4;
  p.dv = 3;
  auto fill = [&](std::vector<double>& v, size_t n, double range) {
    std::uniform_real_distribution<double> dist(-range, range);
    v.resize(n);
    for (double& x : v) x = dist(rng);
  };
  fill(p.q, p.b * p.sq * p.h * p.d, 2.0);
  fill(p.k, p.b * p.skv * p.hkv * p.d, 2.0);
  fill(p.v, p.b * p.skv * p.hkv * p.dv, 1.0);
  return p;
}

// The same problem restricted (through segment ids) to keys with
// kv index in [lo, hi): keys outside get a segment no query has. Query 0 of
// batch 0 gets a segment no key has, so it is empty in every part.
RefProblem Restrict(const RefProblem& p, int64_t lo, int64_t hi) {
  RefProblem r = p;
  r.q_seg.assign(p.b * p.sq, 1);
  r.q_seg[0] = 7;
  r.kv_seg.assign(p.b * p.skv, 2);
  for (int64_t b = 0; b < p.b; ++b)
    for (int64_t j = lo; j < hi; ++j) r.kv_seg[b * p.skv + j] = 1;
  return r;
}

// f32 (out, lse) of the reference over a key range — what a ring step or a
// kernel call would hand to MergePartial.
void Part(const RefProblem& p, int64_t lo, int64_t hi, std::vector<float>& out,
          std::vector<float>& lse) {
  const RefForward f = ReferenceForward(Restrict(p, lo, hi));
  out = ToF32(f.out);
  lse = ToF32(f.lse);
}

// Merging is a few f32 ops per element on O(1) values: 1e-6 relative to the
// largest magnitude is ~10 f32 ulps.
constexpr double kTol = 1e-6;

TEST(MergePartialTest, DisjointPartsEqualTheUnion) {
  Rng rng(11);
  const RefProblem p = MakeProblem(rng);
  const RowShape s{p.b, p.sq, p.h, p.dv};
  const RefForward whole = ReferenceForward(Restrict(p, 0, p.skv));
  // Split points include empty parts ([0, 0) and [8, 8)).
  for (int64_t cut : {0, 3, 8}) {
    for (bool swap : {false, true}) {
      std::vector<float> oa, la, ob, lb;
      Part(p, 0, cut, oa, la);
      Part(p, cut, p.skv, ob, lb);
      if (swap) {
        std::swap(oa, ob);
        std::swap(la, lb);
      }
      kernels::MergePartial(s, oa.data(), la.data(), ob.data(), lb.data());
      const Comparison co = Compare(ToF64(oa), whole.out);
      const Comparison cl = Compare(ToF64(la), whole.lse);
      EXPECT_LT(co.Relative(), kTol) << "cut " << cut << " swap " << swap << ": " << co.Describe();
      EXPECT_LT(cl.Relative(1.0), kTol) << "cut " << cut << ": " << cl.Describe();
      // Row (b=0, i=0) is empty everywhere: out 0, lse -inf, no NaN.
      EXPECT_EQ(la[0], kNegInf);
      EXPECT_EQ(la[p.sq], kNegInf);  // head 1 of the same row
      for (int64_t e = 0; e < p.h * p.dv; ++e) EXPECT_EQ(oa[e], 0.0f);
    }
  }
}

TEST(MergePartialTest, ThreeWayMergeIsOrderIndependent) {
  Rng rng(12);
  const RefProblem p = MakeProblem(rng);
  const RowShape s{p.b, p.sq, p.h, p.dv};
  const RefForward whole = ReferenceForward(Restrict(p, 0, p.skv));
  std::vector<float> o1, l1, o2, l2, o3, l3;
  Part(p, 0, 2, o1, l1);
  Part(p, 2, 5, o2, l2);
  Part(p, 5, 8, o3, l3);
  // Ring order on some rank: 3, 1, 2.
  kernels::MergePartial(s, o3.data(), l3.data(), o1.data(), l1.data());
  kernels::MergePartial(s, o3.data(), l3.data(), o2.data(), l2.data());
  EXPECT_LT(Compare(ToF64(o3), whole.out).Relative(), kTol);
  EXPECT_LT(Compare(ToF64(l3), whole.lse).Relative(1.0), kTol);
}

TEST(MergePartialTest, EmptyGuardsNeverProduceNaN) {
  const RowShape s{1, 1, 1, 2};
  // Accumulator empty, garbage in out (never read as a value): takes the part.
  std::vector<float> oa = {123.0f, -5.0f}, la = {kNegInf};
  std::vector<float> ob = {1.0f, 2.0f}, lb = {0.5f};
  kernels::MergePartial(s, oa.data(), la.data(), ob.data(), lb.data());
  EXPECT_EQ(oa, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(la[0], 0.5f);
  // Part empty: accumulator unchanged.
  std::vector<float> oe = {9.0f, 9.0f}, le = {kNegInf};
  kernels::MergePartial(s, oa.data(), la.data(), oe.data(), le.data());
  EXPECT_EQ(oa, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(la[0], 0.5f);
  // Both empty: out exactly 0, lse -inf.
  std::vector<float> oz = {4.0f, 4.0f}, lz = {kNegInf};
  kernels::MergePartial(s, oz.data(), lz.data(), oe.data(), le.data());
  EXPECT_EQ(oz, (std::vector<float>{0.0f, 0.0f}));
  EXPECT_EQ(lz[0], kNegInf);
  // Huge lse gaps saturate instead of overflowing: the larger side wins.
  std::vector<float> ox = {1.0f, 1.0f}, lx = {-80.0f};
  std::vector<float> oy = {3.0f, 3.0f}, ly = {80.0f};
  kernels::MergePartial(s, ox.data(), lx.data(), oy.data(), ly.data());
  EXPECT_FLOAT_EQ(ox[0], 3.0f);
  EXPECT_FLOAT_EQ(lx[0], 80.0f);
  EXPECT_FALSE(std::isnan(ox[1]));
}

TEST(ApplySinksTest, MatchesReferenceWithSinks) {
  Rng rng(13);
  RefProblem p = MakeProblem(rng);
  const RowShape s{p.b, p.sq, p.h, p.dv};
  RefProblem with = Restrict(p, 0, p.skv);  // row (0, 0) empty
  with.sinks = {0.3, -1.2};
  const RefForward expected = ReferenceForward(with);
  std::vector<float> out, lse;
  Part(p, 0, p.skv, out, lse);
  const std::vector<float> sinks = {0.3f, -1.2f};
  kernels::ApplySinks(s, out.data(), lse.data(), sinks.data());
  EXPECT_LT(Compare(ToF64(out), expected.out).Relative(), kTol);
  EXPECT_LT(Compare(ToF64(lse), expected.lse).Relative(1.0), kTol);
  // The empty row: lse is the sink, out stays 0.
  EXPECT_EQ(lse[0], 0.3f);
  EXPECT_EQ(lse[p.sq], -1.2f);
  EXPECT_EQ(out[0], 0.0f);
}

// Large logits: at lse = 8324.25 the f32 lse cannot hold a sink's share of
// 2.1e-5 (its spacing there is 2^-10), so out must be scaled by the keys'
// share sigmoid(lse - sink) itself, not by exp(lse - rounded new lse) = 1.
// The backward's D = dout . out is all that carries that share into the
// gradients (p = exp(s - lse) rounds to 1 there): an unscaled out left dq 0
// where it should be 2.1e-5 dP K. Both sides of the sink, f64 expectations.
TEST(ApplySinksTest, SmallSharesSurviveLargeLse) {
  const RowShape s{1, 2, 1, 2};
  const float l = 8324.25f;
  std::vector<float> out = {1.0f, -2.0f, 1.0f, -2.0f}, lse = {l, l};
  const std::vector<float> sinks = {8313.5f};
  // Row 0: sink 10.75 below. Row 1 is given lse 10.75 below the sink.
  lse[1] = 8302.75f;
  kernels::ApplySinks(s, out.data(), lse.data(), sinks.data());
  const double share0 = 1.0 / (1.0 + std::exp(8313.5 - 8324.25));  // 1 - 2.1e-5
  const double share1 = 1.0 / (1.0 + std::exp(8313.5 - 8302.75));  // 2.1e-5
  // f32 rounding of the share and the product: a few units of 2^-24.
  EXPECT_NEAR(out[0], share0, 4e-7);
  EXPECT_NEAR(out[1], -2.0 * share0, 8e-7);
  EXPECT_NEAR(out[2] / share1, 1.0, 4e-7);
  EXPECT_NEAR(out[3] / share1, -2.0, 8e-7);
  EXPECT_NEAR(lse[0], 8324.25, 1e-3);  // one f32 spacing
  EXPECT_NEAR(lse[1], 8313.5, 1e-3);
}

TEST(ApplySinksTest, MinusInfinitySinkChangesNothing) {
  const RowShape s{1, 1, 1, 2};
  std::vector<float> out = {1.0f, 2.0f}, lse = {0.25f};
  std::vector<float> empty_out = {0.0f, 0.0f}, empty_lse = {kNegInf};
  const float sink = kNegInf;
  kernels::ApplySinks(s, out.data(), lse.data(), &sink);
  kernels::ApplySinks(s, empty_out.data(), empty_lse.data(), &sink);
  EXPECT_EQ(out, (std::vector<float>{1.0f, 2.0f}));
  EXPECT_EQ(lse[0], 0.25f);
  EXPECT_EQ(empty_lse[0], kNegInf);
  EXPECT_EQ(empty_out, (std::vector<float>{0.0f, 0.0f}));
}

// delta over strided / bf16 views equals the f64 dot product of the values
// actually stored.
TEST(ComputeDeltaTest, AnyDtypeAndStrides) {
  Rng rng(14);
  const int64_t b = 2, sq = 3, h = 4, dv = 5;
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    // dout stored [B, H, Sq, Dv] and viewed [B, Sq, H, Dv]; out contiguous.
    Tensor dout_store = RandomTensor(rng, dt, {b, h, sq, dv});
    Tensor out = RandomTensor(rng, DType::kF32, {b, sq, h, dv});
    const TensorView dout = dout_store.view().Transposed(1, 2);
    std::vector<float> delta(b * h * sq);
    kernels::ComputeDelta(dout, out.view(), delta.data());
    const std::vector<double> x = ToDoubles(dout), y = ToDoubles(out.view());
    std::vector<double> expected(b * h * sq);
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t i = 0; i < sq; ++i)
        for (int64_t hh = 0; hh < h; ++hh) {
          double acc = 0;
          for (int64_t e = 0; e < dv; ++e) {
            const int64_t o = ((bi * sq + i) * h + hh) * dv + e;
            acc += x[o] * y[o];
          }
          expected[(bi * h + hh) * sq + i] = acc;
        }
    // 5-term f32 dot products of O(1) values.
    EXPECT_LT(Compare(ToF64(delta), expected).Relative(), kTol) << DTypeName(dt);
  }
}

TEST(AccumulateDSinksTest, MatchesReferenceAndAccumulates) {
  Rng rng(15);
  RefProblem p = Restrict(MakeProblem(rng), 0, 8);
  p.sinks = {0.4, -0.8};
  const RefForward f = ReferenceForward(p);
  std::vector<double> dout(f.out.size());
  std::uniform_real_distribution<double> dist(-1, 1);
  for (double& x : dout) x = dist(rng);
  const RefBackward g = ReferenceBackward(p, dout);

  Tensor dout_t = TensorFromDoubles(dout, DType::kF32, {p.b, p.sq, p.h, p.dv});
  Tensor out_t = TensorFromDoubles(f.out, DType::kF32, {p.b, p.sq, p.h, p.dv});
  std::vector<float> delta(p.b * p.h * p.sq);
  kernels::ComputeDelta(dout_t.view(), out_t.view(), delta.data());
  const std::vector<float> lse = ToF32(f.lse), sinks = {0.4f, -0.8f};
  const RowShape s{p.b, p.sq, p.h, p.dv};
  std::vector<float> ds = {0.0f, 0.0f};
  kernels::AccumulateDSinks(s, sinks.data(), lse.data(), delta.data(), ds.data());
  EXPECT_LT(Compare(ToF64(ds), g.dsinks).Relative(), kTol);
  // It adds: a second call doubles the result (the ring sums rank parts).
  const std::vector<float> once = ds;
  kernels::AccumulateDSinks(s, sinks.data(), lse.data(), delta.data(), ds.data());
  EXPECT_FLOAT_EQ(ds[0], 2 * once[0]);
  EXPECT_FLOAT_EQ(ds[1], 2 * once[1]);
}

TEST(AccumulateDSinksTest, EmptyRowWithMinusInfinitySinkIsZeroNotNaN) {
  const RowShape s{1, 1, 1, 1};
  const float sink = kNegInf, lse = kNegInf, delta = 0.0f;
  float ds = 0.0f;
  kernels::AccumulateDSinks(s, &sink, &lse, &delta, &ds);
  EXPECT_EQ(ds, 0.0f);
}

}  // namespace
}  // namespace ringsplash::testing
