// Accuracy checks against the f64 reference: see accuracy.h.
#include "tests/support/accuracy.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "ringsplash/comm.h"
#include "ringsplash/error.h"

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
  if (path == KernelPath::kAuto) path = ResolveKernelPath(path);
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

double PRoundingSlack(const std::vector<double>& v, const std::vector<double>& out, double floor) {
  return UnitRoundoff(DType::kBF16) * MaxAbs(v) / std::max(MaxAbs(out), floor);
}

std::vector<int64_t> OutShape(const OwnedInputs& o) {
  const AttentionInputs in = o.inputs();
  return {in.q.shape[0], in.q.shape[1], in.q.shape[2], in.v.shape[3]};
}

// Error model, for any input dtype. The reference runs on the inputs AS
// STORED (bf16/f16 inputs already rounded: what the API was given), so input
// rounding is no error of the kernels, and every path widens 16-bit inputs
// exactly to f32 and accumulates in f32 (bf16 x bf16 products, on
// vdpbf16ps or AMX tiles, are exact in f32): the f32 model of kF32Tolerance
// holds on every path and dtype, except where bf16 intermediates are
// rounded (RoundsBf16Operands: avx512_bf16 and amx, bf16 inputs):
//  - forward: P rounded to bf16 before P V, relative error <= u = 2^-8 per
//    element, and the row sum l taken from the unrounded P, so |d out_ic| <=
//    u sum_j p_ij |v_jc| <= u max|v|: slack u max|v| on out relative to
//    max(max|out|, kMagnitudeFloor) (ErrorsOf's measure; PRoundingSlack).
//    The ring's per-step partials each carry that relative to their own
//    lse, and merging them is a convex combination: the same bound. lse is
//    accumulated from the unrounded P (no slack).
//  - backward (with dout in bf16 too: otherwise its products stay f32):
//    given the same out and lse, P and dS are rounded to bf16 (relative
//    error <= u each) for the dV, dK and dQ products; their other operands
//    (dout, q, k: bf16 inputs) are exact. So |d dv_j| <= u sum_i p_ij
//    |dout_i| (dv_terms, which ErrorsOf measures dv against: slack u) and
//    |d dq_i| <= u scale sum_j |ds_ij| |k_j| (dq_ds_terms; dk alike),
//    which relative to the larger dq_terms that ErrorsOf uses is a slack of
//    u max(dq_ds_terms) / max(dq_terms). Flushing bf16 subnormals to zero
//    adds < 2^-126 absolute per term. To keep the forward's P rounding out of
//    D = dout . out, the backward is checked on the reference's out and lse.
// No portable (or any library) run is a yardstick: each bound is the f32
// model plus what the path that ran provably rounds.
Errors ReferenceBounds(const RefResult& ref, const std::vector<double>& v, KernelPath path,
                       DType dtype, DType dout_dtype, const Tolerances& tol) {
  const bool low = dtype != DType::kF32;
  const bool p_rounded = RoundsBf16Operands(path, dtype);
  const bool grads_rounded = p_rounded && dout_dtype == DType::kBF16;
  const double u = UnitRoundoff(DType::kBF16);
  // u times the rounded terms, relative to what ErrorsOf measures against.
  auto rounding = [&](const std::vector<double>& rounded, const std::vector<double>& terms) {
    return grads_rounded ? u * MaxAbs(rounded) / std::max(kMagnitudeFloor, MaxAbs(terms)) : 0.0;
  };
  const double f32 = tol.f32 + (low ? tol.low_slack : 0.0);
  const double grad = tol.f32_grad + (low ? tol.low_grad_slack : 0.0);
  Errors b;
  b.out = f32 + (p_rounded ? PRoundingSlack(v, ref.fwd.out, kMagnitudeFloor) : 0.0);
  b.lse = f32;
  b.dq = grad + rounding(ref.bwd.dq_ds_terms, ref.bwd.dq_terms);
  b.dk = grad + rounding(ref.bwd.dk_ds_terms, ref.bwd.dk_terms);
  b.dv = grad + rounding(ref.bwd.dv_terms, ref.bwd.dv_terms);
  b.dsinks = grad;  // from D and lse alone, both f32 here
  return b;
}

