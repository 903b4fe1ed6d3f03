// Fuzz target: the attention entry points' argument validation and results.
//
// DecodeProblem (attention_problem.h) builds a call with random shapes,
// dtypes, strides, masks, positions and options, some arguments broken on
// purpose, and the verdict the contract implies. Properties:
//   - only ringsplash::Error is ever thrown (no other exception, no crash,
//     no sanitizer report);
//   - a call with an invalid argument throws, and when exactly one argument
//     was broken the message starts with that argument's name;
//   - a valid call does not throw;
//   - an accepted call matches the f64 reference (tests/support/reference.h):
//     every element written, no NaN, out/lse within the tolerance below, and
//     for all-f32 calls the gradients too.
//
// Tolerances. They catch wrong masks, rows, heads or missing writes (errors
// of order max|v|), not the last ulp — tests/attention_test.cc owns tight
// bounds. With u = 2^-24 and L the largest possible |logit| (scale * D *
// max|q| * max|k|, at most the soft cap, or the largest |sink|), a logit
// carries an absolute error of about sqrt(D) * u * L, which exp() turns into
// that relative error of each probability:
//   out: 1e-4 * max|v| + 64 sqrt(D) u L max|v|, plus 4 * 2^-8 * max|v| when
//        the inputs or out are 16-bit (probabilities rounded to bf16 before
//        P V on the avx512_bf16 path, out rounded on store);
//   lse: 1e-4 * max(1, max|lse|) + 64 sqrt(D) u L;
//   gradients (f32 only): 1e-3 of their natural magnitude (the largest
//        expected value, or the product of the input magnitudes they are
//        made of) + 64 sqrt(D) u L of the same.
// Problems whose logits can exceed 1e4 are only checked for NaN and for
// agreement on which entries are infinite.
#include <algorithm>
#include <cmath>
#include <exception>
#include <string>
#include <vector>

#include "fuzz/attention_problem.h"
#include "fuzz/fuzz_targets.h"
#include "fuzz/fuzz_util.h"
#include "ringsplash/attention.h"
#include "ringsplash/error.h"
#include "tests/support/reference.h"
#include "tests/support/test_util.h"

