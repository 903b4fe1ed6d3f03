// The numeric half of the attention properties, shared by the single-device
// target (attention_target.cc) and the ring target (ring_target.cc): an
// accepted call's outputs against the f64 reference (tests/support/reference.h).
//
// Tolerances. They catch wrong masks, rows, heads or missing writes (errors
// of order max|v|), not the last ulp — tests/attention_test.cc owns tight
// bounds. With u = 2^-24 and L the largest possible |logit| (scale * D *
// max|q| * max|k|, at most the soft cap, or the largest |sink|), a logit
// carries an absolute error of about sqrt(D) * u * L, which exp() turns into
// that relative error of each probability:
//   out: 1e-4 * max|v| + 64 sqrt(D) u L max|v|, plus 4 * 2^-8 * max|v| when
//        the inputs or out are 16-bit (probabilities rounded to bf16 before
//        P V on the amx path, out rounded on store);
//   lse: 1e-4 * max(1, max|lse|) + 64 sqrt(D) u L;
//   gradients (f32 only): 1e-3 of their natural magnitude (the largest
//        expected value, or the product of the input magnitudes they are
//        made of) + 64 sqrt(D) u L of the same.
// A ring merges per-step partial results (a few more roundings of order u
// per row and step), far inside these bounds. Problems whose logits can
// exceed 1e4 are only checked for NaN and for agreement on which entries are
// infinite.
#ifndef RINGSPLASH_FUZZ_ATTENTION_CHECK_H_
#define RINGSPLASH_FUZZ_ATTENTION_CHECK_H_

#include "fuzz/attention_problem.h"
#include "tests/support/reference.h"

namespace ringsplash::fuzz {

class ReferenceCheck {
 public:
  // Computes the reference forward of p's inputs and options.
  explicit ReferenceCheck(const FuzzProblem& p);
  // p.out and p.lse match the reference (aborts via FuzzCheck otherwise;
  // messages start with `who`, the entry point that produced them).
  void Forward(const char* who) const;
  // p.dq, p.dk, p.dv (and p.dsinks) match the reference backward of p.dout.
  void Backward(const char* who) const;

 private:
  const FuzzProblem& p_;
  testing::RefProblem ref_problem_;
  testing::RefForward ref_;
  bool numeric_;      // logits small enough to compare values
  bool low_;          // 16-bit inputs or out
  double logit_err_;  // 64 sqrt(D) u L
  double max_v_;
};

}  // namespace ringsplash::fuzz

#endif  // RINGSPLASH_FUZZ_ATTENTION_CHECK_H_
