// The flash kernels' test harness (flash_problem.h).
#include "tests/support/flash_problem.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>

#include "tests/support/accuracy.h"

namespace ringsplash::testing {

std::vector<double> ToDoubleVec(const std::vector<float>& v) {
  return std::vector<double>(v.begin(), v.end());
}

std::vector<int64_t> Iota(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

::testing::AssertionResult BitwiseEqual(const Result& a, const Result& b) {
  const struct {
    const char* name;
    const std::vector<float>& x;
    const std::vector<float>& y;
  } arrays[] = {{"out", a.out, b.out},
                {"lse", a.lse, b.lse},
                {"dq", a.dq, b.dq},
                {"dk", a.dk, b.dk},
                {"dv", a.dv, b.dv}};
  for (const auto& arr : arrays) {
    if (arr.x.size() != arr.y.size() ||
        (!arr.x.empty() &&
         std::memcmp(arr.x.data(), arr.y.data(), arr.x.size() * sizeof(float)) != 0)) {
      return ::testing::AssertionFailure() << arr.name << " differs";
    }
  }
  return ::testing::AssertionSuccess();
}

Result Problem::Run(const RunConfig& s, bool backward, const RefForward* ref) const {
  const ProblemSpec& sp = spec_;
  Result r;
  r.out.assign(static_cast<size_t>(sp.b * sp.sq * sp.h * sp.dv), -7.0f);
  r.lse.assign(static_cast<size_t>(sp.b * sp.h * sp.sq), -7.0f);
  kernels::ThreadPool pool(s.threads);
  const kernels::FlashParams p = Params(s);
  kernels::FlashForward(p, pool, r.out.data(), r.lse.data(), &r.fwd_stats);
  if (!backward) return r;
  std::vector<float> lse(r.lse), delta(r.lse.size(), 0.0f);
  const std::vector<double> dout = Dout();
  for (int64_t b = 0; b < sp.b; ++b) {
    for (int64_t h = 0; h < sp.h; ++h) {
      for (int64_t i = 0; i < sp.sq; ++i) {
        const int64_t row = (b * sp.h + h) * sp.sq + i;
        double dl = 0;
        for (int64_t c = 0; c < sp.dv; ++c) {
          const int64_t o = ((b * sp.sq + i) * sp.h + h) * sp.dv + c;
          dl += dout[o] * (ref != nullptr ? ref->out[o] : r.out[o]);
        }
        delta[row] = static_cast<float>(dl);
        if (ref != nullptr) lse[row] = static_cast<float>(ref->lse[row]);
      }
    }
  }
  const float fill = s.add_gradients ? 0.5f : std::numeric_limits<float>::quiet_NaN();
  r.dq.assign(static_cast<size_t>(sp.b * sp.sq * sp.h * sp.d), fill);
  r.dk.assign(static_cast<size_t>(sp.b * sp.skv * sp.hkv * sp.d), fill);
  r.dv.assign(static_cast<size_t>(sp.b * sp.skv * sp.hkv * sp.dv), fill);
  const kernels::GradientSums sums{.add_dq = s.add_gradients, .add_dkv = s.add_gradients};
  kernels::FlashBackward(p, pool, dout_.view(), lse.data(), delta.data(), r.dq.data(), r.dk.data(),
                         r.dv.data(), sums, &r.bwd_stats);
  if (s.add_gradients) {
    for (auto* vec : {&r.dq, &r.dk, &r.dv}) {
      for (float& x : *vec) x -= 0.5f;
    }
  }
  return r;
}

bool RoundsP(KernelPath path) { return RoundsBf16Operands(path, DType::kBF16); }

void ExpectClose(const std::vector<float>& actual, const std::vector<double>& expected, double tol,
                 const std::string& what) {
  const Comparison c = Compare(ToDoubleVec(actual), expected);
  EXPECT_LE(c.Relative(), tol) << what << ": " << c.Describe();
}

void ExpectWithinTerms(const std::vector<float>& actual, const std::vector<double>& expected,
                       const std::vector<double>& terms, double tol, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  ASSERT_EQ(terms.size(), expected.size()) << what;
  const double u = std::ldexp(1.0, -8);
  const double allowance = 2 * tol * MaxAbs(expected);
  double worst = -std::numeric_limits<double>::infinity();
  size_t at = 0;
  for (size_t e = 0; e < expected.size(); ++e) {
    const double excess = std::abs(actual[e] - expected[e]) - u * terms[e];
    if (!(excess <= worst)) {  // NaN wins
      worst = excess;
      at = e;
    }
  }
  EXPECT_LE(worst, allowance) << what << ": element " << at << " is " << actual[at] << ", expected "
                              << expected[at] << " within 2^-8 x " << terms[at];
}

void ExpectGradients(const Result& r, const RefBackward& g, KernelPath path, DType dtype,
                     double tol, const std::string& what, double dv_tol) {
  if (dv_tol < 0) dv_tol = tol;
  if (RoundsBf16Operands(path, dtype)) {
    ExpectWithinTerms(r.dq, g.dq, g.dq_ds_terms, tol, "dq " + what);
    ExpectWithinTerms(r.dk, g.dk, g.dk_ds_terms, tol, "dk " + what);
    ExpectWithinTerms(r.dv, g.dv, g.dv_terms, dv_tol, "dv " + what);
    return;
  }
  ExpectClose(r.dq, g.dq, tol, "dq " + what);
  ExpectClose(r.dk, g.dk, tol, "dk " + what);
  ExpectClose(r.dv, g.dv, dv_tol, "dv " + what);
}

ProblemSpec SpecOf(const Shape& sh, DType dtype, bool segments) {
  ProblemSpec spec(sh.b, sh.sq, sh.skv, sh.h, sh.hkv, sh.d, sh.dv);
  spec.dtype = dtype;
  spec.segments = segments;
  return spec;
}

void CheckAgainstReference(const Shape& sh, DType dtype, const RunConfig& s, bool segments,
                           uint64_t seed, bool backward, int64_t q_offset) {
  Problem prob(seed, SpecOf(sh, dtype, segments));
  if (q_offset != 0) {
    prob.owned().q_pos = Iota(sh.sq);
    for (int64_t& x : prob.owned().q_pos) x += q_offset;
    prob.Refresh();
  }
  const RefProblem rp = prob.Ref(s);
  const RefForward ref = ReferenceForward(rp);
  const Result r = prob.Run(s, backward, &ref);
  const std::string what = std::string(KernelPathName(s.path)) + " " + DTypeName(dtype) +
                           " d=" + std::to_string(sh.d) + " dv=" + std::to_string(sh.dv) +
                           " sq=" + std::to_string(sh.sq) + " skv=" + std::to_string(sh.skv) +
                           " h=" + std::to_string(sh.h) + " hkv=" + std::to_string(sh.hkv);
  // bf16 products (avx512_bf16 and amx with bf16 inputs) compute S exactly
  // like f32 on the rounded inputs (bf16 x bf16 products are exact in f32);
  // both also round P to bf16 (relative 2^-8, bf16's unit roundoff) for
  // P V. |out_i error| <= 2^-8 sum_j p_ij |v_j| <= 2^-8 max|v|, plus 2x the
  // f32 error allowance for the rest.
  double out_tol = kF32Tol;
  if (dtype == DType::kBF16 && RoundsP(s.path)) {
    out_tol = 2 * kF32Tol + PRoundingSlack(rp.v, ref.out);
  }
  ExpectClose(r.out, ref.out, out_tol, "out " + what);
  ExpectClose(r.lse, ref.lse, kF32Tol, "lse " + what);
  if (!backward) return;
  const RefBackward g = ReferenceBackward(rp, prob.Dout());
  ExpectGradients(r, g, s.path, dtype, kF32Tol, what);
}

TensorView SliceRows(const TensorView& t, int64_t lo, int64_t n) {
  TensorView s = t;
  s.data = static_cast<char*>(t.data) + lo * t.stride[1] * static_cast<int64_t>(DTypeSize(t.dtype));
  s.shape[1] = n;
  return s;
}

}  // namespace ringsplash::testing