std::string ExceedsBounds(const std::string& label, const Errors& e, const Errors& bound) {
  std::ostringstream failures;
  Expect(failures, label, "out", e.out, bound.out);
  Expect(failures, label, "lse", e.lse, bound.lse);
  Expect(failures, label, "dq", e.dq, bound.dq);
  Expect(failures, label, "dk", e.dk, bound.dk);
  Expect(failures, label, "dv", e.dv, bound.dv);
  Expect(failures, label, "dsinks", e.dsinks, bound.dsinks);
  return failures.str();
}

Errors BackwardOnReference(const OwnedInputs& in, const AttentionOptions& opt, const Tensor& dout,
                           const RefResult& ref) {
  const AttentionInputs ai = in.inputs();
  const std::vector<int64_t> oshape = OutShape(in);
  const Tensor ref_out = TensorFromDoubles(ref.fwd.out, DType::kF32, oshape);
  const Tensor ref_lse =
      TensorFromDoubles(ref.fwd.lse, DType::kF32, {oshape[0], oshape[2], oshape[1]});
  const TensorView &q = ai.q, &k = ai.k, &v = ai.v;
  Tensor dq(DType::kF32, {q.shape[0], q.shape[1], q.shape[2], q.shape[3]});
  Tensor dk(DType::kF32, {k.shape[0], k.shape[1], k.shape[2], k.shape[3]});
  Tensor dv(DType::kF32, {v.shape[0], v.shape[1], v.shape[2], v.shape[3]});
  Tensor ds(DType::kF32, {q.shape[2]});
  AttentionBackward(ai, opt, ref_out.view(), ref_lse.view(), dout.view(), dq.view(), dk.view(),
                    dv.view(), ai.sinks.defined() ? ds.view() : TensorView());
  ApiResult r;
  r.out = ref.fwd.out;
  r.lse = ref.fwd.lse;
  r.dq = ToDoubles(dq.view());
  r.dk = ToDoubles(dk.view());
  r.dv = ToDoubles(dv.view());
  if (ai.sinks.defined()) r.dsinks = ToDoubles(ds.view());
  return ErrorsOf(r, ref);
}

Errors RingBackwardOnReference(const OwnedInputs& in, const AttentionOptions& opt,
                               const Tensor& dout, const RefResult& ref, int ranks, Layout layout) {
  const AttentionInputs g = in.inputs();
  if (!g.q_positions.empty() || !g.kv_positions.empty()) {
    throw Error("RingBackwardOnReference: the ring derives positions from the layout");
  }
  const int64_t b = g.q.shape[0], sq = g.q.shape[1], h = g.q.shape[2];
  const int64_t dv = g.v.shape[3];
  const Tensor ref_out = TensorFromDoubles(ref.fwd.out, DType::kF32, {b, sq, h, dv});
  auto like = [](const TensorView& t) {
    return Tensor(DType::kF32, std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim));
  };
  Tensor dq = like(g.q), dk = like(g.k), dvt = like(g.v), dsinks(DType::kF32, {h});
  RingOptions ring;
  ring.attention = opt;
  ring.layout = layout;
  ring.fault = FaultSpec{};  // none, whatever RINGSPLASH_FAULT says
  RunThreadRanks(ranks, CommOptions{}, [&](Communicator& comm) {
    const int r = comm.rank();
    auto shard = [&](const TensorView& t) {
      if (!t.defined()) return Tensor();
      std::vector<int64_t> shape(t.shape.begin(), t.shape.begin() + t.ndim);
      shape[1] /= ranks;
      Tensor local(t.dtype, shape);
      ShardSequence(layout, r, ranks, t, local.view());
      return local;
    };
    auto view = [](const Tensor& t) { return t.data() != nullptr ? t.view() : TensorView(); };
    const Tensor q = shard(g.q), k = shard(g.k), v = shard(g.v);
    const Tensor q_seg = shard(g.q_segments), kv_seg = shard(g.kv_segments);
    const Tensor dout_l = shard(dout.view()), out_l = shard(ref_out.view());
    // lse [B, H, Sq]: this rank's rows are its global positions along dim 2.
    const std::vector<int64_t> pos = LayoutPositions(layout, sq, r, ranks, "q sequence length");
    const int64_t n = static_cast<int64_t>(pos.size());
    Tensor lse_l(DType::kF32, {b, h, n});
    for (int64_t bh = 0; bh < b * h; ++bh) {
      for (int64_t i = 0; i < n; ++i) {
        lse_l.data_as<float>()[bh * n + i] = static_cast<float>(ref.fwd.lse[bh * sq + pos[i]]);
      }
    }
    AttentionInputs local;
    local.q = q.view();
    local.k = k.view();
    local.v = v.view();
    local.sinks = g.sinks;
    local.q_segments = view(q_seg);
    local.kv_segments = view(kv_seg);
    Tensor dq_l = like(q.view()), dk_l = like(k.view()), dv_l = like(v.view());
    Tensor ds_l(DType::kF32, {h});
    RingAttentionBackward(comm, local, ring, out_l.view(), lse_l.view(), dout_l.view(), dq_l.view(),
                          dk_l.view(), dv_l.view(), g.sinks.defined() ? ds_l.view() : TensorView());
    // Disjoint rows of the global gradients per rank; dsinks is global.
    GatherSequence(layout, r, ranks, dq_l.view(), dq.view(), 1);
    GatherSequence(layout, r, ranks, dk_l.view(), dk.view(), 1);
    GatherSequence(layout, r, ranks, dv_l.view(), dvt.view(), 1);
    if (r == 0) CopyConvert(ds_l.view(), dsinks.view());
  });
  ApiResult result;
  result.out = ref.fwd.out;
  result.lse = ref.fwd.lse;
  result.dq = ToDoubles(dq.view());
  result.dk = ToDoubles(dk.view());
  result.dv = ToDoubles(dvt.view());
  if (g.sinks.defined()) result.dsinks = ToDoubles(dsinks.view());
  return ErrorsOf(result, ref);
}