namespace ringsplash::fuzz {
namespace {

using testing::Compare;
using testing::Comparison;
using testing::MaxAbs;
using testing::ToDoubles;

constexpr double kU32 = 1.0 / 16777216.0;  // 2^-24
constexpr double kMaxCheckedLogit = 1e4;

bool StartsWithAny(const std::string& text, const std::vector<std::string>& prefixes) {
  for (const std::string& p : prefixes) {
    if (text.compare(0, p.size(), p) == 0) return true;
  }
  return false;
}

// Runs `call`; returns true if it threw Error (message in *msg). Any other
// exception is a violation.
template <typename F>
bool Throws(F&& call, std::string* msg) {
  try {
    call();
  } catch (const Error& e) {
    *msg = e.what();
    return true;
  } catch (const std::exception& e) {
    FuzzCheck(false, "non-ringsplash exception: ", e.what());
  }
  return false;
}

// The outcome must match the verdict; returns whether the call was accepted.
bool CheckOutcome(bool threw, const std::string& msg, const Verdict& v, const char* what,
                  const FuzzProblem& p) {
  if (threw) {
    FuzzCheck(v.invalid || v.uncertain, what, " rejected a valid call: \"", msg, "\"; ",
              p.Describe());
    FuzzCheck(!msg.empty(), what, " threw an Error without a message");
    if (v.invalid && !v.uncertain && v.reasons.size() == 1) {
      FuzzCheck(StartsWithAny(msg, v.names), what, " error \"", msg,
                "\" does not start with the broken argument's name (", v.reasons[0], ")");
    }
    return false;
  }
  FuzzCheck(!v.invalid, what, " accepted an invalid call; ", p.Describe());
  return true;
}

// Checks `actual` against `expected` within tol * scale (absolute).
void Near(const std::vector<double>& actual, const std::vector<double>& expected, double tol,
          double scale, bool numeric, const char* name, const FuzzProblem& p) {
  const Comparison c = Compare(actual, expected);
  FuzzCheck(!c.nonfinite_mismatch, name, ": NaN or infinity mismatch (", c.Describe(), "); ",
            p.Describe());
  if (!numeric) return;
  FuzzCheck(c.max_abs_err <= tol * scale, name, ": error ", c.max_abs_err, " above ", tol * scale,
            " (", c.Describe(), "); ", p.Describe());
}

bool Is16Bit(DType d) { return d == DType::kBF16 || d == DType::kF16; }

}  // namespace

int AttentionOneInput(const uint8_t* data, size_t size) {
  if (size > 4096) return 0;
  ByteReader reader(data, size);
  FuzzProblem p = DecodeProblem(reader);

  std::string msg;
  const bool fwd_threw =
      Throws([&] { AttentionForward(p.in, p.opt, p.out.view, p.lse.view); }, &msg);
  if (!CheckOutcome(fwd_threw, msg, p.forward, "AttentionForward", p)) return 0;

  const testing::RefProblem ref_problem = testing::MakeRefProblem(p.in, p.opt);
  const testing::RefForward ref = testing::ReferenceForward(ref_problem);
  const bool numeric = p.max_logit <= kMaxCheckedLogit;
  const int64_t d = p.in.q.shape[3];
  const double logit_err = 64.0 * std::sqrt(static_cast<double>(d)) * kU32 * p.max_logit;
  const double max_v = MaxAbs(ToDoubles(p.in.v));
  const bool low = Is16Bit(p.in.q.dtype) || Is16Bit(p.out.view.dtype);
  const double out_tol = 1e-4 + logit_err + (low ? 4.0 / 256.0 : 0.0);
  Near(ToDoubles(p.out.view), ref.out, out_tol, std::max(max_v, 1e-30), numeric, "out", p);
  Near(ToDoubles(p.lse.view), ref.lse, 1e-4 + logit_err, std::max(1.0, MaxAbs(ref.lse)), numeric,
       "lse", p);

  if (!p.backward) return 0;
  const bool bwd_threw = Throws(
      [&] {
        AttentionBackward(p.in, p.opt, p.out.view, p.lse.view, p.dout.view, p.dq.view, p.dk.view,
                          p.dv.view, p.dsinks.view);
      },
      &msg);
  if (!CheckOutcome(bwd_threw, msg, p.backward_verdict, "AttentionBackward", p)) return 0;

  const std::vector<double> dout = ToDoubles(p.dout.view);
  const testing::RefBackward refb = testing::ReferenceBackward(ref_problem, dout);
  // Gradients are compared numerically only when nothing was rounded to 16
  // bits: the backward starts from the caller's (rounded) out.
  const bool grads_numeric = numeric && !low && !Is16Bit(p.dout.view.dtype) &&
                             !Is16Bit(p.dq.view.dtype) && !Is16Bit(p.dk.view.dtype) &&
                             !Is16Bit(p.dv.view.dtype);
  const double gtol = 1e-3 + logit_err;
  const double max_dout = MaxAbs(dout);
  const double max_q = MaxAbs(ToDoubles(p.in.q));
  const double max_k = MaxAbs(ToDoubles(p.in.k));
  const double scale = std::fabs(ref_problem.scale);
  const double dv_t = static_cast<double>(p.in.v.shape[3]);
  // dq_i = scale * sum_j ds_ij k_j with |ds_ij| <= p_ij * 2 Dv max|dout| max|v|.
  const double dq_mag = scale * max_k * 2 * dv_t * max_dout * max_v;
  const double dk_mag = scale * max_q * 2 * dv_t * max_dout * max_v *
                        static_cast<double>(p.in.q.shape[1] * p.in.q.shape[2]);
  const double dv_mag = max_dout * static_cast<double>(p.in.q.shape[1] * p.in.q.shape[2]);
  Near(ToDoubles(p.dq.view), refb.dq, gtol, std::max(MaxAbs(refb.dq), dq_mag * 1e-2) + 1e-30,
       grads_numeric, "dq", p);
  Near(ToDoubles(p.dk.view), refb.dk, gtol, std::max(MaxAbs(refb.dk), dk_mag * 1e-2) + 1e-30,
       grads_numeric, "dk", p);
  Near(ToDoubles(p.dv.view), refb.dv, gtol, std::max(MaxAbs(refb.dv), dv_mag * 1e-2) + 1e-30,
       grads_numeric, "dv", p);
  if (p.in.sinks.defined()) {
    // dsinks sums B * Sq terms of magnitude <= Dv max|dout| max|v| each.
    const double ds_mag =
        static_cast<double>(p.in.q.shape[0] * p.in.q.shape[1]) * dv_t * max_dout * max_v;
    Near(ToDoubles(p.dsinks.view), refb.dsinks, gtol,
         std::max(MaxAbs(refb.dsinks), ds_mag * 1e-2) + 1e-30, grads_numeric, "dsinks", p);
  }
  return 0;
}

}  // namespace ringsplash::fuzz
