// Accuracy checks of the public API (single device and the threads ring)
// against the f64 reference, shared by attention_test.cc, property_test.cc,
// the ring tests and the numerics suite: the error model (ReferenceBounds)
// and the runs it applies to. The Check* functions return "" when the check
// passes and otherwise a description of every failure (tensor, path, error,
// bound), so callers can add their configuration to the message.
#ifndef RINGSPLASH_TESTS_SUPPORT_ACCURACY_H_
#define RINGSPLASH_TESTS_SUPPORT_ACCURACY_H_

#include <string>
#include <vector>

#include "ringsplash/attention.h"
#include "ringsplash/ring.h"
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
  double f32 = kF32Tolerance;       // out and lse (f32 accumulation on any input dtype)
  double f32_grad = kF32Tolerance;  // dq, dk, dv, dsinks (likewise)
  // Added to every bound of 16-bit inputs on top of the above; 0: bf16 and
  // f16 inputs are held to the f32 bounds plus the bf16 rounding slack of the
  // path that ran (ReferenceBounds). A caller that raises it must say why.
  double low_slack = 0;
  double low_grad_slack = 0;
};

// Whether `path` rounds f32 intermediates to bf16 for its tile products
// when the inputs (and dout) are `dtype`: avx512_bf16 and amx with bf16 round P
// for the forward's P V, and P and dS for the backward's dV, dK and dQ
// (relative error <= 2^-8 each; src/kernels/flash/forward.cc, backward.cc:
// the backward only with dout in bf16 too). No other path or dtype rounds
// anything: f16 inputs and the f32 paths widen to f32 and compute in f32.
// kAuto is taken as what it resolves to (ResolveKernelPath).
bool RoundsBf16Operands(KernelPath path, DType dtype);

// Unit roundoff of a storage dtype (bf16 2^-8, f16 2^-11, f32 2^-24).
double UnitRoundoff(DType dtype);

// Where P is rounded to bf16 for P V (RoundsBf16Operands), out errs by up to
// 2^-8 sum_j p_j |v_j| <= 2^-8 max|v|: that slack relative to
// max(max|out|, floor) (the floor of the comparison it is added to:
// Comparison::Relative's, or kMagnitudeFloor for ErrorsOf), from the
// reference's v and out. Only where P is rounded: elsewhere it is ~1000x the
// f32 error and would hide real bugs.
double PRoundingSlack(const std::vector<double>& v, const std::vector<double>& out,
                      double floor = 1e-30);

// The bounds, as ErrorsOf measures the errors, of a run of `path` (kAuto:
// what it resolves to) on inputs of `dtype` with an upstream gradient of
// `dout_dtype`, against the f64 reference `ref` on the same stored inputs
// (bf16/f16 inputs already rounded, so their rounding is no error of the
// kernels): tol.f32 / tol.f32_grad for the f32 accumulation every path does
// on any dtype (+ tol.low_slack / low_grad_slack for 16-bit inputs), plus
// only where the path rounds P for P V (RoundsBf16Operands) PRoundingSlack
// on out, and only where the backward also rounds P and dS (dout bf16 too)
// 2^-8 of the rounded terms on dq, dk and dv (the derivation is in
// accuracy.cc). `v` is the reference's v (RefProblem::v). The gradients'
// bounds are for a backward given the reference's out and lse
// (BackwardOnReference, or the ring's RingAttentionBackward): a forward that
// rounds P moves out, and through D = dout . out every gradient, by more.
Errors ReferenceBounds(const RefResult& ref, const std::vector<double>& v, KernelPath path,
                       DType dtype, DType dout_dtype, const Tolerances& tol = {});

// "" if every error is within its bound (NaN fails), else one line per
// tensor over its bound, each starting with `label`.
std::string ExceedsBounds(const std::string& label, const Errors& e, const Errors& bound);

// AttentionBackward of `in` with the reference's out (f32) and lse, so that
// the forward's P rounding stays out of D = dout . out; returns its errors
// (out and lse are the reference's own: 0).
Errors BackwardOnReference(const OwnedInputs& in, const AttentionOptions& opt, const Tensor& dout,
                           const RefResult& ref);

// The same for the ring: RingAttentionBackward on `ranks` thread ranks
// (`layout`; opt.num_threads kernel threads each) of the global inputs `in`
// (no positions: the ring derives them), each rank given its shard of the
// reference's out and lse.
Errors RingBackwardOnReference(const OwnedInputs& in, const AttentionOptions& opt,
                               const Tensor& dout, const RefResult& ref, int ranks, Layout layout);

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
