// Test helpers: see test_util.h.
#include "tests/support/test_util.h"

#include <algorithm>
#include <cmath>
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
