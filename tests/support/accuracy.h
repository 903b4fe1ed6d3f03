// Accuracy checks of the public API against the f64 reference, shared by
// attention_test.cc and property_test.cc. Each returns "" when the check
// passes and otherwise a description of every failure (tensor, path, error,
// bound), so callers can add their configuration to the message.
#ifndef RINGSPLASH_TESTS_SUPPORT_ACCURACY_H_
#define RINGSPLASH_TESTS_SUPPORT_ACCURACY_H_

#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "tests/support/test_util.h"

namespace ringsplash::testing {

// f32: 1e-5 relative to the largest magnitude of each tensor. f32 has unit
// roundoff u = 6e-8; every output element is a D-term dot product, an online
// softmax over Skv keys (a few roundings per tile for the rescaling) and a
// Skv-term weighted sum, so the worst-case error bound is of order
// (D + Skv) * u ~ 1e-5 for the test shapes (<= ~100 terms) and the typical
// error is far smaller (random rounding grows like sqrt). The test logits are
// O(1..10), so exp() turns their absolute errors into relative errors of the
// same size. A wrong mask element, a missing rescale or a wrong GQA head is
// O(1e-2) or more.
constexpr double kF32Tolerance = 1e-5;

struct Tolerances {
  double f32 = kF32Tolerance;       // out and lse of f32 inputs
  double f32_grad = kF32Tolerance;  // dq, dk, dv, dsinks of f32 inputs
  // Floor of the low-precision bounds (see CheckLowPrecision).
  double low_slack = 1e-6;
  double low_grad_slack = 1e-6;
};

// Whether `path` rounds f32 intermediates to bf16 for its tile products
// when the inputs (and dout) are `dtype`: avx512_bf16 and amx with bf16 round P
// for the forward's P V, and P and dS for the backward's dV, dK and dQ
// (relative error <= 2^-8 each; flash_forward.cc, flash_backward.cc).
bool RoundsBf16Operands(KernelPath path, DType dtype);

// Unit roundoff of a storage dtype (bf16 2^-8, f16 2^-11, f32 2^-24).
double UnitRoundoff(DType dtype);

// Where P is rounded to bf16 for P V (RoundsBf16Operands), out errs by up to
// 2^-8 sum_j p_j |v_j| <= 2^-8 max|v|: that slack relative to max|out|, from
// the reference's v and out.
double PRoundingSlack(const std::vector<double>& v, const std::vector<double>& out);

// Logical shape of out, [B, Sq, H, Dv].
std::vector<int64_t> OutShape(const OwnedInputs& in);

// Forward + backward of `in` (f32 inputs) on each path against the
// reference, within `tol.f32` / `tol.f32_grad`.
std::string CheckF32(const OwnedInputs& in, AttentionOptions opt,
                     const std::vector<KernelPath>& paths, const Tolerances& tol = {});

// bf16 / f16 inputs; see accuracy.cc for the error model.
std::string CheckLowPrecision(const OwnedInputs& in, AttentionOptions opt,
                              const std::vector<KernelPath>& paths, const Tolerances& tol = {});

// CheckF32 or CheckLowPrecision by the dtype of q, on every supported path.
std::string CheckAgainstReference(const OwnedInputs& in, const AttentionOptions& opt,
                                  const Tolerances& tol = {});

}  // namespace ringsplash::testing

#endif  // RINGSPLASH_TESTS_SUPPORT_ACCURACY_H_
