// Test helpers: see test_util.h.
#include "tests/support/test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "ringsplash/error.h"

namespace ringsplash::testing {

namespace {

// Calls fn(flat_index, element_offset) for every element of `t` in C order of
// its logical shape.
template <typename Fn>
void ForEachElement(const TensorView& t, Fn fn) {
  std::array<int64_t, kMaxDims> shape{1, 1, 1, 1}, stride{0, 0, 0, 0};
  for (int i = 0; i < t.ndim; ++i) {
    shape[kMaxDims - t.ndim + i] = t.shape[i];
    stride[kMaxDims - t.ndim + i] = t.stride[i];
  }
  int64_t flat = 0;
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d)
          fn(flat++, a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3]);
}

std::vector<double> ViewToDoubles(const TensorView& t) {
  return t.defined() ? ToDoubles(t) : std::vector<double>{};
}

}  // namespace

Tensor RandomTensor(Rng& rng, DType dtype, std::vector<int64_t> shape, double lo, double hi) {
  Tensor t(dtype, std::move(shape));
  FillRandom(rng, t.view(), lo, hi);
  return t;
}

std::vector<float> RandomFloats(Rng& rng, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

void FillRandom(Rng& rng, const TensorView& t, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  ForEachElement(
      t, [&](int64_t, int64_t off) { StoreFromF32(t, off, static_cast<float>(dist(rng))); });
}

Tensor RandomSegments(Rng& rng, int64_t b, int64_t s, int64_t max_docs, int32_t first_id) {
  Tensor t(DType::kI32, {b, s});
  int32_t* ids = t.data_as<int32_t>();
  std::uniform_int_distribution<int64_t> cut(0, s);
  for (int64_t bi = 0; bi < b; ++bi) {
    // max_docs - 1 random cut points split [0, s) into at most max_docs runs.
    std::vector<int64_t> cuts;
    for (int64_t c = 0; c + 1 < max_docs; ++c) cuts.push_back(cut(rng));
    std::sort(cuts.begin(), cuts.end());
    for (int64_t i = 0; i < s; ++i) {
      const int64_t doc = std::upper_bound(cuts.begin(), cuts.end(), i) - cuts.begin();
      ids[bi * s + i] = first_id + static_cast<int32_t>(doc);
    }
  }
  return t;
}

std::vector<double> ToDoubles(const TensorView& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  ForEachElement(t, [&](int64_t i, int64_t off) {
    if (t.dtype == DType::kI32) {
      out[i] = static_cast<const int32_t*>(t.data)[off];
    } else {
      out[i] = LoadAsF32(t, off);
    }
  });
  return out;
}

void FromDoubles(const std::vector<double>& values, const TensorView& t) {
  Check(static_cast<int64_t>(values.size()) == t.numel(), "FromDoubles: ", values.size(),
        " values for ", t.Describe());
  ForEachElement(
      t, [&](int64_t i, int64_t off) { StoreFromF32(t, off, static_cast<float>(values[i])); });
}

Tensor TensorFromDoubles(const std::vector<double>& values, DType dtype,
                         std::vector<int64_t> shape) {
  Tensor t(dtype, std::move(shape));
  FromDoubles(values, t.view());
  return t;
}

RefProblem MakeRefProblem(const AttentionInputs& in, const AttentionOptions& opt) {
  RefProblem p;
  p.b = in.q.shape[0];
  p.sq = in.q.shape[1];
  p.h = in.q.shape[2];
  p.d = in.q.shape[3];
  p.skv = in.k.shape[1];
  p.hkv = in.k.shape[2];
  p.dv = in.v.shape[3];
  p.q = ToDoubles(in.q);
  p.k = ToDoubles(in.k);
  p.v = ToDoubles(in.v);
  p.sinks = ViewToDoubles(in.sinks);
  if (in.q_segments.defined()) {
    for (double x : ToDoubles(in.q_segments)) p.q_seg.push_back(static_cast<int32_t>(x));
    for (double x : ToDoubles(in.kv_segments)) p.kv_seg.push_back(static_cast<int32_t>(x));
  }
  p.q_pos = in.q_positions;
  p.kv_pos = in.kv_positions;
  p.mask = opt.mask;
  // The library computes the default scale in f32; use that exact value so
  // the comparison measures the kernels, not a 1-ulp difference in scale.
  p.scale = opt.scale ? static_cast<double>(*opt.scale)
                      : static_cast<double>(1.0f / std::sqrt(static_cast<float>(p.d)));
  p.softcap = opt.softcap ? static_cast<double>(*opt.softcap) : 0.0;
  return p;
}

AttentionInputs OwnedInputs::inputs() const {
  AttentionInputs in;
  in.q = q.view();
  in.k = k.view();
  in.v = v.view();
  if (bhsd) {
    in.q = in.q.Transposed(1, 2);
    in.k = in.k.Transposed(1, 2);
    in.v = in.v.Transposed(1, 2);
  }
  if (sinks.data() != nullptr) in.sinks = sinks.view();
  if (q_seg.data() != nullptr) {
    in.q_segments = q_seg.view();
    in.kv_segments = kv_seg.view();
  }
  in.q_positions = q_pos;
  in.kv_positions = kv_pos;
  return in;
}

OwnedInputs RandomInputs(Rng& rng, const ProblemSpec& s) {
  OwnedInputs o;
  o.bhsd = s.bhsd;
  auto shape = [&](int64_t seq, int64_t heads, int64_t dim) {
    return s.bhsd ? std::vector<int64_t>{s.b, heads, seq, dim}
                  : std::vector<int64_t>{s.b, seq, heads, dim};
  };
  o.q = RandomTensor(rng, s.dtype, shape(s.sq, s.h, s.d), -s.qk_range, s.qk_range);
  o.k = RandomTensor(rng, s.dtype, shape(s.skv, s.hkv, s.d), -s.qk_range, s.qk_range);
  o.v = RandomTensor(rng, s.dtype, shape(s.skv, s.hkv, s.dv));
  if (s.sinks) o.sinks = RandomTensor(rng, DType::kF32, {s.h}, -1.0, 2.0);
  if (s.segments) {
    o.q_seg = RandomSegments(rng, s.b, s.sq, 3);
    o.kv_seg = RandomSegments(rng, s.b, s.skv, 3);
  }
  return o;
}

double Comparison::Relative(double floor) const {
  if (nonfinite_mismatch) return std::numeric_limits<double>::infinity();
  return max_abs_err / std::max(expected_max, floor);
}

std::string Comparison::Describe() const {
  std::ostringstream os;
  os << "max |err| " << max_abs_err << " at " << worst << ", max |expected| " << expected_max
     << (nonfinite_mismatch ? ", NON-FINITE MISMATCH" : "");
  return os.str();
}

Comparison Compare(const std::vector<double>& actual, const std::vector<double>& expected) {
  Comparison c;
  if (actual.size() != expected.size()) {
    c.nonfinite_mismatch = true;
    return c;
  }
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], e = expected[i];
    if (std::isnan(a) || std::isnan(e)) {
      c.nonfinite_mismatch = true;
      if (c.worst < 0) c.worst = static_cast<int64_t>(i);
      continue;
    }
    if (std::isinf(e) || std::isinf(a)) {
      if (a != e) {
        c.nonfinite_mismatch = true;
        if (c.worst < 0) c.worst = static_cast<int64_t>(i);
      }
      continue;
    }
    c.expected_max = std::max(c.expected_max, std::fabs(e));
    const double err = std::fabs(a - e);
    if (err > c.max_abs_err || c.worst < 0) {
      c.max_abs_err = std::max(c.max_abs_err, err);
      c.worst = static_cast<int64_t>(i);
    }
  }
  return c;
}