std::string CheckF32(const OwnedInputs& in, AttentionOptions opt,
                     const std::vector<KernelPath>& paths, const Tolerances& tol) {
  Rng rng(99);
  const Tensor dout = RandomTensor(rng, DType::kF32, OutShape(in));
  const RefResult ref = RunReference(in, opt, &dout);
  const std::vector<double> v = ToDoubles(in.v.view());
  std::string failures;
  for (KernelPath path : paths) {
    opt.kernel_path = path;
    const Errors e = ErrorsOf(RunAttention(in, opt, &dout), ref);
    failures += ExceedsBounds(std::string("f32 path ") + KernelPathName(path), e,
                              ReferenceBounds(ref, v, path, DType::kF32, DType::kF32, tol));
  }
  return failures;
}

// bf16 / f16 inputs and dout of the same dtype: the forward on each path
// with its own out, the backward on the reference's out and lse, each held
// to ReferenceBounds (the error model above).
std::string CheckLowPrecision(const OwnedInputs& in, AttentionOptions opt,
                              const std::vector<KernelPath>& paths, const Tolerances& tol) {
  const DType dt = in.q.dtype();
  Rng rng(98);
  const Tensor dout = RandomTensor(rng, dt, OutShape(in));
  const RefResult ref = RunReference(in, opt, &dout);
  const std::vector<double> v = ToDoubles(in.v.view());
  std::string failures;
  for (KernelPath path : paths) {
    opt.kernel_path = path;
    const Errors ef = ErrorsOf(RunAttention(in, opt, nullptr), ref);
    Errors e = BackwardOnReference(in, opt, dout, ref);
    e.out = ef.out;
    e.lse = ef.lse;
    const Errors bound = ReferenceBounds(ref, v, path, dt, dt, tol);
    const std::string label = std::string(DTypeName(dt)) + " path " + KernelPathName(path);
    const std::string over = ExceedsBounds(label, e, bound);
    if (!over.empty()) {
      failures += over + "  (" + label + ": errors " + e.Describe() + " | bounds " +
                  bound.Describe() + ")\n";
    }
  }
  return failures;
}

std::string CheckAgainstReference(const OwnedInputs& in, const AttentionOptions& opt,
                                  const Tolerances& tol) {
  if (in.q.dtype() == DType::kF32) return CheckF32(in, opt, SupportedKernelPaths(), tol);
  return CheckLowPrecision(in, opt, SupportedKernelPaths(), tol);
}

}  // namespace ringsplash::testing
