// Accuracy checks against the f64 reference: see accuracy.h.
#include "tests/support/accuracy.h"

#include <algorithm>
#include <cmath>
#include <sstream>

namespace ringsplash::testing {

namespace {

// Appends "<label> <name> <err> > <bound>" to `failures` unless err <= bound.
void Expect(std::ostringstream& failures, const std::string& label, const char* name, double err,
            double bound) {
  if (err <= bound) return;  // NaN errors fail too
  failures << label << ' ' << name << " error " << err << " > bound " << bound << '\n';
}

}  // namespace

bool RoundsBf16Operands(KernelPath path, DType dtype) {
  return (path == KernelPath::kAvx512Bf16 || path == KernelPath::kAmx) && dtype == DType::kBF16;
}

double UnitRoundoff(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    case DType::kF16:
      return std::ldexp(1.0, -11);
    default:
      return std::ldexp(1.0, -24);
  }
}

double PRoundingSlack(const std::vector<double>& v, const std::vector<double>& out) {
  return std::ldexp(MaxAbs(v), -8) / std::max(MaxAbs(out), 1e-30);
}

std::vector<int64_t> OutShape(const OwnedInputs& o) {
  const AttentionInputs in = o.inputs();
  return {in.q.shape[0], in.q.shape[1], in.q.shape[2], in.v.shape[3]};
}

std::string CheckF32(const OwnedInputs& in, AttentionOptions opt,
                     const std::vector<KernelPath>& paths, const Tolerances& tol) {
  Rng rng(99);
  const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
  const RefResult ref = RunReference(in, opt, &dout);
  std::ostringstream failures;
  for (KernelPath path : paths) {
    opt.kernel_path = path;
    const ApiResult api = RunAttention(in, opt, &dout);
    const Errors e = ErrorsOf(api, ref);
    const std::string label = std::string("f32 path ") + KernelPathName(path);
    Expect(failures, label, "out", e.out, tol.f32);
    Expect(failures, label, "lse", e.lse, tol.f32);
    Expect(failures, label, "dq", e.dq, tol.f32_grad);
    Expect(failures, label, "dk", e.dk, tol.f32_grad);
    Expect(failures, label, "dv", e.dv, tol.f32_grad);
    Expect(failures, label, "dsinks", e.dsinks, tol.f32_grad);
  }
  return failures.str();
}