double MaxAbs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

OwnedInputs ConvertInputs(const OwnedInputs& in, DType dtype) {
  auto convert = [dtype](const Tensor& t) {
    Tensor c(dtype, t.shape());
    CopyConvert(t.view(), c.view());
    return c;
  };
  auto clone = [](const Tensor& t) {
    if (t.data() == nullptr) return Tensor();
    Tensor c(t.dtype(), t.shape());
    std::memcpy(c.data(), t.data(), t.bytes());
    return c;
  };
  OwnedInputs out;
  out.q = convert(in.q);
  out.k = convert(in.k);
  out.v = convert(in.v);
  out.sinks = clone(in.sinks);
  out.q_seg = clone(in.q_seg);
  out.kv_seg = clone(in.kv_seg);
  out.bhsd = in.bhsd;
  out.q_pos = in.q_pos;
  out.kv_pos = in.kv_pos;
  return out;
}

namespace {

// An output tensor of logical shape [B, S, H, X]: C order, or stored
// [B, H, S, X] and viewed transposed.
struct OutputTensor {
  Tensor storage;
  TensorView view;
  OutputTensor(DType dtype, const TensorView& like, bool strided) {
    const int64_t b = like.shape[0], s = like.shape[1], h = like.shape[2], x = like.shape[3];
    if (strided) {
      storage = Tensor(dtype, {b, h, s, x});
      view = storage.view().Transposed(1, 2);
    } else {
      storage = Tensor(dtype, {b, s, h, x});
      view = storage.view();
    }
    // NaN-fill (where the dtype has NaN) so an element the API forgets to
    // write cannot pass for a zero.
    if (dtype != DType::kI32 && dtype != DType::kBool) {
      const std::vector<double> nan(static_cast<size_t>(view.numel()),
                                    std::numeric_limits<double>::quiet_NaN());
      FromDoubles(nan, view);
    }
  }
};

}  // namespace

