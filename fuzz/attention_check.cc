// ReferenceCheck (attention_check.h): outputs of an accepted call against the
// f64 reference, with the tolerances stated in the header.
#include "fuzz/attention_check.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "fuzz/fuzz_util.h"
#include "tests/support/test_util.h"

namespace ringsplash::fuzz {
namespace {

using testing::Compare;
using testing::Comparison;
using testing::MaxAbs;
using testing::ToDoubles;

constexpr double kU32 = 1.0 / 16777216.0;  // 2^-24
constexpr double kMaxCheckedLogit = 1e4;

bool Is16Bit(DType d) { return d == DType::kBF16 || d == DType::kF16; }

// Checks `actual` against `expected` within tol * scale (absolute).
void Near(const std::vector<double>& actual, const std::vector<double>& expected, double tol,
          double scale, bool numeric, const char* who, const char* name, const FuzzProblem& p) {
  const Comparison c = Compare(actual, expected);
  FuzzCheck(!c.nonfinite_mismatch, who, ": ", name, ": NaN or infinity mismatch (", c.Describe(),
            "); ", p.Describe());
  if (!numeric) return;
  FuzzCheck(c.max_abs_err <= tol * scale, who, ": ", name, ": error ", c.max_abs_err, " above ",
            tol * scale, " (", c.Describe(), "); ", p.Describe());
}

}  // namespace

ReferenceCheck::ReferenceCheck(const FuzzProblem& p)
    : p_(p),
      ref_problem_(testing::MakeRefProblem(p.in, p.opt)),
      ref_(testing::ReferenceForward(ref_problem_)),
      numeric_(p.max_logit <= kMaxCheckedLogit),
      low_(Is16Bit(p.in.q.dtype) || Is16Bit(p.out.view.dtype)),
      logit_err_(64.0 * std::sqrt(static_cast<double>(p.in.q.shape[3])) * kU32 * p.max_logit),
      max_v_(MaxAbs(ToDoubles(p.in.v))) {}

void ReferenceCheck::Forward(const char* who) const {
  const double out_tol = 1e-4 + logit_err_ + (low_ ? 4.0 / 256.0 : 0.0);
  Near(ToDoubles(p_.out.view), ref_.out, out_tol, std::max(max_v_, 1e-30), numeric_, who, "out",
       p_);
  Near(ToDoubles(p_.lse.view), ref_.lse, 1e-4 + logit_err_, std::max(1.0, MaxAbs(ref_.lse)),
       numeric_, who, "lse", p_);
}

void ReferenceCheck::Backward(const char* who) const {
  const FuzzProblem& p = p_;
  const std::vector<double> dout = ToDoubles(p.dout.view);
  const testing::RefBackward refb = testing::ReferenceBackward(ref_problem_, dout);
  // Gradients are compared numerically only when nothing was rounded to 16
  // bits: the backward starts from the caller's (rounded) out.
  const bool grads_numeric = numeric_ && !low_ && !Is16Bit(p.dout.view.dtype) &&
                             !Is16Bit(p.dq.view.dtype) && !Is16Bit(p.dk.view.dtype) &&
                             !Is16Bit(p.dv.view.dtype);
  const double gtol = 1e-3 + logit_err_;
  const double max_dout = MaxAbs(dout);
  const double max_q = MaxAbs(ToDoubles(p.in.q));
  const double max_k = MaxAbs(ToDoubles(p.in.k));
  const double scale = std::fabs(ref_problem_.scale);
  const double dv_t = static_cast<double>(p.in.v.shape[3]);
  const double rows = static_cast<double>(p.in.q.shape[1] * p.in.q.shape[2]);
  // dq_i = scale * sum_j ds_ij k_j with |ds_ij| <= p_ij * 2 Dv max|dout| max|v|.
  const double dq_mag = scale * max_k * 2 * dv_t * max_dout * max_v_;
  const double dk_mag = scale * max_q * 2 * dv_t * max_dout * max_v_ * rows;
  const double dv_mag = max_dout * rows;
  Near(ToDoubles(p.dq.view), refb.dq, gtol, std::max(MaxAbs(refb.dq), dq_mag * 1e-2) + 1e-30,
       grads_numeric, who, "dq", p);
  Near(ToDoubles(p.dk.view), refb.dk, gtol, std::max(MaxAbs(refb.dk), dk_mag * 1e-2) + 1e-30,
       grads_numeric, who, "dk", p);
  Near(ToDoubles(p.dv.view), refb.dv, gtol, std::max(MaxAbs(refb.dv), dv_mag * 1e-2) + 1e-30,
       grads_numeric, who, "dv", p);
  if (p.in.sinks.defined()) {
    // dsinks sums B * Sq terms of magnitude <= Dv max|dout| max|v| each.
    const double ds_mag =
        static_cast<double>(p.in.q.shape[0] * p.in.q.shape[1]) * dv_t * max_dout * max_v_;
    Near(ToDoubles(p.dsinks.view), refb.dsinks, gtol,
         std::max(MaxAbs(refb.dsinks), ds_mag * 1e-2) + 1e-30, grads_numeric, who, "dsinks", p);
  }
}

}  // namespace ringsplash::fuzz