// Error model for bf16 / f16 inputs. The reference runs on the ROUNDED
// inputs (what the API was given), so input rounding is not an error of the
// kernels. What remains:
//  - forward: f32 accumulation everywhere (error comparable to an f32 run),
//    except that the avx512_bf16 and amx paths round the probabilities P to
//    bf16 before the P V product (their GEMMs take bf16 operands). Each P element
//    then has relative error <= u, so |d out| <= u * sum_j p_j |v_j| <=
//    u * max|v|: slack u * max|v| relative to max|out| (on every path). lse is accumulated from
//    unrounded P (no slack).
//  - backward: given the same out and lse its error is that of an f32 run
//    (bf16 x bf16 products are exact in f32), except that avx512_bf16 and
//    amx with bf16 q, k, v and dout round P and dS to bf16 (relative error <= u
//    each) for the dV, dK and dQ products. Then |d dv_j| <= u sum_i p_ij
//    |dout_i| (dv_terms, which ErrorsOf measures dv against: slack u) and
//    |d dq_i| <= u scale sum_j |ds_ij| |k_j| (dq_ds_terms; dk alike), which
//    relative to the larger dq_terms that ErrorsOf uses is a slack of u
//    max(dq_ds_terms) / max(dq_terms). (Only one operand of each product is
//    rounded: the others are bf16 inputs, exact. Flushing bf16 subnormals
//    to zero adds < 2^-126 absolute per term.)
//    To keep the forward's P rounding out of the backward's D = dout . out,
//    the backward is checked with out and lse taken from the reference.
// Bound: err <= 2 * err_f32 + slack, where err_f32 is the error of the
// portable path on f32 copies of the same rounded inputs (the "how hard is
// this problem in f32" baseline; 2x allows a different summation order and
// different exp/tanh approximations), plus a floor of 1e-6 (~16 f32 ulps) so
// that a baseline that happens to be nearly exact does not demand exactness
// from a different summation order.
std::string CheckLowPrecision(const OwnedInputs& in, AttentionOptions opt,
                              const std::vector<KernelPath>& paths, const Tolerances& tol) {
  const DType dt = in.q.dtype();
  const double u = UnitRoundoff(dt);
  Rng rng(98);
  const std::vector<int64_t> oshape = OutShape(in);
  const Tensor dout = RandomTensor(rng, dt, oshape);
  const RefResult ref = RunReference(in, opt, &dout);

  // The f32 baseline: portable path, same (rounded) values in f32.
  const OwnedInputs in32 = ConvertInputs(in, DType::kF32);
  AttentionOptions opt32 = opt;
  opt32.kernel_path = KernelPath::kPortable;
  const Tensor dout32 = TensorFromDoubles(ToDoubles(dout.view()), DType::kF32, oshape);
  const Errors e32 = ErrorsOf(RunAttention(in32, opt32, &dout32), ref);
  const double v_over_out = MaxAbs(ToDoubles(in.v.view())) / std::max(MaxAbs(ref.fwd.out), 1e-30);

  // Backward on the reference's out (f32) and lse.
  const Tensor ref_out = TensorFromDoubles(ref.fwd.out, DType::kF32, oshape);
  const Tensor ref_lse =
      TensorFromDoubles(ref.fwd.lse, DType::kF32, {oshape[0], oshape[2], oshape[1]});
  auto backward = [&](const AttentionInputs& ai, const AttentionOptions& o, const Tensor& d) {
    const TensorView& q = ai.q;
    const TensorView& k = ai.k;
    const TensorView& v = ai.v;
    Tensor dq(DType::kF32, {q.shape[0], q.shape[1], q.shape[2], q.shape[3]});
    Tensor dk(DType::kF32, {k.shape[0], k.shape[1], k.shape[2], k.shape[3]});
    Tensor dv(DType::kF32, {v.shape[0], v.shape[1], v.shape[2], v.shape[3]});
    Tensor ds(DType::kF32, {q.shape[2]});
    AttentionBackward(ai, o, ref_out.view(), ref_lse.view(), d.view(), dq.view(), dk.view(),
                      dv.view(), ai.sinks.defined() ? ds.view() : TensorView());
    ApiResult r;
    r.out = ref.fwd.out;
    r.lse = ref.fwd.lse;
    r.dq = ToDoubles(dq.view());
    r.dk = ToDoubles(dk.view());
    r.dv = ToDoubles(dv.view());
    if (ai.sinks.defined()) r.dsinks = ToDoubles(ds.view());
    return ErrorsOf(r, ref);
  };
  const Errors eb32 = backward(in32.inputs(), opt32, dout32);

  std::ostringstream failures;
  for (KernelPath path : paths) {
    opt.kernel_path = path;
    const Errors ef = ErrorsOf(RunAttention(in, opt, nullptr), ref);
    const Errors eb = backward(in.inputs(), opt, dout);
    const std::string label = std::string(DTypeName(dt)) + " path " + KernelPathName(path);
    const bool rounds = RoundsBf16Operands(path, dt);
    auto slack = [&](const std::vector<double>& rounded, const std::vector<double>& measured) {
      return tol.low_grad_slack +
             (rounds ? u * MaxAbs(rounded) / std::max(kMagnitudeFloor, MaxAbs(measured)) : 0.0);
    };
    const size_t before = failures.tellp();
    Expect(failures, label, "out", ef.out, 2 * e32.out + u * v_over_out + tol.low_slack);
    Expect(failures, label, "lse", ef.lse, 2 * e32.lse + tol.low_slack);
    Expect(failures, label, "dq", eb.dq,
           2 * eb32.dq + slack(ref.bwd.dq_ds_terms, ref.bwd.dq_terms));
    Expect(failures, label, "dk", eb.dk,
           2 * eb32.dk + slack(ref.bwd.dk_ds_terms, ref.bwd.dk_terms));
    Expect(failures, label, "dv", eb.dv, 2 * eb32.dv + slack(ref.bwd.dv_terms, ref.bwd.dv_terms));
    Expect(failures, label, "dsinks", eb.dsinks, 2 * eb32.dsinks + tol.low_grad_slack);
    if (static_cast<size_t>(failures.tellp()) != before) {
      failures << "  (" << label << ": fwd " << ef.Describe() << " | bwd " << eb.Describe()
               << " | f32 baseline fwd " << e32.Describe() << " | bwd " << eb32.Describe() << ")\n";
    }
  }
  return failures.str();
}

std::string CheckAgainstReference(const OwnedInputs& in, const AttentionOptions& opt,
                                  const Tolerances& tol) {
  if (in.q.dtype() == DType::kF32) return CheckF32(in, opt, SupportedKernelPaths(), tol);
  return CheckLowPrecision(in, opt, SupportedKernelPaths(), tol);
}

}  // namespace ringsplash::testing