ApiResult RunAttention(const OwnedInputs& owned, const AttentionOptions& opt, const Tensor* dout,
                       const ApiRun& run) {
  const AttentionInputs in = owned.inputs();
  const int64_t b = in.q.shape[0], sq = in.q.shape[1], h = in.q.shape[2];
  const int64_t dv = in.v.shape[3];
  ApiResult r;
  TensorView out_shape = in.q;
  out_shape.shape[3] = dv;
  OutputTensor out(run.out_dtype, out_shape, run.strided_outputs);
  Tensor lse(DType::kF32, {b, h, sq});
  FromDoubles(std::vector<double>(static_cast<size_t>(b * h * sq),
                                  std::numeric_limits<double>::quiet_NaN()),
              lse.view());
  AttentionForward(in, opt, out.view, lse.view(), &r.fwd);
  r.out = ToDoubles(out.view);
  r.lse = ToDoubles(lse.view());
  if (dout == nullptr) return r;

  OutputTensor dq(run.grad_dtype, in.q, run.strided_outputs);
  OutputTensor dk(run.grad_dtype, in.k, run.strided_outputs);
  OutputTensor dvt(run.grad_dtype, in.v, run.strided_outputs);
  Tensor dsinks;
  if (in.sinks.defined()) {
    dsinks = Tensor(DType::kF32, {h});
    FromDoubles(
        std::vector<double>(static_cast<size_t>(h), std::numeric_limits<double>::quiet_NaN()),
        dsinks.view());
  }
  const TensorView dsinks_view = in.sinks.defined() ? dsinks.view() : TensorView();
  AttentionBackward(in, opt, out.view, lse.view(), dout->view(), dq.view, dk.view, dvt.view,
                    dsinks_view, &r.bwd);
  r.dq = ToDoubles(dq.view);
  r.dk = ToDoubles(dk.view);
  r.dv = ToDoubles(dvt.view);
  if (in.sinks.defined()) r.dsinks = ToDoubles(dsinks.view());
  return r;
}

RefResult RunReference(const OwnedInputs& owned, const AttentionOptions& opt, const Tensor* dout) {
  const RefProblem p = MakeRefProblem(owned.inputs(), opt);
  RefResult r;
  r.fwd = ReferenceForward(p);
  if (dout != nullptr) r.bwd = ReferenceBackward(p, ToDoubles(dout->view()));
  return r;
}

std::string Errors::Describe() const {
  std::ostringstream os;
  os << "out " << out << ", lse " << lse << ", dq " << dq << ", dk " << dk << ", dv " << dv
     << ", dsinks " << dsinks;
  return os.str();
}

Errors ErrorsOf(const ApiResult& api, const RefResult& ref) {
  Errors e;
  e.out = Compare(api.out, ref.fwd.out).Relative(kMagnitudeFloor);
  e.lse = Compare(api.lse, ref.fwd.lse).Relative(1.0);
  if (!ref.bwd.dq.empty() || !api.dq.empty()) {
    e.dq =
        Compare(api.dq, ref.bwd.dq).Relative(std::max(kMagnitudeFloor, MaxAbs(ref.bwd.dq_terms)));
    e.dk =
        Compare(api.dk, ref.bwd.dk).Relative(std::max(kMagnitudeFloor, MaxAbs(ref.bwd.dk_terms)));
    e.dv =
        Compare(api.dv, ref.bwd.dv).Relative(std::max(kMagnitudeFloor, MaxAbs(ref.bwd.dv_terms)));
    double dsinks_scale = kMagnitudeFloor;
    for (double t : ref.bwd.dsinks_terms) dsinks_scale = std::max(dsinks_scale, t);
    e.dsinks = Compare(api.dsinks, ref.bwd.dsinks).Relative(dsinks_scale);
  }
  return e;
}

bool HasNaN(const std::vector<double>& v) {
  return std::any_of(v.begin(), v.end(), [](double x) { return std::isnan(x); });
}

double RoundToBF16(double x) { return BF16ToF32(F32ToBF16(static_cast<float>(x))); }

double RoundTo(DType dtype, double x) {
  switch (dtype) {
    case DType::kBF16:
      return RoundToBF16(x);
    case DType::kF16:
      return F16ToF32(F32ToF16(static_cast<float>(x)));
    default:
      return static_cast<float>(x);
  }
}

}  // namespace ringsplash::testing
